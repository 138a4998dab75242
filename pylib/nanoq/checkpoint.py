"""Checkpoints that never lose work: one directory per step, written atomically.

A checkpoint root holds::

    step_00001000/                      one complete checkpoint
        part-00000-of-00002.safetensors   what process 0's devices own, as ZeRO shards
        part-00001-of-00002.safetensors   ... and process 1's (one part per process)
        trainer_state.json                step, AdamW step count, model config, options, the
                                          caller's extra state (data loader, schedule), the
                                          manifest of the parts, versions
    step_00000900.corrupt-<time>/       a damaged checkpoint that a resume set aside (never read)
    latest                              the name of the newest complete checkpoint (for people
                                          and other tools: nanoq itself takes the newest
                                          valid step by number)
    .lock                               held (flock) while a save or a rotation runs

Each part holds, for every trainable parameter (all of the model's, or with
LoRA only the adapters: the frozen base is the model directory named by
``base_model`` in the state), the slice [begin, end) of the flattened
tensor that lies in the shards of the process's devices (the ZeRO owners,
``Trainer.owned_range``): ``weights.<name>``, ``master.<name>``,
``adam_m.<name>`` and ``adam_v.<name>``, float32 and one-dimensional, under
Hugging Face names. The part's safetensors metadata ``nanoq_part`` (JSON)
says which process wrote it and, per name, the slice and the full shape.
The parts of all processes tile every tensor exactly. A run of one process
writes one part, the same format. ``trainer_state.json`` records the
manifest: ``parts`` (``processes``, ``world_size``: the devices of all
processes), ``files`` (every part file and its size in bytes),
``checksums`` (every part file's CRC-32, ``"crc32:<8 hex digits>"``) and
``finite`` (whether every weight, master weight and AdamW moment is
finite; ``non_finite`` names the first tensors that are not).

The checksum is zlib's CRC-32, streamed over the file in chunks: it is
there to catch accidental damage (a flipped bit, a block of zeros, a file
from another save), which a 32-bit CRC detects with certainty for bursts up
to 32 bits and otherwise misses with odds of 2^-32, and it runs several
times faster than a cryptographic hash such as BLAKE2 (it guards against
accidents, not against someone forging a checkpoint). Loading verifies
every recorded checksum before the trainer is touched; checkpoints written
before checksums existed (format 1, and format 2 without ``checksums``)
load without that check. ``trainer_state.json`` holds a checksum of its own
values, ``state_checksum`` (the CRC-32 of the other fields written as
canonical JSON: sorted keys, no spaces), so that damage which leaves valid
JSON (a digit of the step or of the data loader's position) is found too;
its fields are also checked one by one. A state without one (written before
it existed) is read without that check.

Rotation (``keep_last``, ``keep_every``) never deletes the newest
checkpoint whose state is finite, however many newer ones are not. Before
a save, process 0 checks the free space of the root against the size of
the checkpoint; if it is short and ``keep_last`` > 0, it first deletes the
checkpoints the rotation after this save would delete anyway (oldest
first, never the newest finite one), and warns; if that cannot make enough
room, it deletes nothing and the save fails with an OSError naming the size
needed, the space free and the folder.

Saving is collective: in a world of several processes (``Trainer.world_group``,
e.g. under ``mpiexec``) every process calls ``save_checkpoint`` with the same
arguments, and all directories are on one filesystem that every process
sees (a shared filesystem across nodes). Process 0 takes the root's lock,
makes ``.step_<N>.partial-<pid>/`` and tells the others its name; every
process writes and fsyncs its part there; the processes agree that every
part is durable (a failure on any fails the save on every process, naming
the process that failed, and the partial folder is removed); only then does
process 0 write and fsync the state, rename the folder to ``step_<N>/``
(atomic) and rewrite ``latest`` through a temporary file and a rename. A
process killed at any point (or a whole run) leaves the previous
checkpoints intact and ``latest`` unmoved; its partial folder is never read
and is removed by the next save. Loading checks every file before the
trainer is touched.

Loading works on any number of processes and devices: each trainer reads,
one tensor at a time, the whole weights (every device keeps those it holds
whole) and, of the master weights and AdamW moments, only the slices its
devices own. The only randomness in training is derived from the seed, the
step and the data loader's position (all stored), so a resumed run continues
bit for bit.

Format version 1 (written before several processes were supported), still
read: ``model.safetensors`` (the full trainable weights) and
``optimizer.safetensors`` (``master.<name>``, ``adam_m.<name>``,
``adam_v.<name>``, full tensors) in place of the parts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import math
import os
import re
import shutil
import sys
import time
import warnings
import zlib
from typing import Dict, List, Optional, Tuple

import numpy as np

from nanoq.agreement import agree, on_root
from nanoq.durable import (fsync_path, give_created_mode, make_dirs, read_json_object, replace_text, save_safetensors,
                           write_json)
from nanoq.hf_io import as_float32, safetensors_file
from nanoq.memory import human_bytes
from nanoq.testing import hooks as testing_hooks

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
STATE_FILE = "trainer_state.json"
V1_WEIGHTS_FILE = "model.safetensors"
V1_OPTIMIZER_FILE = "optimizer.safetensors"
PART_METADATA = "nanoq_part"
TENSOR_KINDS = ("weights", "master", "adam_m", "adam_v")  # the tensors of a part, per parameter
LATEST = "latest"
CHECKSUM_CHUNK = 16 << 20  # bytes read at a time to checksum a file
STATE_CHECKSUM = "state_checksum"  # trainer_state.json's checksum of its other fields
# Model options added after checkpoints were first written, and the value a
# checkpoint without them had.
_NEWER_MODEL_FIELDS = {"position_embedding": "rope", "mlp_bias": False, "dropout": 0.0, "causal": True}
REQUIRED_FIELDS = ("format_version", "nanoq_version", "step", "optimizer_steps", "model_config", "options",
                   "extra_state", "files")
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or for another model."""


class NewerFormatError(CheckpointError):
    """A checkpoint written by a newer nanoq, in a format this one cannot
    read: sound, not damaged (never set aside; a newer nanoq reads it)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def part_file_name(process: int, processes: int) -> str:
    """The file of process ``process``'s part in a checkpoint of ``processes`` parts."""
    return f"part-{process:05d}-of-{processes:05d}.safetensors"


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


def _save_tensors(path: str, tensors: Dict[str, np.ndarray], metadata: Dict[str, str]) -> None:
    save_safetensors({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, path,
                     metadata=metadata)
    give_created_mode(path)  # safetensors writes 0600; readable as the JSON beside it is
    fsync_path(path)


def _save_group(trainer):
    """The processes that save ``trainer``'s world together."""
    group = trainer.world_group
    if group is None:
        world, first = trainer.topology
        raise ValueError(f"this trainer holds ranks {first}..{first + trainer.world_size - 1} of a world of {world} "
                         f"placed by hand (TrainOptions.world_size), so it cannot reach the other shards to "
                         f"save a checkpoint: make the trainers of several processes with a process group "
                         f"(under a launcher, or Trainer(..., processes=...)) and save from every one")
    return group


def save_checkpoint(trainer, root: str | os.PathLike, step: int, extra_state: Optional[dict] = None, *,
                    keep_last: int = 0, keep_every: int = 0, tokenizer_dir: Optional[str] = None) -> str:
    """Writes ``root/step_<step>/`` atomically, points ``root/latest`` at it
    and, if ``keep_last`` > 0, rotates (see ``rotate``). Returns the step
    directory. Raises FileExistsError if that step was already saved, and
    OSError (with the previous checkpoints intact) if writing fails.
    tokenizer_dir is recorded for ``nanoq export``.

    Collective in a world of several processes: every process calls it with
    the same arguments, writes its own part, and returns (or raises) only
    once the checkpoint is complete (or has failed) on all; the directories
    must be on a filesystem that every process sees (see the module
    docstring). Process 0 takes the root's lock, writes the state, moves
    ``latest`` and rotates."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    step = int(step)
    keep_last, keep_every = _rotation_count("keep_last", keep_last), _rotation_count("keep_every", keep_every)
    if trainer._core.micro_steps:  # their gradients are in no file: a resume would not be this run
        raise ValueError(f"cannot save a checkpoint with micro-batches pending ({trainer._core.micro_steps} "
                         f"step() calls since the last update()): call update() first")
    extra_state = {} if extra_state is None else extra_state
    try:
        json.dumps(extra_state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra_state must be JSON-serialisable: {e}") from None
    group = _save_group(trainer)
    action = f"saving checkpoint step {step}"
    with contextlib.ExitStack() as root_only:  # process 0's lock, held to the end
        def prepare() -> Tuple[str, str, str]:
            directory = os.path.abspath(os.fspath(root))
            make_dirs(directory, exist_ok=True)
            root_only.enter_context(_RootLock(directory))
            _remove_partials(directory)
            final = os.path.join(directory, step_dir_name(step))
            if os.path.exists(final):
                raise FileExistsError(f"checkpoint {final} already exists; not overwriting it")
            # Incomplete ones count too: a later save of their step would find them in its way.
            later = [saved for saved in list_step_dirs(directory) if saved > step]
            if later:  # it would be read (and kept) as the newest in place of this one
                raise ValueError(f"cannot save checkpoint step {step} into {directory}: it holds a later "
                                 f"checkpoint (step {later[-1]}). A checkpoint root holds one run's checkpoints, "
                                 f"the newest by step last (load_checkpoint, resume and rotation go by step): "
                                 f"save into another directory, or move the later step directories away first")
            _make_room(directory, checkpoint_bytes(trainer), keep_last, keep_every)
            partial = os.path.join(directory, f".{step_dir_name(step)}.partial-{os.getpid()}")
            os.mkdir(partial)
            return directory, partial, final

        directory, partial, final = on_root(group, prepare, action=action)
        where = f" in {directory}" + (f" on process {group.rank} of {group.size}" if group.size > 1 else "")

        error, written = None, None
        try:
            written = _write_part(trainer, partial, group.rank, group.size)
        except BaseException as e:  # noqa: BLE001 - every process must learn of it
            error = _save_error(e, step, where)
        try:
            parts = agree(group, error, written, action=action)
        except BaseException:
            if group.is_root:
                shutil.rmtree(partial, ignore_errors=True)
            raise
        finally:
            error = None  # (no cycle: see nanoq.agreement)

        def finish() -> str:
            try:
                _write_state(trainer, partial, step, extra_state, tokenizer_dir, parts)
                fsync_path(partial)
                os.rename(partial, final)
                fsync_path(directory)
                _point_latest(directory, step_dir_name(step))
            except BaseException as e:
                shutil.rmtree(partial, ignore_errors=True)
                raise _save_error(e, step, where) from e
            if keep_last:
                try:
                    _rotate_locked(directory, keep_last, keep_every)
                except OSError as e:  # the checkpoint is saved: say what was left, do not fail the save
                    warnings.warn(f"checkpoint step {step} is saved in {final}, but rotation (keep_last = "
                                  f"{keep_last}) could not delete an older one: {e.strerror or e}"
                                  + (f" ({e.filename})" if e.filename else "") + "; what it could not delete "
                                  "remains (a partly deleted one is removed by the next save)",
                                  DiskSpaceWarning, stacklevel=_caller())
            return final

        return on_root(group, finish, action=action)


def _save_error(error: BaseException, step: int, where: str) -> BaseException:
    """The error a failed save raises: an OSError says where and that the earlier checkpoints are intact."""
    if isinstance(error, OSError):
        wrapped = OSError(error.errno, f"saving checkpoint step {step}{where} failed "
                                       f"({error.strerror or error}); earlier checkpoints are intact")
        wrapped.__cause__ = error
        return wrapped
    return error


def _write_part(trainer, directory: str, process: int, processes: int) -> dict:
    """Writes this process's part (see the module docstring); returns its
    file name, size in bytes, checksum and the tensors in it that are not finite."""
    tensors, slices = {}, {}
    for name in trainer.trainable_names:
        begin, end = trainer.owned_range(name)
        if begin == end:
            continue
        slices[name] = dict(begin=begin, end=end, shape=list(trainer._parameters[trainer._index[name]][1]))
        tensors[f"weights.{name}"] = trainer.get_parameter_part(name)
        for kind in trainer.OPTIMIZER_STATE:
            tensors[f"{kind}.{name}"] = trainer.get_optimizer_state_part(name, kind)
    non_finite = [key for key, tensor in tensors.items() if not np.isfinite(tensor).all()]
    world, first = trainer.topology
    description = dict(process=process, processes=processes, world_size=world,
                       ranks=[first, first + trainer.world_size], slices=slices)
    file = part_file_name(process, processes)
    path = os.path.join(directory, file)
    _save_tensors(path, tensors, {PART_METADATA: json.dumps(description)})
    fsync_path(directory)
    testing_hooks.pause_in_save_if_armed()
    return dict(file=file, size=os.path.getsize(path), checksum=file_checksum(path), non_finite=non_finite)


def file_checksum(path: str | os.PathLike) -> str:
    """``"crc32:<8 hex digits>"``: zlib's CRC-32 of the file's bytes, read in chunks (see the module docstring)."""
    crc = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHECKSUM_CHUNK)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"


def checkpoint_bytes(trainer) -> int:
    """About the size of a checkpoint of ``trainer``'s world: four float32
    tensors (weights, master, AdamW m and v) per trainable element, the
    tensor headers of every part and the state file."""
    elements = sum(math.prod(trainer.parameter_shapes[name]) for name in trainer.trainable_names)
    headers = 4 * len(trainer.trainable_names) * 200 * trainer.topology[0]
    return 16 * elements + headers + (64 << 10)


def _caller() -> int:
    """The ``stacklevel`` that makes a warning issued by the function calling
    this name the first frame outside nanoq: the user's line, whether it
    called ``nanoq.checkpoint`` or a ``Trainer`` method."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


class DiskSpaceWarning(UserWarning):
    """A save deleted an older checkpoint early to make room (see _make_room),
    or could not delete the older ones its rotation would have (the save
    itself succeeded); the training loop shows it on the console and in
    log.jsonl."""


def _make_room(root: str, needed: int, keep_last: int, keep_every: int) -> None:
    """Makes sure ``root`` has ``needed`` bytes free for the next save:
    deletes, oldest first, the checkpoints the rotation after it would
    delete (with ``keep_last`` > 0; never the newest finite one) while
    space is short, warning for each; OSError (ENOSPC), deleting nothing,
    when even deleting them all would not make room."""
    free = shutil.disk_usage(root).free
    if free >= needed:
        return
    steps = list_checkpoints(root)
    doomed = [step for step in steps if step not in _kept(root, steps, keep_last - 1, keep_every)] \
        if keep_last else []
    if free + sum(_directory_bytes(os.path.join(root, step_dir_name(step))) for step in doomed) < needed:
        doomed = []  # deleting them would not make room: keep them, and fail
    for step in doomed:
        _delete(root, step)
        free = shutil.disk_usage(root).free
        warnings.warn(f"only {human_bytes(free)} free in {root}, short of the {human_bytes(needed)} a checkpoint "
                      f"needs: deleted {step_dir_name(step)} before writing the next one (keep_last = {keep_last} "
                      f"would have deleted it after)", DiskSpaceWarning, stacklevel=_caller())
        if free >= needed:
            return
    raise OSError(errno.ENOSPC, f"not enough disk space for a checkpoint in {root}: it needs about "
                                f"{human_bytes(needed)}, {human_bytes(free)} is free; free some space (or lower "
                                f"keep_last) and resume")


def _directory_bytes(directory: str) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(directory) if entry.is_file())


def _write_state(trainer, directory: str, step: int, extra_state: dict, tokenizer_dir: Optional[str],
                 parts: List[dict]) -> None:
    """Writes ``trainer_state.json``, with the manifest of ``parts`` (what
    ``_write_part`` returned on each process, in rank order)."""
    import nanoq

    options = dict(dataclasses.asdict(trainer.options), backend=trainer.backend, dtype=trainer.dtype)
    del options["comm_id"]  # names this run's communicator world only (bytes, no JSON)
    world = trainer.topology[0]
    state = dict(
        format_version=FORMAT_VERSION,
        nanoq_version=nanoq.__version__,
        step=step,
        optimizer_steps=trainer.optimizer_steps,
        model_config=trainer.config.to_core(),
        max_position_embeddings=max(trainer.config.max_position_embeddings or 0, trainer.options.seq_len),
        tokenizer_dir=None if tokenizer_dir is None else os.path.abspath(tokenizer_dir),
        # The same from the checkpoint root, for a run that is moved or copied with its data.
        tokenizer_dir_from_root=None if tokenizer_dir is None
        else os.path.relpath(os.path.abspath(tokenizer_dir), os.path.dirname(os.path.abspath(directory))),
        options=options,
        devices=world,
        lora=None if trainer.lora is None else dataclasses.asdict(trainer.lora),
        base_model=trainer.base_model,
        # What import_weights read from base_model (nanoq.hf_io.model_fingerprint): a resume may find it moved.
        base_model_fingerprint=trainer.base_model_fingerprint,
        extra_state=extra_state,
        parts=dict(processes=len(parts), world_size=world),
        files={part["file"]: part["size"] for part in parts},
        checksums={part["file"]: part["checksum"] for part in parts},
        finite=not any(part["non_finite"] for part in parts),
        non_finite=[key for part in parts for key in part["non_finite"]][:8],
        saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    write_json(os.path.join(directory, STATE_FILE), dict(state, **{STATE_CHECKSUM: state_checksum(state)}))


def state_checksum(state: dict) -> str:
    """``"crc32:<8 hex digits>"`` of ``state``'s fields but STATE_CHECKSUM,
    written as canonical JSON (sorted keys, no spaces, ASCII): what
    trainer_state.json records and read_state checks."""
    values = {key: value for key, value in state.items() if key != STATE_CHECKSUM}
    text = json.dumps(values, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return f"crc32:{zlib.crc32(text.encode('ascii')):08x}"


def recorded_tokenizer_dir(state: dict) -> Optional[str]:
    """The tokenizer directory a checkpoint's run recorded (``state`` from
    read_state), if it still holds a tokenizer.json: where it was, else, for
    a run moved or copied with its data, the same place from the root the
    checkpoint is in now. None when neither holds one."""
    recorded = state.get("tokenizer_dir")
    if not isinstance(recorded, str):
        return None
    candidates = [recorded]
    relative = state.get("tokenizer_dir_from_root")
    if isinstance(relative, str) and isinstance(state.get("path"), str):
        candidates.append(os.path.normpath(os.path.join(os.path.dirname(state["path"]), relative)))
    return next((c for c in candidates if os.path.isfile(os.path.join(c, "tokenizer.json"))), None)


def _point_latest(root: str, name: str) -> None:
    replace_text(os.path.join(root, LATEST), name + "\n")


# -- finding and reading -------------------------------------------------------

def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_state(path: str | os.PathLike) -> dict:
    """The checked ``trainer_state.json`` of a step directory (or of the
    newest valid checkpoint of a root), with ``path`` added; every data file
    it lists must exist with its recorded size. Raises CheckpointError
    naming the file and the problem."""
    directory = resolve(path)
    file = os.path.join(directory, STATE_FILE)
    try:
        state = read_json_object(file, CheckpointError)
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a checkpoint: no {STATE_FILE}") from None
    except NotADirectoryError:  # a stray file named like a step directory
        raise CheckpointError(f"{directory} is not a checkpoint: a file, not a step directory") from None
    missing = [field for field in REQUIRED_FIELDS if field not in state]
    if missing:
        raise CheckpointError(f"{file} lacks {', '.join(missing)}")
    version = state["format_version"]
    if isinstance(version, int) and not isinstance(version, bool) and version > max(READABLE_VERSIONS):
        import nanoq

        raise NewerFormatError(f"{file} has format version {version}, written by a newer nanoq "
                               f"({state.get('nanoq_version')!r}); this nanoq ({nanoq.__version__}) reads versions "
                               f"{', '.join(map(str, READABLE_VERSIONS))}: upgrade nanoq to read it")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise CheckpointError(f"{file} has format version {state['format_version']!r}; this nanoq reads "
                              f"versions {', '.join(map(str, READABLE_VERSIONS))}")
    if STATE_CHECKSUM in state:
        recorded = state.pop(STATE_CHECKSUM)
        actual = state_checksum(state)
        if recorded != actual:
            raise CheckpointError(f"{file} is corrupt: its values give the checksum {actual}, it was saved with "
                                  f"{recorded!r}")
    for field in ("step", "optimizer_steps"):
        if not _is_count(state[field]):
            raise CheckpointError(f"{file}: {field} must be a non-negative integer, got {state[field]!r}")
    if not isinstance(state["model_config"], dict) or not isinstance(state["files"], dict):
        raise CheckpointError(f"{file}: model_config and files must be objects")
    for name in _data_files(state, file):
        expected = state["files"].get(name)
        actual = os.path.getsize(os.path.join(directory, name)) if os.path.exists(os.path.join(directory, name)) \
            else None
        if actual is None or actual != expected:
            raise CheckpointError(f"{os.path.join(directory, name)}: expected {expected} bytes, found "
                                  f"{'no file' if actual is None else f'{actual} bytes'}")
    state["path"] = directory
    return state


def _data_files(state: dict, file: str) -> List[str]:
    """The data files a checked state lists: the version-1 pair, or the parts of its manifest."""
    if state["format_version"] == 1:
        return [V1_WEIGHTS_FILE, V1_OPTIMIZER_FILE]
    parts = state.get("parts")
    if not isinstance(parts, dict) or not all(_is_count(parts.get(key)) and parts.get(key) > 0
                                              for key in ("processes", "world_size")):
        raise CheckpointError(f"{file}: parts must be an object with positive integers processes and world_size, "
                              f"got {parts!r}")
    processes = parts["processes"]
    if len(state["files"]) != processes:  # checked before the names are made: processes may be absurd
        raise CheckpointError(f"{file}: files lists {len(state['files'])} file(s) for {processes} part(s)")
    names = [part_file_name(process, processes) for process in range(processes)]
    unexpected = sorted(set(state["files"]) - set(names))
    if unexpected:
        raise CheckpointError(f"{file}: files lists {unexpected[0]!r}, which is not a part of {processes}")
    return names


def verify(state: dict, share: Tuple[int, int] = (0, 1)) -> None:
    """Recomputes the checksum of every file the manifest of ``state`` (from
    ``read_state``) records one for; CheckpointError naming the first file
    whose bytes differ. Checkpoints without checksums pass unchecked.
    share (i, n): only every n-th file from the i-th, in name order (the
    processes of a world verify a checkpoint together)."""
    checksums = state.get("checksums")
    if checksums is None:
        return
    file = os.path.join(state["path"], STATE_FILE)
    if not isinstance(checksums, dict) or set(checksums) != set(state["files"]) or \
            not all(isinstance(value, str) and value.startswith("crc32:") for value in checksums.values()):
        raise CheckpointError(f"{file}: checksums must give a \"crc32:...\" value for each of the files "
                              f"{sorted(state['files'])}, got {checksums!r}")
    for name in sorted(checksums)[share[0]::share[1]]:
        path = os.path.join(state["path"], name)
        actual = file_checksum(path)
        if actual != checksums[name]:
            raise CheckpointError(f"{path} is corrupt: its checksum is {actual}, the checkpoint recorded "
                                  f"{checksums[name]} when it wrote it")


def is_finite(state: dict) -> bool:
    """Whether the checkpoint of ``state`` recorded its weights and optimizer
    state as finite (checkpoints from before that record count as finite)."""
    return state.get("finite", True) is not False


def newest_finite(root: str | os.PathLike) -> Optional[str]:
    """The step directory of the newest complete checkpoint under ``root``
    whose state is finite, or None."""
    root = os.path.abspath(os.fspath(root))
    for step in reversed(list_checkpoints(root)):
        directory = os.path.join(root, step_dir_name(step))
        if is_finite(read_state(directory)):
            return directory
    return None


def set_aside(directory: str | os.PathLike) -> str:
    """Renames a damaged step directory to ``step_<N>.corrupt-<UTC time>``
    beside it (kept for inspection, never read again, and its step may be
    saved anew); returns the new path."""
    directory = os.path.abspath(os.fspath(directory))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = f"{directory}.corrupt-{stamp}"
    suffix = 0
    while os.path.exists(target):
        suffix += 1
        target = f"{directory}.corrupt-{stamp}-{suffix}"
    os.rename(directory, target)
    fsync_path(os.path.dirname(directory))
    return target


def _is_valid(directory: str) -> bool:
    """Whether ``directory`` is a complete checkpoint; one of a newer nanoq's
    format raises NewerFormatError (an older step is not what was asked)."""
    try:
        read_state(directory)
        return True
    except NewerFormatError:
        raise
    except CheckpointError:
        return False


def list_step_dirs(root: str | os.PathLike) -> List[int]:
    """Steps of every ``step_<N>`` directory under ``root``, complete or
    not (see ``list_checkpoints``), ascending."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    return sorted(int(match.group(1)) for match in map(_STEP_DIR.match, os.listdir(root))
                  if match and os.path.isdir(os.path.join(root, match.group(0))))


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
    """A step directory itself, or a root's newest valid checkpoint by step
    (not ``latest``, which a crash between a save's rename and its pointer
    update leaves one behind). Raises CheckpointError when there is none."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(os.path.join(path, STATE_FILE)) or _STEP_DIR.match(os.path.basename(path)):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}")
    steps = list_checkpoints(path)
    if not steps:
        raise CheckpointError(f"{path} holds no complete checkpoint")
    return os.path.join(path, step_dir_name(steps[-1]))


class _Slices:
    """Where a checkpoint's tensors lie: for each (kind, name) of
    TENSOR_KINDS, the slices [begin, end) of the flattened tensor and the
    memory-mapped views that hold them, and each name's full shape. Only
    headers are read to make it; ``read`` reads the data a range needs."""

    def __init__(self, state: dict):
        self.directory = state["path"]
        self.shapes: Dict[str, Tuple[int, ...]] = {}
        self.slices: Dict[Tuple[str, str], list] = {}  # (kind, name) -> [(begin, end, dtype name, view, file)]
        if state["format_version"] == 1:
            self._add_version_1()
        else:
            processes = state["parts"]["processes"]
            for process in range(processes):
                self._add_part(part_file_name(process, processes), process, processes)

    def _views(self, name: str):
        path = os.path.join(self.directory, name)
        try:
            return safetensors_file(path)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: {e}") from None

    def _add(self, kind: str, name: str, shape, begin: int, end: int, dtype_name: str, view, file: str) -> None:
        shape = tuple(shape)
        if self.shapes.setdefault(name, shape) != shape:
            raise CheckpointError(f"{os.path.join(self.directory, file)}: {name} has shape {shape}, another part "
                                  f"says {self.shapes[name]}")
        self.slices.setdefault((kind, name), []).append((begin, end, dtype_name, view.reshape(-1), file))

    def _add_version_1(self) -> None:
        for file, prefixed in ((V1_WEIGHTS_FILE, False), (V1_OPTIMIZER_FILE, True)):
            for key, dtype_name, view in self._views(file)[1]:
                kind, name = key.partition(".")[::2] if prefixed else ("weights", key)
                if prefixed and kind not in TENSOR_KINDS[1:]:
                    raise CheckpointError(f"{os.path.join(self.directory, file)}: unexpected tensor {key!r}")
                self._add(kind, name, view.shape, 0, view.size, dtype_name, view, file)

    def _add_part(self, file: str, process: int, processes: int) -> None:
        path = os.path.join(self.directory, file)
        metadata, views = self._views(file)
        try:
            description = json.loads((metadata or {})[PART_METADATA])
            slices = description["slices"]
            if (description["process"], description["processes"]) != (process, processes) or \
                    not isinstance(slices, dict):
                raise ValueError(f"it says it is part {description['process']!r} of {description['processes']!r}")
            for name, entry in slices.items():
                shape, begin, end = entry["shape"], entry["begin"], entry["end"]
                if not (isinstance(shape, list) and all(_is_count(d) for d in shape) and _is_count(begin)
                        and _is_count(end) and begin < end <= math.prod(shape)):
                    raise ValueError(f"slice {entry!r} of {name!r} is not a range of its shape")
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
            raise CheckpointError(f"{path}: not a part {process} of {processes} of a nanoq checkpoint: "
                                  f"{PART_METADATA} metadata missing or malformed ({e})") from None
        expected = {f"{kind}.{name}" for kind in TENSOR_KINDS for name in slices}
        found = {key for key, _, _ in views}
        if found != expected:
            odd = sorted(found - expected) or [f"{key} (missing)" for key in sorted(expected - found)]
            raise CheckpointError(f"{path}: tensors do not match its slices: {', '.join(odd[:3])}")
        for key, dtype_name, view in views:
            kind, _, name = key.partition(".")
            entry = slices[name]
            if view.shape != (entry["end"] - entry["begin"],):
                raise CheckpointError(f"{path}: {key} has shape {view.shape}, its slice "
                                      f"[{entry['begin']}, {entry['end']}) needs ({entry['end'] - entry['begin']},)")
            self._add(kind, name, entry["shape"], entry["begin"], entry["end"], dtype_name, view, file)

    def check(self, expected: Dict[str, Tuple[int, ...]]) -> None:
        """CheckpointError unless every name in ``expected`` is present with
        its shape, every kind of it tiled exactly by its slices, and nothing
        else is there."""
        problems = [f"{name}: not a parameter of this model" for name in sorted(set(self.shapes) - set(expected))]
        for name, shape in expected.items():
            if name not in self.shapes:
                problems.append(f"{name}: missing")
                continue
            if self.shapes[name] != tuple(shape):
                problems.append(f"{name}: shape {self.shapes[name]}, expected {tuple(shape)}")
                continue
            for kind in TENSOR_KINDS:
                at = 0
                for begin, end, _, _, file in sorted(self.slices.get((kind, name), []), key=lambda s: s[:2]):
                    if begin != at:
                        problems.append(f"{kind}.{name}: {'overlapping' if begin < at else 'no'} elements at "
                                        f"{min(at, begin)} (in {file})")
                        break
                    at = end
                else:
                    if at != math.prod(shape):
                        problems.append(f"{kind}.{name}: missing" if at == 0 else
                                        f"{kind}.{name}: elements from {at} missing")
        if problems:
            raise CheckpointError(f"{self.directory}: {'; '.join(problems[:3])}")

    def read(self, kind: str, name: str, begin: int, end: int) -> np.ndarray:
        """Elements [begin, end) of the flattened tensor, float32; only
        the slices that overlap the range are read."""
        out = np.empty(end - begin, np.float32)
        for slice_begin, slice_end, dtype_name, view, _ in self.slices[(kind, name)]:
            lo, hi = max(begin, slice_begin), min(end, slice_end)
            if lo < hi:
                out[lo - begin:hi - begin] = as_float32(view[lo - slice_begin:hi - slice_begin], dtype_name)
        return out


def read_weights(path: str | os.PathLike) -> Dict[str, np.ndarray]:
    """The weights of a checkpoint (step directory or root), float32 by
    Hugging Face name, assembled from every process's part."""
    state = read_state(path)
    slices = _Slices(state)
    slices.check(slices.shapes)
    verify(state)
    return {name: slices.read("weights", name, 0, math.prod(shape)).reshape(shape)
            for name, shape in slices.shapes.items()}


def load_checkpoint(trainer, path: str | os.PathLike, *, checksums: bool = True) -> dict:
    """Loads a checkpoint into ``trainer`` (any number of processes and
    devices) and returns its state (see ``read_state``). The model config
    and LoRA setting must match the trainer's; a LoRA checkpoint loads only
    the adapters, so import the base model (``state["base_model"]``) first.
    Every file's header is read and checked, and its checksum verified (in a
    world, each process verifies a share of the files), before anything
    is set (``checksums=False`` leaves the checksums to a caller that has
    just verified this checkpoint, as resuming a run does while choosing
    it); then the weights are set one tensor at a time, and of the
    optimizer state only this trainer's part (``Trainer.owned_range``) is
    read.

    In a world of several processes every process calls it; they agree that
    each found the same valid checkpoint before any sets anything (else
    every process raises, naming the process that failed)."""
    error, slices = None, None
    try:
        state, slices = _check_loadable(trainer, path, checksums)
    except Exception as e:  # noqa: BLE001 - the other processes must learn of it
        error, state = e, None
    group = trainer.world_group
    try:
        if group is not None and group.size > 1:
            directories = agree(group, error, None if state is None else state["path"],
                                action="loading a checkpoint", fallback=CheckpointError)
            if len(set(directories)) > 1:
                raise CheckpointError(f"the processes found different checkpoints at {path}: "
                                      f"{', '.join(f'process {p}: {d}' for p, d in enumerate(directories))}")
        elif error is not None:
            raise error
    finally:
        error = None  # (no cycle: see nanoq.agreement)
    for i in trainer._trainable:
        name, shape, _ = trainer._parameters[i]
        trainer._core.set_parameter(i, slices.read("weights", name, 0, math.prod(shape)))
        begin, end = trainer.owned_range(name)
        for kind in trainer.OPTIMIZER_STATE:
            trainer.set_optimizer_state_part(name, kind, slices.read(kind, name, begin, end))
    trainer._core.set_optimizer_steps(state["optimizer_steps"])
    return state


def model_differences(state: dict, config, what: str) -> List[str]:
    """How the ModelConfig ``config`` (``what``'s) differs from the model a
    checkpoint's ``state`` holds, as "key: checkpoint A, <what> B" lines
    (empty: the same model). Dropout changes no parameter: a run may resume
    with another (as Nano's can)."""
    ours = config.to_core()
    theirs = dict(_NEWER_MODEL_FIELDS, **state["model_config"])  # options newer than its format: the defaults
    return [f"{key}: checkpoint {theirs.get(key)!r}, {what} {ours[key]!r}" for key in ours
            if theirs.get(key) != ours[key] and key != "dropout"]


def _check_loadable(trainer, path, checksums: bool = True) -> Tuple[dict, _Slices]:
    """The state and the slices of the checkpoint at ``path``, checked against ``trainer``."""
    state = read_state(path)
    directory = state["path"]
    differences = model_differences(state, trainer.config, "trainer")
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
    if saved_lora and base and trainer.weights_from is None:
        raise CheckpointError(f"{directory} holds LoRA adapters trained on {base}, but this trainer's frozen "
                              f"weights are its initial random ones: import the base model first "
                              f"(trainer.import_weights({base!r}))")
    if saved_lora and base and trainer.base_model:
        # The same weights: the fingerprint saved matches (a moved base), else the same folder.
        recorded = state.get("base_model_fingerprint")
        same = recorded == trainer.base_model_fingerprint if recorded else \
            os.path.realpath(base) == os.path.realpath(trainer.base_model)
        if not same:
            held = (f" ({trainer.base_model}) are not the weights {base} held then (nanoq.hf_io.model_fingerprint "
                    f"differs)" if recorded else f" come from {trainer.base_model}")
            warnings.warn(f"{directory} trained its adapters on {base}, but the trainer's frozen weights{held}",
                          stacklevel=_caller())
    if trainer._core.micro_steps:
        raise ValueError("cannot load a checkpoint with micro-batches pending: call update() first")
    slices = _Slices(state)
    slices.check({trainer._parameters[i][0]: trainer._parameters[i][1] for i in trainer._trainable})
    if checksums:
        group = trainer.world_group  # its processes share the reading (load_checkpoint agrees on the outcome)
        verify(state, (group.rank, group.size) if group is not None else (0, 1))  # after the headers: they say more
    return state, slices


# -- rotation ------------------------------------------------------------------

def _rotation_count(name: str, value) -> int:
    """``value`` of keep_last / keep_every as an int: ValueError, before
    anything is written or deleted, for anything but a non-negative integer
    (a negative keep_last would keep nothing but the new step)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        zero = "no rotation" if name == "keep_last" else "none"
        raise ValueError(f"{name} must be a non-negative integer (0: {zero}), got {value!r}")
    return int(value)


def rotate(root: str | os.PathLike, keep_last: int, keep_every: int = 0) -> List[int]:
    """Deletes complete checkpoints except the newest ``keep_last``, every
    step divisible by ``keep_every`` and the newest one whose state is
    finite (``is_finite``); never the newest one, never while a save holds
    the root's lock. Returns the deleted steps."""
    keep_last, keep_every = _rotation_count("keep_last", keep_last), _rotation_count("keep_every", keep_every)
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    root = os.path.abspath(os.fspath(root))
    with _RootLock(root):
        return _rotate_locked(root, keep_last, keep_every)


def _kept(root: str, steps: List[int], keep_last: int, keep_every: int) -> set:
    """The steps rotation keeps of ``steps`` (ascending): the newest
    ``keep_last``, those divisible by ``keep_every``, and the newest finite one."""
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    for step in reversed(steps):
        if is_finite(read_state(os.path.join(root, step_dir_name(step)))):
            keep.add(step)
            break
    return keep


def _delete(root: str, step: int) -> None:
    # Renamed first, so a crash mid-delete leaves no half checkpoint under a valid name.
    doomed = os.path.join(root, f".deleting-{step_dir_name(step)}")
    os.rename(os.path.join(root, step_dir_name(step)), doomed)
    shutil.rmtree(doomed)


def _rotate_locked(root: str, keep_last: int, keep_every: int) -> List[int]:
    steps = list_checkpoints(root)
    keep = _kept(root, steps, max(1, keep_last), keep_every)
    deleted = []
    for step in steps:
        if step not in keep:
            _delete(root, step)
            deleted.append(step)
    return deleted
