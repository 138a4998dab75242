"""From documents to token files: split, encode (optionally in worker processes), write.

Output directory layout (written under a temporary name and renamed when
complete, so a directory with this name is always whole):

    train_000000.bin, ...   training tokens (shards of at most shard_tokens, whole
                            documents: only a longer document is split across shards)
    eval_000000.bin         held-out documents (only with eval_fraction > 0)
    tokenizer.json          the tokenizer used (absent for Nano imports without one)
    tokenizer_config.json   for transformers' AutoTokenizer: the EOS token and, for SFT
                            data, nanoq's chat template (nanoq.tokenization.sources)
    tokenize.json           what was done: inputs, counts, vocab size, EOS id, seed

Every document ends with the EOS token (a Nano line only given an eos_id),
and every token file records where its documents start (nanoq.data.token_file),
so that a document holding EOS tokens of its own (an SFT conversation, with an
EOS after each assistant turn) is packed whole. Files get a mask only when some token is not trained
on (SFT data).
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import shutil
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from nanoq.data import write_token_shards
from nanoq.tokenization.sources import Document

# Documents sent to a worker process at a time.
_CHUNK_DOCUMENTS = 64
DEFAULT_SHARD_TOKENS = 100_000_000

Encoded = Tuple[np.ndarray, np.ndarray]  # one document: int32 tokens, bool mask
# Documents in order: their tokens and mask concatenated, and int64 document starts
# (the index of each one's first token).
Concatenated = Tuple[np.ndarray, np.ndarray, np.ndarray]

# What text that spells one of the tokenizer's special tokens becomes (Encoder).
SPECIAL_TEXT = ("tokens", "text")

_worker_encoder = None


def special_tokens(tokenizer) -> dict:
    """{text: id} of the tokenizer's special tokens (its added tokens marked
    special: EOS, chat markers, reserved control tokens)."""
    return {token.content: index for index, token in tokenizer.get_added_tokens_decoder().items() if token.special}


class Encoder:
    """Encodes Documents with one tokenizer (a ``tokenizers.Tokenizer``).

    special_text: what the data's text spelling one of the tokenizer's
    special tokens (``<|endoftext|>`` in a web page, say) becomes: "tokens"
    (that token, as a Hugging Face tokenizer call and chat template do) or
    "text" (ordinary text, as tiktoken's encode_ordinary does; the tokenizer's
    ``encode_special_tokens``). Either way the EOS nanoq writes and a
    template's own markers (Document.markup) are tokens. ``spelled_specials``
    says which special tokens a document's text spells. bos: the ids that
    start each document (the tokenizer's BOS, see bos_prefix), not targets.
    """

    def __init__(self, tokenizer, eos: int, special_text: str = "tokens", bos: Sequence[int] = ()):
        if special_text not in SPECIAL_TEXT:
            raise ValueError(f"special_text must be one of {', '.join(SPECIAL_TEXT)}, got {special_text!r}")
        self.eos, self.special_text, self.bos = eos, special_text, tuple(bos)
        self.specials = special_tokens(tokenizer)
        # Markers that take the whitespace after them with them (an added token's rstrip).
        self._rstrip = {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.rstrip}
        self._spelling = re.compile("|".join(re.escape(t) for t in sorted(self.specials, key=len, reverse=True))) \
            if self.specials else None
        if special_text == "text":
            if not hasattr(tokenizer, "encode_special_tokens"):
                import tokenizers

                raise ValueError(f"special_text 'text' needs tokenizers 0.15.1 or newer (its encode_special_tokens); "
                                 f"this is {tokenizers.__version__}")
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_str(tokenizer.to_str())  # its own: the caller's keeps its setting
            tokenizer.encode_special_tokens = True
        self.tokenizer = tokenizer

    def _markup(self, document: Document) -> dict:
        """{segment index: markup length} of the document's markers that stay
        tokens against the tokenizer's setting: those spelling a special token
        where the data's spellings are text."""
        if self.special_text == "tokens":
            return {}
        return {index: length for index, length in document.markup
                if document.segments[index][0][:length] in self.specials}

    def encode(self, document: Document) -> Encoded:
        """tokens int32 [n], mask bool [n] of one document, its closing EOS included."""
        markup = self._markup(document)
        tokens: List[int] = list(self.bos)
        mask: List[bool] = [False] * len(self.bos)
        for index, (text, trained) in enumerate(document.segments):
            if text is None:
                ids = [self.eos]
            else:
                length = markup.get(index, 0)
                rest = text[length:]
                ids = []
                if length:
                    ids.append(self.specials[text[:length]])
                    if text[:length] in self._rstrip:
                        rest = rest.lstrip()
                ids += self.tokenizer.encode(rest, add_special_tokens=False).ids
            tokens += ids
            mask += [trained] * len(ids)
        if document.segments[-1][0] is not None:
            tokens.append(self.eos)
            mask.append(document.eos_trained)
        return np.asarray(tokens, dtype=np.int32), np.asarray(mask, dtype=bool)

    def spelled_specials(self, document: Document) -> set:
        """The special tokens that the document's text (its markup aside) spells."""
        if self._spelling is None:
            return set()
        markup = dict(document.markup)
        return {match.group() for index, (text, _) in enumerate(document.segments) if text is not None
                for match in self._spelling.finditer(text, markup.get(index, 0))}


def _encode_chunk(documents: Sequence[Document]) -> List[Encoded]:
    return [_worker_encoder.encode(d) for d in documents]


def _init_worker(tokenizer_json: str, eos: int, special_text: str, bos: Sequence[int]) -> None:
    # The worker's own tokenizer; its Rust thread pool stays off, the processes are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    global _worker_encoder
    _worker_encoder = Encoder(Tokenizer.from_str(tokenizer_json), eos, special_text, bos)


def encode_documents(encoder: Encoder, documents: Sequence[Document], workers: int = 1,
                     progress: Optional[Callable[[int], None]] = None) -> List[Encoded]:
    """Encodes documents in order, in ``workers`` processes (1: in this process).

    progress: called with the number of documents just finished.
    """
    if workers <= 1 or len(documents) <= _CHUNK_DOCUMENTS:
        encoded = []
        for document in documents:
            encoded.append(encoder.encode(document))
            if progress:
                progress(1)
        return encoded
    chunks = [documents[i:i + _CHUNK_DOCUMENTS] for i in range(0, len(documents), _CHUNK_DOCUMENTS)]
    encoded = []
    # spawn: safe after the tokenizers library has started its threads, and the same on every OS.
    context = multiprocessing.get_context("spawn")
    initargs = (encoder.tokenizer.to_str(), encoder.eos, encoder.special_text, encoder.bos)
    with context.Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        for chunk, result in zip(chunks, pool.imap(_encode_chunk, chunks)):
            encoded += result
            if progress:
                progress(len(chunk))
    return encoded


def split_documents(count: int, eval_fraction: float, seed: int) -> np.ndarray:
    """bool [count], True for the documents held out for evaluation.

    round(count * eval_fraction) documents (at least one when eval_fraction > 0),
    chosen by a permutation seeded with ``seed``; at least one stays for training.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval fraction must be in [0, 1), got {eval_fraction}")
    held_out = np.zeros(count, dtype=bool)
    if eval_fraction == 0.0:
        return held_out
    n_eval = max(1, round(count * eval_fraction))
    if n_eval >= count:
        raise ValueError(f"eval fraction {eval_fraction} of {count} document(s) leaves none for training; "
                         f"give more documents (e.g. --split paragraph for one big text file) or "
                         f"--eval-fraction 0")
    held_out[np.random.default_rng(seed).permutation(count)[:n_eval]] = True
    return held_out


def concatenate(encoded: Sequence[Encoded]) -> Concatenated:
    """The documents one after another, with where each starts (a document
    without tokens starts nowhere)."""
    if not encoded:
        return np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(0, np.int64)
    lengths = np.array([t.size for t, _ in encoded], dtype=np.int64)
    starts = (np.cumsum(lengths) - lengths)[lengths > 0]
    return np.concatenate([t for t, _ in encoded]), np.concatenate([m for _, m in encoded]), starts


def check_output(path: str | os.PathLike) -> str:
    """The absolute path of ``path`` as a tokenization's output folder, which
    must not exist (or be an empty directory) and can be made: a folder
    above it that is a file, a dangling symbolic link or a folder this
    process may not write in raises FileExistsError or PermissionError, so
    that the command says so before any work."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise FileExistsError(f"output {path} already exists and is not an empty directory; "
                              f"remove it or choose another")
    if os.path.islink(path) and not os.path.exists(path):  # (the rename at the end would fail)
        raise FileExistsError(f"output {path} is a symbolic link to {os.readlink(path)}, which does "
                              f"not exist; remove the link or choose another output")
    above = os.path.dirname(path)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise FileExistsError(f"output {path} cannot be made: {above} is a file, not a directory")
    if not os.access(above, os.W_OK | os.X_OK):
        raise PermissionError(f"output {path} cannot be made: no permission to write in {above}")
    return path


class OutputDirectory:
    """A directory built under ``<path>.partial-<pid>`` and renamed to ``path``
    by ``commit()``; on failure (or without commit) the partial one is removed.
    ``path`` must not exist or be an empty directory (never overwritten)."""

    def __init__(self, path: str | os.PathLike):
        self.path = check_output(path)
        self.partial = f"{self.path}.partial-{os.getpid()}"

    def __enter__(self) -> "OutputDirectory":
        os.makedirs(self.partial)
        return self

    def file(self, name: str) -> str:
        return os.path.join(self.partial, name)

    def commit(self) -> None:
        if os.path.isdir(self.path):
            os.rmdir(self.path)
        os.replace(self.partial, self.path)

    def __exit__(self, *exc) -> None:
        if os.path.isdir(self.partial):
            shutil.rmtree(self.partial)


def write_split(out: OutputDirectory, name: str, documents: Concatenated, vocab_size: int,
                shard_tokens: int, force_mask: bool) -> List[str]:
    """Writes ``name_000000.bin, ...`` (shards cut between documents) with
    their document starts; a mask only if some token is untrained (or
    ``force_mask``). Returns the file names."""
    tokens, mask, starts = documents
    keep_mask = force_mask or not bool(mask.all())
    paths = write_token_shards(out.file(name), tokens, vocab_size, mask if keep_mask else None,
                               max_tokens=shard_tokens, document_starts=starts)
    return [os.path.basename(p) for p in paths]


def write_summary(out: OutputDirectory, result, **extra) -> None:
    """tokenize.json: the result's fields (but the output path, which moves) and ``extra``."""
    summary = {key: value for key, value in dataclasses.asdict(result).items() if key != "output"}
    summary.update(extra)
    with open(out.file("tokenize.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
