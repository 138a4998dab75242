"""Run logs: a JSONL file that stays valid if the process dies, and console lines.

Every line of ``log.jsonl`` is one JSON object, written and flushed whole:

    {"type": "start", "time": ..., "parameters": N, "backend": "cpu", "config": {...},
     "memory": [{"device": 0, "contexts": {"weights": bytes, ...}, "allocated": bytes, ...}, ...]}
    {"type": "train", "step": 1, "loss": ..., "lr": ..., "grad_norm": ..., "tokens": ...,
     "trained_tokens": ..., "tokens_per_s": ..., "time": ...}
    {"type": "eval", "step": 0, "loss": ..., "tokens": ..., "time": ...}
    {"type": "telemetry", "step": 10, "time": ..., "gpus": [{"device": 0, "gpu_util": 97, ...}, ...]}
    {"type": "sample", "step": 60, "index": 0, "prompt": "...", "completion": "...", "time": ...}
    {"type": "warning", "step": 40, "message": "only ... free in ...: deleted step_00000020 ...", "time": ...}
    {"type": "end", "step": N, "time": ..., "model_dir": ...}

``step`` counts finished optimizer updates (a train line's step is 1 after the
first update; an eval at step 0 scores the initial weights). ``tokens`` on a
train line is the running total of tokens fed to the model, and
``trained_tokens`` the number of them the step's loss averaged (targets not
masked out: the responses of SFT data); on an eval line, the tokens scored. ``time`` is seconds since the start of training.
A ``sample`` line is the greedy continuation of prompt ``index`` of
train.sample_prompts after ``step`` updates (see nanoq.training.samples). A
``warning`` line says that the save at ``step`` deleted an older checkpoint
early because the disk was short of room (nanoq.checkpoint.DiskSpaceWarning).
``memory`` (also on a ``resume`` line) is Trainer.memory_summary(): each
device's allocations summed by context, and more; ``gpus`` holds GpuTelemetry.sample()
(see nanoq.telemetry: cuda runs with NVML only, every run.telemetry_every steps).
"""
from __future__ import annotations

import json
import math
import os
import warnings
from typing import IO, List, Optional

from nanoq.memory import human_bytes


class JsonlLog:
    """Appends one JSON object per line to ``path`` and flushes each line.

    tracker: a nanoq.training.tracking.Tracker that receives every record
    written (the same dict as the line), so a tracker logs what log.jsonl
    holds; ``close`` closes it too."""

    def __init__(self, path: str | os.PathLike, tracker=None):
        self.path = os.fspath(path)
        _drop_torn_line(self.path)
        self._file: Optional[IO[str]] = open(self.path, "a", encoding="utf-8")
        self.tracker = tracker

    def write(self, **record) -> None:
        # NaN/inf are not JSON: they become null so every line parses anywhere.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self.tracker is not None:
            self.tracker.record(clean)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.close()

    def __enter__(self) -> "JsonlLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _drop_torn_line(path: str) -> None:
    """Cuts a torn last line (a writer killed mid-line: no newline at the
    end) off an existing log, so that the next record starts a line of its
    own instead of gluing onto the fragment (which no reader could parse)."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return
    with f:
        size = f.seek(0, os.SEEK_END)
        if not size:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # The end of the last whole line: read back from the end in blocks.
        end, block = size, 1 << 16
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return
            end = start
        f.truncate(0)


def read_log(path: str | os.PathLike) -> list:
    """The records of a log.jsonl. A torn last line (no newline ends it and
    it does not parse: the writer was killed mid-line, or is still writing
    it; a run that resumes cuts it off before it writes) is skipped with a
    warning naming the file; any other bad line, the last one included when
    a newline ends it, is a ValueError naming the file and line."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # after the last newline: written only in part
                warnings.warn(f"{path}: skipped its last line {number}, cut off before its newline (a run killed, "
                              f"or still writing, mid-line)", stacklevel=2)
                break
            raise ValueError(f"{path}:{number}: not a JSON line") from None
    return records


def format_duration(seconds: float) -> str:
    """``m:ss`` or ``h:mm:ss``."""
    seconds = int(round(max(seconds, 0.0)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def train_line(step: int, steps: int, loss: float, grad_norm: float, lr: float, tokens_per_s: float,
               trained_per_s: float, elapsed: float, eta: float) -> str:
    """The console line of a step: tokens/s of all tokens fed and of the
    trained ones (targets not masked out), which differ on SFT data."""
    width = len(str(steps))
    return (f"step {step:>{width}}/{steps} | loss {loss:.4f} | grad norm {grad_norm:.3f} | lr {lr:.2e} | "
            f"{tokens_per_s:,.0f} tok/s ({trained_per_s:,.0f} trained) | {format_duration(elapsed)} elapsed, "
            f"ETA {format_duration(eta)}")


def eval_line(step: int, loss: float, tokens: int, seconds: float) -> str:
    return f"eval @ step {step}: loss {loss:.4f} ({tokens:,} tokens, {seconds:.1f}s)"


def memory_lines(memory: List[dict]) -> List[str]:
    """Console lines of Trainer.memory_summary(): one per device, or one for
    all when every device holds the same."""
    def parts(entry: dict) -> str:
        items = [f"{context} {human_bytes(size)}" for context, size in entry["contexts"].items()]
        items.append(f"total {human_bytes(entry['allocated'])}")
        if entry["host"]:
            items.append(f"host {human_bytes(entry['host'])}")
        return ", ".join(items)

    if len(memory) > 1 and all(parts(entry) == parts(memory[0]) for entry in memory):
        return [f"memory per device (x{len(memory)}): {parts(memory[0])}"]
    return [f"memory device {entry['device']}: {parts(entry)}" for entry in memory]


def gpu_summary(gpus: List[dict]) -> str:
    """The console fragment of a telemetry sample, e.g. ``gpu 97% 61.2GiB
    612W 71C`` for one GPU; for several, ranges (``95-98%``) and the summed
    power. Clock limits other than idle follow as ``throttled: sw_power_cap``.
    Metrics a GPU did not report are left out; no GPUs: ""."""
    if not gpus:
        return ""

    def span(key: str, scale: float, unit: str) -> Optional[str]:
        values = [gpu[key] / scale for gpu in gpus if key in gpu]
        if len(values) < len(gpus):
            return None
        digits = 1 if unit == "GiB" else 0
        low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
        return (low if low == high else f"{low}-{high}") + unit

    pieces = ["gpu" if len(gpus) == 1 else f"{len(gpus)} gpus", span("gpu_util", 1, "%"),
              span("memory_used", 2**30, "GiB")]
    if all("power_w" in gpu for gpu in gpus):
        pieces.append(f"{sum(gpu['power_w'] for gpu in gpus):.0f}W")
    pieces.append(span("temperature_c", 1, "C"))
    reasons = sorted({name for gpu in gpus for name in gpu.get("throttle", ()) if name != "idle"})
    if reasons:
        pieces.append("throttled: " + ", ".join(reasons))
    return " ".join(piece for piece in pieces if piece)
