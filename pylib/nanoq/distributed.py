"""Several processes: the world that a launcher (``mpiexec``, Slurm's ``srun``) starts.

nanoq never starts processes itself. Under a launcher, every process runs
the same program; MPI (through mpi4py, ``pip install "nanoq[mpi]"``) tells
each its rank among the processes, hands rank 0's communicator id to all
(the NCCL unique id on cuda), and carries the collectives between processes
on cpu. A process started without a launcher is a world of one process and
never imports mpi4py.

The world of devices is processes x devices: process p drives
``options.devices`` local devices, global ranks ``p * devices ..
(p + 1) * devices - 1``. ``Trainer(config, options)`` under a launcher
joins that world by itself (see ``Trainer``); so do ``nanoq train`` and the
training loop.

``processes()`` is this process's ProcessGroup: rank, size and the few
host-side collectives the Python layer needs (barrier, broadcast and
all-gather of small picklable objects, agreement on a flag) on top of the
device collectives the core runs. ``check_agreement`` refuses a run whose
processes differ in what must match (settings, data files, the nanoq
version); nanoq.agreement runs a step on every process (or the root) so
that a failure anywhere fails it everywhere.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from traceback import format_exception_only
from typing import Any, Dict, List, Optional

# Environment variables by which launchers tell a process its rank and the
# number of processes: MPICH/Hydra and Intel MPI (PMI_*), Open MPI
# (OMPI_COMM_WORLD_*), PMIx launchers (PMIX_RANK with the size in the
# universe variables), and Slurm (SLURM_PROCID/SLURM_NTASKS, which srun sets
# for every task whatever MPI it then brings up; only inside a job step, with
# SLURM_STEP_ID, since a batch script's own shell has them too).
_RANK_SIZE_VARIABLES = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMIX_RANK", "OMPI_UNIVERSE_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
)


def launcher_world() -> Optional[tuple]:
    """(rank, size) from the launcher's environment, or None when this
    process was not started by a launcher of several processes."""
    for rank_name, size_name in _RANK_SIZE_VARIABLES:
        rank, size = os.environ.get(rank_name), os.environ.get(size_name)
        if rank is None or size is None or (rank_name == "SLURM_PROCID" and "SLURM_STEP_ID" not in os.environ):
            continue
        try:
            rank, size = int(rank), int(size)
        except ValueError:
            continue
        if size > 1 and 0 <= rank < size:
            return rank, size
    return None


class ProcessGroup:
    """The processes of one run. Every method is collective: every process
    calls it, in the same order."""

    rank: int = 0
    size: int = 1

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        raise NotImplementedError

    def broadcast(self, value: Any, root: int = 0) -> Any:
        """Process ``root``'s ``value`` (picklable), on every process. In a
        world of several processes a value that does not pickle raises
        TypeError on every process."""
        raise NotImplementedError

    def allgather(self, value: Any) -> List[Any]:
        """Every process's ``value`` (picklable), in rank order, on every
        process. In a world of several processes a value that does not
        pickle, on any process, raises TypeError on every process."""
        raise NotImplementedError

    def any(self, flag: bool) -> bool:
        """True on every process when ``flag`` is true on any."""
        return any(self.allgather(bool(flag)))

    def abort(self, code: int = 1) -> None:
        """Ends every process of the run now, with exit status ``code``."""
        raise NotImplementedError

    def node_local(self) -> tuple:
        """(this process's index, number of processes) among those on its node."""
        return 0, 1

    def transport(self):
        """What the core's cpu communicator uses between processes (see
        MPITransport), or None for a world of one process."""
        return None


class SingleProcess(ProcessGroup):
    """A process started without a launcher: a world of one."""

    def barrier(self) -> None:
        pass

    def broadcast(self, value: Any, root: int = 0) -> Any:
        _check_root(root, 1)
        return value

    def allgather(self, value: Any) -> List[Any]:
        return [value]

    def abort(self, code: int = 1) -> None:
        os._exit(code)


class MPITransport:
    """Byte exchanges between processes for the core's cpu communicator,
    over an mpi4py communicator. The core calls ``alltoallv`` from one
    thread of each process at a time (the leader of its devices), with the
    GIL taken for the call; mpi4py releases it while MPI moves the data."""

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def alltoallv(self, send, send_counts, recv, recv_counts) -> None:
        """Sends ``send_counts[q]`` bytes of ``send`` (consecutive blocks, in
        process order) to process q and receives ``recv_counts[q]`` bytes
        from each into ``recv``: writable and readable buffers of bytes.
        Gives up as ``await_every_process`` says."""
        from mpi4py import MPI

        send_displacements = _displacements(send_counts)
        recv_displacements = _displacements(recv_counts)
        await_every_process(self.comm, "the exchange of the core's collective")
        self.comm.Alltoallv([send, (list(send_counts), send_displacements), MPI.BYTE],
                            [recv, (list(recv_counts), recv_displacements), MPI.BYTE])

    def barrier(self) -> None:
        _barrier(self.comm, "the core's barrier")


# Communicators (by MPI handle) on which a wait timed out: MPI cannot take
# back the barrier left pending, so every later collective on them would pair
# with the wrong calls of the other processes. Each refuses at once instead.
_timed_out: Dict[int, str] = {}


def await_every_process(comm, what: str) -> bool:
    """Returns once every process of mpi4py communicator ``comm`` has called
    it (a nonblocking barrier, polled): True, or False at once without
    waiting where the limit is 0. A process that stopped without
    failing would leave the others waiting in their next collective for
    ever: past the collective time limit (``NANOQ_COLLECTIVE_TIMEOUT``,
    nanoq._core.collective_timeout) this raises RuntimeError naming ``what``
    instead, and so does every later call on ``comm`` (the run must end).
    The collective that follows then runs between processes that have all
    reached it; the barrier holds no buffer, so the one abandoned on the
    error can write nowhere."""
    from nanoq import _core

    handle = comm.py2f()
    if handle in _timed_out:
        raise RuntimeError(f"{what} refused: an earlier wait timed out ({_timed_out[handle]}); the processes' "
                           f"collectives are out of step since, and the run must end")
    limit = _core.collective_timeout()
    if not limit:
        return False
    request = comm.Ibarrier()
    # Polled every 100 us at most (the core's exchanges come many to a step) until a
    # second has passed, then every 10 ms (a long wait, e.g. on a checkpoint's save).
    start, pause = time.monotonic(), 20e-6
    while not request.Test():
        waited = time.monotonic() - start
        if waited > limit:
            message = (f"process {comm.Get_rank()} of {comm.Get_size()}: {what} did not finish within {limit:g} s: "
                       f"it waits for every process of the run: {_core.collective_timeout_advice()}")
            _timed_out[handle] = message
            raise RuntimeError(message)
        time.sleep(pause)
        pause = min(2 * pause, 1e-4 if waited < 1 else 1e-2)
    return True


def _barrier(comm, what: str) -> None:
    """A barrier of ``comm``'s processes under the collective time limit
    (``await_every_process`` is one; MPI's blocking one without a limit)."""
    if not await_every_process(comm, what):
        comm.Barrier()


def _displacements(counts) -> List[int]:
    out, at = [], 0
    for count in counts:
        out.append(at)
        at += int(count)
    return out


def _pickled(MPI, value: Any) -> tuple:
    """(the pickle of ``value`` by mpi4py's serializer, None), or (b"", why it does not pickle)."""
    try:
        return MPI.pickle.dumps(value), None
    except Exception as e:  # noqa: BLE001 - every process must learn of it
        return b"", unsendable(e)


def unsendable(error: Exception) -> str:
    """Why a process's value cannot travel to the others (``error`` from pickling or copying it)."""
    return f"does not pickle: {type(error).__name__}: {error}"


def allgather_failed(failures: List[str]) -> TypeError:
    """The error every process of an all-gather raises: ``failures`` are
    "process R's value <unsendable(...)>", in rank order."""
    return TypeError(f"an all-gather between the processes failed: {'; '.join(failures)}")


def _check_root(root: int, size: int) -> None:
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"root must be a process rank in [0, {size}), got {root!r}")


class MPIGroup(ProcessGroup):
    """The processes of an MPI communicator (mpi4py's COMM_WORLD by default)."""

    def __init__(self, comm=None):
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._transport = MPITransport(self.comm)
        self._node = None

    def barrier(self) -> None:
        _barrier(self.comm, "a barrier of the processes")

    # The values are pickled here, not inside mpi4py's bcast/allgather: a
    # value that does not pickle would raise in mpi4py on its own process
    # before sending, and the others would wait in the collective for ever
    # (where that process catches the error). Here each process pickles its
    # value first (with mpi4py's serializer, MPI.pickle, the one its bcast
    # and allgather use: what is unpickled still comes only from the run's
    # own processes), the processes exchange (failure, size), and a failure
    # anywhere raises TypeError on every process; then the bytes travel as
    # a buffer (one pickled copy, as mpi4py's own would make).
    def broadcast(self, value: Any, root: int = 0) -> Any:
        from mpi4py import MPI

        _check_root(root, self.size)
        data, failure = _pickled(MPI, value) if self.rank == root else (b"", None)
        await_every_process(self.comm, "a broadcast between the processes")
        failure, size = self.comm.bcast((failure, len(data)), root=root)
        if failure is not None:
            raise TypeError(f"a broadcast between the processes failed: process {root}'s value {failure}")
        buffer = data if self.rank == root else bytearray(size)
        self.comm.Bcast([buffer, MPI.BYTE], root=root)
        return MPI.pickle.loads(buffer)

    def allgather(self, value: Any) -> List[Any]:
        from mpi4py import MPI

        data, failure = _pickled(MPI, value)
        await_every_process(self.comm, "an all-gather between the processes")
        reports = self.comm.allgather((failure, len(data)))
        failures = [f"process {rank}'s value {failure}" for rank, (failure, _) in enumerate(reports) if failure]
        if failures:
            raise allgather_failed(failures)
        sizes = [size for _, size in reports]
        begins = _displacements(sizes)
        buffer = bytearray(sum(sizes))
        self.comm.Allgatherv([data, MPI.BYTE], [buffer, (sizes, begins), MPI.BYTE])
        view = memoryview(buffer)
        return [MPI.pickle.loads(view[begin:begin + size]) for begin, size in zip(begins, sizes)]

    def abort(self, code: int = 1) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(0.5)  # the launcher forwards what was printed before it ends the processes
        self.comm.Abort(code)

    def transport(self):
        return self._transport

    def node_local(self) -> tuple:
        if self._node is None:
            from mpi4py import MPI

            await_every_process(self.comm, "the processes' count of their nodes")
            node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            self._node = (node.Get_rank(), node.Get_size())
            node.Free()
        return self._node


_ABSENT = object()


def check_agreement(group: ProcessGroup, values: Dict[str, Any], what: str) -> None:
    """Raises ValueError on every process unless every process passed equal
    ``values`` ({name: value}, picklable, compared with ==; a name one
    process lacks counts as "absent" there). The message names each name
    that differs and which processes hold which value; ``what`` says what
    the names are, a noun phrase with its article ("the settings", "the
    data files"). Collective."""
    gathered = group.allgather(dict(values))
    names = list(dict.fromkeys(name for entry in gathered for name in entry))
    lines = []
    for name in names:
        groups: List[list] = []  # [value, ranks]: values compared with ==, so unhashable ones work
        for rank, entry in enumerate(gathered):
            value = entry.get(name, _ABSENT)
            for known in groups:
                if (known[0] is _ABSENT) == (value is _ABSENT) and (value is _ABSENT or known[0] == value):
                    known[1].append(rank)
                    break
            else:
                groups.append([value, [rank]])
        if len(groups) > 1:
            held = "; ".join(f"{'absent' if value is _ABSENT else _short_repr(value)} on "
                             f"{_process_list(ranks)}" for value, ranks in groups)
            lines.append(f"  {name}: {held}")
    if lines:
        raise ValueError(f"the {group.size} processes of this run disagree on {what}:\n" + "\n".join(lines)
                         + f"\n{what} must be the same on every process")


def _short_repr(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _process_list(ranks: List[int]) -> str:
    return ("process " if len(ranks) == 1 else "processes ") + ", ".join(str(rank) for rank in ranks)


_lock = threading.Lock()
_processes: Optional[ProcessGroup] = None


def processes() -> ProcessGroup:
    """This process's ProcessGroup: the launcher's processes through MPI, or
    a SingleProcess when no launcher started several. Made once."""
    global _processes
    with _lock:
        if _processes is None:
            _processes = _connect()
        return _processes


def _connect() -> ProcessGroup:
    world = launcher_world()
    if world is None:
        return SingleProcess()
    try:
        from mpi4py import MPI  # noqa: F401 - initialises MPI
    except ImportError as e:
        raise RuntimeError(
            f"this process is rank {world[0]} of {world[1]} started by a launcher, but mpi4py cannot be "
            f"imported ({e}): install nanoq with the mpi extra (pip install \"nanoq[mpi]\") or mpi4py for "
            f"your MPI") from None
    group = MPIGroup()
    _abort_world_on_uncaught_exception(group)
    if (group.rank, group.size) != world:
        raise RuntimeError(
            f"the launcher's environment says this is process {world[0]} of {world[1]}, but MPI says "
            f"{group.rank} of {group.size}: mpi4py is built for another MPI than the one that launched "
            f"the run (run mpiexec of the MPI that mpi4py uses: python -m mpi4py --mpi-library)")
    return group


def local_devices(group: ProcessGroup, devices: int, visible: int) -> int:
    """The first of the ``devices`` GPUs this process drives, of the
    ``visible`` ones it sees (collective). Processes that share a node and
    see the same GPUs take consecutive ones in node order; where the
    launcher gave each process GPUs of its own (Slurm's --gpus-per-task,
    CUDA_VISIBLE_DEVICES per rank), each starts at its first."""
    index, count = group.node_local()
    if count > 1 and visible >= count * devices:
        return index * devices
    if visible >= devices:
        return 0
    raise ValueError(f"this process should drive {devices} GPU(s) but sees {visible} ({count} process(es) of the run "
                     f"on this node): start fewer processes per node, lower run.devices, or give each process its "
                     f"own GPUs")


def _abort_world_on_uncaught_exception(group: ProcessGroup) -> None:
    """An exception that ends one process would leave the others waiting in
    their next collective for good: print it once, as this process's, then
    end every process of the run (the launcher reports a non-zero status)."""
    previous = sys.excepthook

    def hook(kind, value, traceback):
        try:
            # The error first, whole, on one line: the launcher may cut what
            # follows when it ends the processes.
            summary = "".join(format_exception_only(kind, value)).strip().replace("\n", " ")
            sys.stderr.write(f"nanoq: process {group.rank} of {group.size} failed: {summary}; ending the run\n")
            sys.stderr.flush()
            previous(kind, value, traceback)
        finally:
            group.abort(1)

    sys.excepthook = hook


def exit_status(code) -> int:
    """The process exit status of ``SystemExit(code)``."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def abort_on_failure(main):
    """Runs ``main()``; under a launcher, a non-zero exit (an error click
    reported, sys.exit(n)) ends every process of the run, so that none waits
    for one that is gone. Uncaught exceptions are ended so by the excepthook
    that processes() installs, here before ``main`` starts."""
    if launcher_world() is not None:
        processes()
    try:
        return main()
    except SystemExit as e:
        status = exit_status(e.code)
        if status and launcher_world() is not None:
            group = processes()
            if group.size > 1:
                sys.stdout.flush()
                sys.stderr.flush()
                group.abort(status)
        raise


def set_processes(group: ProcessGroup) -> ProcessGroup:
    """Makes ``group`` this process's ProcessGroup (for tests and for
    programs that bring their own MPI communicator); returns the previous one."""
    global _processes
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a nanoq.distributed.ProcessGroup, got {type(group).__name__}")
    with _lock:
        previous, _processes = _processes, group
    return previous
