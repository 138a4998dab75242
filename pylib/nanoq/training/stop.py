"""Stopping a run cleanly: SIGINT/SIGTERM and runs of non-finite steps.

The first SIGINT or SIGTERM only asks the loop to stop: it finishes the step
(or the evaluation) in flight (the core call is not interrupted), writes a
checkpoint and returns.
The handler also hands both signals back, so a second one stops at once,
without that checkpoint. In ``nanoq train`` (``end_process_on_second_signal``)
it ends the process, even inside a core call. Called from Python, the
handlers the program had before the run take it: Python's own raises
KeyboardInterrupt for SIGINT (at the Trainer's next wait, within 50 ms), so
that a notebook or a script calling ``train`` lives on; SIGTERM's default
ends the process. Either is safe: every checkpoint is written to a temporary
directory and renamed into place, so the last complete one is never damaged.
Under a launcher the processes agree after every step whether any of them
was asked to stop (``agreed``).

A console whose reader went away (``nanoq train | head``: writing to it
raises BrokenPipeError, Python's form of SIGPIPE) stops the run the same way,
as "SIGPIPE" (``ask_to_stop``), instead of ending it without a checkpoint.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional


class TrainingHalted(RuntimeError):
    """Training stopped after too many consecutive updates with a non-finite
    loss or gradient; the message names the checkpoint of the last good state."""


_active: Optional["StopRequest"] = None  # the StopRequest of the run in progress (main thread), if any
_second_signal_ends_process = False  # (end_process_on_second_signal)


def end_process_on_second_signal() -> None:
    """From now on, a second stop signal during a run ends the process at
    once (the signal's default action), as ``nanoq train`` documents,
    instead of going to the program's handler from before the run."""
    global _second_signal_ends_process
    _second_signal_ends_process = True


def ask_to_stop(name: str) -> bool:
    """Asks the run in progress to stop after its current step as a first
    signal does, ``name`` standing for the signal; False when no run is in
    progress (nothing to stop, so nothing to save)."""
    if _active is None:
        return False
    _active.ask(name)
    return True


class StopRequest:
    """Installs the handlers while active (main thread only; elsewhere it is
    inert). ``signal_name`` is set once a stop was asked for. ``say``: write
    that a stop was asked for on stderr (under a launcher only the root
    process does: a launcher passes Ctrl-C to every process)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, say: bool = True):
        self.say = say
        self.signal_name: Optional[str] = None
        self._previous = {}
        self._wakeup = None  # (read end, write end) of the pipe counting deliveries, or None

    def __enter__(self) -> "StopRequest":
        global _active
        if threading.current_thread() is threading.main_thread():
            self._count_deliveries()
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
            _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        if _active is self:
            _active = None
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def _count_deliveries(self) -> None:
        """Python runs a signal's handler only between bytecodes of the main
        thread: two signals that arrive within one long C call run it once,
        and the second would be lost. The interpreter writes one byte per
        delivery to a wakeup fd, which the handler reads to count them. Left
        alone when the program has a wakeup fd of its own (asyncio's)."""
        read, write = os.pipe()
        for fd in (read, write):
            os.set_blocking(fd, False)
        try:
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = None
        if previous is None or previous != -1:
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            return
        self._wakeup = (read, write)

    def _deliveries(self) -> int:
        """How many stop signals arrived since the last call (1 without a count)."""
        if self._wakeup is None:
            return 1
        try:
            data = os.read(self._wakeup[0], 4096)
        except BlockingIOError:
            return 1
        return max(sum(byte in self.SIGNALS for byte in data), 1)

    def _handle(self, number, frame) -> None:
        if self._deliveries() > 1 or self.signal_name is not None:  # a second one
            self._hand_back()
            handler = signal.getsignal(number)
            if callable(handler):
                handler(number, frame)  # Python's default_int_handler raises KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), number)
            return  # (SIG_IGN: ignored, as the program asked)
        self.ask(signal.Signals(number).name)

    def _hand_back(self) -> None:
        """After the first signal: the second goes to the signal's default
        action (end_process_on_second_signal) or to the program's handler."""
        for number in self.SIGNALS:
            previous = self._previous.get(number)
            ends = _second_signal_ends_process or previous is None
            signal.signal(number, signal.SIG_DFL if ends else previous)

    def ask(self, name: str) -> None:
        """The stop a first signal asks for (``name``: the signal's)."""
        if self.signal_name is not None:
            return
        self.signal_name = name
        # (Elsewhere than in the main thread, _handle sees signal_name set and hands them back.)
        if threading.current_thread() is threading.main_thread() and self._previous:
            self._hand_back()
        if not self.say:
            return
        # Said at once: the step in flight (and a save) may take a while.
        try:
            sys.stderr.write(f"nanoq: {name}: stopping after the current step, with a checkpoint (a second "
                             f"signal stops at once, without one)\n")
            sys.stderr.flush()
        except OSError:
            pass  # a console that is gone: the run's log.jsonl records the stop

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def agreed(self, group) -> Optional[str]:
        """The signal that asked any process of ``group`` (a
        nanoq.distributed.ProcessGroup) to stop, or None: every process gets
        the same answer, so all stop after the same step (collective)."""
        names = [name for name in group.allgather(self.signal_name) if name is not None]
        return names[0] if names else None
