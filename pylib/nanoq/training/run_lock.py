"""One trainer per run directory.

A run holds an OS file lock (``flock``) on ``<run>/run.lock`` from the moment
it knows its directory until it returns, so that a second ``nanoq train`` (or
``train()``) on the same run fails at once instead of interleaving its log and
checkpoints with the first. The kernel drops the lock when the holding process
dies, however it dies: a lock file left by a killed run never blocks. The file
holds the holder's process id and host, for the message the second run gets,
and is removed when the run ends.

Taking the lock first checks that the run directory (and its checkpoints/,
when it has one) can be written (``require_writable``), so that a read-only
run folder is a clear error before any training, not a traceback at the
first save.

Under a launcher only the root process takes the lock (the run directory is
the root's); the others learn the outcome from it, so that every process of a
run fails together.
"""
from __future__ import annotations

import fcntl
import os
import socket
import time
from typing import Optional

from nanoq.agreement import on_root
from nanoq.distributed import ProcessGroup, processes

LOCK_FILE = "run.lock"


class RunInUse(RuntimeError):
    """The run directory is locked by another running trainer; the message names its process id."""


class RunLock:
    """The held lock of one run directory (see ``lock_run``); ``release()`` or use it with ``with``."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd: Optional[int] = fd

    @classmethod
    def acquire(cls, run_dir: str) -> "RunLock":
        """Locks ``run_dir`` for this process, or raises RunInUse naming the holder."""
        path = os.path.join(run_dir, LOCK_FILE)
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise _not_writable(run_dir, e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise _in_use(run_dir, holder) from None
            except BaseException:
                os.close(fd)
                raise
            # A holder that was finishing may have removed the file between our open and flock: then we
            # locked a file nobody else will see, and must lock the one now at `path` instead.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        return cls(path, fd)

    def release(self) -> None:
        """Removes the lock file and drops the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked, so nobody locks the file we remove
        except FileNotFoundError:  # the run directory itself was removed (a new run that failed to start)
            pass
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _in_use(run_dir: str, holder: str) -> RunInUse:
    return RunInUse(f"run directory {run_dir} is in use by another trainer ({holder}, named in "
                    f"{os.path.join(run_dir, LOCK_FILE)}); wait for it to finish or stop it, then run again")


def require_not_in_use(run_dir: str) -> None:
    """RunInUse naming the holder while another trainer holds ``run_dir``'s
    lock; nothing when none does (no lock file, or one left by a dead
    process). Takes no lock and creates nothing: for the checks that
    refuse a run directory before it is locked, so that their message
    says it is busy rather than what its contents lack."""
    try:
        fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(run_dir, _holder(fd)) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    """What the lock file says of its holder ("pid 123 on host"); it writes that right after locking."""
    for _ in range(20):
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.01)
    return "a process that has not written its id yet"


def _probe(directory: str) -> None:
    """Creates and removes a file in ``directory``: an OSError when it cannot be written."""
    path = os.path.join(directory, f".write-probe-{os.getpid()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"nanoq")
    finally:
        os.close(fd)
        os.unlink(path)


def _not_writable(directory: str, error: OSError) -> OSError:
    wrapped = OSError(error.errno, f"the run directory {directory} is not writable ({error.strerror or error}): "
                                   f"nanoq writes its lock, log and checkpoints there; make it writable or choose "
                                   f"another out_dir")
    wrapped.filename = directory
    return wrapped


def require_writable(run_dir: str) -> None:
    """OSError naming the folder unless ``run_dir`` and, if it exists, its
    checkpoints/ accept new files (tried by writing one: the permission
    bits alone say nothing on a read-only mount or to root)."""
    from nanoq.training.resume import CHECKPOINTS

    for directory in (run_dir, os.path.join(run_dir, CHECKPOINTS)):
        if directory != run_dir and not os.path.isdir(directory):
            continue
        try:
            _probe(directory)
        except OSError as e:
            raise _not_writable(directory, e) from None


def lock_run(run_dir: str, group: Optional[ProcessGroup] = None) -> Optional[RunLock]:
    """Locks ``run_dir`` for the run about to use it (collective: every
    process of ``group``, default ``nanoq.distributed.processes()``, calls
    it). The root process takes the lock and gets the RunLock; the others
    get None. RunInUse on every process when another trainer holds it; an
    OSError naming the folder on every process when the run directory or
    its checkpoints/ cannot be written (``require_writable``; see
    nanoq.agreement.on_root)."""
    group = group if group is not None else processes()
    held = []

    def lock() -> None:
        require_writable(run_dir)
        held.append(RunLock.acquire(run_dir))

    on_root(group, lock, action=f"locking the run directory {run_dir}", fallback=RunInUse)
    return held[0] if held else None
