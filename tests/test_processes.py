"""Several processes under a real launcher: mpiexec (from the mpich wheel the
test extra installs) starts P processes of tests/processes/worker.py, each a
Trainer of D cpu devices; the core's cpu communicator carries the
collectives between processes through MPI (mpi4py). P x D must train
bitwise like one process of P*D devices (the sums run in the same order),
and a process that fails or dies must end the whole run within seconds."""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import nanoq
import nanoq.distributed
from conftest import require_cuda_emulator
from processes.world import CONFIG, global_batches, to_options

STEPS = 3


def mpiexec_path() -> str:
    """The mpiexec beside this Python (the mpich wheel's), else one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.path.exists(beside) else shutil.which("mpiexec")
    assert found, "mpiexec not found: install the test extra (it brings mpi4py and the mpich wheel)"
    return found


def launch(processes: int, spec: dict, timeout: float = 120, **env):
    """Runs the worker under mpiexec (with environment variables `env` too);
    returns (CompletedProcess, seconds)."""
    command = [mpiexec_path(), "-n", str(processes), sys.executable,
               os.path.join(os.path.dirname(__file__), "processes", "worker.py"), json.dumps(spec)]
    began = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **env))
    return result, time.monotonic() - began


def single_process(fields: dict, world: int):
    """Losses, norms and weights of one process of `world` devices."""
    options = to_options(dict(fields, devices=world))
    losses, norms = [], []
    with nanoq.Trainer(CONFIG, options) as trainer:
        trainer.init_weights(seed=3)
        for index, (inputs, targets) in enumerate(global_batches(STEPS * options.grad_accum,
                                                                  world * options.batch_size, options.seq_len)):
            trainer.step(inputs, targets)
            if (index + 1) % options.grad_accum == 0:
                stats = trainer.update(lr=1e-2)
                losses.append(stats.loss)
                norms.append(stats.grad_norm)
        weights = trainer.get_weights()
    return np.array(losses), np.array(norms), weights


VARIANTS = [
    dict(zero_stage=1),
    dict(zero_stage=2),
    dict(zero_stage=3),
    dict(zero_stage=2, recompute=["block"]),
    dict(zero_stage=3, offload=["optimizer", "master", "gradients"], recompute=["qkv", "swiglu"]),
    dict(zero_stage=1, offload=["optimizer"], grad_accum=3),
]


@pytest.mark.parametrize("fields", VARIANTS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_two_processes_of_two_devices_train_like_one_process_of_four(tmp_path, fields):
    result, _ = launch(2, dict(options=dict(fields, devices=2), steps=STEPS, out=str(tmp_path)))
    assert result.returncode == 0, result.stderr[-3000:]
    losses, norms, weights = single_process(fields, world=4)
    for rank in range(2):
        got = np.load(tmp_path / f"rank{rank}.npz")
        assert tuple(got["topology"]) == (4, 2 * rank)
        np.testing.assert_array_equal(got["losses"], losses)
        np.testing.assert_array_equal(got["norms"], norms)
        for name, value in weights.items():
            np.testing.assert_array_equal(got[f"w.{name}"], value, err_msg=name)


def test_four_processes_of_one_device_train_like_one_process_of_four(tmp_path):
    fields = dict(zero_stage=2)
    result, _ = launch(4, dict(options=dict(fields, devices=1), steps=STEPS, out=str(tmp_path)))
    assert result.returncode == 0, result.stderr[-3000:]
    losses, norms, weights = single_process(fields, world=4)
    for rank in range(4):
        got = np.load(tmp_path / f"rank{rank}.npz")
        np.testing.assert_array_equal(got["losses"], losses)
        np.testing.assert_array_equal(got["norms"], norms)
        for name, value in weights.items():
            np.testing.assert_array_equal(got[f"w.{name}"], value, err_msg=name)


@pytest.mark.parametrize("mode", ["raise", "core_failure", "kill"])
def test_a_failing_process_ends_every_process_within_seconds(tmp_path, mode):
    spec = dict(mode=mode, failing=1, options=dict(devices=2), steps=1000, out=str(tmp_path))
    result, seconds = launch(2, spec, timeout=60)
    assert result.returncode != 0
    assert seconds < 20, f"the run took {seconds:.1f} s to end after process 1 failed"
    assert not list(tmp_path.glob("rank*.npz")), "a process finished its run although another failed"
    if mode != "kill":
        # The failing process's error, printed once.
        expected = ("RuntimeError: deliberate failure on process 1" if mode == "raise"
                    else "nanoq._core.NanoqError: step() #4 (micro-batch 2 of optimizer step 2) failed on device 0: "
                         "injected fault")
        assert result.stderr.count(f"nanoq: process 1 of 2 failed: {expected}") == 1, result.stderr[-3000:]
        assert "nanoq: process 0 of 2 failed" not in result.stderr


def test_a_process_that_stops_without_failing_ends_the_run_within_the_collective_time_limit(tmp_path):
    # Process 1 sleeps mid-run, as one stuck in I/O or a deadlock: alive, so neither its error nor
    # the launcher ends the run. Process 0's next exchange gives up after NANOQ_COLLECTIVE_TIMEOUT
    # seconds, and its error ends every process.
    spec = dict(mode="stall", failing=1, options=dict(devices=2), steps=1000, out=str(tmp_path),
                late_env=dict(NANOQ_COLLECTIVE_TIMEOUT="2"))
    result, seconds = launch(2, spec, timeout=120)
    assert result.returncode != 0
    assert seconds < 30, f"the run took {seconds:.1f} s to end after process 1 stalled"
    # Process 0's failing call waited the limit out first (a wait that gave up at once would not).
    waited = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"rank": 0')]
    assert len(waited) == 1 and waited[0]["failed_after"] >= 2, result.stdout
    assert not list(tmp_path.glob("rank*.npz")), "a process finished its run although another stalled"
    failed = [line for line in result.stderr.splitlines() if line.startswith("nanoq: process 0 of 2 failed: ")]
    assert len(failed) == 1, result.stderr[-3000:]
    assert "did not finish within 2 s: it waits for every process of the run" in failed[0], failed
    assert "NANOQ_COLLECTIVE_TIMEOUT" in failed[0], failed
    assert "nanoq: process 1 of 2 failed" not in result.stderr


@pytest.mark.parametrize("backend, option, value, differs", [
    ("cpu", "z_loss", "1e-4 * group.rank", "z_loss=0.000100 (against z_loss=0.000000)"),
    ("cpu", "cuda_graphs", "group.rank == 0", "cuda_graphs=0 (against cuda_graphs=1)"),
])
def test_processes_that_disagree_on_the_options_refuse_to_start(tmp_path, backend, option, value, differs):
    # Process 1 asks for another z_loss (or cuda_graphs: NCCL needs a
    # collective captured in a graph on every rank or on none): the core
    # compares every process's signature with process 0's and every
    # process refuses, naming the setting (the cuda backend's world too:
    # test_cuda_emulated_faults.py, as the emulated one cannot span processes).
    script = tmp_path / "disagree.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import nanoq\n"
        "from nanoq import distributed\n"
        "from processes.world import CONFIG, to_options\n"
        "group = distributed.processes()\n"
        f"options = to_options(dict(backend={backend!r}, devices=1, {option}={value}))\n"
        "try:\n"
        "    nanoq.Trainer(CONFIG, options)\n"
        "except ValueError as e:\n"
        "    print(f'refused {group.rank}: {e}')\n")
    env = dict(os.environ, NANOQ_NCCL_INIT_TIMEOUT="20")
    result = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(script)], capture_output=True,
                            text=True, timeout=90, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        assert f"refused {rank}: the processes of one world must have the same model config and options" \
            in result.stdout, result.stdout
    assert f"process 1 differs from process 0 in {differs}" in result.stdout, result.stdout


# -- without a launcher ----------------------------------------------------------

class NodeGroup(nanoq.distributed.SingleProcess):
    """A stand-in: this process is `index` of `count` on its node."""

    def __init__(self, index, count):
        self._node = (index, count)

    def node_local(self):
        return self._node


@pytest.mark.parametrize("index,count,devices,visible,first", [
    (0, 1, 2, 8, 0),   # alone on its node
    (1, 2, 2, 4, 2),   # two processes share the node's four GPUs
    (3, 8, 1, 8, 3),   # one process per GPU
    (1, 2, 2, 2, 0),   # the launcher gave each process its own two GPUs
])
def test_processes_on_one_node_take_consecutive_gpus(index, count, devices, visible, first):
    assert nanoq.distributed.local_devices(NodeGroup(index, count), devices, visible) == first


def test_too_few_gpus_for_the_processes_of_a_node_is_a_clear_error():
    with pytest.raises(ValueError, match="should drive 4 GPU"):
        nanoq.distributed.local_devices(NodeGroup(0, 2), 4, 2)


@pytest.mark.cuda_emulated
def test_first_device_beyond_the_machines_devices_is_refused():
    from nanoq.backends import device_count

    require_cuda_emulator()
    available = device_count("cuda_emulated")
    options = to_options(dict(backend="cuda_emulated", devices=1, first_device=available))
    with pytest.raises(ValueError, match=f"from device {available}, but {available} are available"):
        nanoq.Trainer(CONFIG, options)


@pytest.mark.parametrize("variables,world", [
    ({}, None),
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, (1, 4)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}, (2, 3)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, (0, 2)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, None),  # a batch script's shell, not a task of srun
    ({"PMI_RANK": "0", "PMI_SIZE": "1"}, None),          # a launcher of one process: as without one
    ({"PMI_RANK": "x", "PMI_SIZE": "2"}, None),
])
def test_the_launchers_environment_names_rank_and_size(monkeypatch, variables, world):
    for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
                 "OMPI_UNIVERSE_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert nanoq.distributed.launcher_world() == world


def test_a_command_line_error_on_one_process_ends_every_process(tmp_path):
    # The config file exists on "node" 0 only: process 1's `nanoq train` exits
    # with click's error while process 0 goes on into its first collective;
    # the entry point's guard ends process 0 too instead of leaving it waiting.
    for node in ("node0", "node1"):
        (tmp_path / node).mkdir()
    (tmp_path / "node0" / "run.toml").write_text("[train]\nsteps = 1\n")
    program = [sys.executable, "-m", "nanoq_cli.main", "train", "run.toml", "--backend", "cpu", "--threads", "1",
               "--out_dir", "runs"]
    command = [mpiexec_path(), "-n", "1", "-wdir", str(tmp_path / "node0"), *program, ":",
               "-n", "1", "-wdir", str(tmp_path / "node1"), *program]
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert time.monotonic() - began < 30, "the other process waited for the one that exited"
    assert "run.toml" in done.stderr, done.stdout + done.stderr


STALLED_COLLECTIVE = """
import sys, time
from nanoq import distributed
group = distributed.processes()
if group.rank == 1:
    time.sleep(600)  # stopped without failing
called = time.monotonic()
try:
    {call}
except RuntimeError:
    print(f"waited {{time.monotonic() - called:.3f}}", flush=True)
    try:
        group.barrier()  # the communicator is out of step now: refused at once, not a second wait
    except RuntimeError as e:
        print(f"then {{time.monotonic() - called:.3f}}: {{e}}", flush=True)
    raise
"""


@pytest.mark.parametrize("call, what", [
    ("group.barrier()", "a barrier of the processes"),
    ("group.broadcast('x')", "a broadcast between the processes"),
    ("group.allgather(1)", "an all-gather between the processes"),
    ("group.any(False)", "an all-gather between the processes"),
])
def test_the_process_groups_collectives_give_up_on_a_stalled_process(call, what):
    # The Python layer's own collectives (agreement, checkpoints) wait for every process as the
    # core's do, and give up after the same limit with an error that ends the run.
    command = [mpiexec_path(), "-n", "2", sys.executable, "-c", STALLED_COLLECTIVE.format(call=call)]
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, NANOQ_COLLECTIVE_TIMEOUT="1.5"))
    seconds = time.monotonic() - began
    assert done.returncode != 0
    assert seconds < 30, seconds
    assert (f"nanoq: process 0 of 2 failed: RuntimeError: process 0 of 2: {what} did not finish within 1.5 s: "
            "it waits for every process of the run") in done.stderr, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    waited = float(lines[0].split()[1])
    assert waited >= 1.5, done.stdout  # the limit waited out, not an error at once
    # After the timeout every collective on the communicator refuses at once (MPI cannot take the
    # pending barrier back: a second one would pair with the other process's calls wrongly).
    then, message = lines[1].split(" ", 1)[1].split(": ", 1)
    assert float(then) - waited < 1.0, done.stdout
    assert message.startswith("a barrier of the processes refused: an earlier wait timed out (process 0 of 2: "), message
    assert message.endswith("the run must end"), message


UNPICKLABLE_VALUE = """
import os, sys, threading, time
import numpy as np
from nanoq import distributed
group = distributed.processes()
out = open(os.path.join(sys.argv[1], f"rank{group.rank}.txt"), "w")  # the processes' prints would interleave
lock = threading.Lock()  # does not pickle
for name, call in [("broadcast", lambda: group.broadcast(lock if group.rank == 0 else None)),
                   ("allgather", lambda: group.allgather(lock if group.rank == 1 else group.rank))]:
    began = time.monotonic()
    try:
        call()
    except TypeError as e:
        print(f"{group.rank} {name} {time.monotonic() - began:.3f} {e}", file=out, flush=True)
# The processes are still in step: the next collectives carry values, arrays included.
print(group.rank, "then", group.broadcast({"id": 7}, root=1), file=out, flush=True)
parts = group.allgather(np.arange(3 + group.rank, dtype=np.float32) * (group.rank + 1))
print(group.rank, "then", [part.tolist() for part in parts], group.allgather(b""), file=out, flush=True)
"""


def test_a_value_that_does_not_pickle_fails_the_collective_on_every_process_at_once(tmp_path):
    # A broadcast or all-gather whose value does not pickle on one process fails on every process
    # (where that process caught its error, the others used to wait in the collective for ever),
    # and leaves the processes in step for their next collectives.
    command = [mpiexec_path(), "-n", "2", sys.executable, "-c", UNPICKLABLE_VALUE, str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, NANOQ_COLLECTIVE_TIMEOUT="20"))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    for rank in (0, 1):
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert len(lines) == 4, lines
        broadcast = next(line for line in lines if line.startswith(f"{rank} broadcast "))
        seconds, message = broadcast.split(" ", 3)[2:]
        assert float(seconds) < 10, broadcast  # not the collective time limit
        assert message == ("a broadcast between the processes failed: process 0's value does not pickle: "
                           "TypeError: cannot pickle '_thread.lock' object"), message
        allgather = next(line for line in lines if line.startswith(f"{rank} allgather "))
        seconds, message = allgather.split(" ", 3)[2:]
        assert float(seconds) < 10, allgather
        assert message == ("an all-gather between the processes failed: process 1's value does not pickle: "
                           "TypeError: cannot pickle '_thread.lock' object"), message
        assert f"{rank} then {{'id': 7}}" in lines
        assert f"{rank} then [[0.0, 1.0, 2.0], [0.0, 2.0, 4.0, 6.0]] [b'', b'']" in lines


def test_a_thread_worlds_all_gather_of_a_value_that_does_not_copy_fails_on_every_member_alike():
    # The test stand-in for processes (nanoq.testing.threads) fails as MPIGroup does.
    from nanoq.testing.threads import ThreadWorld

    world, lock, seen = ThreadWorld(2, timeout=30), threading.Lock(), {}

    def member(rank):
        group = world.member(rank)
        with pytest.raises(TypeError) as failed:
            group.allgather(lock if rank == 1 else rank)
        seen[rank] = (str(failed.value), group.allgather(rank))

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    message = ("an all-gather between the processes failed: process 1's value does not pickle: "
               "TypeError: cannot pickle '_thread.lock' object")
    assert seen == {0: (message, [0, 1]), 1: (message, [0, 1])}


def test_a_collective_time_limit_that_is_not_a_number_of_seconds_is_refused(monkeypatch):
    monkeypatch.setenv("NANOQ_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="NANOQ_COLLECTIVE_TIMEOUT must be a number of seconds >= 0"):
        nanoq._core.collective_timeout()
    monkeypatch.setenv("NANOQ_COLLECTIVE_TIMEOUT", "0")
    assert nanoq._core.collective_timeout() == 0
    monkeypatch.delenv("NANOQ_COLLECTIVE_TIMEOUT")
    assert nanoq._core.collective_timeout() == 1800


class _CountingComm:
    """An mpi4py communicator's barrier calls, counted: its nonblocking barrier
    completes on the third test."""

    def __init__(self):
        self.calls = []

    def py2f(self):
        return id(self)

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Ibarrier(self):
        self.calls.append("Ibarrier")
        comm = self

        class Request:
            tests = 0

            def Test(self):
                Request.tests += 1
                comm.calls.append("Test")
                return Request.tests >= 3
        return Request()

    def Barrier(self):
        self.calls.append("Barrier")


@pytest.mark.parametrize("limit, calls", [("30", ["Ibarrier", "Test", "Test", "Test"]), ("0", ["Barrier"])])
def test_a_barrier_meets_the_other_processes_once(monkeypatch, limit, calls):
    # Under a time limit the polled nonblocking barrier is the barrier (a blocking one after it
    # would cost a second round for nothing); without one, MPI's blocking barrier.
    monkeypatch.setenv("NANOQ_COLLECTIVE_TIMEOUT", limit)
    comm = _CountingComm()
    nanoq.distributed.MPITransport(comm).barrier()
    assert comm.calls == calls


QUEUED_STEP_THEN_INSPECT = """
import numpy as np, nanoq
from nanoq import distributed
from nanoq.testing import hooks
group = distributed.processes()
config = nanoq.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
trainer = nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", batch_size=1, seq_len=16, threads=1))
tokens = np.random.default_rng(0).integers(0, 128, size=(1, 17)).astype(np.int32)
inputs, targets = np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
for inspect in ("get_allocations(0)", "get_stack_info(0)", "memory_summary()"):
    hooks.delay_next_step(trainer, 0, 0.2)  # still queued when the inspection comes
    trainer.step(inputs, targets)
    eval("trainer." + inspect)
    print(group.rank, inspect, trainer.update(lr=1e-3).loss, flush=True)
trainer.close()
"""


def test_inspecting_memory_while_a_step_is_queued_does_not_hang_the_processes():
    # The inspection waits for the queued step, whose gradient exchange between the processes
    # (MPITransport, on a worker thread) needs the GIL: the wait must not hold it.
    command = [mpiexec_path(), "-n", "2", sys.executable, "-c", QUEUED_STEP_THEN_INSPECT]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)  # (a hang: TimeoutExpired)
    assert done.returncode == 0, done.stderr[-3000:]
    for inspect in ("get_allocations(0)", "get_stack_info(0)", "memory_summary()"):
        assert done.stdout.count(inspect) == 2, done.stdout  # (the processes' lines may interleave)
