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
import os
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from nanoq.data.token_file import TokenFile

IGNORE_INDEX = -100

Batch = Tuple[np.ndarray, np.ndarray]


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


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
    """

    def __init__(self, paths_or_globs, seq_len: int, window_step: Optional[int] = None):
        self.seq_len = positive_int("seq_len", seq_len)
        self.files = [TokenFile(path) for path in _expand(paths_or_globs)]
        self._cut(window_step)

    def _cut(self, window_step: Optional[int]) -> None:
        step = self.seq_len if window_step is None else window_step
        if step not in (self.seq_len, self.seq_len + 1):
            raise ValueError(f"window_step must be seq_len ({self.seq_len}: windows sharing a token) or "
                             f"seq_len + 1 ({self.seq_len + 1}: disjoint windows); got {window_step!r}")
        self.window_step = step
        window = self.seq_len + 1
        windows_per_file = np.array([(len(f) - window) // step + 1 if len(f) >= window else 0
                                     for f in self.files], dtype=np.int64)
        # _first_window[i] = global index of file i's first window; last entry = total.
        self._first_window = np.concatenate([[0], np.cumsum(windows_per_file)])
        if self.num_windows == 0:
            tokens = sum(len(f) for f in self.files)
            raise ValueError(f"no complete window of seq_len + 1 = {window} tokens in "
                             f"{', '.join(repr(f.path) for f in self.files)} ({tokens} tokens in all)")
        self.vocab_size = max(f.vocab_size for f in self.files)
        self.max_token = max(f.max_token for f in self.files)

    def with_window_step(self, window_step: int) -> "Dataset":
        """The same files cut with another window_step (this one if it already is)."""
        if window_step == self.window_step:
            return self
        other = object.__new__(Dataset)
        other.seq_len, other.files = self.seq_len, self.files
        other._cut(window_step)
        return other

    def check_vocab(self, model_vocab: int, what: str = "the model") -> None:
        """ValueError naming the file, the index and ``model_vocab`` when a
        token id is >= model_vocab (an embedding row the model lacks)."""
        for token_file in self.files:
            token_file.check_vocab(model_vocab, what)

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
        (which differs between window steps)."""
        digest = hashlib.sha256(str(self.seq_len).encode())
        for name, size in self.file_sizes():
            digest.update(f"\0{name}\0{size}".encode())
        return {"files": len(self.files), "windows": self.num_windows, "sha256": digest.hexdigest()[:32]}

    def read_windows(self, indices) -> Batch:
        """inputs, targets: int32 [len(indices), seq_len], C-contiguous.

        indices: global window numbers in [0, len(self)).
        """
        indices = np.asarray(indices, dtype=np.int64)
        inputs = np.empty((indices.size, self.seq_len), dtype=np.int32)
        targets = np.empty((indices.size, self.seq_len), dtype=np.int32)
        file_of = np.searchsorted(self._first_window, indices, side="right") - 1
        for row, (index, file_index) in enumerate(zip(indices.tolist(), file_of.tolist())):
            self._read_window(index, file_index, inputs[row], targets[row])
        return inputs, targets

    def _read_window(self, index: int, file_index: int, inputs: np.ndarray, targets: np.ndarray) -> None:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} outside [0, {self.num_windows})")
        token_file = self.files[file_index]
        start = (index - int(self._first_window[file_index])) * self.window_step
        stop = start + self.seq_len + 1
        window = token_file.tokens[start:stop]
        inputs[:] = window[:-1]
        targets[:] = window[1:]
        mask = token_file.mask_range(start + 1, stop)
        if mask is not None:
            targets[~mask] = IGNORE_INDEX

    def __repr__(self) -> str:
        step = "" if self.window_step == self.seq_len else f", window_step={self.window_step}"
        return f"Dataset({len(self.files)} files, seq_len={self.seq_len}{step}, windows={self.num_windows})"


class DataLoader:
    """Endless shuffled global batches: (inputs, targets), int32 [batch_rows, seq_len].

    batch_rows is the global batch: devices * per-device batch. The trainer
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
        self.dataset = dataset
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
        [part_rows, seq_len] (the whole batch, [batch_rows, seq_len], by default)."""
        chosen = []
        needed = self.batch_rows
        while needed:
            order = self._epoch_order()
            take = order[self.position:self.position + needed]
            chosen.append(take)
            needed -= take.size
            self.position += take.size
            if self.position == order.size:
                self.epoch += 1
                self.position = 0
        first = self.part[0] * self.part_rows
        return self.dataset.read_windows(np.concatenate(chosen)[first:first + self.part_rows])

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def state_dict(self) -> dict:
        """JSON-serialisable position: seed, epoch, position, the window layout
        (window_step) and the dataset's fingerprint."""
        return {"kind": "DataLoader", "seed": self.seed, "epoch": self.epoch, "position": self.position,
                "window_step": self.dataset.window_step, "dataset": self.dataset.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Continues from ``state``: the next batches are those the saving loader
        would have served next. The dataset and seed must match (ValueError).

        The loader takes the state's window layout: a state without
        ``window_step`` was saved before windows stepped by seq_len, and the
        loader goes on with that run's windows of seq_len + 1 tokens apart
        (``dataset`` becomes ``dataset.with_window_step(seq_len + 1)``)."""
        check_state(state, "DataLoader", ("seed", "epoch", "position", "dataset"))
        step = state.get("window_step", self.seq_len + 1)
        if isinstance(step, bool) or not isinstance(step, int) or step not in (self.seq_len, self.seq_len + 1):
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

    Yields inputs, targets int32 [batch_rows, seq_len]. The last batch is
    padded to full size with rows of inputs 0 and targets -100, so every batch
    has the trainer's shape and the padding counts for nothing in the loss.
    Each iteration starts again from the first window; len() is the number of
    batches.

    part: (index, count) yields only rows [index * part_rows, (index + 1) *
    part_rows) of every batch, part_rows = batch_rows // count, padded
    alike, and reads only their windows (see DataLoader).
    """

    def __init__(self, dataset: Dataset, batch_rows: int, part: Tuple[int, int] = (0, 1)):
        self.dataset = dataset
        self.batch_rows = positive_int("batch_rows", batch_rows)
        self.part = check_part(part, self.batch_rows)
        self.part_rows = self.batch_rows // self.part[1]

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
            inputs, targets = self.dataset.read_windows(np.arange(start, stop))
            if stop - start < self.part_rows:
                padded_inputs = np.zeros((self.part_rows, self.seq_len), dtype=np.int32)
                padded_targets = np.full((self.part_rows, self.seq_len), IGNORE_INDEX, dtype=np.int32)
                padded_inputs[:stop - start] = inputs
                padded_targets[:stop - start] = targets
                inputs, targets = padded_inputs, padded_targets
            yield inputs, targets
