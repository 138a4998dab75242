"""Token files (.bin): llm.q's tokenizer output, format version 2.

Layout, all little-endian:

    bytes 0..1023   header: 256 int32 words
                      words 0-1  the 8 ASCII bytes "BIN.TOK\\n"
                      word 2     version (2)
                      word 3     bytes per token (4)
                      word 4     token count
                      word 5     vocabulary size
                      word 6     has-mask (0 or 1)
                      word 7     the 4 ASCII bytes "DOCS" when document starts follow
                      word 8     with "DOCS": the number of documents D
                      words 9..  zero
    then            count int32 tokens
    then            if has-mask: ceil(count / 8) bytes of mask bits; bit i (byte
                    i // 8, bit i % 8, least significant first) is 1 when token i
                    is trained on as a target.
    then            with "DOCS": D int32 document starts, the index of each
                    document's first token, ascending, the first 0 (D is 0
                    only for a file without tokens).

Document starts are nanoq's addition (``nanoq tokenize`` writes them): they
say where each document begins, so that a document may hold EOS tokens of
its own (an SFT conversation ends every assistant turn with EOS) and still
be packed whole. A file without them (llm.q's, nanoq's from before) is read
as before, and a packer takes each EOS as a document's end. llm.q's reader
reads header words 2-6, the tokens and the mask at their offsets and never
checks the file's size, so it reads a file with starts as one without.
The tag, not a zero count, says they are there: llm.q's tokenizer leaves
words 7.. filled with the "*" bytes it reserves the header with, and nanoq
wrote zeros. (nanoq from before document starts refuses a file that has
them: it checks the exact size.)

Writers go through a temporary file that is renamed into place only once it is
complete and on disk, so a crash never leaves a file that looks whole.
Readers memory-map the file and scan every token when the file is opened
(one sequential pass, in chunks of bounded memory): a negative id is
refused at once, and the largest id is kept (``max_token``) for
``check_vocab``, which checks the ids against the model's vocabulary before
training starts, so a bad token is reported with its file and index rather
than as an out-of-range id somewhere later. Ids are not checked against the
header's vocabulary size: llm.q's tokenizer writes an EOS that is an added
token (Qwen2.5's, say) as id = header vocab, and llm.q's reader checks the
ids against the model. Document starts are checked when the file is opened.
"""
from __future__ import annotations

import errno
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from nanoq.durable import fsync_path

MAGIC = b"BIN.TOK\n"
VERSION = 2
BYTES_PER_TOKEN = 4
HEADER_BYTES = 1024
HEADER_WORDS = HEADER_BYTES // 4
MAX_TOKENS_PER_FILE = 2**31 - 1  # the header's count is an int32

# Word indices of the header fields (the magic fills words 0 and 1).
_VERSION_WORD, _BYTES_PER_TOKEN_WORD, _COUNT_WORD, _VOCAB_WORD, _HAS_MASK_WORD = 2, 3, 4, 5, 6
_DOCUMENTS_TAG_WORD, _DOCUMENTS_WORD = 7, 8
DOCUMENTS_TAG = b"DOCS"  # word 7 when document starts follow the tokens (and mask)

# Tokens converted, written or checked per chunk: bounds the extra memory to 64 MiB.
_CHUNK_TOKENS = 1 << 24
_READ_BYTES = 64 << 10  # a token file up to this size is read into memory instead of mapped (it holds no descriptor)


def open_token_files(paths: Sequence[str]) -> List["TokenFile"]:
    """TokenFile of each path. A mapped file holds a file descriptor while
    it is open: when the files above _READ_BYTES outnumber what the
    process's soft limit (``ulimit -n``) leaves, it is raised towards the
    hard limit; past that, a ValueError says how many files there are and
    how to have fewer, before any is opened."""
    mapped = sum(1 for path in paths if os.path.isfile(path) and os.path.getsize(path) > _READ_BYTES)
    try:
        import resource
    except ImportError:  # (not on this platform: nothing to raise)
        resource = None
    if resource is not None and mapped:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        needed = len(os.listdir("/proc/self/fd")) + mapped + 64 if os.path.isdir("/proc/self/fd") else mapped + 1024
        if soft != resource.RLIM_INFINITY and needed > soft:
            if hard == resource.RLIM_INFINITY or needed <= hard:
                resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
            else:
                raise ValueError(f"{mapped} token files over {_READ_BYTES >> 10} KiB, each mapped with a file "
                                 f"descriptor, need more than this process may open ({hard}, the hard limit of "
                                 f"ulimit -n): tokenize the data into fewer, larger files (nanoq tokenize "
                                 f"--shard-tokens), or raise the limit")
    return [TokenFile(path) for path in paths]


def _mask_bytes(count: int) -> int:
    return (count + 7) // 8


def _as_tokens(tokens, vocab_size: int) -> np.ndarray:
    """Validated 1-D integer view of ``tokens`` (not yet converted to int32)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) \
            or not 0 < vocab_size <= MAX_TOKENS_PER_FILE:
        raise ValueError(f"vocab_size must be an integer in [1, {MAX_TOKENS_PER_FILE}], got {vocab_size!r}")
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be a 1-D array, got shape {array.shape}")
    if array.size == 0:
        return array.astype(np.int32)
    if array.dtype.kind not in "iu":
        raise TypeError(f"tokens must be an integer array, got dtype {array.dtype}")
    for start in range(0, array.size, _CHUNK_TOKENS):
        chunk = array[start:start + _CHUNK_TOKENS]
        bad = (chunk < 0) | (chunk >= vocab_size)
        if bad.any():
            index = start + int(np.argmax(bad))
            raise ValueError(f"token id {int(array[index])} outside [0, {vocab_size}) "
                             f"at tokens[{index}]")
    return array


def _as_mask(mask, count: int) -> Optional[np.ndarray]:
    if mask is None:
        return None
    array = np.asarray(mask)
    if array.dtype != np.bool_:
        raise TypeError(f"mask must be a bool array (True = train on this token), got dtype {array.dtype}")
    if array.shape != (count,):
        raise ValueError(f"mask must have shape ({count},) like tokens, got {array.shape}")
    return array


def _document_starts_problem(starts: np.ndarray, count: int) -> Optional[str]:
    """What makes ``starts`` wrong as the document starts of ``count`` tokens
    (see the module docstring), or None. Checked in chunks of bounded memory."""
    if count == 0:
        return None if starts.size == 0 else f"{starts.size} document start(s) for no tokens"
    if starts.size == 0 or int(starts[0]) != 0:
        found = "none" if starts.size == 0 else f"{int(starts[0])}"
        return f"the first document start must be 0 (every token is in a document), got {found}"
    for begin in range(0, starts.size, _CHUNK_TOKENS):
        chunk = np.asarray(starts[begin:begin + _CHUNK_TOKENS + 1], dtype=np.int64)
        bad = np.diff(chunk) <= 0
        if bad.any():
            index = begin + int(np.argmax(bad)) + 1
            return (f"document start {int(starts[index])} at document_starts[{index}] does not come after "
                    f"{int(starts[index - 1])}; starts must ascend")
    if int(starts[-1]) >= count:
        return (f"document start {int(starts[-1])} at document_starts[{starts.size - 1}] is past the last token "
                f"(index {count - 1})")
    return None


def _as_document_starts(document_starts, count: int) -> Optional[np.ndarray]:
    """Validated 1-D int64 document starts of ``count`` tokens, or None."""
    if document_starts is None:
        return None
    array = np.asarray(document_starts)
    if array.ndim != 1:
        raise ValueError(f"document_starts must be a 1-D array, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"document_starts must be an integer array, got dtype {array.dtype}")
    array = array.astype(np.int64)
    problem = _document_starts_problem(array, count)
    if problem:
        raise ValueError(f"document_starts of {count} tokens: {problem}")
    return array


def _header(count: int, vocab_size: int, has_mask: bool, documents: Optional[int]) -> bytes:
    words = np.zeros(HEADER_WORDS, dtype="<i4")
    words[_VERSION_WORD] = VERSION
    words[_BYTES_PER_TOKEN_WORD] = BYTES_PER_TOKEN
    words[_COUNT_WORD] = count
    words[_VOCAB_WORD] = vocab_size
    words[_HAS_MASK_WORD] = int(has_mask)
    if documents is not None:
        words[_DOCUMENTS_WORD] = documents
    header = bytearray(words.tobytes())
    header[:len(MAGIC)] = MAGIC
    if documents is not None:
        header[4 * _DOCUMENTS_TAG_WORD:4 * _DOCUMENTS_TAG_WORD + 4] = DOCUMENTS_TAG
    return bytes(header)


def _write_validated(path: str, tokens: np.ndarray, vocab_size: int, mask: Optional[np.ndarray],
                     document_starts: Optional[np.ndarray]) -> None:
    """Atomic write of already validated tokens (and mask, document starts) to ``path``."""
    count = tokens.size
    if count > MAX_TOKENS_PER_FILE:
        raise ValueError(f"{count} tokens do not fit one file (at most {MAX_TOKENS_PER_FILE}); "
                         f"use write_token_shards")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):  # (else the error names the temporary file)
        raise FileNotFoundError(errno.ENOENT, f"no folder {os.path.dirname(path) or '.'!r} to write the token "
                                f"file into (make it first: os.makedirs)", path)
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            f.write(_header(count, vocab_size, mask is not None,
                            None if document_starts is None else document_starts.size))
            for start in range(0, count, _CHUNK_TOKENS):
                f.write(np.ascontiguousarray(tokens[start:start + _CHUNK_TOKENS], dtype="<i4").tobytes())
            if mask is not None:
                f.write(np.packbits(mask, bitorder="little").tobytes())
            if document_starts is not None:
                f.write(document_starts.astype("<i4").tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException as e:
        if os.path.exists(temporary):
            os.remove(temporary)
        if isinstance(e, OSError) and e.errno is not None and e.filename is None:  # a write's names no file
            raise OSError(e.errno, f"{e.strerror} (writing {path})") from e
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))


def write_tokens(path, tokens, vocab_size: int, mask=None, document_starts=None) -> None:
    """Writes one token file atomically.

    tokens: 1-D integer array-like, every id in [0, vocab_size) (ValueError
    naming the first bad index and value otherwise); stored as int32.
    mask: None or a 1-D bool array of the same length; True = train on the
    token as a target. document_starts: None (documents are told apart by
    EOS) or the index of each document's first token, a 1-D integer array,
    ascending, the first 0 (see the module docstring). The data goes to
    ``path + ".tmp-<pid>"``, is flushed and fsynced, then renamed onto
    ``path``; on any failure the temporary file is removed and an existing
    ``path`` is left untouched.
    """
    path = os.fspath(path)
    array = _as_tokens(tokens, vocab_size)
    _write_validated(path, array, int(vocab_size), _as_mask(mask, array.size),
                     _as_document_starts(document_starts, array.size))


def _shard_bounds(count: int, max_tokens: int, document_starts: Optional[np.ndarray]) -> List[Tuple[int, int]]:
    """[start, stop) of each shard: at most max_tokens tokens, ending at the
    last document start that allows (a document longer than max_tokens is
    split); without document starts, every max_tokens tokens."""
    bounds = []
    start = 0
    while True:
        stop = min(start + max_tokens, count)
        if stop < count and document_starts is not None:
            last = int(document_starts[np.searchsorted(document_starts, stop, side="right") - 1])
            if last > start:
                stop = last
        bounds.append((start, stop))
        if stop == count:
            return bounds
        start = stop


def write_token_shards(prefix, tokens, vocab_size: int, mask=None,
                       max_tokens: int = MAX_TOKENS_PER_FILE, document_starts=None) -> List[str]:
    """Splits tokens into ``prefix_000000.bin, prefix_000001.bin, ...``.

    Each shard holds at most ``max_tokens`` tokens (and its slice of the mask,
    packed from bit 0). With ``document_starts`` (as for write_tokens) shards
    end only between documents, each holding as many whole documents as fit,
    and record their own starts; only a document longer than max_tokens is
    split, and its piece in the next shard starts that shard as a document
    of its own (windows never cross files anyway). Without them shards are
    cut every max_tokens tokens. All tokens are validated before the first
    shard is written. Zero tokens give one empty shard. Shards left by an
    earlier, longer write with the same prefix are not deleted. Returns the
    paths.
    """
    prefix = os.fspath(prefix)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) \
            or not 0 < max_tokens <= MAX_TOKENS_PER_FILE:
        raise ValueError(f"max_tokens must be an integer in [1, {MAX_TOKENS_PER_FILE}], got {max_tokens!r}")
    array = _as_tokens(tokens, vocab_size)
    mask_array = _as_mask(mask, array.size)
    starts = _as_document_starts(document_starts, array.size)
    paths = []
    for shard, (start, stop) in enumerate(_shard_bounds(array.size, int(max_tokens), starts)):
        shard_starts = None
        if starts is not None:
            shard_starts = starts[np.searchsorted(starts, start):np.searchsorted(starts, stop)] - start
            if stop > start and (shard_starts.size == 0 or shard_starts[0] != 0):
                shard_starts = np.concatenate([[0], shard_starts])  # the rest of a split document
        path = f"{prefix}_{shard:06d}.bin"
        _write_validated(path, array[start:stop], int(vocab_size),
                         None if mask_array is None else mask_array[start:stop], shard_starts)
        paths.append(path)
    return paths


class TokenFile:
    """A read-only, memory-mapped token file.

    tokens: int32 array [len(self)] (a view of the file, no copy).
    mask: bool array [len(self)] (True = train on the token) or None; unpacked
    on first access. ``mask_range(start, stop)`` unpacks just a slice.
    document_starts: int32 array [documents] (a view of the file), the index
    of each document's first token, or None when the file does not record
    them (then EOS tokens end documents; see the module docstring).
    vocab_size, version, has_mask: from the header. max_token: the largest
    token id (-1 for an empty file); it may reach past vocab_size (see the
    module docstring).

    Opening checks the header, the exact file size, that no token is
    negative and that document starts ascend from 0 within the file; each
    problem raises FileNotFoundError or ValueError naming the file.
    ``check_vocab`` checks the ids against a model's vocabulary.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"token file {self.path!r} does not exist")
        if not os.path.isfile(self.path):
            raise ValueError(f"token file {self.path!r} is not a regular file")
        size = os.path.getsize(self.path)
        if size < HEADER_BYTES:
            raise ValueError(f"token file {self.path!r} is {size} bytes, shorter than the "
                             f"{HEADER_BYTES}-byte header; truncated or not a token file")
        with open(self.path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if header[:len(MAGIC)] != MAGIC:
            raise ValueError(f"token file {self.path!r} has the wrong magic {header[:len(MAGIC)]!r} "
                             f"(expected {MAGIC!r}); not a token file: `nanoq tokenize` makes them from text, "
                             f"JSONL or Nano files, and nanoq.data.write_tokens(path, tokens, vocab_size) from a "
                             f"token array (nanoGPT's train.bin: numpy.fromfile(path, numpy.uint16))")
        words = np.frombuffer(header, dtype="<i4")
        self.version = int(words[_VERSION_WORD])
        if self.version != VERSION:
            older = (" (an older llm.q's, with no vocabulary size in its header: tokenize its text again, with "
                     "nanoq tokenize or llm.q's current scripts/tokenize_data.py)" if self.version == 1 else "")
            raise ValueError(f"token file {self.path!r} has format version {self.version}; "
                             f"only version {VERSION} is supported{older}")
        bytes_per_token = int(words[_BYTES_PER_TOKEN_WORD])
        if bytes_per_token != BYTES_PER_TOKEN:
            raise ValueError(f"token file {self.path!r} has {bytes_per_token} bytes per token; "
                             f"only {BYTES_PER_TOKEN} is supported")
        count = int(words[_COUNT_WORD])
        if count < 0:
            raise ValueError(f"token file {self.path!r} has a negative token count {count}")
        self.vocab_size = int(words[_VOCAB_WORD])
        if self.vocab_size <= 0:
            raise ValueError(f"token file {self.path!r} has vocab size {self.vocab_size}; must be positive")
        has_mask = int(words[_HAS_MASK_WORD])
        if has_mask not in (0, 1):
            raise ValueError(f"token file {self.path!r} has has-mask word {has_mask}; must be 0 or 1")
        self.has_mask = bool(has_mask)
        documents = None
        if header[4 * _DOCUMENTS_TAG_WORD:4 * _DOCUMENTS_TAG_WORD + 4] == DOCUMENTS_TAG:
            documents = int(words[_DOCUMENTS_WORD])
            if documents < 0:
                raise ValueError(f"token file {self.path!r} has a negative document count {documents}")
        starts_offset = HEADER_BYTES + BYTES_PER_TOKEN * count + (_mask_bytes(count) if self.has_mask else 0)
        expected = starts_offset + BYTES_PER_TOKEN * (documents or 0)
        if size != expected:
            parts = f"{'with' if self.has_mask else 'no'} mask" + \
                ("" if documents is None else f", {documents} document starts")
            raise ValueError(f"token file {self.path!r} is {size} bytes but its header ({count} tokens, "
                             f"{parts}) needs exactly {expected} bytes; "
                             f"the file is {'truncated' if size < expected else 'longer than its header says'}")

        self._count = count
        # The file's bytes, mapped once (a mapping holds a file descriptor: one per file, so that a
        # set of many shards stays far below the process's limit), or read when small (then none).
        if size <= _READ_BYTES:
            with open(self.path, "rb") as f:
                data = np.frombuffer(f.read(), dtype=np.uint8)
            if data.size != size:
                raise ValueError(f"token file {self.path!r} changed while it was read")
        else:
            data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.tokens = data[HEADER_BYTES:HEADER_BYTES + BYTES_PER_TOKEN * count].view("<i4")
        mask_offset = HEADER_BYTES + BYTES_PER_TOKEN * count
        self._mask_bits = data[mask_offset:mask_offset + _mask_bytes(count)] if self.has_mask else None
        self._mask = None
        self.document_starts = None
        if documents is not None:
            self.document_starts = data[starts_offset:starts_offset + BYTES_PER_TOKEN * documents].view("<i4")
            problem = _document_starts_problem(self.document_starts, count)
            if problem:
                raise ValueError(f"token file {self.path!r}: {problem}; the file is corrupt")
        self._check_token_range()

    def _check_token_range(self) -> None:
        """Refuses negative ids and finds max_token (one pass)."""
        self.max_token = -1
        for start in range(0, self._count, _CHUNK_TOKENS):
            chunk = self.tokens[start:start + _CHUNK_TOKENS]
            if int(chunk.min()) < 0:
                index = start + int(np.argmax(chunk < 0))
                raise ValueError(f"token file {self.path!r}: token id {int(self.tokens[index])} at index "
                                 f"{index} is negative; the file is corrupt")
            self.max_token = max(self.max_token, int(chunk.max()))

    def first_id_from(self, limit: int) -> int | None:
        """The index of the first token id >= ``limit``, or None."""
        if self.max_token < limit:
            return None
        for start in range(0, self._count, _CHUNK_TOKENS):
            bad = self.tokens[start:start + _CHUNK_TOKENS] >= limit
            if bad.any():
                return start + int(np.argmax(bad))
        return None

    def check_vocab(self, model_vocab: int, what: str = "the model", trained: bool = True) -> None:
        """ValueError naming this file, the first index of an id >= model_vocab
        and ``what`` has that vocabulary (``what``: e.g. "the model"); for a
        model to be ``trained`` it suggests a larger vocabulary too."""
        index = self.first_id_from(model_vocab)
        if index is not None:
            grow = f" or give the model a vocabulary of at least {self.max_token + 1}" if trained else ""
            raise ValueError(f"token file {self.path!r}: token id {int(self.tokens[index])} at index {index} "
                             f"is outside the vocabulary of {what} ({model_vocab} ids, [0, {model_vocab})); "
                             f"the file's header says vocab {self.vocab_size}. Tokenize with the model's "
                             f"tokenizer{grow}")

    def __len__(self) -> int:
        return self._count

    @property
    def mask(self) -> Optional[np.ndarray]:
        """bool [len(self)], True = train on the token; None without a mask."""
        if self._mask_bits is None:
            return None
        if self._mask is None:
            self._mask = np.unpackbits(self._mask_bits, count=self._count, bitorder="little").astype(bool)
        return self._mask

    def mask_range(self, start: int, stop: int) -> Optional[np.ndarray]:
        """bool [stop - start]: the mask of tokens [start, stop), or None without a mask."""
        if self._mask_bits is None:
            return None
        if not 0 <= start <= stop <= self._count:
            raise IndexError(f"mask range [{start}, {stop}) outside [0, {self._count}] in {self.path!r}")
        bits = np.unpackbits(self._mask_bits[start // 8:_mask_bytes(stop)], bitorder="little")
        first = start % 8
        return bits[first:first + stop - start].astype(bool)

    def __repr__(self) -> str:
        documents = "" if self.document_starts is None else f", documents={self.document_starts.size}"
        return (f"TokenFile({self.path!r}, tokens={self._count}, vocab_size={self.vocab_size}, "
                f"mask={self.has_mask}{documents})")
