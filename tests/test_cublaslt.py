"""The cuda backend's cuBLASLt matmuls (cuda_core/cuda/cublaslt_matmul.h):
the bias epilogue, the algorithm chosen by measurement, on the emulator's
cuBLASLt stand-in (cuda_core/cuda/emulator/cublasLt.h).

Asked to (NANOQ_EMU_LT_ALGORITHMS=3; it offers one by default), the stand-in's
heuristic offers three algorithms, the same float64 reference GEMM, algorithm
i of 3 delayed by (2 - i) * 0.5 ms, so timing them runs the selection code
for real; since all three compute alike, tuning must leave results bitwise
as they are without it. NANOQ_MATMUL_LOG=1 makes each new plan print its
choice to stderr, which these tests read:
  "nanoq matmul plan MxNxK ... bias=<type>: 3 algorithms, timed [t0 t1 t2] ms, chose i".
Plans are cached per backend and choices per device for the process, so each
test uses shapes of its own (no other test runs them first). The tests taking
`backend` also run on a GPU (marked gpu), where the heuristic offers what it
offers and the timings are real.
"""

import re

import numpy as np
import nanoq
import pytest

from nanoq.testing import OpRunner
from conftest import CUDA_BACKENDS, assert_array_close, require_cuda_emulator, use_cuda_backend

PLAN = re.compile(r"nanoq matmul plan (\d+)x(\d+)x(\d+) trans_a=(\d) trans_b=(\d) accumulate=(\d) "
                  r"types=(-?\d+)/(-?\d+)/(-?\d+) bias=(-?\d+): (\d+) algorithms, (.*), chose (\d+)")
CUDA_R_32F, CUDA_R_16BF = 0, 14


@pytest.fixture(params=[pytest.param(name, marks=mark, id=name) for name, mark in CUDA_BACKENDS])
def backend(request):
    return use_cuda_backend(request.param, request)


@pytest.fixture
def runner(backend, monkeypatch):
    """An OpRunner of `backend` (on the emulator, three algorithms offered)."""
    monkeypatch.setenv("NANOQ_MATMUL_LOG", "1")
    monkeypatch.setenv("NANOQ_EMU_LT_ALGORITHMS", "3")
    return OpRunner(backend)


def offered(backend, plan):
    """The emulator offers three; a GPU's heuristic what it finds (one or more)."""
    return plan["algorithms"] == 3 if backend == "cuda_emulated" else plan["algorithms"] >= 1


def assert_fastest_chosen(plan):
    if plan["algorithms"] == 1:
        assert plan["how"] == "untimed" and plan["chosen"] == 0
        return
    measured = times(plan["how"])
    assert len(measured) == plan["algorithms"] and np.isfinite(measured).any()
    assert plan["chosen"] == int(np.argmin(measured))


def plans(capfd):
    """The plans built since the last call: (M, N, K, accumulate, bias type, algorithms, how, chosen)."""
    found = []
    for line in capfd.readouterr().err.splitlines():
        m = PLAN.search(line)
        if m:
            g = m.groups()
            found.append(dict(shape=(int(g[0]), int(g[1]), int(g[2])), accumulate=int(g[5]), bias=int(g[9]),
                              algorithms=int(g[10]), how=g[11], chosen=int(g[12])))
    return found


def times(how):
    m = re.fullmatch(r"timed \[([^\]]*)\] ms", how)
    assert m, how
    return [float(t) for t in m.group(1).split()]


def normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_a_plan_times_every_algorithm_and_keeps_the_fastest(backend, runner, capfd):
    rng = np.random.default_rng(0)
    M, N, K = 37, 29, 23
    a, b = normal(rng, M, K), normal(rng, K, N)
    out = runner.run("matmul", a=a, b=b)
    assert_array_close(out, a.astype(np.float64) @ b, 1e-5, "out")
    [plan] = plans(capfd)
    assert plan["shape"] == (M, N, K) and offered(backend, plan)
    if backend == "cuda_emulated":
        assert all(np.isfinite(times(plan["how"])))
    assert_fastest_chosen(plan)
    # Cached: the same shape again builds no plan.
    runner.run("matmul", a=a, b=b)
    assert plans(capfd) == []
    # A second backend of the device reuses the choice (a second trainer computes bitwise as the first).
    again = OpRunner(backend).run("matmul", a=a, b=b)
    [second] = plans(capfd)
    if plan["algorithms"] > 1:
        assert second["how"] == "chosen earlier in this process"
    assert second["chosen"] == plan["chosen"]
    np.testing.assert_array_equal(again, out)


def test_an_accumulating_plan_is_timed_without_touching_its_output(backend, runner, capfd):
    """Timing runs the product several times; into the real output they
    would add it several times over."""
    rng = np.random.default_rng(1)
    M, N, K = 41, 19, 31
    a, b, c = normal(rng, K, M), normal(rng, N, K), normal(rng, M, N)  # trans_a, trans_b
    out = runner.run("matmul", a=a, b=b, trans_a=True, trans_b=True, accumulate_into=c)
    assert_array_close(out, c + a.T.astype(np.float64) @ b.T, 1e-5, "out")
    [plan] = plans(capfd)
    assert plan["accumulate"] == 1 and offered(backend, plan)
    assert_fastest_chosen(plan)


def test_without_autotuning_the_heuristics_first_algorithm_runs(backend, runner, capfd, monkeypatch):
    monkeypatch.setenv("NANOQ_MATMUL_AUTOTUNE", "0")
    rng = np.random.default_rng(2)
    a, b = normal(rng, 43, 17), normal(rng, 17, 13)
    out = runner.run("matmul", a=a, b=b)
    assert_array_close(out, a.astype(np.float64) @ b, 1e-5, "out")
    [plan] = plans(capfd)
    assert plan["how"] == "untimed" and plan["chosen"] == 0 and offered(backend, plan)


def test_a_bad_autotune_setting_is_a_value_error(runner, monkeypatch):
    monkeypatch.setenv("NANOQ_MATMUL_AUTOTUNE", "yes")
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match='NANOQ_MATMUL_AUTOTUNE must be 0 or 1, got "yes"'):
        runner.run("matmul", a=normal(rng, 47, 11), b=normal(rng, 11, 7))


@pytest.mark.parametrize("dtype,out_dtype,bias_type", [("fp32", "fp32", CUDA_R_32F), ("bf16", "bf16", CUDA_R_16BF),
                                                       ("bf16", "fp32", CUDA_R_32F)])
def test_the_bias_is_added_in_the_epilogue(runner, capfd, dtype, out_dtype, bias_type):
    """matmul_epilogue's bias and scale go to cuBLASLt (one plan with the
    bias epilogue, no separate kernel); against float64, with the inputs
    as the device sees them (bf16-rounded)."""
    rng = np.random.default_rng(4)
    M, N, K = 24, 40, 16
    a, b, bias = normal(rng, M, K), normal(rng, N, K), normal(rng, N)
    out = runner.run("matmul_epilogue", a=a, b=b, bias=bias, trans_b=True, scale=0.5, dtype=dtype,
                       out_dtype=out_dtype)
    [plan] = [p for p in plans(capfd) if p["bias"] != -1]
    assert plan["bias"] == bias_type
    if dtype == "bf16":
        a, b = bf16(a), bf16(b)
    if out_dtype == "bf16":
        bias = bf16(bias)
    expected = 0.5 * (a.astype(np.float64) @ b.T) + bias
    assert_array_close(out, expected, 1e-2 if out_dtype == "bf16" else 1e-5, "out")


def bf16(x):
    """x rounded to the nearest bf16 (ties to even), as float32."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


@pytest.mark.cuda_emulated
def test_the_cublaslt_stand_in_refuses_what_the_library_refuses(monkeypatch):
    """The emulator's cuBLASLt implements the epilogues nanoq asks for and
    refuses the rest, holds fp8 to Hopper's rules (scales and fast
    accumulation on fp8 products only) and strided batches to consistent
    layouts (15 = NOT_SUPPORTED, 7 = INVALID_VALUE), so that a wrong call
    fails here as on a GPU."""
    import ctypes
    import os

    import nanoq

    require_cuda_emulator()
    monkeypatch.setenv("NANOQ_EMU_LT_ALGORITHMS", "3")
    nanoq.backends()
    lib = ctypes.CDLL(os.path.join(os.path.dirname(nanoq._core.__file__), "libnanoq_cuda_emulated.so"))
    report = ctypes.create_string_buffer(4096)
    assert lib.nanoq_emu_cublaslt_refusals(report, 4096) == 0
    statuses = dict(word.split("=") for word in report.value.decode().split())
    assert statuses == {
        "relu_epilogue": "15", "bias_epilogue": "0", "unknown_attribute": "7",
        "fp8_tn": "0", "fp8_tn_algorithms": "3", "fp8_nn": "15", "fp8_m24": "15", "fp8_into_fp8": "15",
        "fp8_e4m3_e5m2": "0", "fp8_e5m2_e4m3": "0", "fp8_e5m2_e5m2": "15", "fp8_e5m2_nn": "15", "fp8_with_bf16": "15",
        # (fast accumulation off fp8: the stand-in refuses it, whatever the library does; nanoq never asks)
        "scale_on_bf16": "15", "fast_accum_on_bf16": "15", "f32_bias_on_bf16": "15",
        "bias_epilogue_without_bias": "7",
        # Strided batches: an operand shared by stride 0 is fine; batch counts that differ, outputs that
        # overlap and (in the stand-in) negative strides are refused.
        "batch_shared_operand": "0", "batch_counts_differ": "7", "batch_outputs_overlap": "7",
        "batch_negative_stride": "15",
    }


@pytest.mark.cuda_emulated
def test_a_plan_first_needed_inside_a_graph_capture_is_not_timed(monkeypatch, capfd):
    """Timing waits on events on the host, which a capture forbids (the
    emulator, like CUDA, invalidates the capture): a plan first needed
    inside one keeps the heuristic's first algorithm and says so, and the
    captured product replays right. The trainer warms every captured body up
    uncaptured first, so this is the guard behind that order."""
    import ctypes
    import os

    require_cuda_emulator()
    monkeypatch.setenv("NANOQ_MATMUL_LOG", "1")
    monkeypatch.setenv("NANOQ_EMU_LT_ALGORITHMS", "3")
    nanoq.backends()
    lib = ctypes.CDLL(os.path.join(os.path.dirname(nanoq._core.__file__), "libnanoq_cuda_emulated.so"))
    M, N, K = 24, 40, 56  # a shape of its own: no plan or remembered choice for it yet
    rng = np.random.default_rng(4)
    a, b = normal(rng, M, K), normal(rng, K, N)
    out = np.zeros((M, N), np.float32)
    message = ctypes.create_string_buffer(1024)
    f = ctypes.POINTER(ctypes.c_float)
    status = lib.nanoq_emu_matmul_planned_in_capture(M, N, K, a.ctypes.data_as(f), b.ctypes.data_as(f),
                                                     out.ctypes.data_as(f), message, 1024)
    assert status == 0, message.value.decode()
    assert_array_close(out, a.astype(np.float64) @ b, 1e-5, "captured matmul")
    (plan,) = plans(capfd)
    assert plan["algorithms"] == 3 and plan["chosen"] == 0
    assert plan["how"] == "untimed (first needed inside a CUDA graph capture)"


@pytest.mark.cuda_emulated
def test_tuned_training_is_bitwise_untuned_training(monkeypatch, capfd):
    """Two devices, two micro-batches per step (weight gradients accumulate):
    every plan timed on the first use of its shape, into the output or a
    scratch one, must leave the run bitwise as with NANOQ_MATMUL_AUTOTUNE=0
    (on the emulator every algorithm computes alike). A model shape of its
    own, so that no earlier test's choices are reused."""
    require_cuda_emulator()
    monkeypatch.setenv("NANOQ_MATMUL_LOG", "1")
    monkeypatch.setenv("NANOQ_EMU_LT_ALGORITHMS", "3")
    config = nanoq.ModelConfig(vocab_size=96, hidden_size=40, intermediate_size=56, num_hidden_layers=1,
                               num_attention_heads=5, num_key_value_heads=1)
    options = nanoq.TrainOptions(backend="cuda_emulated", dtype="bf16", devices=2, batch_size=2, seq_len=12,
                                 grad_accum=2, seed=0)
    rng = np.random.default_rng(5)
    batches = [(rng.integers(0, 96, (4, 12), dtype=np.int32), rng.integers(0, 96, (4, 12), dtype=np.int32))
               for _ in range(4)]

    def run():
        with nanoq.Trainer(config, options) as trainer:
            trainer.init_weights(3)
            losses = []
            for i in range(0, 4, 2):
                for inputs, targets in batches[i:i + 2]:
                    trainer.step(inputs, targets)
                losses.append(trainer.update(lr=1e-2).loss)
            return losses, trainer.get_weights()

    tuned_losses, tuned = run()
    tuned_plans = plans(capfd)
    monkeypatch.setenv("NANOQ_MATMUL_AUTOTUNE", "0")
    plain_losses, plain = run()
    assert any(p["accumulate"] == 1 and p["how"].startswith("timed") for p in tuned_plans), tuned_plans
    assert all(p["how"].startswith("timed") or p["how"] == "chosen earlier in this process" for p in tuned_plans)
    assert tuned_losses == plain_losses
    for name in plain:
        np.testing.assert_array_equal(tuned[name], plain[name], name)


@pytest.mark.cuda_emulated
def test_timing_an_accumulating_plan_leaves_no_memory_with_the_pool(monkeypatch, capfd):
    """An accumulating product is timed into a scratch output from the
    device's memory pool (cudaMallocAsync). Freed in stream order, it would
    stay with the pool (the emulator models CUDA's pool: its release
    threshold of 0 acts only at a synchronisation, which the backend never
    makes) outside the memory plan for the rest of the run: the backend
    trims the pool after timing, so the device holds no more than before the
    step beside the trainer's own allocations. A shape of its own (plans and
    choices are kept for the process)."""
    require_cuda_emulator()
    monkeypatch.setenv("NANOQ_MATMUL_LOG", "1")
    monkeypatch.setenv("NANOQ_EMU_LT_ALGORITHMS", "3")
    config = nanoq.ModelConfig(vocab_size=200, hidden_size=48, intermediate_size=72, num_hidden_layers=1,
                               num_attention_heads=3, num_key_value_heads=1)
    options = nanoq.TrainOptions(backend="cuda_emulated", dtype="bf16", batch_size=2, seq_len=10, seed=0)
    rng = np.random.default_rng(6)
    inputs, targets = (rng.integers(0, 200, (2, 10), dtype=np.int32) for _ in range(2))
    with nanoq.Trainer(config, options) as trainer:
        before = trainer.memory_summary()[0]["other"]
        trainer.step(inputs, targets)
        trainer.update(lr=1e-2)
        after = trainer.memory_summary()[0]["other"]
    timed = [p for p in plans(capfd) if p["accumulate"] == 1 and p["how"].startswith("timed")]
    assert timed, "no accumulating product was timed"
    # The largest scratch output would be the head's gradient (200 x 48 floats) and more.
    assert after == before, f"{after - before} bytes stay taken outside the trainer's allocator"
