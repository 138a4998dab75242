"""Windows of token files, served as shuffled training batches or in-order eval batches.

A Dataset cuts each file into windows of seq_len + 1 tokens that step by
seq_len, as llm.q and nanoGPT-style loaders do: window i covers tokens
[i * seq_len, i * seq_len + seq_len + 1), its tokens [0, seq_len) are the
inputs and [1, seq_len] the targets, so consecutive windows share one token
(the last target of one is the first input of the next) and every token but
a file's first is a target exactly once per epoch.

Runs from before nanoq stepped by seq_len cut windows every seq_len + 1
tokens (``window_step = seq_len + 1``); a DataLoader state saved then lacks
``window_step`` and resumes with those windows (see DataLoader.load_state_dict).

DataLoader streams windows in a per-epoch permutation and cuts the stream into
global batches of batch_rows rows. The stream, not the batch, is what epochs
divide: when an epoch ends inside a batch, the batch is completed from the next
epoch, so every window is used exactly once per epoch and no window is dropped.
The loader's position is a window index into that stream, which is why resuming
is exact and even survives a change of batch_rows.

With ``packing="pack"`` (token files of whole documents, as ``nanoq
tokenize`` writes them), a window is instead whole documents packed in file
order, never split. A file's documents are where it records them (its
document starts, see nanoq.data.token_file: a document, such as an SFT
conversation with an EOS after every assistant turn, may hold EOS tokens of
its own); in a file without them (llm.q's, older nanoq's) each EOS closes a
document. A document of n tokens fills
n - 1 positions (its tokens but the last as inputs, but the first as
targets, so its last target is its EOS), a document that does not fit the
rest of a window starts the next one, and the rest of a window is padding
(input 0, target -100, position 0: one-token documents that count for
nothing). Batches then carry positions [rows, seq_len] as a third array,
each token's position in its document, which Trainer.step takes so that
attention stays inside each document and RoPE restarts with it. A document
longer than a window is the one exception: it is cut into pieces of
seq_len positions (with a warning), each piece its own document (positions
restart at 0), so no piece attends past its window. The packing is
computed once, when the Dataset opens, and the loaders treat its windows as
they treat stream windows: shuffling, resume and parts are unchanged.

``objective`` (nanoq.data.objectives) says how a stream window becomes
(inputs, targets): "causal" as above; "seq2seq" (windows of 2 * seq_len
tokens: the first half the inputs, the second the targets) and "denoise"
(windows of seq_len tokens, the targets the window and the inputs it with
tokens replaced by ``mask_token``, drawn per window from the loader's seed,
the epoch and the window's index) are Nano's objectives for bidirectional
models; their windows are disjoint.

Under a launcher every process serves only its part of each global batch
(``part=(index, count)``: rows [index * batch_rows / count, (index + 1) *
batch_rows / count)), the rows of its devices. Every process computes the
same global order, reads from the token files only the windows of its own
rows, and keeps the same (global) position, so P processes together consume
exactly the batches one process would.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import warnings
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from nanoq.data import objectives
from nanoq.data.objectives import IGNORE_INDEX
from nanoq.data.token_file import TokenFile, open_token_files

PACKINGS = ("stream", "pack")

# (inputs, targets), or with packing "pack" (inputs, targets, positions).
Batch = Tuple[np.ndarray, ...]


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def check_dataset(dataset, loader: str) -> Dataset:
    """``dataset``, when it is a Dataset; else TypeError saying how to make
    one (``loader``: the class taking it, for the message)."""
    if not isinstance(dataset, Dataset):
        hint = (f"; make one from the files: {loader}(Dataset({dataset!r}, seq_len=...), ...)"
                if isinstance(dataset, (str, os.PathLike, list, tuple)) else
                " (nanoq.data.Dataset(paths_or_globs, seq_len) makes one from token files)")
        raise TypeError(f"{loader} takes a nanoq.data.Dataset as its dataset, got {type(dataset).__name__}{hint}")
    return dataset


def check_part(part, batch_rows: int) -> Tuple[int, int]:
    """(index, count) of a loader's ``part`` argument: part ``index`` of
    ``count`` equal parts of each batch of ``batch_rows`` rows."""
    if not (isinstance(part, (tuple, list)) and len(part) == 2
            and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in part)):
        raise ValueError(f"part must be (index, count): this process's part of each global batch, got {part!r}")
    index, count = int(part[0]), int(part[1])
    if count <= 0 or not 0 <= index < count:
        raise ValueError(f"part (index, count) needs count >= 1 and 0 <= index < count, got {part!r}")
    if batch_rows % count:
        raise ValueError(f"batch_rows {batch_rows} is not divisible into {count} parts (part {part!r}): every "
                         f"process takes the same number of rows")
    return index, count


def check_state(state, kind: str, keys: Sequence[str]) -> dict:
    """Checks that ``state`` is a state_dict written by a ``kind``; returns it."""
    if not isinstance(state, dict) or state.get("kind") != kind:
        found = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not a {kind} state: expected a dict with kind {kind!r}, got {found!r}")
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(f"{kind} state is missing {', '.join(missing)}")
    return state


def _expand(paths_or_globs) -> List[str]:
    specs = [paths_or_globs] if isinstance(paths_or_globs, (str, os.PathLike)) else list(paths_or_globs)
    if not specs:
        raise ValueError("no token files given")
    paths = []
    for spec in specs:
        spec = os.fspath(spec)
        if glob.has_magic(spec):
            matches = sorted(glob.glob(spec))
            if not matches:
                raise ValueError(f"glob {spec!r} matches no files")
            paths.extend(matches)
        else:
            paths.append(spec)
    seen = set()
    for path in paths:
        key = os.path.realpath(path)
        if key in seen:
            raise ValueError(f"token file {path!r} is listed more than once")
        seen.add(key)
    return paths


def tokenize_summary(path: str) -> dict:
    """The tokenize.json that ``nanoq tokenize`` wrote beside token file
    ``path`` ({} when there is none)."""
    summary = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenize.json")
    if not os.path.isfile(summary):
        return {}
    with open(summary, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def default_packing(paths_or_globs) -> str:
    """The packing the files' tokenization chose (tokenize.json's
    ``packing``: "pack" for ``--format sft``), "stream" where none did."""
    choices = {tokenize_summary(path).get("packing", "stream") for path in _expand(paths_or_globs)}
    return "pack" if choices == {"pack"} else "stream"


class Dataset:
    """Token files cut into windows of seq_len + 1 tokens, stepping by seq_len.

    paths_or_globs: a path or glob, or a list of them; globs expand sorted and
    must match something. Window i of a file covers its tokens
    [i * window_step, i * window_step + seq_len + 1); windows never cross
    files, and a file's tail too short for another window is dropped.
    Windows are numbered file by file in the given order. A target whose
    token has mask bit 0 becomes -100.

    window_step: seq_len (the default: every token but a file's first is a
    target once) or seq_len + 1 (disjoint windows: one per line of a Nano
    import, see the data.window_step setting, and the windows of runs from
    before nanoq stepped by seq_len, see ``with_window_step``).

    vocab_size: the largest header vocab size of the files (what the
    tokenizer says); max_token: the largest token id in them, which may
    reach past vocab_size (llm.q writes an added EOS token as id = header
    vocab). ``check_vocab(model_vocab)`` checks the tokens against a model.

    packing: "stream" (the default, the windows above) or "pack" (whole
    documents packed into windows, see the module docstring; then
    read_windows also returns positions). "auto" is what the files'
    tokenization chose (``default_packing``: pack for SFT files). eos_id:
    the token that closes each document, for pack, where a file does not
    record its document starts (default: the eos_id of the tokenize.json
    beside the files; needed only then).

    objective: "causal" (the default), "seq2seq" or "denoise" (see the module
    docstring and nanoq.data.objectives; stream windows only): windows of
    ``objectives.window_tokens(objective, seq_len)`` tokens, disjoint for the
    last two. mask_token: the id denoise puts in place of a token.
    """

    def __init__(self, paths_or_globs, seq_len: int, window_step: Optional[int] = None,
                 packing: str = "stream", eos_id: Optional[int] = None, objective: str = "causal",
                 mask_token: Optional[int] = None):
        self.seq_len = positive_int("seq_len", seq_len)
        if packing == "auto":  # what the files were tokenized for; the other objectives' windows are the stream's
            packing = default_packing(paths_or_globs) if objective == "causal" else "stream"
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {', '.join(PACKINGS)} or auto, got {packing!r}")
        self.packing = packing
        self.objective = objectives.check_objective(objective)
        if objective != "causal" and packing == "pack":
            raise ValueError(f"packing pack is for the causal objective; {objective} reads stream windows")
        if objective == "denoise":
            if isinstance(mask_token, bool) or not isinstance(mask_token, (int, np.integer)) or mask_token < 0:
                raise ValueError(f"objective denoise needs mask_token, a non-negative token id; got {mask_token!r}")
            mask_token = int(mask_token)
        elif mask_token is not None:
            raise ValueError(f"mask_token is for objective denoise, not {objective}")
        self.mask_token = mask_token
        self.files = open_token_files(_expand(paths_or_globs))
        if packing == "pack":
            if window_step not in (None, self.seq_len):
                raise ValueError(f"packing pack fills windows with whole documents: window_step must be unset "
                                 f"(or seq_len {self.seq_len}), got {window_step!r}")
            self.eos_id = self._document_end(eos_id)
            self._pack()
        else:
            self.eos_id = None
            self._cut(window_step)

    def _document_end(self, eos_id: Optional[int]) -> Optional[int]:
        """The EOS id that ends documents in files without document starts
        (None when every file records its starts and none is known)."""
        if eos_id is None:
            ids = {tokenize_summary(f.path).get("eos_id") for f in self.files}
            if len(ids) != 1 or None in ids:
                without_starts = [f.path for f in self.files if f.document_starts is None]
                if not without_starts:
                    return None
                raise ValueError(f"packing pack needs the EOS id that closes each document of "
                                 f"{', '.join(map(repr, without_starts))} (which do not record where their "
                                 f"documents start): give eos_id, or tokenize the files with nanoq tokenize (its "
                                 f"tokenize.json names it); found {sorted(map(str, ids))} for "
                                 f"{', '.join(repr(f.path) for f in self.files)}")
            eos_id = ids.pop()
        if isinstance(eos_id, bool) or not isinstance(eos_id, (int, np.integer)) or eos_id < 0:
            raise ValueError(f"eos_id must be a non-negative integer, got {eos_id!r}")
        return int(eos_id)

    def _documents(self, token_file: TokenFile) -> Tuple[np.ndarray, np.ndarray]:
        """starts, ends: int64 [documents], each document's tokens [start, end):
        the file's recorded document starts, else the documents its EOS
        tokens close (and a last one without its EOS)."""
        if token_file.document_starts is not None:
            starts = np.asarray(token_file.document_starts, dtype=np.int64)
            return starts, np.append(starts[1:], len(token_file))
        ends = np.flatnonzero(np.asarray(token_file.tokens) == self.eos_id) + 1
        if len(token_file) and (ends.size == 0 or ends[-1] != len(token_file)):
            ends = np.append(ends, len(token_file))  # a last document without its EOS
        return np.concatenate([[0], ends[:-1]]).astype(np.int64), ends

    def _pack(self) -> None:
        """Packs each file's documents in order into windows of seq_len
        positions: segments (file, first token, positions) in window order,
        _first_segment[w] the first segment of window w (CSR)."""
        T = self.seq_len
        seg_file, seg_start, seg_length, first_segment = [], [], [], [0]
        split = 0
        for file_index, token_file in enumerate(self.files):
            starts, ends = self._documents(token_file)
            filled = 0
            for start, end in zip(starts.tolist(), ends.tolist()):
                positions = end - start - 1  # inputs of the document (its last token is only a target)
                if positions <= 0:
                    continue
                if positions > T:
                    split += 1
                pieces = [(start + p, min(T, positions - p)) for p in range(0, positions, T)]
                for piece_start, length in pieces:
                    if filled and filled + length > T:
                        first_segment.append(len(seg_file))
                        filled = 0
                    seg_file.append(file_index)
                    seg_start.append(piece_start)
                    seg_length.append(length)
                    filled += length
            if filled:
                first_segment.append(len(seg_file))
        if split:
            warnings.warn(f"packing: {split} document(s) longer than a window of seq_len {T} positions were cut "
                          f"into pieces of {T} (each its own document: positions restart, no piece attends to "
                          f"another)", stacklevel=3)
        self._segments = (np.array(seg_file, np.int64), np.array(seg_start, np.int64),
                          np.array(seg_length, np.int64))
        self._first_segment = np.array(first_segment, np.int64)
        self.window_step = T
        self.tail_tokens = 0  # (every document is in a window)
        self._first_window = np.array([0, len(first_segment) - 1], np.int64)
        if self.num_windows == 0:
            raise ValueError(f"no document of two or more tokens in {', '.join(repr(f.path) for f in self.files)} "
                             f"(documents: as recorded in a file, else closed by EOS id {self.eos_id})")
        self.vocab_size = max(f.vocab_size for f in self.files)
        self.max_token = max(f.max_token for f in self.files)

    def _cut(self, window_step: Optional[int]) -> None:
        steps = objectives.window_steps(self.objective, self.seq_len)
        step = steps[0] if window_step is None else window_step
        if step not in steps:
            if self.objective == "causal":
                raise ValueError(f"window_step must be seq_len ({self.seq_len}: windows sharing a token) or "
                                 f"seq_len + 1 ({self.seq_len + 1}: disjoint windows); got {window_step!r}")
            raise ValueError(f"objective {self.objective}'s windows of {steps[0]} tokens are disjoint: window_step "
                             f"must be {steps[0]}; got {window_step!r}")
        self.window_step = step
        window = objectives.window_tokens(self.objective, self.seq_len)
        windows_per_file = np.array([(len(f) - window) // step + 1 if len(f) >= window else 0
                                     for f in self.files], dtype=np.int64)
        # _first_window[i] = global index of file i's first window; last entry = total.
        self._first_window = np.concatenate([[0], np.cumsum(windows_per_file)])
        # Windows do not span files: the tokens after each file's last whole window are in none.
        self.tail_tokens = sum(len(f) - ((n - 1) * step + window if n else 0)
                               for f, n in zip(self.files, windows_per_file.tolist()))
        if self.num_windows == 0:
            tokens = sum(len(f) for f in self.files)
            size = {"causal": "seq_len + 1", "seq2seq": "2 * seq_len", "denoise": "seq_len"}[self.objective]
            names = ", ".join(repr(f.path) for f in self.files[:3])
            if len(self.files) > 3:
                names += f" and {len(self.files) - 3} more files"
            raise ValueError(f"no complete window of {size} = {window} tokens in {names} ({tokens} tokens in all; "
                             f"windows do not span files)")
        self.vocab_size = max(f.vocab_size for f in self.files)
        self.max_token = max(f.max_token for f in self.files)

    def with_window_step(self, window_step: int) -> "Dataset":
        """The same files cut with another window_step (this one if it already is)."""
        if window_step == self.window_step:
            return self
        if self.packing == "pack":
            raise ValueError(f"a packed dataset's windows are seq_len {self.seq_len} positions of whole "
                             f"documents; there is no window_step {window_step}")
        other = object.__new__(Dataset)
        other.seq_len, other.files, other.packing, other.eos_id = self.seq_len, self.files, self.packing, None
        other.objective, other.mask_token = self.objective, self.mask_token
        other._cut(window_step)
        return other

    def check_vocab(self, model_vocab: int, what: str = "the model", trained: bool = True) -> None:
        """ValueError naming the file, the index and ``model_vocab`` when a
        token id is >= model_vocab (an embedding row the model lacks)."""
        for token_file in self.files:
            token_file.check_vocab(model_vocab, what, trained)

    @property
    def num_windows(self) -> int:
        return int(self._first_window[-1])

    def __len__(self) -> int:
        return self.num_windows

    def file_sizes(self) -> List[Tuple[str, int]]:
        """(file name without its directory, bytes) of every file, in order:
        what identifies the files (see ``fingerprint``)."""
        return [(os.path.basename(f.path), os.path.getsize(f.path)) for f in self.files]

    def fingerprint(self) -> dict:
        """Identifies the windows for state checks: file names (not directories,
        so a dataset may move), file sizes, seq_len and the number of windows
        (which differs between window steps), and for a packed dataset its
        packing and EOS id."""
        digest = hashlib.sha256(str(self.seq_len).encode())
        if self.packing == "pack":
            digest.update(f"\0pack\0{self.eos_id}".encode())
        if self.objective != "causal":
            digest.update(f"\0{self.objective}\0{self.mask_token}".encode())
        for name, size in self.file_sizes():
            digest.update(f"\0{name}\0{size}".encode())
        return {"files": len(self.files), "windows": self.num_windows, "sha256": digest.hexdigest()[:32]}

    def read_windows(self, indices, seed: int = 0, epochs=0) -> Batch:
        """inputs, targets: int32 [len(indices), seq_len], C-contiguous; with
        packing "pack" also positions (the same shape).

        indices: global window numbers in [0, len(self)). seed, epochs (one
        for all rows, or one per row): what the denoise objective draws its
        corruption of each window from (see nanoq.data.objectives).
        """
        indices = np.asarray(indices, dtype=np.int64)
        if self.packing == "pack":
            return self._read_packed(indices)
        inputs = np.empty((indices.size, self.seq_len), dtype=np.int32)
        targets = np.empty((indices.size, self.seq_len), dtype=np.int32)
        file_of = np.searchsorted(self._first_window, indices, side="right") - 1
        for row, (index, file_index) in enumerate(zip(indices.tolist(), file_of.tolist())):
            self._read_window(index, file_index, inputs[row], targets[row])
        if self.objective == "denoise":
            objectives.corrupt(inputs, indices, self.mask_token, seed, epochs)
        return inputs, targets

    def _read_window(self, index: int, file_index: int, inputs: np.ndarray, targets: np.ndarray) -> None:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} outside [0, {self.num_windows})")
        token_file = self.files[file_index]
        start = (index - int(self._first_window[file_index])) * self.window_step
        stop = start + objectives.window_tokens(self.objective, self.seq_len)
        objectives.split_window(self.objective, token_file.tokens[start:stop], token_file.mask_range(start, stop),
                                inputs, targets)

    def _read_packed(self, indices: np.ndarray) -> Batch:
        rows = indices.size
        inputs = np.zeros((rows, self.seq_len), dtype=np.int32)
        targets = np.full((rows, self.seq_len), IGNORE_INDEX, dtype=np.int32)
        positions = np.zeros((rows, self.seq_len), dtype=np.int32)
        seg_file, seg_start, seg_length = self._segments
        for row, index in enumerate(indices.tolist()):
            if not 0 <= index < self.num_windows:
                raise IndexError(f"window {index} outside [0, {self.num_windows})")
            at = 0
            for s in range(int(self._first_segment[index]), int(self._first_segment[index + 1])):
                token_file, start, n = self.files[int(seg_file[s])], int(seg_start[s]), int(seg_length[s])
                piece = token_file.tokens[start:start + n + 1]
                inputs[row, at:at + n] = piece[:-1]
                targets[row, at:at + n] = piece[1:]
                mask = token_file.mask_range(start + 1, start + n + 1)
                if mask is not None:
                    targets[row, at:at + n][~mask] = IGNORE_INDEX
                positions[row, at:at + n] = np.arange(n, dtype=np.int32)
                at += n
        return inputs, targets, positions

    def __repr__(self) -> str:
        if self.packing == "pack":
            return (f"Dataset({len(self.files)} files, seq_len={self.seq_len}, packing=pack, "
                    f"windows={self.num_windows})")
        step = "" if self.window_step == self.seq_len else f", window_step={self.window_step}"
        return f"Dataset({len(self.files)} files, seq_len={self.seq_len}{step}, windows={self.num_windows})"


class DataLoader:
    """Endless shuffled global batches: (inputs, targets), int32 [batch_rows, seq_len].

    dataset: a Dataset (TypeError otherwise; ``Dataset(paths_or_globs,
    seq_len)`` makes one from token files). batch_rows is the global
    batch: devices * per-device batch. The trainer
    gives device d rows [d * rows_per_device, (d + 1) * rows_per_device); the
    loader itself never looks at devices, so one seed gives the same global
    batches for any device count.

    Epoch e visits every window once, in the order
    ``np.random.default_rng([seed, e]).permutation(len(dataset))`` (this
    shuffles files and windows together). Batches are consecutive slices of
    the concatenated epochs, so a batch may end one epoch and start the next.
    ``epoch`` and ``position`` name the next window to be served.

    part: (index, count) serves only rows [index * part_rows, (index + 1) *
    part_rows) of every global batch, part_rows = batch_rows // count, and
    reads only their windows: one process's rows under a launcher (process
    p of P: part (p, P), with devices the world's). The order, the position
    and state_dict are the global ones, the same for every part.
    """

    def __init__(self, dataset: Dataset, batch_rows: int, seed: int, devices: int = 1,
                 part: Tuple[int, int] = (0, 1)):
        self.dataset = check_dataset(dataset, "DataLoader")
        self.batch_rows = positive_int("batch_rows", batch_rows)
        devices = positive_int("devices", devices)
        if self.batch_rows % devices:
            raise ValueError(f"batch_rows {self.batch_rows} is not divisible by devices {devices}")
        self.devices = devices
        self.rows_per_device = self.batch_rows // devices
        self.part = check_part(part, self.batch_rows)
        self.part_rows = self.batch_rows // self.part[1]
        self.seed = check_seed(seed)
        self.epoch = 0
        self.position = 0
        self._order_epoch = None
        self._order = None

    @property
    def seq_len(self) -> int:
        return self.dataset.seq_len

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = np.random.default_rng([self.seed, self.epoch]).permutation(self.dataset.num_windows)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> Batch:
        """This part's rows of the next global batch: inputs, targets int32
        [part_rows, seq_len] (the whole batch, [batch_rows, seq_len], by
        default), and positions with a packed dataset."""
        chosen, epochs = [], []
        needed = self.batch_rows
        while needed:
            order = self._epoch_order()
            take = order[self.position:self.position + needed]
            chosen.append(take)
            epochs.append(np.full(take.size, self.epoch, dtype=np.int64))
            needed -= take.size
            self.position += take.size
            if self.position == order.size:
                self.epoch += 1
                self.position = 0
        rows = slice(self.part[0] * self.part_rows, (self.part[0] + 1) * self.part_rows)
        return self.dataset.read_windows(np.concatenate(chosen)[rows], seed=self.seed,
                                         epochs=np.concatenate(epochs)[rows])

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def state_dict(self) -> dict:
        """JSON-serialisable position: seed, epoch, position, the window layout
        (window_step) and the dataset's fingerprint."""
        return {"kind": "DataLoader", "seed": self.seed, "epoch": self.epoch, "position": self.position,
                "window_step": self.dataset.window_step, "packing": self.dataset.packing,
                "objective": self.dataset.objective, "dataset": self.dataset.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Continues from ``state``: the next batches are those the saving loader
        would have served next. The dataset and seed must match (ValueError).

        The loader takes the state's window layout: a state without
        ``window_step`` was saved before windows stepped by seq_len, and the
        loader goes on with that run's windows of seq_len + 1 tokens apart
        (``dataset`` becomes ``dataset.with_window_step(seq_len + 1)``)."""
        check_state(state, "DataLoader", ("seed", "epoch", "position", "dataset"))
        packing = state.get("packing", "stream")
        if packing != self.dataset.packing:
            raise ValueError(f"DataLoader state was saved with packing {packing!r}, this loader's dataset has "
                             f"packing {self.dataset.packing!r}: its windows differ")
        objective = state.get("objective", "causal")
        if objective != self.dataset.objective:
            raise ValueError(f"DataLoader state was saved with objective {objective!r}, this loader's dataset has "
                             f"objective {self.dataset.objective!r}: its windows differ")
        step = state.get("window_step", self.seq_len + 1)
        steps = (self.seq_len,) if packing == "pack" else objectives.window_steps(objective, self.seq_len)
        if isinstance(step, bool) or not isinstance(step, int) or step not in steps:
            if objective != "causal":
                raise ValueError(f"DataLoader state has window_step {step!r}; objective {objective}'s windows step "
                                 f"by {steps[0]}")
            raise ValueError(f"DataLoader state has window_step {step!r}; this loader's windows are "
                             f"{self.seq_len + 1} tokens long and step by {self.seq_len} (or, for runs from "
                             f"before that, {self.seq_len + 1})")
        dataset = self.dataset.with_window_step(step)
        if state["dataset"] != dataset.fingerprint():
            raise ValueError(f"DataLoader state is from a different dataset (saved {state['dataset']}, "
                             f"this one {dataset.fingerprint()}); same files and seq_len are needed")
        if state["seed"] != self.seed:
            raise ValueError(f"DataLoader state was saved with seed {state['seed']}, this loader has seed "
                             f"{self.seed}")
        epoch, position = state["epoch"], state["position"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(position, int)
                and 0 <= position < dataset.num_windows):
            raise ValueError(f"DataLoader state has an invalid epoch {epoch!r} or position {position!r}")
        if dataset is not self.dataset:
            self.dataset, self._order_epoch, self._order = dataset, None, None
        self.epoch, self.position = epoch, position


class EvalLoader:
    """One in-order pass over a dataset in batches of batch_rows rows.

    dataset: a Dataset (TypeError otherwise). Yields inputs, targets int32
    [batch_rows, seq_len] (and positions with a packed dataset). The last batch is padded to full size with rows of
    inputs 0 and targets -100 (positions 0), so every batch has the
    trainer's shape and the padding counts for nothing in the loss.
    Each iteration starts again from the first window; len() is the number of
    batches.

    part: (index, count) yields only rows [index * part_rows, (index + 1) *
    part_rows) of every batch, part_rows = batch_rows // count, padded
    alike, and reads only their windows (see DataLoader).
    """

    def __init__(self, dataset: Dataset, batch_rows: int, part: Tuple[int, int] = (0, 1), seed: int = 0):
        self.dataset = check_dataset(dataset, "EvalLoader")
        self.batch_rows = positive_int("batch_rows", batch_rows)
        self.part = check_part(part, self.batch_rows)
        self.part_rows = self.batch_rows // self.part[1]
        self.seed = check_seed(seed)  # the denoise objective's draws (epoch 0): the same at every evaluation

    @property
    def seq_len(self) -> int:
        return self.dataset.seq_len

    def __len__(self) -> int:
        return -(-self.dataset.num_windows // self.batch_rows)

    def __iter__(self) -> Iterator[Batch]:
        total = self.dataset.num_windows
        for batch_start in range(0, total, self.batch_rows):
            start = min(batch_start + self.part[0] * self.part_rows, total)
            stop = min(start + self.part_rows, total)
            arrays = self.dataset.read_windows(np.arange(start, stop), seed=self.seed)
            if stop - start < self.part_rows:
                padded = [np.zeros((self.part_rows, self.seq_len), dtype=np.int32) for _ in arrays]
                padded[1][:] = IGNORE_INDEX
                for full, part in zip(padded, arrays):
                    full[:stop - start] = part
                arrays = tuple(padded)
            yield arrays
