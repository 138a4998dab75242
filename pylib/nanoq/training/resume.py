"""Resuming a run: finding its newest checkpoint, checking the new config
against the run's, and restoring the loop's progress.

A checkpoint's extra state holds what the loop needs besides the trainer: the
next step, the data loader's position, tokens seen, the eval history and the
run's config. Settings that define the model or the stream of training
windows must match (``FIXED_ON_RESUME``); every other change is applied and
reported, so a resumed run is bit for bit the uninterrupted one unless a
setting changed.

Resuming from a run (or its checkpoints/) takes the newest checkpoint that
passes verification (its files complete and their checksums right, see
nanoq.checkpoint.verify). Each newer one that fails is reported and moved
aside to ``step_<N>.corrupt-<time>``, so that the run can save that step
again. That happens only once the run is locked (``find_run``, then
``nanoq.training.run_lock.lock_run``, then ``prepare_resume``); under a
launcher only the root process does it.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Dict, List, Optional

from nanoq.checkpoint import (STATE_FILE, CheckpointError, NewerFormatError, list_checkpoints, list_step_dirs,
                              load_checkpoint, read_state, set_aside, step_dir_name, verify)
from nanoq.data import DataLoader
from nanoq.memory import human_bytes
from nanoq.trainer import Trainer
from nanoq.training.log import read_log
from nanoq.training.settings import Setting, TrainConfig, resolve_paths, settings
from nanoq.training.run_lock import require_not_in_use

CHECKPOINTS = "checkpoints"
# Settings a resumed run must share with its checkpoint: they define the model,
# or which training windows the data loader serves and in which order.
FIXED_ON_RESUME = ("model.*", "lora.*", "data.train_data", "data.eval_data", "data.curriculum", "data.seq_len",
                   "data.window_step", "data.packing", "data.mask_token",
                   "train.seed", "train.objective")
# Where the run lives: a resumed run stays in its own directory, so these keep
# the checkpoint's values and are never compared.
_LOCATION = ("out_dir", "run_name")
_STATE_KEYS = ("step", "tokens", "data_loader", "evals", "train_loss", "time", "config")


@dataclasses.dataclass
class Progress:
    """Where the loop stands; a checkpoint's extra state holds it with the loader's position and the config."""

    step: int = 0                   # optimizer steps done, i.e. the index of the next step
    tokens: int = 0                 # tokens fed to the model so far
    evals: List[tuple] = dataclasses.field(default_factory=list)  # [(step, eval loss)]
    train_loss: float = math.nan    # loss of the last step
    time: float = 0.0               # seconds of training so far, earlier processes included


def _json_float(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None


def extra_state(progress: Progress, loader: DataLoader, config: TrainConfig) -> dict:
    return dict(step=progress.step, tokens=progress.tokens, data_loader=loader.state_dict(),
                evals=[[step, _json_float(loss)] for step, loss in progress.evals],
                train_loss=_json_float(progress.train_loss), time=progress.time, config=config.sections())


def _float(value: Optional[float]) -> float:
    return math.nan if value is None else float(value)


@dataclasses.dataclass
class Resume:
    """A checkpoint to continue from, already checked against the new config."""

    run_dir: str
    state: dict                 # nanoq.checkpoint.read_state of the step directory
    config: TrainConfig         # the new config, with the run's own out_dir and run_name
    changes: Dict[str, list]    # {"train.lr": [checkpoint value, new value]}: the applied changes
    # When the run finished at this checkpoint's step, which is train.steps, and its model is still there
    # (nothing is left to do): finished_run's account of that finish
    finished: Optional[dict] = None


def _is_fixed(item: Setting) -> bool:
    return item.key in FIXED_ON_RESUME or f"{item.section}.*" in FIXED_ON_RESUME


def config_changes(saved: Dict[str, Dict[str, Any]], config: TrainConfig) -> Dict[str, list]:
    """``{key: [saved value, value in config]}`` of every setting that differs.
    saved: ``TrainConfig.sections()`` of a checkpoint's run (a setting it lacks
    counts as its default). run.out_dir and run.run_name are left out."""
    flat = {name: value for values in saved.values() for name, value in values.items()}
    # Runs from before paths were made absolute saved them as given, relative
    # to the working directory: compare them as resolved there.
    flat = resolve_paths(flat, os.getcwd())
    changes = {}
    for item in settings():
        old, new = flat.get(item.name, item.default), getattr(config, item.name)
        if item.name not in _LOCATION and old != new:
            changes[item.key] = [old, new]
    return changes


def _auto_run_dir(config: TrainConfig, say: Callable[[str], None]) -> Optional[str]:
    """The run ``resume="auto"`` continues, or None for a fresh run."""
    if config.run_name:
        run_dir = os.path.join(config.out_dir, config.run_name)
        if not os.path.exists(run_dir):
            say(f"--resume auto: {run_dir} does not exist yet, starting it")
            return None
        if not list_checkpoints(os.path.join(run_dir, CHECKPOINTS)):
            require_not_in_use(run_dir)  # a run still before its first checkpoint: say it is busy
            raise ValueError(f"--resume auto: run directory {run_dir} exists but holds no checkpoint (it ran "
                             f"with checkpoint_every = 0 or stopped before its first checkpoint); remove it or "
                             f"choose another run_name")
        return run_dir
    newest = None  # (mtime of the run's newest checkpoint, run name)
    if os.path.isdir(config.out_dir):
        for name in os.listdir(config.out_dir):
            root = os.path.join(config.out_dir, name, CHECKPOINTS)
            steps = list_checkpoints(root)
            if steps:
                candidate = (os.path.getmtime(os.path.join(root, step_dir_name(steps[-1]))), name)
                newest = candidate if newest is None else max(newest, candidate)
    if newest is None:
        say(f"--resume auto: no run in {config.out_dir} has a checkpoint, starting a fresh run")
        return None
    return os.path.join(config.out_dir, newest[1])


@dataclasses.dataclass
class RunToResume:
    """Where a resume continues (``find_run``): the run directory, its
    checkpoint root and the step directory the caller named, if any."""

    run_dir: str
    root: str
    step_dir: Optional[str] = None  # None: the newest good checkpoint of root


def _locate(path: str) -> RunToResume:
    """The run of a resume path: a step directory itself, or a run
    directory or its checkpoints/ (whose newest good checkpoint, by step,
    not ``latest``, which a crash between a save's rename and its pointer
    update can leave behind, ``prepare_resume`` picks)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"cannot resume from {path}: no such directory (give a run directory, its "
                                f"checkpoints/ or a checkpoint step directory)")
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        root = os.path.dirname(path)
        if os.path.basename(root) != CHECKPOINTS:  # its run's folder (lock, log, config) would be a guess
            raise ValueError(f"cannot resume from {path}: a step directory is resumed inside its run, as "
                             f"<run>/{CHECKPOINTS}/{os.path.basename(path)}; put it back there, or export it "
                             f"(nanoq export) and start a new run from it with model.init_from")
        return RunToResume(os.path.dirname(root), root, path)
    if os.path.isdir(os.path.join(path, CHECKPOINTS)):
        run_dir, root = path, os.path.join(path, CHECKPOINTS)
    elif os.path.isfile(os.path.join(path, "config.toml")):
        raise ValueError(f"cannot resume {path}: the run has no checkpoints (it ran with checkpoint_every = 0 "
                         f"or stopped before its first checkpoint)")
    else:
        run_dir, root = os.path.dirname(path), path
    if not list_step_dirs(root):
        raise CheckpointError(f"cannot resume from {path}: {root} holds no complete checkpoint")
    return RunToResume(run_dir, root)


def find_run(config: TrainConfig, resume, say: Callable[[str], None]) -> Optional[RunToResume]:
    """The run ``resume`` names (None, "auto" or a path; see
    ``nanoq.training.train``); None to start fresh (only for "auto").
    Touches nothing on disk."""
    if resume == "auto":
        resume = _auto_run_dir(config, say)
        if resume is None:
            return None
    elif not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"resume must be None, \"auto\" or a path, got {resume!r}")
    return _locate(resume)


def _verify(state: dict, say: Callable[[str], None]) -> None:
    """``verify(state)``, saying first what it reads (a large model's
    checkpoint takes a while: every byte is read once)."""
    checksums = state.get("checksums")
    try:
        size = sum(os.path.getsize(os.path.join(state["path"], name))
                   for name in (checksums if isinstance(checksums, dict) else ()))
    except OSError:
        size = 0  # a file is missing: verify says which
    if size:
        say(f"verifying {state['path']} ({human_bytes(size)})")
    verify(state)


def _newest_good(root: str, say: Callable[[str], None]) -> dict:
    """The verified state of the newest good checkpoint under ``root``;
    each newer one that fails verification is reported and set aside."""
    for step in reversed(list_step_dirs(root)):
        step_dir = os.path.join(root, step_dir_name(step))
        try:
            state = read_state(step_dir)
            _verify(state, say)
            return state
        except NewerFormatError:
            raise  # sound, for a newer nanoq: never set aside
        except CheckpointError as e:
            moved = set_aside(step_dir)
            say(f"warning: skipping checkpoint {step_dir}: {e}; moved it aside to {moved}")
    raise CheckpointError(f"cannot resume from {root}: it holds no good checkpoint (the damaged ones were moved "
                          f"aside)")


def prepare_resume(config: TrainConfig, run: RunToResume, say: Callable[[str], None]) -> Resume:
    """The checkpoint to continue ``run`` (from ``find_run``) from, checked
    against ``config``. The newest good one when ``run`` names no step
    directory: newer ones that fail verification are moved aside, as are
    damaged step directories after a named one (a later complete checkpoint
    is refused: continuing would overwrite it; one of a newer nanoq's format
    raises NewerFormatError). Call it with the run locked, on one process."""
    root = run.root
    if run.step_dir is None:
        state = _newest_good(root, say)
    else:
        state = read_state(run.step_dir)
        _verify(state, say)
    run_dir, step_dir = run.run_dir, state["path"]
    extra = state["extra_state"]
    missing = [key for key in _STATE_KEYS if key not in extra]
    if missing:
        raise CheckpointError(f"{step_dir} was not written by nanoq train (its extra state lacks "
                              f"{', '.join(missing)}): it can be exported (nanoq export) but not resumed")
    later = []
    for step in list_step_dirs(root):
        if step > state["step"]:
            later_dir = os.path.join(root, step_dir_name(step))
            try:
                read_state(later_dir)
            except NewerFormatError:
                raise
            except CheckpointError as e:  # its step's save would find it in the way
                say(f"warning: setting aside the damaged later checkpoint {later_dir}: {e}; moved it to "
                    f"{set_aside(later_dir)}")
                continue
            later.append(step)
    if later:
        raise ValueError(f"cannot resume from {step_dir}: {root} holds a later checkpoint (step {later[-1]}), "
                         f"which continuing from here would have to overwrite; resume from {root}, or move "
                         f"the later step directories away first")
    changes = config_changes(extra["config"], config)
    schema = {item.key: item for item in settings()}
    refused = {key: values for key, values in changes.items() if _is_fixed(schema[key])}
    if config.init_from and not os.path.isfile(os.path.join(config.init_from, "config.json")):
        raise ValueError(f"cannot resume from {step_dir}: model.init_from {config.init_from} holds no config.json "
                         f"(moved or deleted?); if the model moved, resume with its new place (nanoq train "
                         f"--resume {run_dir} --init-from PATH, or model.init_from): a folder holding the same "
                         f"model is taken")
    if "model.init_from" in refused and all(refused["model.init_from"]):  # moved, not added or dropped
        _check_moved_base(state, *refused.pop("model.init_from"))
    if refused:
        lines = "\n".join(f"  {key}: checkpoint {old!r}, now {new!r}" for key, (old, new) in refused.items())
        raise ValueError(f"cannot resume from {step_dir}: these settings define the model or the data stream "
                         f"and differ from the checkpoint's:\n{lines}\nresume with the run's values (`nanoq "
                         f"train {os.path.join(run_dir, 'config.toml')} --resume {run_dir}` takes them all), "
                         f"or start a new run")
    if config.steps < extra["step"]:
        raise ValueError(f"cannot resume from {step_dir}: it is at step {extra['step']}, past train.steps "
                         f"{config.steps}; give train.steps >= {extra['step']}")
    location = {name: extra["config"].get("run", {}).get(name, getattr(config, name)) for name in _LOCATION}
    return Resume(run_dir=run_dir, state=state, config=dataclasses.replace(config, **location), changes=changes,
                  finished=finished_run(run_dir, state) if extra["step"] == config.steps else None)


def finished_run(run_dir: str, state: dict) -> Optional[dict]:
    """How the run finished, when the last "end" record of its log.jsonl
    is at the step of checkpoint ``state`` (from read_state) and the model
    that record names (its export, or the final checkpoint of a model
    transformers cannot load) is still there, in the run directory if the
    run was moved: a dict of ``model_dir``, ``parameters`` (None if the log
    lacks them), ``evals`` ([(step, loss)]: the checkpoint's, then the
    final evaluation the log holds) and ``train_loss``. Else None. A run resumed at that
    step has nothing left to do: training again would only evaluate that
    step again and write another copy of the model. Without that model
    (moved, deleted) or a readable log the resume goes on, and writes the
    model again."""
    try:
        records = [record for record in read_log(os.path.join(run_dir, "log.jsonl")) if isinstance(record, dict)]
    except (OSError, ValueError):
        return None
    steps, extra = state["step"], state["extra_state"]
    ends = [index for index, record in enumerate(records) if record.get("type") == "end"]
    if not ends or records[ends[-1]].get("step") != steps:
        return None
    before = records[:ends[-1]]
    model_dir = records[ends[-1]].get("model_dir")
    began = next((record for record in reversed(before) if record.get("type") in ("start", "resume")), {})
    if not isinstance(model_dir, str) or not model_dir:
        return None
    old_run_dir = began.get("run_dir")
    if not os.path.isdir(model_dir) and isinstance(old_run_dir, str) and \
            model_dir.startswith(old_run_dir.rstrip(os.sep) + os.sep):  # the run moved since
        model_dir = os.path.join(run_dir, os.path.relpath(model_dir, old_run_dir))
    if not os.path.isdir(model_dir):
        return None
    evals = [(step, _float(loss)) for step, loss in extra["evals"]]
    final = [record for record in before if record.get("type") == "eval" and record.get("step") == steps]
    if final and not (evals and evals[-1][0] == steps):
        evals.append((steps, _float(final[-1].get("loss"))))
    return dict(model_dir=os.path.abspath(model_dir), parameters=began.get("parameters"), evals=evals,
                train_loss=_float(extra["train_loss"]))


def _check_moved_base(state: dict, old: str, new: str) -> None:
    """A resume may take model.init_from from another place (the model was
    moved) when that folder holds the model the checkpoint was saved with:
    the same architecture, and the same weights by the fingerprint the
    checkpoint recorded (nanoq.hf_io.model_fingerprint). Without a
    fingerprint (an older nanoq's checkpoint) the architecture is enough for
    full weights, which the checkpoint holds, but not for LoRA adapters,
    whose frozen base it does not. ValueError saying what differs."""
    from nanoq import ModelConfig
    from nanoq.checkpoint import model_differences
    from nanoq.hf_io import model_fingerprint

    step_dir = state["path"]
    refused = f"cannot resume from {step_dir} with model.init_from {new} (the checkpoint's: {old})"
    differences = model_differences(state, ModelConfig.from_pretrained(new), "now")
    if differences:
        raise ValueError(f"{refused}: it is another model: {'; '.join(differences)}")
    recorded = state.get("base_model_fingerprint")
    if recorded is not None and model_fingerprint(new) != recorded:
        raise ValueError(f"{refused}: its weights are not the ones {old} held when the checkpoint was saved "
                         f"(their fingerprints differ): give the folder holding that model")
    if recorded is None and state.get("lora"):
        raise ValueError(f"{refused}: the checkpoint holds LoRA adapters and records no fingerprint of the base "
                         f"model they were trained on (saved by an older nanoq), so nothing shows {new} holds the "
                         f"same frozen weights: put the model back at {old}, or resume with it there")


def restore(trainer: Trainer, loader: DataLoader, resumed: Resume) -> Progress:
    """Loads the checkpoint into the trainer (any device count) and the loader; the loop's progress.
    Its checksums are not verified again: ``prepare_resume`` verified them
    while choosing it, under the run's lock (a second pass would read every
    file once more: minutes for a large model's optimizer state)."""
    extra = load_checkpoint(trainer, resumed.state["path"], checksums=False)["extra_state"]
    loader.load_state_dict(extra["data_loader"])
    return Progress(step=extra["step"], tokens=extra["tokens"],
                     evals=[(step, _float(loss)) for step, loss in extra["evals"]],
                     train_loss=_float(extra["train_loss"]), time=extra["time"])
