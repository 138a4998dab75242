"""Failures of the cuda backend, on the CPU emulator of CUDA (cuda_emulated).

A GPU that is lost on one rank (the emulator's nanoq_emu_lose_device: as
after a fatal fault, everything on that device fails from then on, and
peers waiting for it in a collective wait for ever) must reach Python as
that rank's error within seconds, whether the rank fails before its NCCL
communicator connects or in the middle of a step, and the process must not
hang; and no rank's thread may touch another rank's communicator. Each
scenario runs in a subprocess, so that a hang is a failed test (and a lost
device stays in its own process).
"""
import ctypes
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import nanoq
from nanoq import _core
from nanoq.testing import OpRunner

pytestmark = pytest.mark.cuda_emulated

os.environ.setdefault("NANOQ_EMU_SEED", "1")  # a fixed schedule for the emulator in this process


def emulator():
    """The emulated backend's library (loaded once), for its test controls."""
    _core.device_count("cuda_emulated")  # loads it, as a Trainer would
    lib = ctypes.CDLL(os.path.join(os.path.dirname(nanoq.__file__), "libnanoq_cuda_emulated.so"))
    lib.nanoq_emu_lose_device.argtypes = [ctypes.c_int, ctypes.c_long]
    lib.nanoq_emu_pageable_copies.restype = ctypes.c_ulonglong
    lib.nanoq_emu_nccl_teardowns_under_graphs.restype = ctypes.c_ulonglong
    lib.nanoq_emu_nccl_foreign_thread_calls.restype = ctypes.c_ulonglong
    lib.nanoq_emu_nccl_withhold_rank.argtypes = [ctypes.c_int]
    lib.nanoq_emu_nccl_stall_rank.argtypes = [ctypes.c_int, ctypes.c_int]
    return lib


SCENARIO = """
import faulthandler, json, os, sys, time
import numpy as np
# A hang ends the process with every thread's Python stack on stderr, which the test shows: where the
# main thread waits names the call that hung (the emulator's own waits give up only after 120 s).
faulthandler.dump_traceback_later({hang_after}, exit=True)
import nanoq
sys.path.insert(0, {tests!r})
from test_cuda_emulated_faults import emulator

where, stage, kernel = {where!r}, {stage}, {kernel}
config = nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4)
options = nanoq.TrainOptions(backend="cuda_emulated", devices=2, batch_size=1, seq_len=8, zero_stage=stage)
tokens = np.random.default_rng(0).integers(0, 64, (2, 9), dtype=np.int32)
inputs, targets = np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
trainer = None
if where == "connect":
    emulator().nanoq_emu_lose_device(1, 0)  # rank 1's device is gone before the trainer exists
elif where == "withheld":
    emulator().nanoq_emu_nccl_withhold_rank(1)  # rank 1 never joins: as a process that never connects
else:
    trainer = nanoq.Trainer(config, options)
    trainer.step(inputs, targets)
    trainer.update(lr=1e-3)
    if where == "update":
        trainer.step(inputs, targets)
    if where == "stalled":
        # The step runs before the stop: the stopped rank's host stops in its next wait for unfinished work,
        # and a stop inside the step (its batch copies not yet done) would keep this process's update() from
        # being queued at all, as no stopped peer process could; the update's collectives are what rank 0
        # then waits for.
        trainer.step(inputs, targets)
        trainer.wait()
        # The limit from here on (host waits read it as they begin): the set-up's waits, slow under a
        # sanitizer, are not held to it.
        os.environ["NANOQ_COLLECTIVE_TIMEOUT"] = "1.5"
        emulator().nanoq_emu_nccl_stall_rank(1, 1)  # as a process of the run that stopped without failing
    else:
        emulator().nanoq_emu_lose_device(1, kernel)  # at rank 1's kernel-th next kernel
start = time.monotonic()
try:
    if where in ("connect", "withheld"):
        trainer = nanoq.Trainer(config, options)
    elif where == "step":
        trainer.step(inputs, targets)  # queues the step: its failure surfaces at the next waiting call
        trainer.update(lr=1e-3)
    else:
        trainer.update(lr=1e-3)
    error = None
except (nanoq.NanoqError, ValueError) as e:  # ValueError: bad settings
    error = str(e)
elapsed = time.monotonic() - start
start = time.monotonic()
if trainer is not None:
    trainer.close()
print(json.dumps(dict(error=error, elapsed=elapsed, close=time.monotonic() - start,
                      foreign=emulator().nanoq_emu_nccl_foreign_thread_calls(),
                      under_graphs=emulator().nanoq_emu_nccl_teardowns_under_graphs())), flush=True)
"""


def run_scenario(where, stage=1, kernel=0, timeout=120, **env):
    script = SCENARIO.format(tests=os.path.dirname(__file__), where=where, stage=stage, kernel=kernel,
                             hang_after=timeout - 20)
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, NANOQ_EMU_SEED="1", **env))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process hung: no result within {timeout} s\n{e.stdout}\n{e.stderr}")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


LOST = "emulated device 1 was lost"


def test_a_rank_that_fails_before_its_communicator_connects_fails_the_trainer_promptly():
    # Rank 1 fails creating its stream; rank 0 is meanwhile in NCCL's
    # initialisation, which waits for every rank: it must give up.
    result = run_scenario("connect")
    assert result["error"] is not None and LOST in result["error"], result
    assert result["elapsed"] < 10, result
    assert result["foreign"] == 0, result


def test_a_rank_that_never_joins_fails_the_communicators_initialisation_within_its_time_limit():
    # NCCL waits for every rank for ever; a process of the run that never connects (failed, or not
    # started under a launcher that does not end the others) must not hang the rest without a word.
    result = run_scenario("withheld", NANOQ_NCCL_INIT_TIMEOUT="1.5")
    assert result["error"] is not None, result
    assert "ncclCommInitRankConfig did not finish within 1.5 s" in result["error"], result
    assert "waited for every rank of the world to join" in result["error"], result
    assert "NANOQ_NCCL_INIT_TIMEOUT" in result["error"], result
    assert 1.5 <= result["elapsed"] < 10, result
    assert result["close"] < 10 and result["foreign"] == 0, result
    # A limit that is not a number of seconds is refused, naming the variable.
    bad = run_scenario("withheld", NANOQ_NCCL_INIT_TIMEOUT="soon")
    assert "NANOQ_NCCL_INIT_TIMEOUT must be a number of seconds >= 0" in bad["error"], bad


def check_stalled(result):
    error = result["error"]
    assert error is not None and error.startswith("rank 0 of 2: "), result
    assert "did not finish within 1.5 s" in error, result
    assert "another rank may have stopped without failing" in error and "NANOQ_COLLECTIVE_TIMEOUT" in error, result
    assert "abandoned" not in error, result  # the root cause, not a peer's abandoned wait
    assert 1.5 <= result["elapsed"] < 10, result
    assert result["close"] < 10, result
    assert result["foreign"] == 0 and result["under_graphs"] == 0, result


@pytest.mark.parametrize("stage", [1, 3])
def test_a_rank_that_stops_without_failing_fails_the_others_waits_within_the_collective_time_limit(stage):
    # Rank 1 stops, as a process stuck in I/O or a deadlock: its collectives never come and its
    # host thread never returns to give up itself. Without a limit rank 0 would wait in its
    # collectives for ever (NCCL has none); with it, rank 0 gives up, and its error is the one said.
    check_stalled(run_scenario("stalled", stage))
    # A limit that is not a number of seconds is refused when the trainer connects, naming the variable.
    bad = run_scenario("withheld", NANOQ_COLLECTIVE_TIMEOUT="soon")
    assert "NANOQ_COLLECTIVE_TIMEOUT must be a number of seconds >= 0" in bad["error"], bad


def check_lost(result):
    # The root cause, not the peers' abandoned collectives.
    assert result["error"] is not None and LOST in result["error"], result
    assert "abandoned" not in result["error"] and "aborted" not in result["error"], result
    assert result["elapsed"] < 10, result
    assert result["close"] < 10, result
    # Every rank aborted only its own communicator, from its own thread: a
    # communicator used by two threads is a data race (and, once freed by
    # one, a use after free for the other). And its CUDA graphs went first:
    # NCCL's abort waits for those that hold its collectives.
    assert result["foreign"] == 0 and result["under_graphs"] == 0, result


@pytest.mark.parametrize("where, stage, kernel", [
    ("step", 3, 1),    # ZeRO-3: rank 0 waits in the layers' gathers
    ("step", 3, 25),
    # Late in the backward, rank 0's layer reductions in flight (rank 1's step
    # issues 42 kernels at stage 1 and 48 at stage 2 since the fused kernels:
    # an index past the step's last kernel would lose the device after it).
    ("step", 1, 36),
    ("step", 2, 42),
    ("update", 1, 1),  # rank 0 waits in the reduce-scatter / all-gathers, then copying stats to the host
    ("update", 1, 6),
])
def test_a_rank_lost_during_a_step_fails_it_promptly_with_that_ranks_error(where, stage, kernel):
    check_lost(run_scenario(where, stage, kernel))


@pytest.mark.parametrize("where, stage, kernel", [("stalled", 1, 0), ("stalled", 3, 0), ("update", 1, 1),
                                                  ("step", 3, 1)])
def test_failures_are_handled_the_same_in_other_interleavings(where, stage, kernel):
    # The emulator sleeps at random where host threads and streams meet (NANOQ_EMU_JITTER_US), so
    # that each run takes another interleaving. Two races these found, each once in some tens of
    # runs: a step that was still copying its batch when rank 1 stopped kept update() from being
    # queued (the scenario now stops rank 1 after the step), and a capture that failed because a
    # peer did kept its collectives' hold on the communicator, so that the abort waited for it.
    result = run_scenario(where, stage, kernel, NANOQ_EMU_JITTER_US="3000")
    (check_stalled if where == "stalled" else check_lost)(result)


def test_pinned_staging_is_reused_after_an_op_that_raised():
    """An op that raises after staging its inputs (attention over more than
    65535 sequences: the grid's z dimension) must not leave the pinned
    staging buffer marked in use: later copies go through it again, and
    results match a fresh runner's."""
    rng = np.random.default_rng(0)
    # q of [B, T, 1, 2] fills the staging buffer (2 int32 per row) exactly.
    small = [rng.standard_normal((2, 8, 1, 2), dtype=np.float32) for _ in range(3)]
    expected = OpRunner("cuda_emulated").attention_forward(*small)
    runner = OpRunner("cuda_emulated")
    big = np.zeros((65536, 1, 1, 2), np.float32)
    with pytest.raises(nanoq.NanoqError, match="invalid grid"):
        runner.attention_forward(big, big, big)
    lib = emulator()
    for _ in range(2):
        before = lib.nanoq_emu_pageable_copies()
        out = runner.attention_forward(*small)
        # Of q, k and v, at least q is staged through pinned memory (k and v
        # too once the copy before them has completed).
        assert lib.nanoq_emu_pageable_copies() - before < 3
        for got, want in zip(out, expected):
            assert np.array_equal(got, want)


def test_micro_batches_stage_their_positions_and_dropout_seed_through_pinned_memory():
    """Each micro-batch copies its packed positions and its dropout seed to
    the device through the backend's pinned staging. From pageable memory
    such a copy may wait for the work queued before it, so the host could
    not queue the next micro-batch while the device runs this one."""
    config = nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, dropout=0.1)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 64, (2, 16), dtype=np.int32)
    positions = np.array([list(range(5)) + list(range(11)), list(range(16))], np.int32)
    lib = emulator()
    options = nanoq.TrainOptions(backend="cuda_emulated", batch_size=2, seq_len=16, grad_accum=8)
    with nanoq.Trainer(config, options) as trainer:
        trainer.step(tokens, tokens, positions=positions)  # the first allocates the positions' buffer
        trainer.wait()
        before = lib.nanoq_emu_pageable_copies()
        for _ in range(7):
            trainer.step(tokens, tokens, positions=positions)
        trainer.wait()
        assert lib.nanoq_emu_pageable_copies() == before


def test_the_cuda_backends_processes_that_disagree_refuse_before_nccl_connects_them():
    """The cuda backend's world (make_nccl_group) compares every process's
    settings with process 0's, as the cpu backend's does: processes that
    disagree (here on cuda_graphs, which NCCL needs alike on every rank)
    all refuse, naming the setting, instead of waiting in NCCL's
    initialisation for each other. Two processes are played by two threads
    of this one joined by an in-memory transport."""
    lib = emulator()
    lib.nanoq_emu_nccl_group_of_two_processes.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                                          ctypes.c_char_p, ctypes.c_int]

    def refusals(first, second):
        messages = [ctypes.create_string_buffer(4096) for _ in range(2)]
        assert lib.nanoq_emu_nccl_group_of_two_processes(first.encode(), second.encode(), *messages, 4096) == 0
        return [m.value.decode() for m in messages]

    agreed = "vocab=64 seed=0 cuda_graphs=1 matmul_dtype=0"
    assert refusals(agreed, agreed) == ["", ""]
    for message in refusals(agreed, agreed.replace("cuda_graphs=1", "cuda_graphs=0")):
        assert "the processes of one world must have the same model config and options" in message, message
        assert "process 1 differs from process 0 in cuda_graphs=0 (against cuda_graphs=1)" in message, message
