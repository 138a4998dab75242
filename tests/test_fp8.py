"""fp8 (e4m3) projection matmuls: TrainOptions.matmul_dtype = "fp8" on the cuda backend.

What runs in fp8 (cuda_backend.cpp, CudaBackend::fp8_projection): the
forward projections x[M,K] @ W[N,K]^T (q/k/v, o, gate/up, down), each input
and weight quantized with its own current scale (448 / its absolute
maximum, kernels_fp8.cu) and multiplied by cuBLASLt into bf16, bias in the
epilogue. The backward, the classifier, the optimizer and master weights
stay as they were.

Checked here on the emulator (cuda_core/cuda/emulator: an e4m3 type with
CUDA's rounding and saturation, and a float64 reference GEMM that reads fp8
operands and their scale pointers):
  - the quantize kernels against PyTorch's float8_e4m3fn rounding (bitwise);
  - one projection against float64: within 1e-2 of max |out| of the
    product of the dequantized operands (what differs is the bf16 rounding
    of the output), and within 0.1 of max |out| of the unquantized product
    (e4m3 keeps 3 mantissa bits: each operand is off by up to 2^-4 relative;
    measured 0.035 on these inputs);
  - training steps with fp8 against bf16: losses within FP8_LOSS_REL;
  - the memory plan holds the fp8 operand buffer.
On a GPU (marked gpu): the same steps, and 200 steps of the demo whose final
loss must be within FP8_CURVE_ABS of the bf16 run's (bench/gpu_check.sh runs it).
"""

import ctypes
import os
import re

import numpy as np
import pytest
import torch

import nanoq
from nanoq.memory import estimate_memory
from conftest import CUDA_BACKENDS, assert_array_close, random_batch, require_cuda_emulator, use_cuda_backend

E4M3_MAX = np.float32(448.0)
CUDA_R_16BF, CUDA_R_8F_E4M3 = 14, 28
# Relative difference of the loss, fp8 against bf16, over the steps below
# (measured up to 4.2e-3 on the emulator).
FP8_LOSS_REL = 1.5e-2


def bf16(x):
    """x rounded to the nearest bf16 (ties to even), as float32."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def reference_quantize(x):
    """(e4m3 bytes, inverse scale) of float32 x, as the kernels define them,
    computed with PyTorch's float8_e4m3fn (round to nearest even; it does not
    saturate, so the values are clamped to +-448 first)."""
    x = np.asarray(x, np.float32)
    amax = np.float32(np.nanmax(np.abs(x))) if x.size else np.float32(0)
    scale = E4M3_MAX / amax if amax > 0 and np.isfinite(amax) else np.float32(1)
    scaled = np.clip(x * scale, -E4M3_MAX, E4M3_MAX)  # float32 product, as on the device
    codes = torch.from_numpy(scaled).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return codes, np.float32(1) / scale


def decode(codes):
    return torch.from_numpy(np.asarray(codes, np.uint8)).view(torch.float8_e4m3fn).to(torch.float64).numpy()


@pytest.fixture(scope="module")
def probes():
    require_cuda_emulator()
    nanoq.backends()  # loads the emulated backend's library through the core
    lib = ctypes.CDLL(os.path.join(os.path.dirname(nanoq._core.__file__), "libnanoq_cuda_emulated.so"))
    lib.nanoq_emu_fp8_quantize.restype = ctypes.c_int
    lib.nanoq_emu_fp8_projection.restype = ctypes.c_int
    return lib


def float_ptr(a):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if a is not None else None


def quantize(probes, x, bf16_input):
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros(len(x), np.uint8)
    floats = np.zeros(2, np.float32)
    message = ctypes.create_string_buffer(4096)
    status = probes.nanoq_emu_fp8_quantize(float_ptr(x), ctypes.c_long(len(x)), int(bf16_input),
                                           out.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte)), float_ptr(floats),
                                           message, 4096)
    assert status == 0, message.value.decode()
    return out, floats[0], floats[1]


def project(probes, a, b, bias=None):
    M, K = a.shape
    N = b.shape[0]
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    bias = None if bias is None else np.ascontiguousarray(bias, np.float32)
    out = np.zeros((M, N), np.float32)
    message = ctypes.create_string_buffer(4096)
    status = probes.nanoq_emu_fp8_projection(M, N, K, float_ptr(a), float_ptr(b), float_ptr(bias), float_ptr(out),
                                             message, 4096)
    assert status == 0, message.value.decode()
    return out


def values_to_quantize(rng):
    """Normal values over many magnitudes (down to e4m3's subnormals once
    scaled), zeros, and a maximum that is not a power of two."""
    x = rng.standard_normal(4000).astype(np.float32) * np.float32(3.7)
    x[::7] *= np.float32(1e-3)
    x[::11] *= np.float32(1e-5)
    x[5:40] = 0.0
    x[100] = -17.25
    return x


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("bf16_input", [False, True], ids=["float32", "bf16"])
def test_quantize_rounds_to_e4m3_as_pytorch_does(probes, bf16_input):
    x = values_to_quantize(np.random.default_rng(0))
    if bf16_input:
        x = bf16(x)
    codes, amax, inverse = quantize(probes, x, bf16_input)
    want_codes, want_inverse = reference_quantize(x)
    assert amax == np.abs(x).max()
    assert inverse == want_inverse
    mismatch = np.flatnonzero(codes != want_codes)
    assert mismatch.size == 0, f"{mismatch.size} codes differ, first at {mismatch[0]}: x={x[mismatch[0]]!r} " \
                               f"-> {codes[mismatch[0]]:#x}, PyTorch {want_codes[mismatch[0]]:#x}"
    assert codes[np.argmax(np.abs(x))] & 0x7F == 0x7E  # the maximum lands on 448


@pytest.mark.cuda_emulated
def test_quantize_keeps_every_e4m3_value_and_its_special_cases(probes):
    finite = decode(np.arange(256, dtype=np.uint8)).astype(np.float32)
    finite = finite[np.isfinite(finite)]  # 254 values (0x7f, 0xff are NaN); 448 is the max: scale 1
    codes, amax, inverse = quantize(probes, finite, False)
    np.testing.assert_array_equal(decode(codes), finite.astype(np.float64))
    assert amax == 448.0 and inverse == 1.0
    zeros, amax, inverse = quantize(probes, np.zeros(64, np.float32), False)
    assert not zeros.any() and amax == 0.0 and inverse == 1.0  # nothing to scale
    with_nan, _, _ = quantize(probes, np.array([1.0, np.nan, -np.nan, 2.0], np.float32), False)
    assert with_nan[1] & 0x7F == 0x7F and with_nan[2] & 0x7F == 0x7F  # NaN stays NaN
    assert with_nan[3] == 0x7E  # the maximum ignores the NaN


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_fp8_projection_matches_float64(probes, capfd, monkeypatch, with_bias):
    monkeypatch.setenv("NANOQ_MATMUL_LOG", "1")
    rng = np.random.default_rng(1)
    M, N, K = 48, 32, 64
    a, b = bf16(rng.standard_normal((M, K)) * 2.0), bf16(rng.standard_normal((N, K)) * 0.05)
    bias = bf16(rng.standard_normal(N) * 0.5) if with_bias else None
    out = project(probes, a, b, bias)
    plans = [line for line in capfd.readouterr().err.splitlines() if "nanoq matmul plan" in line]
    assert any(f"types={CUDA_R_16BF}/{CUDA_R_8F_E4M3}/{CUDA_R_8F_E4M3}" in p for p in plans), plans
    bias64 = 0.0 if bias is None else bias.astype(np.float64)
    qa, ia = reference_quantize(a)
    qb, ib = reference_quantize(b)
    dequantized = (decode(qa).reshape(M, K) * ia) @ (decode(qb).reshape(N, K) * ib).T + bias64
    assert_array_close(out, dequantized, 1e-2, "fp8 product vs its dequantized operands")
    exact = a.astype(np.float64) @ b.T.astype(np.float64) + bias64
    assert_array_close(out, exact, 0.1, "fp8 product vs the unquantized product")


@pytest.mark.cuda_emulated
def test_a_projection_off_the_fp8_tiles_runs_in_bf16(probes, capfd, monkeypatch):
    """M = 24 is not a multiple of 16: cuBLASLt's fp8 kernels refuse it, the bf16 matmul runs."""
    monkeypatch.setenv("NANOQ_MATMUL_LOG", "1")
    rng = np.random.default_rng(2)
    a, b = bf16(rng.standard_normal((24, 32))), bf16(rng.standard_normal((16, 32)))
    out = project(probes, a, b)
    plans = [line for line in capfd.readouterr().err.splitlines() if "nanoq matmul plan 24x16x32" in line]
    assert plans and all(f"types={CUDA_R_16BF}/{CUDA_R_16BF}/{CUDA_R_16BF}" in p for p in plans), plans
    assert_array_close(out, a.astype(np.float64) @ b.T, 1e-2, "bf16 product")


# --------------------------------------------------------------------------
# Training with fp8 projections
# --------------------------------------------------------------------------


def train_losses(checkpoint, backend, matmul_dtype, steps, rng_seed=0, batch_size=4):
    options = nanoq.TrainOptions(backend=backend, dtype="bf16", batch_size=batch_size, seq_len=16, seed=0,
                                 matmul_dtype=matmul_dtype)
    rng = np.random.default_rng(rng_seed)
    batches = [random_batch(rng, batch_size) for _ in range(steps)]
    held_out = random_batch(rng, batch_size)
    losses = []
    with nanoq.Trainer(nanoq.ModelConfig.from_pretrained(checkpoint), options) as trainer:
        trainer.import_weights(checkpoint)
        for inputs, targets in batches:
            trainer.step(inputs, targets)
            trainer.update(lr=3e-3)
            losses.append(trainer.validate(*held_out).loss)
        allocations = trainer.get_allocations(0)
    return np.array(losses), allocations


@pytest.fixture(params=[pytest.param(name, marks=mark, id=name) for name, mark in CUDA_BACKENDS])
def backend(request):
    return use_cuda_backend(request.param, request)


@pytest.mark.parametrize("variant", ["qwen2"])  # q/k/v biases: the fp8 product's epilogue
def test_fp8_training_steps_follow_bf16(checkpoints, backend, capfd, monkeypatch, variant):
    monkeypatch.setenv("NANOQ_MATMUL_LOG", "1")
    checkpoint = checkpoints.path(variant)
    fp8, allocations = train_losses(checkpoint, backend, "fp8", steps=4)
    plans = [line for line in capfd.readouterr().err.splitlines() if "nanoq matmul plan" in line]
    reference, plain = train_losses(checkpoint, backend, "auto", steps=4)
    assert np.all(np.isfinite(fp8))
    np.testing.assert_allclose(fp8, reference, rtol=FP8_LOSS_REL)
    assert not np.array_equal(fp8, reference), "fp8 computed bitwise as bf16: did the fp8 path run?"
    fp8_plans = [p for p in plans if f"/{CUDA_R_8F_E4M3}/{CUDA_R_8F_E4M3}" in p]
    # q, k, v (with bias), o, gate, up and down: the shapes of the tiny model (rows 64).
    shapes = {re.search(r"plan (\d+x\d+x\d+)", p).group(1) for p in fp8_plans}
    assert {"64x32x32", "64x16x32", "64x64x32", "64x32x64"} <= shapes, shapes
    assert not any(re.search(r"plan \d+x128x32 .*/28/28", p) for p in plans), "the classifier ran in fp8"
    names = {a["name"] for a in allocations}
    assert "fp8-operands" in names and "fp8-operands" not in {a["name"] for a in plain}


@pytest.mark.cuda_emulated
def test_the_memory_plan_holds_the_fp8_operands(checkpoints):
    config = nanoq.ModelConfig.from_pretrained(checkpoints.path("qwen2"))
    kwargs = dict(backend="cuda_emulated", dtype="bf16", batch_size=4, seq_len=16)
    fp8 = estimate_memory(config, nanoq.TrainOptions(matmul_dtype="fp8", **kwargs)).allocations
    plain = estimate_memory(config, nanoq.TrainOptions(**kwargs)).allocations
    segment = [a for a in fp8 if a.name == "fp8-operands"]
    # 256 bytes of scales, the widest input (64 rows x 64) and the largest packed weight (gate|up: 2 x 64 x 32).
    assert len(segment) == 1 and segment[0].bytes == 256 + 64 * 64 + 2 * 64 * 32 and segment[0].kind == "device"
    assert not [a for a in plain if a.name == "fp8-operands"]
    # The trainer allocates what the plan holds.
    with nanoq.Trainer(config, nanoq.TrainOptions(matmul_dtype="fp8", **kwargs)) as trainer:
        [allocated] = [a for a in trainer.get_allocations(0) if a["name"] == "fp8-operands"]
    assert allocated["bytes"] == segment[0].bytes


# The demo (its default model: hidden 256, 4 layers, seq 128, batch 16) for
# 200 steps: the fp8 run's final eval loss within this many nats of bf16's.
FP8_CURVE_ABS = 0.05
CURVE_STEPS = 200


@pytest.mark.gpu
def test_fp8_demo_loss_curve_follows_bf16(tmp_path, cuda_device):
    """bench/gpu_check.sh runs this with the other gpu tests (`pytest -m gpu`)."""
    from nanoq.training import TrainConfig, train

    results = {}
    for matmul_dtype in ("auto", "fp8"):
        config = TrainConfig(backend="cuda", dtype="bf16", matmul_dtype=matmul_dtype, steps=CURVE_STEPS,
                             eval_every=50, eval_batches=8, seed=0, out_dir=str(tmp_path / matmul_dtype))
        results[matmul_dtype] = train(config, say=lambda line: None)
    bf16_run, fp8_run = results["auto"], results["fp8"]
    first_eval = bf16_run.evals[0][1]
    assert bf16_run.final_eval_loss < first_eval - 1.0, "the bf16 run did not learn"
    assert abs(fp8_run.final_eval_loss - bf16_run.final_eval_loss) <= FP8_CURVE_ABS, (
        f"fp8 final eval loss {fp8_run.final_eval_loss:.4f} vs bf16 {bf16_run.final_eval_loss:.4f}")
    for (step, fp8_loss), (_, bf16_loss) in zip(fp8_run.evals, bf16_run.evals):
        assert abs(fp8_loss - bf16_loss) <= 2 * FP8_CURVE_ABS, f"step {step}: fp8 {fp8_loss:.4f} vs bf16 {bf16_loss:.4f}"
