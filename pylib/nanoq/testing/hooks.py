"""Testing hooks: named ways for a test to make nanoq fail or pause.

The core's hooks are declared once in cuda_core/include/nanoq/testing_hooks.h
(one line each) and armed per Trainer by name with ``arm_hook``; they are
listed by ``core_hooks()``. The Python side has one hook, for checkpoint
writes; it is an environment variable so that a test can arm it in a child
process (a CLI run) that it then kills mid-save.
"""

import os
import time

from nanoq import _core

# Set to a file path: the checkpoint writer creates that file once this
# process's part is written (before the processes agree that every part
# is, and before the state), then sleeps (for an hour), so that a test can
# signal or kill the process in the middle of a save.
PAUSE_IN_SAVE_ENV = "NANOQ_TEST_PAUSE_IN_SAVE"


def core_hooks() -> dict:
    """{name: what arming it does} for every hook of the core."""
    return {name: doc for name, _, doc in _core.testing_hooks()}


def arm_hook(trainer, name: str, value: int) -> None:
    """Arms the core hook `name` of a nanoq.Trainer with `value` (ValueError for an unknown name)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"a testing hook's value must be an int, got {value!r}")
    trainer._core.arm_testing_hook(name, value)


def fail_next_step(trainer, device: int) -> None:
    """The trainer's next step() fails (NanoqError) inside the worker of `device`."""
    arm_hook(trainer, "fail_next_step_in_worker", trainer._check_device(device))


def delay_next_step(trainer, device: int, seconds: float) -> None:
    """The work of the trainer's next step() on the worker of `device` starts
    `seconds` late; step() itself returns without waiting for it."""
    if not 0 <= seconds <= 600:
        raise ValueError(f"seconds must be in [0, 600], got {seconds!r}")
    arm_hook(trainer, "delay_next_step_milliseconds", int(round(seconds * 1000)))
    arm_hook(trainer, "delay_next_step_in_worker", trainer._check_device(device))


def delay_next_validate(trainer, device: int, seconds: float) -> None:
    """The work of the trainer's next validate() on the worker of `device`
    starts `seconds` late (validate() waits for it, as for a slow forward pass)."""
    if not 0 <= seconds <= 600:
        raise ValueError(f"seconds must be in [0, 600], got {seconds!r}")
    arm_hook(trainer, "delay_next_step_milliseconds", int(round(seconds * 1000)))
    arm_hook(trainer, "delay_next_validate_in_worker", trainer._check_device(device))


def synchronous_reductions(trainer, on: bool = True) -> None:
    """From the next step() on, gradient reductions run synchronously, as before
    they overlapped the backward (ZeRO stage 1: all in update()); ``False``
    restores the overlap."""
    arm_hook(trainer, "synchronous_gradient_reductions", int(bool(on)))


def trace_communication(trainer, on: bool = True) -> None:
    """From the next step() on, every device records the order of its layers'
    backward and its gradient reductions (read with ``communication_trace``)."""
    arm_hook(trainer, "trace_communication", int(bool(on)))


def communication_trace(trainer, device: int) -> list:
    """The events `device` recorded since the last call, in order, as
    ``(what, layer, ticket)``: ``"backward"`` (the layer's backward is done),
    ``"issue"``/``"wait"`` (the reduction of the layer's gradients was issued /
    the compute was ordered after it; layer -1 = embedding, num_layers =
    head; ``ticket`` names the collective), ``"comm-start"``/``"comm-end"``
    (cpu: the communication thread runs collective ``ticket``) or
    ``"compute-waits"`` (cuda: the compute stream is made to wait for
    collective ``ticket`` and those before it); layer -2 for those three."""
    return trainer._core.communication_trace(trainer._check_device(device))


def pause_in_save_if_armed() -> None:
    """Called by the checkpoint writer after this process's part: pauses there when armed."""
    marker = os.environ.get(PAUSE_IN_SAVE_ENV)
    if marker:
        open(marker, "w").close()
        time.sleep(3600)
