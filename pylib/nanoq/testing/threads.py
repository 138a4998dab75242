"""Process groups of threads: several "processes" inside one Python process,
one thread each, for tests of multi-process logic (checkpoints, data,
agreement checks) without a launcher. Members of one ThreadWorld meet at
the same barriers as MPI processes would; ``abort`` fails every member's
current and later collectives instead of ending the process."""
from __future__ import annotations

import copy
import threading
from typing import Any, List

from nanoq.distributed import ProcessGroup, allgather_failed, unsendable


class ThreadWorldAborted(RuntimeError):
    """A member of the ThreadWorld aborted it."""


class ThreadWorld:
    """Shared state of ``size`` members; ``member(rank)`` is rank's group."""

    def __init__(self, size: int, timeout: float = 120.0):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: List[Any] = [None] * size
        self.aborted_with = None

    def member(self, rank: int) -> "ThreadGroup":
        return ThreadGroup(self, rank)

    def _meet(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise ThreadWorldAborted(f"the thread world was aborted (code {self.aborted_with})") from None


class ThreadGroup(ProcessGroup):
    def __init__(self, world: ThreadWorld, rank: int):
        if not 0 <= rank < world.size:
            raise ValueError(f"rank must be in [0, {world.size}), got {rank}")
        self.world = world
        self.rank = rank
        self.size = world.size

    def barrier(self) -> None:
        self.world._meet()

    def allgather(self, value: Any) -> List[Any]:
        # As MPIGroup's: a value that does not copy (pickle, there) fails the
        # call on every member, which stay in step.
        try:
            self.world._slots[self.rank] = (None, copy.deepcopy(value))
        except Exception as e:  # noqa: BLE001 - every member must learn of it
            self.world._slots[self.rank] = (f"process {self.rank}'s value {unsendable(e)}", None)
        self.world._meet()
        failures = [failure for failure, _ in self.world._slots if failure is not None]
        out = [] if failures else [copy.deepcopy(v) for _, v in self.world._slots]
        self.world._meet()  # nobody writes a slot before everyone has read them
        if failures:
            raise allgather_failed(failures)
        return out

    def broadcast(self, value: Any, root: int = 0) -> Any:
        return self.allgather(value if self.rank == root else None)[root]

    def node_local(self) -> tuple:
        return self.rank, self.size

    def abort(self, code: int = 1) -> None:
        self.world.aborted_with = code
        self.world._barrier.abort()
        raise ThreadWorldAborted(f"rank {self.rank} aborted the thread world (code {code})")
