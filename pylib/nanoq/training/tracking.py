"""Experiment tracking: the records of log.jsonl, also sent to TensorBoard or Weights & Biases.

``run.tracker`` picks the tracker ("" = none). The run's JsonlLog hands every
record it writes to the tracker (``JsonlLog(path, tracker=...)``), so the
tracker holds exactly the figures of log.jsonl and the two cannot drift:

- every number of a record becomes a scalar ``<type>/<field>`` at the
  record's ``step`` (a record without one, ``start``, at step 0):
  ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``,
  ``train/tokens``, ``train/trained_tokens``, ``eval/loss``, ``eval/tokens``, ...
  (``time`` too: ``train/time`` is seconds since the start of training);
- ``memory`` (start and resume records) becomes ``memory/device<d>/<context>``
  bytes and ``memory/device<d>/<figure>`` for the other numbers of a device;
- ``gpus`` (telemetry records) becomes ``gpu<d>/<metric>`` (gpu_util,
  memory_used, power_w, temperature_c, ...);
- a ``sample`` record becomes the texts ``sample/<index>/prompt`` and
  ``sample/<index>/completion``;
- ``config`` (start and resume records) becomes the tracker run's config
  (``section.name`` keys).

Strings of other records (paths) and lists of ids are left out.

TensorBoard writes event files to ``<run>/tensorboard``; Weights & Biases a
run in ``<run>/wandb`` (``WANDB_MODE=offline`` works without an account;
``nanoq`` keeps the W&B run id in ``<run>/wandb_run_id``). A resumed run
continues the same tracker run: TensorBoard in the same directory, purging
what the earlier run logged after the checkpoint's step (a restart marker at
step + 1, which TensorBoard's readers honour); W&B resumes the stored run id,
with ``step`` as the x-axis of every figure. Records of the resumed run at or
before the checkpoint's step (the evaluation it repeats there) are not sent
again. Only the root process tracks.
"""
from __future__ import annotations

import abc
import importlib
import math
import numbers
import os
import secrets
import string
import time
from typing import Dict, Optional, Tuple

TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # run.tracker -> the package (and extra) it needs
WANDB_ID_FILE = "wandb_run_id"
TENSORBOARD_DIR = "tensorboard"


def check_tracker(kind: str) -> None:
    """ImportError naming the extra to install when run.tracker ``kind``'s
    library is missing ("" needs nothing); ValueError for an unknown kind."""
    if not kind:
        return
    if kind not in TRACKER_PACKAGES:
        raise ValueError(f"run.tracker must be one of {', '.join(repr(k) for k in ('',) + tuple(TRACKER_PACKAGES))}, "
                         f"got {kind!r}")
    package = TRACKER_PACKAGES[kind]
    try:
        importlib.import_module(package)  # a fixed name of the table above
    except ImportError:
        raise ImportError(f'run.tracker = "{kind}" needs the {package} package: pip install "nanoq[{package}]" '
                          f'(from a source checkout: pip install ".[{package}]"; or pip install {package})') \
            from None


def _number(value) -> Optional[float]:
    """``value`` as a float if it is a finite real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def figures(record: dict) -> Tuple[int, Dict[str, float], Dict[str, str]]:
    """(step, {tag: number}, {tag: text}) of a log.jsonl record, as the
    module docstring lists them."""
    kind = record.get("type", "record")
    step = int(record.get("step") or 0)
    scalars: Dict[str, float] = {}
    texts: Dict[str, str] = {}
    for key, value in record.items():
        if key in ("type", "step", "config"):
            continue
        if key == "memory" and isinstance(value, list):
            for entry in value:
                device = entry.get("device", 0)
                for name, size in entry.get("contexts", {}).items():
                    scalars[f"memory/device{device}/{name}"] = float(size)
                for name, figure in entry.items():
                    if name != "device" and _number(figure) is not None:
                        scalars[f"memory/device{device}/{name}"] = _number(figure)
        elif key == "gpus" and isinstance(value, list):
            for gpu in value:
                device = gpu.get("device", 0)
                for name, figure in gpu.items():
                    if name != "device" and _number(figure) is not None:
                        scalars[f"gpu{device}/{name}"] = _number(figure)
        elif kind == "sample" and isinstance(value, str):
            texts[f"sample/{record.get('index', 0)}/{key}"] = value
        elif kind == "sample" and key == "index":
            continue
        elif _number(value) is not None:
            scalars[f"{kind}/{key}"] = _number(value)
    return step, scalars, texts


def flat_config(sections: dict) -> Dict[str, object]:
    """``{"section.name": value}`` of TrainConfig.sections()."""
    return {f"{section}.{name}": value for section, values in sections.items() for name, value in values.items()}


class Tracker(abc.ABC):
    """Receives every record of the run's log (``record``) and sends its
    figures to a tracker; ``resume_step``: the checkpoint step a resumed
    run continues from (None for a new run)."""

    def __init__(self, resume_step: Optional[int] = None):
        self.resume_step = resume_step

    def record(self, record: dict) -> None:
        if record.get("config") is not None:
            self._config(record["config"])
        step, scalars, texts = figures(record)
        resent = self.resume_step is not None and record.get("type") != "resume" and step <= self.resume_step
        if not resent and (scalars or texts):
            self._log(step, scalars, texts)

    @abc.abstractmethod
    def _config(self, sections: dict) -> None:
        """Sets the tracker run's config from TrainConfig.sections()."""

    @abc.abstractmethod
    def _log(self, step: int, scalars: Dict[str, float], texts: Dict[str, str]) -> None:
        """Logs one record's figures at ``step``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Writes out what is pending and ends the tracker run."""


class TensorBoardTracker(Tracker):
    """Event files in ``<run_dir>/tensorboard``, written with tensorboard's own writer."""

    def __init__(self, run_dir: str, resume_step: Optional[int] = None):
        super().__init__(resume_step)
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self._text = event_pb2, summary_pb2, text_pb
        self.directory = os.path.join(run_dir, TENSORBOARD_DIR)
        self._writer = EventFileWriter(self.directory, flush_secs=10)
        self._config_written = False
        if resume_step is not None:
            # A restart marker: readers drop the earlier run's events from this step on.
            self._writer.add_event(event_pb2.Event(step=resume_step + 1, wall_time=time.time(),
                                                   session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

    def _config(self, sections: dict) -> None:
        lines = [f"| {key} | `{value!r}` |" for key, value in flat_config(sections).items()]
        summary = self._text("config", "| setting | value |\n|---|---|\n" + "\n".join(lines))
        self._writer.add_event(self._event.Event(step=self.resume_step or 0, wall_time=time.time(), summary=summary))

    def _log(self, step: int, scalars: Dict[str, float], texts: Dict[str, str]) -> None:
        values = [self._summary.Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
        summary = self._summary.Summary(value=values)
        for tag, text in texts.items():
            summary.value.extend(self._text(tag, text).value)
        self._writer.add_event(self._event.Event(step=step, wall_time=time.time(), summary=summary))

    def close(self) -> None:
        self._writer.close()


def new_run_id() -> str:
    """A fresh W&B run id: 8 random lowercase letters and digits."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbTracker(Tracker):
    """A Weights & Biases run in ``<run_dir>/wandb`` whose id is kept in
    ``<run_dir>/wandb_run_id``; its project is $WANDB_PROJECT, else "nanoq"."""

    def __init__(self, run_dir: str, resume_step: Optional[int] = None):
        super().__init__(resume_step)
        import wandb

        id_file = os.path.join(run_dir, WANDB_ID_FILE)
        continuing = resume_step is not None and os.path.isfile(id_file)
        if continuing:
            with open(id_file, encoding="utf-8") as f:
                run_id = f.read().strip()
        else:
            run_id = new_run_id()
            with open(id_file, "w", encoding="utf-8") as f:
                f.write(run_id + "\n")
        self.run_id = run_id
        try:
            self._run = wandb.init(id=run_id, resume="must" if continuing else "allow", dir=run_dir,
                                   project=os.environ.get("WANDB_PROJECT") or "nanoq",
                                   name=os.path.basename(os.path.abspath(run_dir)),
                                   settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                                           disable_git=True, save_code=False))
        except Exception as e:  # noqa: BLE001 - wandb's errors (no API key, no network, ...) have no common base
            raise ValueError(f"run.tracker wandb could not start its run: {e} (WANDB_MODE=offline logs into the "
                             f"run directory without an account; wandb sync uploads it later)") from None
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def _config(self, sections: dict) -> None:
        self._run.config.update(flat_config(sections), allow_val_change=True)

    def _log(self, step: int, scalars: Dict[str, float], texts: Dict[str, str]) -> None:
        self._run.log({"step": step, **scalars, **texts})

    def close(self) -> None:
        self._run.finish()


def open_tracker(kind: str, run_dir: str, resume_step: Optional[int] = None) -> Optional[Tracker]:
    """The Tracker of run.tracker ``kind`` for the run in ``run_dir`` (None for "")."""
    if not kind:
        return None
    check_tracker(kind)
    return (TensorBoardTracker if kind == "tensorboard" else WandbTracker)(run_dir, resume_step)
