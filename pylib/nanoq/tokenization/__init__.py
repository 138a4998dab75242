"""nanoq.tokenization: text, JSONL and SFT data (or Nano's pickled lines) to token files.

    from nanoq.tokenization import tokenize_files
    result = tokenize_files(["corpus.txt"], "data/", train_tokenizer_vocab=4096, eval_fraction=0.05)
    # data/train_000000.bin, data/eval_000000.bin, data/tokenizer.json, data/tokenize.json

Input formats (``fmt``): ``text`` (UTF-8; a document per file, paragraph or
line, see ``split``), ``jsonl`` (a document per line, the string field
``text_field``), ``sft`` (prompt/response or chat ``messages`` lines, trained
on the responses only; the template is in ``nanoq.tokenization.sources``,
and goes into the saved tokenizer_config.json as its Jinja chat_template), and
``auto`` (.jsonl/.json files are jsonl, the rest text). Nano's base64-pickled
line files go through ``import_nano`` (formats in ``nanoq.tokenization.nano``).

The train/eval split is by document, deterministic in ``seed``. The output
directory appears only when complete (see ``nanoq.tokenization.pipeline``).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import shutil
import time
import warnings
from typing import Dict, List, Optional, Sequence

import numpy as np

from nanoq.tokenization.nano import decode_line, read_nano_lines, safe_loads
from nanoq.tokenization.pipeline import (
    DEFAULT_SHARD_TOKENS,
    SPECIAL_TEXT,
    Encoder,
    OutputDirectory,
    check_output,
    concatenate,
    encode_documents,
    split_documents,
    write_split,
    write_summary,
)
from nanoq.tokenization.sources import Document, InputError, chat_template, read_documents
from nanoq.tokenization.tokenizer import (
    EOS_TOKEN,
    bos_prefix,
    find_eos_id,
    load_tokenizer,
    set_chat_template,
    tokenizer_file,
    tokenizer_vocab_size,
    train_bpe_tokenizer,
    write_tokenizer_config,
)

__all__ = [
    "Document",
    "InputError",
    "TokenizeResult",
    "chat_template",
    "decode_line",
    "find_eos_id",
    "import_nano",
    "load_tokenizer",
    "read_documents",
    "safe_loads",
    "tokenize_documents",
    "tokenize_files",
    "train_bpe_tokenizer",
]


@dataclasses.dataclass
class TokenizeResult:
    """What a tokenization wrote: the output directory, file names (relative
    to it), counts and the vocabulary size written into the headers."""

    output: str
    train_files: List[str]
    eval_files: List[str]
    documents: int
    eval_documents: int
    train_tokens: int
    eval_tokens: int
    vocab_size: int
    eos_id: Optional[int]
    seconds: float
    # Documents whose text spells one of the tokenizer's special tokens (see special_text),
    # and how many spell each one.
    special_text_documents: int = 0
    special_text_tokens: Dict[str, int] = dataclasses.field(default_factory=dict)
    # Documents with no token to train on (an SFT conversation without an assistant turn).
    untrained_documents: int = 0
    # The ids that start each document: the tokenizer's BOS where its post-processor adds one.
    bos_ids: List[int] = dataclasses.field(default_factory=list)


def _progress_bar(total: int, enabled: Optional[bool]):
    """A tqdm bar over documents (None: shown only on a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="doc", desc="tokenizing", disable=None if enabled is None else not enabled,
                leave=False)


def tokenize_documents(documents: Sequence[Document], output: str | os.PathLike, *,
                       tokenizer: Optional[str | os.PathLike] = None, train_tokenizer_vocab: int = 0,
                       eos_token: Optional[str] = None, eval_fraction: float = 0.0, seed: int = 0,
                       workers: int = 1, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                       progress: Optional[bool] = None, inputs: Sequence[str] = (),
                       sft_template: bool = False, packing: str = "stream",
                       special_text: str = "tokens") -> TokenizeResult:
    """Tokenizes documents into ``output`` (a new or empty directory).

    tokenizer: a tokenizer.json file or model directory; or train_tokenizer_vocab
    > 0 to train a byte-level BPE of that size on the training documents
    (exactly one of the two). eos_token: overrides the EOS token's detection
    in ``tokenizer``; a trained tokenizer's EOS is always ``EOS_TOKEN``
    (``<|endoftext|>``), so with train_tokenizer_vocab any other is a
    ValueError.
    eval_fraction: share of documents held out as eval_*.bin. workers:
    encoding processes. progress: bar on/off (None: on a terminal only).
    sft_template: write nanoq's SFT chat template (``chat_template``, with
    this EOS) into the saved tokenizer_config.json, replacing any the given
    tokenizer had (SFT data is formatted with nanoq's own).
    packing: how a Dataset with packing "auto" serves the files, recorded in
    tokenize.json: "stream" (windows of the concatenated documents) or
    "pack" (whole documents per window, attention inside each; see
    nanoq.data.loader).
    special_text: what text spelling one of the tokenizer's special tokens
    (``<|endoftext|>``, a chat marker) becomes: "tokens" (that token, as a
    Hugging Face tokenizer call does) or "text" (ordinary text, as tiktoken's
    encode_ordinary does); the EOS nanoq writes between documents and the SFT
    template's markers are tokens either way. The documents holding such text
    are counted (``special_text_documents``) whichever is chosen.
    """
    if packing not in ("stream", "pack"):
        raise ValueError(f"packing must be stream or pack, got {packing!r}")
    if special_text not in SPECIAL_TEXT:
        raise ValueError(f"special_text must be one of {', '.join(SPECIAL_TEXT)}, got {special_text!r}")
    start = time.time()
    if not documents:
        raise InputError(f"no documents in {', '.join(inputs) or 'the input'}: the corpus is empty")
    if (tokenizer is None) == (not train_tokenizer_vocab):
        raise ValueError("give a tokenizer (tokenizer.json or model directory) or a vocab size to train one, "
                         "not both and not neither")
    if train_tokenizer_vocab and eos_token and eos_token != EOS_TOKEN:
        raise ValueError(f"EOS token {eos_token!r} (--eos-token) does not go with a trained tokenizer "
                         f"(--train-tokenizer), whose EOS is always {EOS_TOKEN}: leave it out, or give a "
                         f"tokenizer (--tokenizer) whose vocabulary has {eos_token!r}")
    held_out = split_documents(len(documents), eval_fraction, seed)
    train_docs = [d for d, h in zip(documents, held_out) if not h]
    eval_docs = [d for d, h in zip(documents, held_out) if h]

    with OutputDirectory(output) as out:
        if tokenizer is None:
            texts = (text for d in train_docs for text, _ in d.segments if text)
            model = train_bpe_tokenizer(texts, train_tokenizer_vocab)
            eos = find_eos_id(model, eos_token or EOS_TOKEN)
            model.save(out.file("tokenizer.json"))
            write_tokenizer_config(out.file("tokenizer_config.json"), EOS_TOKEN)
        else:
            model = load_tokenizer(tokenizer)
            eos = find_eos_id(model, eos_token, source=os.fspath(tokenizer))
            added = model.get_added_tokens_decoder().get(eos)
            if eos_token and not (added is not None and added.special):
                warnings.warn(f"the EOS token {eos_token!r} (id {eos}) is an ordinary token of the tokenizer, not "
                              f"a special one: wherever the text holds it, it reads as the end of a document too",
                              stacklevel=2)
            source_file = tokenizer_file(tokenizer)
            shutil.copyfile(source_file, out.file("tokenizer.json"))
            config = os.path.join(os.path.dirname(source_file), "tokenizer_config.json")
            if os.path.isfile(config):
                shutil.copyfile(config, out.file("tokenizer_config.json"))
        bos = bos_prefix(model)
        if sft_template:
            config = out.file("tokenizer_config.json")
            if not os.path.isfile(config):
                write_tokenizer_config(config, model.id_to_token(eos))
            set_chat_template(config, chat_template(model.id_to_token(eos),
                                                    "".join(model.id_to_token(i) for i in bos)))
        vocab = tokenizer_vocab_size(model)
        encoder = Encoder(model, eos, special_text, bos)
        spelled = [encoder.spelled_specials(d) for d in documents]
        spelled_tokens = collections.Counter(token for tokens in spelled for token in tokens)

        with _progress_bar(len(documents), progress) as bar:
            train_encoded = concatenate(encode_documents(encoder, train_docs, workers, bar.update))
            eval_encoded = concatenate(encode_documents(encoder, eval_docs, workers, bar.update))
        force_mask = not (train_encoded[1].all() and eval_encoded[1].all())
        train_files = write_split(out, "train", train_encoded, vocab, shard_tokens, force_mask)
        eval_files = write_split(out, "eval", eval_encoded, vocab, shard_tokens, force_mask) if eval_docs else []
        result = TokenizeResult(output=out.path, train_files=train_files, eval_files=eval_files,
                                documents=len(documents), eval_documents=len(eval_docs),
                                train_tokens=int(train_encoded[0].size), eval_tokens=int(eval_encoded[0].size),
                                vocab_size=vocab, eos_id=eos, seconds=time.time() - start,
                                special_text_documents=sum(map(bool, spelled)),
                                special_text_tokens=dict(spelled_tokens.most_common()),
                                bos_ids=list(bos),
                                untrained_documents=sum(not (document.eos_trained or any(trained for _, trained in
                                                                                        document.segments))
                                                        for document in documents))
        write_summary(out, result, inputs=list(inputs), eval_fraction=eval_fraction, seed=seed, masked=force_mask,
                      packing=packing, special_text=special_text)
        out.commit()
    return result


def tokenize_files(inputs: Sequence[str | os.PathLike], output: str | os.PathLike, *, fmt: str = "auto",
                   text_field: str = "text", split: str = "file", **options) -> TokenizeResult:
    """Reads ``inputs`` (see the module docstring for ``fmt``, ``text_field``
    and ``split``) and tokenizes them with ``tokenize_documents(**options)``;
    ``packing`` defaults to "pack" for sft (each example whole in a window,
    attending only to itself), else "stream"."""
    options.setdefault("packing", "pack" if fmt == "sft" else "stream")
    paths = [os.fspath(p) for p in inputs]
    if not paths:
        raise ValueError("no input files given")
    check_output(output)  # before the work (and again when it is written)
    documents: List[Document] = []
    for path in paths:
        documents += read_documents(path, fmt, text_field, split)
    return tokenize_documents(documents, output, inputs=paths, sft_template=fmt == "sft", **options)


def import_nano(inputs: Sequence[str | os.PathLike], output: str | os.PathLike, *, vocab_size: int,
                eos_id: Optional[int] = None, eval_fraction: float = 0.0, seed: int = 0,
                shard_tokens: int = DEFAULT_SHARD_TOKENS) -> TokenizeResult:
    """Writes Nano's base64-pickled line files (formats in
    ``nanoq.tokenization.nano``) as token files, a line per document (the
    files record where each starts).

    vocab_size: the model's vocabulary (every id must be below it).
    eos_id: a token appended after every line (None: lines are concatenated as they are).
    """
    start = time.time()
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab size must be a positive integer, got {vocab_size!r}")
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int)
                               or not 0 <= eos_id < vocab_size):
        raise ValueError(f"eos id must be an integer in [0, {vocab_size}), got {eos_id!r}")
    paths = [os.fspath(p) for p in inputs]
    check_output(output)  # before the work (and again when it is written)
    sequences = []
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"input {path!r} does not exist or is not a file")
        for number, ids, mask in read_nano_lines(path):
            bad = next((i for i in ids if not 0 <= i < vocab_size), None)  # ints of any size, before numpy
            if bad is not None:
                raise InputError(f"{path}:{number}: token id {bad} is outside [0, {vocab_size}); "
                                 f"is --vocab-size right?")
            tokens = np.asarray(ids, dtype=np.int64)
            trained = np.ones(tokens.size, bool) if mask is None else np.asarray(mask, bool)
            if eos_id is not None:
                tokens, trained = np.append(tokens, eos_id), np.append(trained, mask is None)
            sequences.append((tokens, trained))
    if not sequences:
        raise InputError(f"no lines in {', '.join(paths)}: the corpus is empty")
    held_out = split_documents(len(sequences), eval_fraction, seed)
    train = concatenate([s for s, h in zip(sequences, held_out) if not h])
    held = concatenate([s for s, h in zip(sequences, held_out) if h])
    force_mask = not (train[1].all() and held[1].all())
    with OutputDirectory(output) as out:
        train_files = write_split(out, "train", train, vocab_size, shard_tokens, force_mask)
        eval_files = write_split(out, "eval", held, vocab_size, shard_tokens, force_mask) if held[0].size else []
        result = TokenizeResult(output=out.path, train_files=train_files, eval_files=eval_files,
                                documents=len(sequences), eval_documents=int(held_out.sum()),
                                train_tokens=int(train[0].size), eval_tokens=int(held[0].size),
                                vocab_size=vocab_size, eos_id=eos_id, seconds=time.time() - start)
        write_summary(out, result, inputs=paths, format="nano", eval_fraction=eval_fraction, seed=seed,
                      masked=force_mask)
        out.commit()
    return result
