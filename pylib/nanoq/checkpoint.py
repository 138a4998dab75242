"""Checkpoints that never lose work: one directory per step, written atomically.

A checkpoint root holds::

    step_00001000/            one complete checkpoint
        model.safetensors       the trainable weights (float32, Hugging Face names): all of the
                                model's, or with LoRA only the adapters (the frozen base is the
                                model directory named by ``base_model`` in the state)
        optimizer.safetensors   master weights and AdamW moments: master.<name>, adam_m.<name>, adam_v.<name>
        trainer_state.json      step, AdamW step count, model config, options, the caller's
                                extra state (data loader, schedule), file sizes, versions
    latest                    the name of the newest complete checkpoint
    .lock                     held (flock) while a save or a rotation runs

A save builds ``.step_<N>.partial-<pid>/``, fsyncs every file and the folder,
renames it to ``step_<N>/`` (atomic), and only then rewrites ``latest``
through a temporary file and a rename. A process killed at any point leaves
the previous checkpoints intact; its partial folder is never read and is
removed by the next save. A failed write (a full disk) removes the partial
folder and raises. Loading checks every file before the trainer is touched.

Optimizer state is stored as full tensors (gathered from the device shards),
so a checkpoint written on N devices loads on any number of devices. The
only randomness in training is derived from the seed, the step and the data
loader's position (all stored), so a resumed run continues bit for bit.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shutil
import time
import warnings
from typing import Dict, List, Optional

import numpy as np

from nanoq.durable import fsync_path, read_json_object, write_json
from nanoq.hf_io import read_safetensors
from nanoq.testing import hooks as testing_hooks

FORMAT_VERSION = 1
STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
LATEST = "latest"
REQUIRED_FIELDS = ("format_version", "nanoq_version", "step", "optimizer_steps", "model_config", "options",
                   "extra_state", "files")
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or for another model."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# -- writing -----------------------------------------------------------------

class _RootLock:
    """Exclusive lock on a checkpoint root, across processes."""

    def __init__(self, root: str):
        self.path = os.path.join(root, ".lock")

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _remove_partials(root: str) -> None:
    """Removes what interrupted saves and deletions left behind."""
    for name in os.listdir(root):
        if name.startswith(".") and (".partial-" in name or name.startswith(".deleting-")):
            path = os.path.join(root, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)


def _save_tensors(path: str, tensors: Dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, path,
              metadata={"format": "pt"})
    fsync_path(path)


def save_checkpoint(trainer, root: str | os.PathLike, step: int, extra_state: Optional[dict] = None, *,
                    keep_last: int = 0, keep_every: int = 0, tokenizer_dir: Optional[str] = None) -> str:
    """Writes ``root/step_<step>/`` atomically, points ``root/latest`` at it
    and, if ``keep_last`` > 0, rotates (see ``rotate``). Returns the step
    directory. Raises FileExistsError if that step was already saved, and
    OSError (with the previous checkpoints intact) if writing fails.
    tokenizer_dir is recorded for ``nanoq export``."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    step = int(step)
    extra_state = {} if extra_state is None else extra_state
    try:
        json.dumps(extra_state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra_state must be JSON-serialisable: {e}") from None
    root = os.path.abspath(os.fspath(root))
    os.makedirs(root, exist_ok=True)
    with _RootLock(root):
        _remove_partials(root)
        final = os.path.join(root, step_dir_name(step))
        if os.path.exists(final):
            raise FileExistsError(f"checkpoint {final} already exists; not overwriting it")
        partial = os.path.join(root, f".{step_dir_name(step)}.partial-{os.getpid()}")
        os.mkdir(partial)
        try:
            _write_checkpoint(trainer, partial, step, extra_state, tokenizer_dir)
            fsync_path(partial)
            os.rename(partial, final)
            fsync_path(root)
            _point_latest(root, step_dir_name(step))
        except BaseException as e:
            shutil.rmtree(partial, ignore_errors=True)
            if isinstance(e, OSError):
                raise OSError(e.errno, f"saving checkpoint step {step} in {root} failed ({e.strerror or e}); "
                                       f"earlier checkpoints are intact") from e
            raise
        if keep_last:
            _rotate_locked(root, keep_last, keep_every)
    return final


def _write_checkpoint(trainer, directory: str, step: int, extra_state: dict, tokenizer_dir: Optional[str]) -> None:
    import nanoq

    _save_tensors(os.path.join(directory, WEIGHTS_FILE), trainer.get_weights(trainable_only=True))
    testing_hooks.pause_in_save_if_armed()
    optimizer = {f"{kind}.{name}": array for kind, arrays in trainer.get_optimizer_state().items()
                 for name, array in arrays.items()}
    _save_tensors(os.path.join(directory, OPTIMIZER_FILE), optimizer)
    files = {name: os.path.getsize(os.path.join(directory, name)) for name in (WEIGHTS_FILE, OPTIMIZER_FILE)}
    options = dict(dataclasses.asdict(trainer.options), backend=trainer.backend, dtype=trainer.dtype)
    del options["comm_id"]  # names this run's communicator world only (bytes, no JSON)
    write_json(os.path.join(directory, STATE_FILE), dict(
        format_version=FORMAT_VERSION,
        nanoq_version=nanoq.__version__,
        step=step,
        optimizer_steps=trainer.optimizer_steps,
        model_config=trainer.config.to_core(),
        max_position_embeddings=max(trainer.config.max_position_embeddings or 0, trainer.options.seq_len),
        tokenizer_dir=None if tokenizer_dir is None else os.path.abspath(tokenizer_dir),
        options=options,
        devices=trainer.world_size,
        lora=None if trainer.lora is None else dataclasses.asdict(trainer.lora),
        base_model=trainer.base_model,
        extra_state=extra_state,
        files=files,
        saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    ))


def _point_latest(root: str, name: str) -> None:
    temporary = os.path.join(root, f".latest.partial-{os.getpid()}")
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(root, LATEST))
    fsync_path(root)


# -- finding and reading -------------------------------------------------------

def read_state(path: str | os.PathLike) -> dict:
    """The checked ``trainer_state.json`` of a step directory (or of the
    newest valid checkpoint of a root), with ``path`` added. Raises
    CheckpointError naming the file and the problem."""
    directory = resolve(path)
    file = os.path.join(directory, STATE_FILE)
    try:
        state = read_json_object(file, CheckpointError)
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a checkpoint: no {STATE_FILE}") from None
    missing = [field for field in REQUIRED_FIELDS if field not in state]
    if missing:
        raise CheckpointError(f"{file} lacks {', '.join(missing)}")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{file} has format version {state['format_version']!r}; this nanoq reads "
                              f"version {FORMAT_VERSION}")
    for field in ("step", "optimizer_steps"):
        if isinstance(state[field], bool) or not isinstance(state[field], int) or state[field] < 0:
            raise CheckpointError(f"{file}: {field} must be a non-negative integer, got {state[field]!r}")
    if not isinstance(state["model_config"], dict) or not isinstance(state["files"], dict):
        raise CheckpointError(f"{file}: model_config and files must be objects")
    for name in (WEIGHTS_FILE, OPTIMIZER_FILE):
        expected = state["files"].get(name)
        actual = os.path.getsize(os.path.join(directory, name)) if os.path.exists(os.path.join(directory, name)) \
            else None
        if actual is None or actual != expected:
            raise CheckpointError(f"{os.path.join(directory, name)}: expected {expected} bytes, found "
                                  f"{'no file' if actual is None else f'{actual} bytes'}")
    state["path"] = directory
    return state


def _is_valid(directory: str) -> bool:
    try:
        read_state(directory)
        return True
    except CheckpointError:
        return False


def list_checkpoints(root: str | os.PathLike) -> List[int]:
    """Steps of the complete checkpoints under ``root``, ascending."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if match and _is_valid(os.path.join(root, name)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def resolve(path: str | os.PathLike) -> str:
    """A step directory itself, or a root's ``latest`` (if valid) or newest
    valid checkpoint. Raises CheckpointError when there is none."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(os.path.join(path, STATE_FILE)) or _STEP_DIR.match(os.path.basename(path)):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}")
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            candidate = os.path.join(path, f.read().strip())
        if _STEP_DIR.match(os.path.basename(candidate)) and _is_valid(candidate):
            return candidate
    steps = list_checkpoints(path)
    if not steps:
        raise CheckpointError(f"{path} holds no complete checkpoint")
    return os.path.join(path, step_dir_name(steps[-1]))


def _read_file(directory: str, name: str) -> Dict[str, np.ndarray]:
    path = os.path.join(directory, name)
    try:
        return dict(read_safetensors(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def read_weights(path: str | os.PathLike) -> Dict[str, np.ndarray]:
    """The weights of a checkpoint (step directory or root), float32 by Hugging Face name."""
    return _read_file(read_state(path)["path"], WEIGHTS_FILE)


def load_checkpoint(trainer, path: str | os.PathLike) -> dict:
    """Loads a checkpoint into ``trainer`` (any device count) and returns its
    state (see ``read_state``). The model config and LoRA setting must match
    the trainer's; a LoRA checkpoint loads only the adapters, so import the
    base model (``state["base_model"]``) first. Every file is read and
    checked before anything is set."""
    state = read_state(path)
    directory = state["path"]
    ours = trainer.config.to_core()
    theirs = state["model_config"]
    differences = [f"{key}: checkpoint {theirs.get(key)!r}, trainer {ours[key]!r}" for key in ours
                   if theirs.get(key) != ours[key]]
    if differences:
        raise CheckpointError(f"{directory} is for another model: {'; '.join(differences)}")
    trainer_lora = None if trainer.lora is None else dataclasses.asdict(trainer.lora)
    saved_lora = state.get("lora")
    if isinstance(saved_lora, dict):
        saved_lora = dict(saved_lora, targets=tuple(saved_lora.get("targets", ())))
    if trainer_lora != saved_lora:
        raise CheckpointError(f"{directory} holds LoRA adapters {saved_lora}, but the trainer's LoRA setting is "
                              f"{trainer_lora}" if saved_lora else
                              f"{directory} holds full weights, but the trainer trains LoRA adapters")
    base = state.get("base_model")
    if saved_lora and base and trainer.base_model and os.path.realpath(base) != os.path.realpath(trainer.base_model):
        warnings.warn(f"{directory} trained its adapters on {base}, but the trainer's frozen weights come from "
                      f"{trainer.base_model}", stacklevel=2)
    if trainer._core.micro_steps:
        raise ValueError("cannot load a checkpoint with micro-batches pending: call update() first")
    weights = _read_file(directory, WEIGHTS_FILE)
    flat = _read_file(directory, OPTIMIZER_FILE)
    optimizer = {kind: {} for kind in trainer.OPTIMIZER_STATE}
    for key, array in flat.items():
        kind, _, name = key.partition(".")
        if kind not in optimizer:
            raise CheckpointError(f"{os.path.join(directory, OPTIMIZER_FILE)}: unexpected tensor {key!r}")
        optimizer[kind][name] = array
    expected = {trainer._parameters[i][0]: trainer._parameters[i][1] for i in trainer._trainable}
    for label, tensors in [(WEIGHTS_FILE, weights)] + [(f"{OPTIMIZER_FILE} ({k})", v) for k, v in optimizer.items()]:
        unknown = sorted(set(tensors) - set(expected))
        problems = [f"{name}: missing" for name in expected if name not in tensors]
        problems += [f"{name}: shape {tensors[name].shape}, expected {expected[name]}" for name in expected
                     if name in tensors and tensors[name].shape != expected[name]]
        problems += [f"{name}: not a parameter of this model" for name in unknown]
        if problems:
            raise CheckpointError(f"{os.path.join(directory, label.split(' ')[0])}: {'; '.join(problems[:3])}")
    trainer.set_weights(weights, trainable_only=True)
    trainer.set_optimizer_state(optimizer, state["optimizer_steps"])
    return state


# -- rotation ------------------------------------------------------------------

def rotate(root: str | os.PathLike, keep_last: int, keep_every: int = 0) -> List[int]:
    """Deletes complete checkpoints except the newest ``keep_last`` and every
    step divisible by ``keep_every``; never the newest one, never while a save
    holds the root's lock. Returns the deleted steps."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    root = os.path.abspath(os.fspath(root))
    with _RootLock(root):
        return _rotate_locked(root, keep_last, keep_every)


def _rotate_locked(root: str, keep_last: int, keep_every: int) -> List[int]:
    steps = list_checkpoints(root)
    keep = set(steps[-max(1, keep_last):])
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    deleted = []
    for step in steps:
        if step in keep:
            continue
        # Renamed first, so a crash mid-delete leaves no half checkpoint under a valid name.
        doomed = os.path.join(root, f".deleting-{step_dir_name(step)}")
        os.rename(os.path.join(root, step_dir_name(step)), doomed)
        shutil.rmtree(doomed)
        deleted.append(step)
    return deleted
