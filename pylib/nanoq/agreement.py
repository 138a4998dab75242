"""Work that the processes of a run do together (saving a checkpoint,
exporting a model), and their agreement on how it went.

Every process calls these with the same ``action`` at the same point. A
failure anywhere becomes a failure everywhere: the failing process raises
its own exception, every other process an exception of the same built-in
class (``fallback`` for other classes) whose message names the failing
process and repeats its error. No process returns while another one failed,
and none waits for ever on a process that raised: the failure travels in
the same collective as success would have.

A frame that raises an exception it holds in a variable (``raise error``)
must drop that variable (``finally: error = None``): the exception's
traceback holds the frame, and the frame would hold the exception, a cycle
that keeps every object the frames refer to (a Trainer, its memory and
threads) alive after the caller's ``del`` until the garbage collector runs.
The functions here do, and so must their callers that keep the error.
"""
from __future__ import annotations

import builtins
from typing import Any, Callable, List, Optional, TypeVar

from nanoq.distributed import ProcessGroup

T = TypeVar("T")


def agree(group: ProcessGroup, error: Optional[BaseException], value: Any = None, *, action: str,
          fallback: type = RuntimeError) -> List[Any]:
    """Every process reports its ``error`` (None: its part succeeded) and a
    picklable ``value``; returns every process's value, in rank order, when
    none failed, else raises as the module says."""
    report = (None, value) if error is None else (_described(error), None)
    reports = group.allgather(report)
    failures = [(rank, failure) for rank, (failure, _) in enumerate(reports) if failure is not None]
    if not failures:
        return [value for _, value in reports]
    if error is not None:
        try:
            raise error
        finally:
            error = None  # (no cycle: see the module docstring)
    rank, (kind, message) = failures[0]
    others = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    raise _rebuilt(kind, f"{action} failed on process {rank} of {group.size}{others}: {kind}: {message}", fallback)


def on_root(group: ProcessGroup, work: Callable[[], T], *, action: str, fallback: type = RuntimeError) -> T:
    """Runs ``work()`` on the root process only; every process returns its
    (picklable) result, or raises as the module says when it raised."""
    result, error = None, None
    if group.is_root:
        try:
            result = work()
        except BaseException as e:  # noqa: BLE001 - every process must learn of it
            error = e
    report = group.broadcast((None, result) if error is None else (_described(error), None))
    failure, result = report
    if failure is None:
        return result
    if error is not None:
        try:
            raise error
        finally:
            error = None  # (no cycle: see the module docstring)
    kind, message = failure
    raise _rebuilt(kind, f"{action} failed on process 0 of {group.size}: {kind}: {message}", fallback)


def _described(error: BaseException) -> tuple:
    """(class name, message) of ``error``, to send to the other processes:
    always, even where its str() fails (the others must hear of it)."""
    try:
        message = str(error)
    except Exception as e:  # noqa: BLE001 - the error itself still goes out
        message = f"(its message could not be read: {type(e).__name__})"
    return type(error).__name__, message


def _rebuilt(kind: str, message: str, fallback: type) -> Exception:
    """An exception of the built-in class named ``kind`` (OSError,
    ValueError, FileExistsError, ...) with ``message``, else a ``fallback``."""
    cls = getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except TypeError:  # a class that takes other arguments (UnicodeDecodeError)
            pass
    return fallback(message)
