"""fp8 matmuls: TrainOptions.matmul_dtype = "fp8" on the cuda backend.

What runs in fp8 (cuda_backend.cpp): the projections (q/k/v, o, gate/up,
down) forward and backward, every operand quantized with its own current
scale (max / its absolute maximum, kernels_fp8.cu) and multiplied by
cuBLASLt in the "TN" layout its fp8 kernels take:
  - forward (CudaBackend::fp8_projection): x[M,K] @ W[N,K]^T, both e4m3,
    into bf16, bias in the epilogue, in cuBLASLt's fp8 fast accumulation
    mode (NANOQ_FP8_FAST_ACCUM=0: promoting, as the gradients' products do);
  - dgrad (matmul_input_grad): dx = dy W, dy in e5m2 (gradients need the
    range), W^T quantized transposed to e4m3, accumulating into dx;
  - wgrad (matmul_weight_grad): dW += dy^T x, dy^T in e5m2 and x^T in e4m3
    (both quantized transposed), beta 1 into the float32 or bf16 gradient;
    the bias gradient stays bf16;
  - within one composite each tensor is quantized once per form:
    matmul_backward writes dy and dy^T in one pass (fp8_quantize_both), and
    gate|up quantizes x once for its two products and x^T once for its two
    weight gradients;
  - producer maxima: where the kernel that wrote an operand took its
    maximum on the way (SwiGLU forward and backward, the norms forward and
    backward, the pass that packs the q|k|v gradient) and no other op has
    run since, the quantization takes that
    maximum instead of a pass of its own;
  - forward maxima: a weight gradient's x^T takes the maximum the
    forward's quantization of the same x kept (the model names the value,
    Backend::projection_input).
The classifier, attention, the adapters, the optimizer and master weights
stay as they were.

Checked here on the emulator (cuda_core/cuda/emulator: e4m3/e5m2 types with
CUDA's rounding and saturation, and a float64 reference GEMM that reads fp8
operands and their scale pointers and refuses what Hopper's fp8 kernels
refuse):
  - the quantize kernels, plain, transposing and both at once, against
    PyTorch's float8_e4m3fn and float8_e5m2 rounding (bitwise);
  - the composites' reuse: the number of quantization passes, and outputs
    bitwise as the products apart;
  - one projection, and one dgrad/wgrad pair, against float64: within 1e-2
    of max |out| of the product of the dequantized operands where the output
    is bf16 (its rounding is what differs), 1e-6 where it is float32; and
    within 0.1 (forward, e4m3 x e4m3) or 0.2 (backward: e5m2 keeps 2
    mantissa bits, 2^-3 relative per element) of max |out| of the
    unquantized product;
  - training steps with fp8 against bf16: losses within FP8_LOSS_REL, and
    one step's gradients within FP8_GRAD_REL;
  - the memory plan holds the fp8 operand buffer, and the weight cache;
  - the weight cache (each weight's e4m3 copies quantized once per update):
    training bitwise as quantizing on every call, across updates, with
    graphs, recomputation and ZeRO-1, none at ZeRO-3; weights set between
    two captured validations are quantized again;
  - producer maxima: the passes that take them (none where another op
    wrote the operand in between), outputs bitwise as with
    NANOQ_FP8_PRODUCER_MAXIMA=0 and as float64 gives from the operands' own
    scales, and training bitwise as without them;
  - forward maxima: taken only where the forward defined the site, outputs
    bitwise as without, and training bitwise as NANOQ_FP8_FORWARD_MAXIMA=0;
  - fast accumulation: set on the forward product's descriptor only (the
    emulated cuBLASLt counts the products of each mode; it computes both
    alike, so its precision on the device is left to the GPU tests below).
On a GPU (marked gpu): the same steps and gradients, and 200 steps of the
demo whose final loss must be within FP8_CURVE_ABS of the bf16 run's
(bench/gpu_check.sh runs it).
"""

import ctypes
import os
import re

import numpy as np
import pytest
import torch

import nanoq
from nanoq.memory import estimate_memory
from conftest import (CUDA_BACKENDS, assert_array_close, random_batch, require_cuda_emulator, rope_table,
                      use_cuda_backend)

FORMATS = {"e4m3": (np.float32(448.0), torch.float8_e4m3fn), "e5m2": (np.float32(57344.0), torch.float8_e5m2)}
CUDA_R_32F, CUDA_R_16BF, CUDA_R_8F_E4M3, CUDA_R_8F_E5M2 = 0, 14, 28, 29
# Relative difference of the loss, fp8 against bf16, over the steps below
# (forward only in fp8 it measured up to 4.2e-3 on the emulator; with the
# backward in fp8 too, up to 4.6e-3).
FP8_LOSS_REL = 1.5e-2
# One step's gradients, fp8 against bf16, per parameter: the norm of the
# difference within FP8_GRAD_REL of the bf16 gradient's norm plus
# FP8_GRAD_ABS (measured up to 0.24 relative on the emulator's tiny model,
# where per-tensor scales of a few thousand elements do not average out:
# e5m2 rounds each gradient element by up to 12.5 %, e4m3 each operand by up
# to 6 %, and the errors compound through the layers). The absolute part is
# for k_proj.bias, whose exact gradient is zero (attention does not change
# when every key moves by the same vector): what is computed is rounding
# noise, measured 0.012 in norm.
FP8_GRAD_REL = 0.35
FP8_GRAD_ABS = 0.02


def bf16(x):
    """x rounded to the nearest bf16 (ties to even), as float32."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def reference_quantize(x, fmt="e4m3"):
    """(fp8 bytes, inverse scale) of float32 x, as the kernels define them,
    computed with PyTorch's float8 types (round to nearest even; they do not
    saturate, so the values are clamped to the format's largest first)."""
    largest, dtype = FORMATS[fmt]
    x = np.asarray(x, np.float32)
    amax = np.float32(np.nanmax(np.abs(x))) if x.size else np.float32(0)
    with np.errstate(over="ignore"):  # a tiny maximum: the scale is held to 2^126
        scale = min(np.float32(largest) / amax, np.float32(2.0**126)) if amax > 0 and np.isfinite(amax) else np.float32(1)
    scaled = np.clip(x * scale, -largest, largest)  # float32 product, as on the device
    codes = torch.from_numpy(scaled).to(dtype).view(torch.uint8).numpy()
    # An infinite maximum (an overflow in x): NaN, so that the product is NaN as bf16's would be non-finite.
    return codes, np.float32(np.nan) if np.isinf(amax) else np.float32(1) / scale


def decode(codes, fmt="e4m3"):
    return torch.from_numpy(np.asarray(codes, np.uint8)).view(FORMATS[fmt][1]).to(torch.float64).numpy()


def fp8_value(x, fmt):
    """x as the fp8 product sees it: its codes decoded, times the inverse scale (float64)."""
    codes, inverse = reference_quantize(x, fmt)
    return decode(codes, fmt).reshape(np.shape(x)) * np.float64(inverse)


@pytest.fixture(scope="module")
def probes():
    require_cuda_emulator()
    nanoq.backends()  # loads the emulated backend's library through the core
    lib = ctypes.CDLL(os.path.join(os.path.dirname(nanoq._core.__file__), "libnanoq_cuda_emulated.so"))
    lib.nanoq_emu_fp8_quantize.restype = ctypes.c_int
    lib.nanoq_emu_fp8_projection.restype = ctypes.c_int
    lib.nanoq_emu_fp8_backward.restype = ctypes.c_int
    lib.nanoq_emu_fp8_gate_up.restype = ctypes.c_int
    lib.nanoq_emu_fp8_mlp.restype = ctypes.c_int
    lib.nanoq_emu_fp8_norms.restype = ctypes.c_int
    return lib


def f32(a):
    return np.ascontiguousarray(a, np.float32)


def float_ptr(a):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if a is not None else None


def quantize(probes, x, bf16_input, fmt="e4m3", transposed=False, offset=0):
    """(bytes, amax, inverse scale) of the kernels for x (1-D, or 2-D
    [rows, cols]; with `transposed` the bytes are [cols, rows]; with
    transposed="both", fp8_quantize_both's pair (plain [rows, cols],
    transposed [cols, rows])); `offset` elements into the device buffers (off
    their 16-byte alignment)."""
    x = np.ascontiguousarray(x, np.float32)
    rows, cols = x.shape if x.ndim == 2 else (1, x.size)
    both = transposed == "both"
    transposed = 2 if both else int(transposed)
    out = np.zeros(2 * x.size if both else x.size, np.uint8)
    floats = np.zeros(2, np.float32)
    message = ctypes.create_string_buffer(4096)
    status = probes.nanoq_emu_fp8_quantize(float_ptr(x), rows, cols, int(bf16_input), int(fmt == "e5m2"),
                                           int(transposed), offset,
                                           out.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte)),
                                           float_ptr(floats), message, 4096)
    assert status == 0, message.value.decode()
    if both:
        return (out[:x.size].reshape(rows, cols), out[x.size:].reshape(cols, rows)), floats[0], floats[1]
    return (out.reshape(cols, rows) if transposed else out), floats[0], floats[1]


def project(probes, a, b, bias=None, out_offset=0, bias_offset=0):
    """a @ b.T (+ bias) through the fp8-configured backend's projection;
    out and bias `out_offset` and `bias_offset` bf16 elements into their
    device buffers."""
    M, K = a.shape
    N = b.shape[0]
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    bias = None if bias is None else np.ascontiguousarray(bias, np.float32)
    out = np.zeros((M, N), np.float32)
    message = ctypes.create_string_buffer(4096)
    status = probes.nanoq_emu_fp8_projection(M, N, K, float_ptr(a), float_ptr(b), float_ptr(bias), float_ptr(out),
                                             out_offset, bias_offset, message, 4096)
    assert status == 0, message.value.decode()
    return out


# Off the element-wise kernel's tiles, thinner than one, and the vectorised kernel's shapes (within one of its
# tiles, and across them with part tiles).
SHAPES_TO_TRANSPOSE = ((37, 45), (5, 70), (48, 40), (272, 72))


def matrix_to_quantize(rng, rows, cols):
    return np.resize(values_to_quantize(rng), rows * cols).reshape(rows, cols)


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
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("bf16_input", [False, True], ids=["float32", "bf16"])
def test_quantize_rounds_as_pytorch_does(probes, bf16_input, fmt):
    x = values_to_quantize(np.random.default_rng(0))
    if bf16_input:
        x = bf16(x)
    codes, amax, inverse = quantize(probes, x, bf16_input, fmt)
    want_codes, want_inverse = reference_quantize(x, fmt)
    assert amax == np.abs(x).max()
    assert inverse == want_inverse
    mismatch = np.flatnonzero(codes != want_codes)
    assert mismatch.size == 0, f"{mismatch.size} codes differ, first at {mismatch[0]}: x={x[mismatch[0]]!r} " \
                               f"-> {codes[mismatch[0]]:#x}, PyTorch {want_codes[mismatch[0]]:#x}"
    largest_code = 0x7E if fmt == "e4m3" else 0x7B  # 448, 57344
    assert codes[np.argmax(np.abs(x))] & 0x7F == largest_code  # the maximum lands on the format's largest


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("bf16_input", [False, True], ids=["float32", "bf16"])
def test_quantize_reads_whole_chunks_and_tails_and_unaligned_operands_alike(probes, bf16_input):
    """The kernels read 16-byte chunks where the pointers allow: lengths with
    and without a tail past the last whole chunk, tensors smaller than one
    chunk, and operands off the alignment (element by element) all give the
    reference codes and maximum; the maximum anywhere (in a chunk, in the
    tail, in the first or last element) is found."""
    rng = np.random.default_rng(11)
    for n in (4096, 4099, 3, 8, 517):
        for offset in (0, 1, 3):
            for peak in (0, n - 1, n // 2):
                x = rng.standard_normal(n).astype(np.float32)
                x[peak] = np.float32(-40.5)
                if bf16_input:
                    x = bf16(x)
                codes, amax, inverse = quantize(probes, x, bf16_input, offset=offset)
                want_codes, want_inverse = reference_quantize(x)
                assert amax == np.abs(x).max() == np.float32(40.5), (n, offset, peak)
                assert inverse == want_inverse
                np.testing.assert_array_equal(codes, want_codes, err_msg=f"n={n} offset={offset}")


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_transposed_writes_the_transpose_of_the_same_codes(probes, fmt):
    """The element-wise kernel on shapes off its 32 x 32 tiles on both sides
    (37 x 45) and thinner than a tile (5 x 70), and the vectorised one
    (rows % 16, cols % 8, aligned: the fp8 products' shapes) on less than
    one of its 256 x 64 tiles (48 x 40) and across tiles both ways, with a
    part tile at each end (272 x 72): every element lands at [c, r] with the
    codes and scale of the plain quantization of the whole tensor."""
    rng = np.random.default_rng(3)
    for rows, cols in SHAPES_TO_TRANSPOSE:
        x = bf16(matrix_to_quantize(rng, rows, cols))
        codes, amax, inverse = quantize(probes, x, True, fmt, transposed=True)
        want_codes, want_inverse = reference_quantize(x, fmt)
        assert codes.shape == (cols, rows)
        np.testing.assert_array_equal(codes, want_codes.reshape(rows, cols).T)
        assert amax == np.abs(x).max() and inverse == want_inverse


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("bf16_input", [False, True], ids=["float32", "bf16"])
def test_quantize_both_writes_the_plain_and_transposed_codes_of_one_scale(probes, bf16_input, fmt):
    """fp8_quantize_both (the backward's dy for dgrad and wgrad): its two
    forms are bitwise the plain and the transposing kernels' codes, with their
    maximum and scale, on the shapes of the transposing test, and off the
    16-byte alignment."""
    rng = np.random.default_rng(7)
    for (rows, cols), offset in [(shape, 0) for shape in SHAPES_TO_TRANSPOSE] + [((48, 32), 3)]:
        x = matrix_to_quantize(rng, rows, cols)
        if bf16_input:
            x = bf16(x)
        (plain, transposed), amax, inverse = quantize(probes, x, bf16_input, fmt, transposed="both", offset=offset)
        want_plain, want_amax, want_inverse = quantize(probes, x, bf16_input, fmt, offset=offset)
        want_transposed, _, _ = quantize(probes, x, bf16_input, fmt, transposed=True, offset=offset)
        np.testing.assert_array_equal(plain, want_plain.reshape(rows, cols))
        np.testing.assert_array_equal(transposed, want_transposed)
        assert amax == want_amax == np.abs(x).max() and inverse == want_inverse
        np.testing.assert_array_equal(plain, reference_quantize(x, fmt)[0].reshape(rows, cols))


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
@pytest.mark.parametrize("bf16_input", [False, True])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_keeps_an_overflow_and_a_tiny_tensor_apart_from_nan(probes, bf16_input, fmt):
    """An infinity in x (an overflow upstream) gives a NaN inverse scale: the
    saturating codes alone would make the product finite and hide it. A
    tensor whose maximum is below largest / FLT_MAX (bf16 holds such values)
    gets a finite scale (at most 2^126), not an infinite one that would turn
    its zeros into NaN."""
    largest = FORMATS[fmt][0]
    overflow = np.array([1.0, np.inf, -2.0, 0.0] * 8, np.float32)
    for transposed in (False, True, "both"):
        x = overflow.reshape(2, 16) if transposed else overflow
        _, amax, inverse = quantize(probes, x, bf16_input, fmt, transposed)
        assert np.isinf(amax) and np.isnan(inverse), (transposed, amax, inverse)
    tiny = np.zeros(32, np.float32)
    tiny[::5] = np.float32(2.0**-127) * np.array([1, -1, 1, -1, 1, 1, -1], np.float32)
    tiny = bf16(tiny) if bf16_input else tiny
    with np.errstate(over="ignore"):
        assert np.float32(largest) / np.abs(tiny).max() == np.inf  # the unclamped scale would be infinite
    codes, amax, inverse = quantize(probes, tiny, bf16_input, fmt)
    expected, expected_inverse = reference_quantize(tiny, fmt)
    assert amax == np.abs(tiny).max() and inverse == expected_inverse == np.float32(2.0**-126)
    np.testing.assert_array_equal(codes, expected)
    values = decode(codes, fmt) * np.float64(inverse)
    assert np.isfinite(values).all() and not values[tiny == 0].any()
    np.testing.assert_allclose(values, tiny, rtol=0.15)


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


PROJECTION_32x16x48 = "nanoq matmul plan 32x16x48"


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("out_offset, bias_offset", [(4, None), (4, 8), (8, 4)],
                         ids=["output-nobias", "output", "bias"])
def test_a_projection_whose_output_or_bias_is_off_16_bytes_runs_in_bf16(probes, capfd, monkeypatch, out_offset,
                                                                         bias_offset):
    """cuBLASLt's fp8 kernels need every matrix and the bias 16-byte aligned
    (the emulated library refuses others, as the real one finds no
    algorithm): an output or a bias 4 bf16 elements (8 bytes) into its
    buffer runs the bf16 matmul instead of failing; 8 elements in, fp8."""
    monkeypatch.setenv("NANOQ_MATMUL_LOG", "1")
    rng = np.random.default_rng(3)
    a, b = bf16(rng.standard_normal((32, 48))), bf16(rng.standard_normal((16, 48)))
    bias = None if bias_offset is None else bf16(rng.standard_normal(16))
    out = project(probes, a, b, bias, out_offset, bias_offset or 0)
    plans = [line for line in capfd.readouterr().err.splitlines() if PROJECTION_32x16x48 in line]
    assert plans and all(f"types={CUDA_R_16BF}/{CUDA_R_16BF}/{CUDA_R_16BF}" in p for p in plans), plans
    assert_array_close(out, a.astype(np.float64) @ b.T + (0.0 if bias is None else bias), 1e-2, "bf16 product")
    aligned = project(probes, a, b, bias, 8, 0 if bias is None else 8)
    plans = [line for line in capfd.readouterr().err.splitlines() if PROJECTION_32x16x48 in line]
    assert any(f"types={CUDA_R_16BF}/{CUDA_R_8F_E4M3}/{CUDA_R_8F_E4M3}" in p for p in plans), plans
    assert_array_close(aligned, out, 0.1, "fp8 product vs bf16")


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("dweight_dtype", ["float32", "bf16"])
def test_gradients_whose_outputs_are_off_16_bytes_run_in_bf16(probes, capfd, monkeypatch, dweight_dtype):
    """dx and dweight 8 bytes into their buffers: the input and weight
    gradients run the bf16 matmuls (cuBLASLt's fp8 kernels would find no
    algorithm), with the bf16 products' results."""
    monkeypatch.setenv("NANOQ_MATMUL_LOG", "1")
    rng = np.random.default_rng(5)
    rows, n, k = 48, 32, 64
    dy = bf16(rng.standard_normal((rows, n)) * 1e-2)
    weight, x = bf16(rng.standard_normal((n, k)) * 0.05), bf16(rng.standard_normal((rows, k)))
    dx, dweight = backward(probes, dy, weight, x, dweight_f32=dweight_dtype == "float32", offset_bytes=8)
    plans = [line for line in capfd.readouterr().err.splitlines() if "nanoq matmul plan" in line]
    assert plans and not any(f"/{CUDA_R_8F_E5M2}/" in p for p in plans), plans
    assert_array_close(dx, dy.astype(np.float64) @ weight, 1e-2, "bf16 dgrad")
    assert_array_close(dweight, dy.T.astype(np.float64) @ x, 1e-2, "bf16 wgrad")


def backward(probes, dy, weight, x, dx=None, dweight=None, dweight_f32=True, joint=False, passes=None,
             offset_bytes=0):
    """(dx, dweight) of the probe: dx = dy @ weight (+ dx), dweight + dy^T x,
    as one matmul_backward with `joint`, else as matmul_input_grad and
    matmul_weight_grad; `passes` (a list) gets the number of quantization
    passes the backend made; dx and dweight lie `offset_bytes` into their
    device buffers."""
    rows, n = dy.shape
    k = weight.shape[1]
    dx_io = np.array(np.zeros((rows, k)) if dx is None else dx, np.float32)  # copies: written in place
    dweight_io = np.array(np.zeros((n, k)) if dweight is None else dweight, np.float32)
    message = ctypes.create_string_buffer(4096)
    count = ctypes.c_int(-1)
    status = probes.nanoq_emu_fp8_backward(rows, n, k, float_ptr(f32(dy)), float_ptr(f32(weight)), float_ptr(f32(x)),
                                           float_ptr(dx_io), int(dx is not None), float_ptr(dweight_io),
                                           int(dweight_f32), int(joint), offset_bytes, ctypes.byref(count),
                                           message, 4096)
    assert status == 0, message.value.decode()
    if passes is not None:
        passes.append(count.value)
    return dx_io, dweight_io


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("dweight_dtype", ["float32", "bf16"])
def test_fp8_backward_matches_float64(probes, capfd, monkeypatch, dweight_dtype):
    """dgrad dx += dy W (e5m2 x e4m3 into bf16) and wgrad dW += dy^T x (e5m2 x
    e4m3 into the gradient's dtype), both accumulating into what was there."""
    monkeypatch.setenv("NANOQ_MATMUL_LOG", "1")
    rng = np.random.default_rng(4)
    rows, n, k = 48, 32, 64
    dy = bf16(rng.standard_normal((rows, n)) * 1e-3)  # gradients: small, as in training
    weight, x = bf16(rng.standard_normal((n, k)) * 0.05), bf16(rng.standard_normal((rows, k)))
    dx0 = bf16(rng.standard_normal((rows, k)) * 1e-5)
    dweight0 = rng.standard_normal((n, k)).astype(np.float32) * np.float32(1e-3)
    if dweight_dtype == "bf16":
        dweight0 = bf16(dweight0)
    dx, dweight = backward(probes, dy, weight, x, dx0, dweight0, dweight_f32=dweight_dtype == "float32")
    out_type = CUDA_R_32F if dweight_dtype == "float32" else CUDA_R_16BF
    types = capfd.readouterr().err
    assert f"plan {rows}x{k}x{n} trans_a=0 trans_b=1 accumulate=1 types={CUDA_R_16BF}/{CUDA_R_8F_E5M2}/" \
           f"{CUDA_R_8F_E4M3}" in types, types
    assert f"plan {n}x{k}x{rows} trans_a=0 trans_b=1 accumulate=1 types={out_type}/{CUDA_R_8F_E5M2}/" \
           f"{CUDA_R_8F_E4M3}" in types, types
    # From the same quantized operands: dy in e5m2, W^T in e4m3 (its codes and
    # scale are W's), dy^T in e5m2, x^T in e4m3.
    want_dx = dx0 + fp8_value(dy, "e5m2") @ fp8_value(weight, "e4m3")
    want_dweight = dweight0 + fp8_value(dy, "e5m2").T @ fp8_value(x, "e4m3")
    assert_array_close(dx, want_dx, 1e-2, "fp8 dgrad vs its dequantized operands")
    assert_array_close(dweight, want_dweight, 1e-6 if dweight_dtype == "float32" else 1e-2,
                       "fp8 wgrad vs its dequantized operands")
    exact_dx = dx0 + dy.astype(np.float64) @ weight
    exact_dweight = dweight0 + dy.T.astype(np.float64) @ x
    assert_array_close(dx, exact_dx, 0.2, "fp8 dgrad vs the unquantized product")
    assert_array_close(dweight, exact_dweight, 0.2, "fp8 wgrad vs the unquantized product")


def fp8_products(probes):
    """(fast, promoting): the fp8 products the emulated cuBLASLt has queued in this process."""
    probes.nanoq_emu_lt_fp8_products.restype = ctypes.c_ulonglong
    return probes.nanoq_emu_lt_fp8_products(1), probes.nanoq_emu_lt_fp8_products(0)


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("switch", ["default", "0", "1"])
def test_forward_products_accumulate_fast_and_gradient_products_promote(probes, capfd, monkeypatch, switch):
    """The forward product runs in cuBLASLt's fp8 fast accumulation mode (its
    descriptor says so, and so does its plan), dgrad and wgrad promote;
    NANOQ_FP8_FAST_ACCUM=0 promotes in the forward too."""
    monkeypatch.setenv("NANOQ_MATMUL_LOG", "1")
    if switch != "default":
        monkeypatch.setenv("NANOQ_FP8_FAST_ACCUM", switch)
    fast = switch != "0"
    rng = np.random.default_rng(6)
    rows, n, k = 48, 32, 64
    start = fp8_products(probes)
    project(probes, bf16(rng.standard_normal((rows, k))), bf16(rng.standard_normal((n, k)) * 0.05))
    after_forward = fp8_products(probes)
    backward(probes, bf16(rng.standard_normal((rows, n)) * 1e-3), bf16(rng.standard_normal((n, k)) * 0.05),
             bf16(rng.standard_normal((rows, k))))
    after_backward = fp8_products(probes)
    assert np.subtract(after_forward, start).tolist() == ([1, 0] if fast else [0, 1])
    assert np.subtract(after_backward, after_forward).tolist() == [0, 2]  # dgrad and wgrad
    plans = [line for line in capfd.readouterr().err.splitlines() if "nanoq matmul plan" in line]
    forward = [p for p in plans if p.startswith(f"nanoq matmul plan {rows}x{n}x{k} ")]
    grads = [p for p in plans if p.startswith((f"nanoq matmul plan {rows}x{k}x{n} ", f"nanoq matmul plan {n}x{k}x{rows} "))]
    assert len(forward) == 1 and forward[0].endswith(f"fast_accum={int(fast)}"), plans
    assert len(grads) == 2 and all(p.endswith("fast_accum=0") for p in grads), plans


@pytest.mark.cuda_emulated
def test_a_forward_product_without_a_fast_accumulation_kernel_promotes(probes, capfd, monkeypatch):
    """Fast accumulation is a speed hint: where cuBLASLt offers no such kernel
    (the emulator's NANOQ_EMU_LT_NO_FAST_ACCUM=1), the product promotes, says
    so once, and computes what it should."""
    monkeypatch.setenv("NANOQ_MATMUL_LOG", "1")
    monkeypatch.setenv("NANOQ_EMU_LT_NO_FAST_ACCUM", "1")
    rng = np.random.default_rng(7)
    a, b = bf16(rng.standard_normal((32, 64))), bf16(rng.standard_normal((16, 64)) * 0.05)
    start = fp8_products(probes)
    out = project(probes, a, b)
    assert np.subtract(fp8_products(probes), start).tolist() == [0, 1]
    err = capfd.readouterr().err
    assert err.count("nanoq: cuBLASLt has no fp8 fast-accumulation algorithm for the 32x16x64 product; it "
                     "promotes its partial sums instead") == 1, err
    assert re.search(r"nanoq matmul plan 32x16x64 .*fast_accum=0$", err, re.M), err
    qa, ia = reference_quantize(a)
    qb, ib = reference_quantize(b)
    dequantized = (decode(qa).reshape(a.shape) * ia) @ (decode(qb).reshape(b.shape) * ib).T
    assert_array_close(out, dequantized, 1e-2, "fp8 product vs its dequantized operands")


@pytest.mark.cuda_emulated
def test_a_bad_fast_accumulation_switch_is_refused(probes, monkeypatch):
    monkeypatch.setenv("NANOQ_FP8_FAST_ACCUM", "yes")
    with pytest.raises(AssertionError, match='NANOQ_FP8_FAST_ACCUM must be 0 or 1, got "yes"'):
        project(probes, np.ones((16, 16), np.float32), np.ones((16, 16), np.float32))


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("dweight_dtype", ["float32", "bf16"])
def test_matmul_backward_quantizes_dy_once_for_both_products(probes, dweight_dtype):
    """matmul_backward (each projection's backward in the model) writes dy's
    e5m2 codes as stored and transposed in one pass: three quantization
    passes (dy, W^T, x^T) where the two calls apart make four (dy twice),
    and bitwise the same dx and dweight."""
    rng = np.random.default_rng(5)
    rows, n, k = 48, 32, 64
    dy = bf16(rng.standard_normal((rows, n)) * 1e-3)
    weight, x = bf16(rng.standard_normal((n, k)) * 0.05), bf16(rng.standard_normal((rows, k)))
    dx0 = bf16(rng.standard_normal((rows, k)) * 1e-5)
    dweight0 = rng.standard_normal((n, k)).astype(np.float32) * np.float32(1e-3)
    if dweight_dtype == "bf16":
        dweight0 = bf16(dweight0)
    passes = []
    args = dict(dx=dx0, dweight=dweight0, dweight_f32=dweight_dtype == "float32", passes=passes)
    apart = backward(probes, dy, weight, x, joint=False, **args)
    joint = backward(probes, dy, weight, x, joint=True, **args)
    assert passes == [4, 3]
    for got, want, name in zip(joint, apart, ("dx", "dweight")):
        np.testing.assert_array_equal(got, want, name)


def gate_up(probes, x, weights, dgate, dup, joint):
    """(gate, up, dx, dgate_up, quantization passes) of the gate|up probe."""
    rows, channels = x.shape
    intermediate = weights.shape[0] // 2
    gate, up = np.zeros((rows, intermediate), np.float32), np.zeros((rows, intermediate), np.float32)
    dx, dweights = np.zeros((rows, channels), np.float32), np.zeros(weights.shape, np.float32)
    count = ctypes.c_int(-1)
    message = ctypes.create_string_buffer(4096)
    status = probes.nanoq_emu_fp8_gate_up(rows, intermediate, channels, float_ptr(f32(x)), float_ptr(f32(weights)),
                                          float_ptr(f32(dgate)), float_ptr(f32(dup)), float_ptr(gate), float_ptr(up),
                                          float_ptr(dx), float_ptr(dweights), int(joint), ctypes.byref(count),
                                          message, 4096)
    assert status == 0, message.value.decode()
    return gate, up, dx, dweights, count.value


@pytest.mark.cuda_emulated
def test_gate_up_quantizes_each_operand_once(probes):
    """gate|up in fp8 through its composites: the forward quantizes x once
    for both products (x, Wg, Wu: 3 passes where the products apart make 4),
    the backward dgate and dup once each for dgrad and wgrad and x^T once
    for both wgrads (5 where apart 8); every output bitwise as apart, and
    the products what their dequantized operands give."""
    rng = np.random.default_rng(6)
    rows, intermediate, channels = 32, 48, 32
    x = bf16(rng.standard_normal((rows, channels)))
    weights = bf16(rng.standard_normal((2 * intermediate, channels)) * 0.05)
    dgate, dup = (bf16(rng.standard_normal((rows, intermediate)) * 1e-3) for _ in range(2))
    apart = gate_up(probes, x, weights, dgate, dup, joint=False)
    joint = gate_up(probes, x, weights, dgate, dup, joint=True)
    assert (apart[-1], joint[-1]) == (12, 8)
    for got, want, name in zip(joint[:-1], apart[:-1], ("gate", "up", "dx", "dgate_up")):
        np.testing.assert_array_equal(got, want, name)
    wg, wu = weights[:intermediate], weights[intermediate:]
    assert_array_close(joint[0], fp8_value(x, "e4m3") @ fp8_value(wg, "e4m3").T, 1e-2, "gate")
    assert_array_close(joint[1], fp8_value(x, "e4m3") @ fp8_value(wu, "e4m3").T, 1e-2, "up")
    want_dx = fp8_value(dgate, "e5m2") @ fp8_value(wg, "e4m3") + fp8_value(dup, "e5m2") @ fp8_value(wu, "e4m3")
    assert_array_close(joint[2], want_dx, 1e-2, "dx")
    want_dweights = np.concatenate([fp8_value(dgate, "e5m2").T @ fp8_value(x, "e4m3"),
                                    fp8_value(dup, "e5m2").T @ fp8_value(x, "e4m3")])
    assert_array_close(joint[3], want_dweights, 1e-6, "dgate_up")


def mlp(probes, monkeypatch, producer_maxima, intervene):
    """The MLP's products in fp8 after the kernels that produce their
    operands (nanoq_emu_fp8_mlp): inputs, outputs, the quantization passes
    and how many took a producer's maximum."""
    monkeypatch.setenv("NANOQ_FP8_PRODUCER_MAXIMA", "1" if producer_maxima else "0")
    rng = np.random.default_rng(8)
    rows, intermediate, channels = 64, 256, 32  # SwiGLU in 8 blocks: 8 schedules of the emulator
    # dup much larger than dgate (small up): a block that mixed dup's partial maxima into dgate's would show.
    gate = bf16(rng.standard_normal((rows, intermediate)) * 2)
    up = bf16(rng.standard_normal((rows, intermediate)) * 0.05)
    down = bf16(rng.standard_normal((channels, intermediate)) * 0.05)
    dout = bf16(rng.standard_normal((rows, intermediate)) * 1e-3)
    x = bf16(rng.standard_normal((rows, channels)))
    weights = bf16(rng.standard_normal((2 * intermediate, channels)) * 0.05)
    out, dx = np.zeros((rows, channels), np.float32), np.zeros((rows, channels), np.float32)
    dweights = np.zeros(weights.shape, np.float32)
    passes, taken = ctypes.c_int(-1), ctypes.c_int(-1)
    message = ctypes.create_string_buffer(4096)
    status = probes.nanoq_emu_fp8_mlp(rows, intermediate, channels, *(float_ptr(f32(a)) for a in (gate, up, down)),
                                      float_ptr(f32(dout)), float_ptr(f32(x)), float_ptr(f32(weights)),
                                      int(intervene), float_ptr(out), float_ptr(dx), float_ptr(dweights),
                                      ctypes.byref(passes), ctypes.byref(taken), message, 4096)
    assert status == 0, message.value.decode()
    inputs = {"gate": gate, "up": up, "down": down, "dout": dout, "x": x, "gate_up": weights}
    return inputs, (out, dx, dweights), passes.value, taken.value


def silu(g):
    return g / (1 + np.exp(-g.astype(np.float64)))


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("intervene", [False, True], ids=["adjacent", "another-op-between"])
def test_the_mlp_products_take_the_swiglu_kernels_maxima(probes, monkeypatch, intervene):
    """Producer maxima: the down projection's input (SwiGLU's output) and
    gate|up's dy (dgate, dup) are quantized with the maximum their kernel
    took as it wrote them (3 of the 7 passes; none where another op wrote
    them in between: the maximum would be stale); the outputs bitwise those
    of quantizations that take their own maxima (NANOQ_FP8_PRODUCER_MAXIMA=0),
    and the products what the operands' own per-tensor scaling gives
    (independent float64 reference)."""
    inputs, taking, passes, taken = mlp(probes, monkeypatch, True, intervene)
    _, own, own_passes, own_taken = mlp(probes, monkeypatch, False, intervene)
    assert (passes, taken, own_passes, own_taken) == (7, 0 if intervene else 3, 7, 0)
    for got, want, name in zip(taking, own, ("out", "dx", "dgate_up")):
        np.testing.assert_array_equal(got, want, name)
    factor = 2 if intervene else 1  # the other op: t += t
    g, u, d = inputs["gate"], inputs["up"], inputs["dout"]
    s = bf16(silu(g) * u) * factor
    sig = 1 / (1 + np.exp(-g.astype(np.float64)))
    dgate = bf16(d * u * (sig + silu(g) * (1 - sig))) * factor
    dup = bf16(d * silu(g))
    assert_array_close(taking[0], fp8_value(s, "e4m3") @ fp8_value(inputs["down"], "e4m3").T, 2e-2, "out")
    intermediate = g.shape[1]
    wg, wu = inputs["gate_up"][:intermediate], inputs["gate_up"][intermediate:]
    want_dx = fp8_value(dgate, "e5m2") @ fp8_value(wg, "e4m3") + fp8_value(dup, "e5m2") @ fp8_value(wu, "e4m3")
    assert_array_close(taking[1], want_dx, 2e-2, "dx")
    want_dweights = np.concatenate([fp8_value(dgate, "e5m2").T @ fp8_value(inputs["x"], "e4m3"),
                                    fp8_value(dup, "e5m2").T @ fp8_value(inputs["x"], "e4m3")])
    assert_array_close(taking[2], want_dweights, 2e-2, "dgate_up")


def norms(probes, monkeypatch, producer_maxima, intervene):
    """The fp8 products after the norms (nanoq_emu_fp8_norms): inputs,
    outputs, the quantization passes and how many took a producer's maximum."""
    monkeypatch.setenv("NANOQ_FP8_PRODUCER_MAXIMA", "1" if producer_maxima else "0")
    rng = np.random.default_rng(9)
    rows, channels, n = 32, 48, 32
    x = bf16(rng.standard_normal((rows, channels)) * 3)
    norm_weight = bf16(1 + 0.5 * rng.standard_normal(channels))
    weight, weight2 = bf16(rng.standard_normal((n, channels)) * 0.05), bf16(rng.standard_normal((channels, n)) * 0.05)
    dy = bf16(rng.standard_normal((rows, n)) * 1e-2)
    dres = bf16(rng.standard_normal((rows, channels)) * 1e-3)
    y, dh = np.zeros((rows, n), np.float32), np.zeros((rows, n), np.float32)
    dweight2 = np.zeros(weight2.shape, np.float32)
    passes, taken = ctypes.c_int(-1), ctypes.c_int(-1)
    message = ctypes.create_string_buffer(4096)
    status = probes.nanoq_emu_fp8_norms(rows, channels, n, *(float_ptr(f32(a)) for a in (x, norm_weight, weight, dy,
                                                                                           weight2)),
                                        int(intervene), float_ptr(y), float_ptr(dres), float_ptr(dh),
                                        float_ptr(dweight2), ctypes.byref(passes), ctypes.byref(taken), message, 4096)
    assert status == 0, message.value.decode()
    inputs = {"x": x, "norm_weight": norm_weight, "weight": weight, "weight2": weight2}
    return inputs, (y, dres, dh, dweight2), passes.value, taken.value


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("intervene", [False, True], ids=["adjacent", "another-op-between"])
def test_the_products_after_the_norms_take_the_norm_kernels_maxima(probes, monkeypatch, intervene):
    """Producer maxima of the norms: a projection's input (RMSNorm's
    output) and the next projection backward's dy (the residual stream's
    gradient, which the norm's backward adds into) are quantized with the
    maximum their kernel took as it wrote them (2 of the 7 passes; none
    where another op wrote them in between); the outputs bitwise those of
    quantizations that take their own maxima, and the products what the
    operands' own per-tensor scaling gives (float64 reference)."""
    inputs, taking, passes, taken = norms(probes, monkeypatch, True, intervene)
    _, own, own_passes, own_taken = norms(probes, monkeypatch, False, intervene)
    assert (passes, taken, own_passes, own_taken) == (7, 0 if intervene else 2, 7, 0)
    for got, want, name in zip(taking, own, ("y", "dres", "dh", "dweight2")):
        np.testing.assert_array_equal(got, want, name)
    x = inputs["x"].astype(np.float64)
    xn = bf16(inputs["norm_weight"] * x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-6))
    xn = xn * (2 if intervene else 1)
    y, dres = taking[0], taking[1]
    assert_array_close(y, fp8_value(xn, "e4m3") @ fp8_value(inputs["weight"], "e4m3").T, 2e-2, "y")
    assert_array_close(taking[2], fp8_value(dres, "e5m2") @ fp8_value(inputs["weight2"], "e4m3"), 2e-2, "dh")
    assert_array_close(taking[3], fp8_value(dres, "e5m2").T @ fp8_value(y, "e4m3"), 2e-2, "dweight2")


def qkv_backward(probes, monkeypatch, producer_maxima, split, largest):
    """The q|k|v projection's fp8 backward after the pass that packs its
    gradient (nanoq_emu_fp8_qkv_backward), attention's gradient of side
    `largest` (q, k or v) 8 times the others': inputs, (dx, dweight,
    dbias), the quantization passes and how many took a producer's maximum."""
    monkeypatch.setenv("NANOQ_FP8_PRODUCER_MAXIMA", "1" if producer_maxima else "0")
    rng = np.random.default_rng(10)
    # 512 head rows of 2 lanes: 4 blocks of 128 (q's in blocks 0-1, k's in 2, v's in 3).
    batch, time, heads, kv_heads, head_dim, channels = 2, 32, 4, 2, 32, 32
    rows, width = batch * time, (heads + 2 * kv_heads) * head_dim
    scale = {side: 8e-3 if side == largest else 1e-3 for side in "qkv"}
    grads = {side: bf16(rng.standard_normal((rows, (heads if side == "q" else kv_heads) * head_dim)) * scale[side])
             for side in "qkv"}
    cos_sin = rope_table(time, head_dim)
    x = bf16(rng.standard_normal((rows, channels)))
    weight = bf16(rng.standard_normal((width, channels)) * 0.05)
    dx, dweight, dbias = np.zeros((rows, channels), np.float32), np.zeros(weight.shape, np.float32), np.zeros(width, np.float32)
    passes, taken = ctypes.c_int(-1), ctypes.c_int(-1)
    message = ctypes.create_string_buffer(4096)
    status = probes.nanoq_emu_fp8_qkv_backward(batch, time, heads, kv_heads, head_dim, channels,
                                               *(float_ptr(f32(grads[side])) for side in "qkv"), float_ptr(cos_sin),
                                               float_ptr(f32(x)), float_ptr(f32(weight)), int(split), float_ptr(dx),
                                               float_ptr(dweight), float_ptr(dbias), ctypes.byref(passes),
                                               ctypes.byref(taken), message, 4096)
    assert status == 0, message.value.decode()
    inputs = dict(grads, x=x, weight=weight, cos_sin=cos_sin, time=time, head_dim=head_dim)
    return inputs, (dx, dweight, dbias), passes.value, taken.value


def rope_backward(dy, cos_sin, time, head_dim):
    """The gradient of x [rows, heads * D] before RoPE's rotation from that
    of after it (rows = batch * time; half-split convention), float64."""
    rows = dy.shape[0]
    d = dy.astype(np.float64).reshape(rows // time, time, -1, head_dim)
    c, s = (cos_sin[..., i].astype(np.float64)[None, :, None, :] for i in (0, 1))
    a, b = d[..., : head_dim // 2], d[..., head_dim // 2:]
    return np.concatenate([a * c + b * s, b * c - a * s], -1).reshape(rows, -1)


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("largest", ["q", "k", "v"], ids=lambda side: f"largest-in-{side}")
@pytest.mark.parametrize("split", [False, True], ids=["qkv_backward", "rope-then-projection-backward"])
def test_the_qkv_projection_backward_takes_the_maximum_of_the_packing_pass(probes, monkeypatch, split, largest):
    """Producer maxima of the packed q|k|v gradient: the pass that rotates
    dq, dk back and packs dq|dk|dv takes its largest magnitude as it writes
    it (one atomic per block; the largest value in q's, k's or v's blocks),
    and the projection backward's one quantization of it into both forms
    takes that (1 of its 3 passes: dy, x^T, W^T), also where RoPE's backward
    ran as an op of its own before (the packing is the projection
    backward's); the outputs bitwise those of a quantization taking its own
    maximum, and what float64 gives from the operands' own scales."""
    inputs, taking, passes, taken = qkv_backward(probes, monkeypatch, True, split, largest)
    _, own, own_passes, own_taken = qkv_backward(probes, monkeypatch, False, split, largest)
    assert (passes, taken, own_passes, own_taken) == (3, 1, 3, 0)
    for got, want, name in zip(taking, own, ("dx", "dweight", "dbias")):
        np.testing.assert_array_equal(got, want, name)
    time, head_dim = inputs["time"], inputs["head_dim"]
    dqkv = np.concatenate([bf16(rope_backward(inputs["q"], inputs["cos_sin"], time, head_dim)),
                           bf16(rope_backward(inputs["k"], inputs["cos_sin"], time, head_dim)), inputs["v"]], 1)
    assert_array_close(taking[0], fp8_value(dqkv, "e5m2") @ fp8_value(inputs["weight"], "e4m3"), 2e-2, "dx")
    assert_array_close(taking[1], fp8_value(dqkv, "e5m2").T @ fp8_value(inputs["x"], "e4m3"), 1e-6, "dweight")
    assert_array_close(taking[2], dqkv.astype(np.float64).sum(0), 1e-5, "dbias")


@pytest.mark.cuda_emulated
def test_a_backward_off_the_fp8_tiles_runs_in_bf16(probes, capfd, monkeypatch):
    """rows = 24: wgrad's K and dgrad's M are not multiples of 16, so both run
    in bf16 and compute what the bf16 products do."""
    monkeypatch.setenv("NANOQ_MATMUL_LOG", "1")
    rng = np.random.default_rng(5)
    rows, n, k = 24, 16, 32
    dy, weight, x = (bf16(rng.standard_normal(shape)) for shape in ((rows, n), (n, k), (rows, k)))
    dx, dweight = backward(probes, dy, weight, x)
    err = capfd.readouterr().err
    plans = [line for line in err.splitlines() if "nanoq matmul plan" in line]
    assert plans and not any(f"/{CUDA_R_8F_E5M2}/" in p or f"/{CUDA_R_8F_E4M3}" in p for p in plans), plans
    assert_array_close(dx, dy.astype(np.float64) @ weight, 1e-2, "bf16 dgrad")
    assert_array_close(dweight, dy.T.astype(np.float64) @ x, 1e-5, "bf16 wgrad into float32")


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
    # The packed q|k|v (one product, 32 + 2 x 16 wide, its bias in the epilogue), o, gate, up and down: the
    # shapes of the tiny model (rows 64).
    shapes = {re.search(r"plan (\d+x\d+x\d+)", p).group(1) for p in fp8_plans}
    assert {"64x32x32", "64x64x32", "64x32x64"} <= shapes, shapes
    assert any(re.search(rf"plan 64x64x32 .* bias={CUDA_R_16BF}:", p) for p in fp8_plans), fp8_plans
    # The backward: e5m2 gradients times e4m3 operands, dgrad into the bf16
    # input gradient, wgrad into the float32 weight gradients.
    dgrad = {re.search(r"plan (\d+x\d+x\d+)", p).group(1) for p in plans
             if f"types={CUDA_R_16BF}/{CUDA_R_8F_E5M2}/{CUDA_R_8F_E4M3}" in p}
    wgrad = {re.search(r"plan (\d+x\d+x\d+)", p).group(1) for p in plans
             if f"types={CUDA_R_32F}/{CUDA_R_8F_E5M2}/{CUDA_R_8F_E4M3}" in p}
    assert {"64x32x32", "64x32x64", "64x64x32"} <= dgrad, dgrad  # o, the packed q|k|v and gate/up, down
    assert {"32x32x64", "64x32x64", "32x64x64"} <= wgrad, wgrad
    assert not any(re.search(r"plan \d+x128x32 .*/28/28", p) for p in plans), "the classifier ran in fp8"
    assert not any(re.search(r"plan \d+x32x128 .*/29/", p) for p in plans), "the classifier's backward ran in fp8"
    names = {a["name"] for a in allocations}
    assert "fp8-operands" in names and "fp8-operands" not in {a["name"] for a in plain}


def first_step_gradients(checkpoint, backend, matmul_dtype):
    options = nanoq.TrainOptions(backend=backend, dtype="bf16", batch_size=4, seq_len=16, seed=0,
                                 matmul_dtype=matmul_dtype)
    inputs, targets = random_batch(np.random.default_rng(7), 4)
    with nanoq.Trainer(nanoq.ModelConfig.from_pretrained(checkpoint), options) as trainer:
        trainer.import_weights(checkpoint)
        trainer.step(inputs, targets)
        return trainer.get_gradients()


def test_fp8_gradients_follow_bf16(checkpoints, backend):
    """One step's gradients with the projections forward and backward in
    fp8, against the bf16 run (see FP8_GRAD_REL)."""
    checkpoint = checkpoints.path("qwen2")
    fp8 = first_step_gradients(checkpoint, backend, "fp8")
    reference = first_step_gradients(checkpoint, backend, "auto")
    assert fp8.keys() == reference.keys()
    for name, want in reference.items():
        assert np.all(np.isfinite(fp8[name])), name
        err, norm = np.linalg.norm(fp8[name] - want), np.linalg.norm(want)
        assert err <= FP8_GRAD_REL * norm + FP8_GRAD_ABS, (
            f"gradient of {name}: |fp8 - bf16| {err:.3g}, |bf16| {norm:.3g}")


@pytest.mark.cuda_emulated
def test_the_memory_plan_holds_the_fp8_operands(checkpoints):
    config = nanoq.ModelConfig.from_pretrained(checkpoints.path("qwen2"))
    kwargs = dict(backend="cuda_emulated", dtype="bf16", batch_size=4, seq_len=16)
    fp8 = estimate_memory(config, nanoq.TrainOptions(matmul_dtype="fp8", **kwargs)).allocations
    plain = estimate_memory(config, nanoq.TrainOptions(**kwargs)).allocations
    segment = [a for a in fp8 if a.name == "fp8-operands"]
    # 256 bytes of maxima and inverse scales, 256 of producer maxima, the
    # forward maxima's slots (4 floats per layer, 2 layers: 32 bytes, in 256),
    # then what gate|up's backward holds at once, the most of any call (64
    # rows, hidden 32, intermediate 64): dgate and dup, each as stored and
    # transposed (4 x 64 x 64), x^T (64 x 32) and both weights transposed as
    # if uncached (2 x 64 x 32).
    assert config.num_hidden_layers == 2
    expected = 256 + 256 + 256 + 4 * 64 * 64 + 64 * 32 + 2 * 64 * 32
    assert len(segment) == 1 and segment[0].bytes == expected and segment[0].kind == "device"
    assert not [a for a in plain if a.name == "fp8-operands"]
    # The trainer allocates what the plan holds.
    with nanoq.Trainer(config, nanoq.TrainOptions(matmul_dtype="fp8", **kwargs)) as trainer:
        [allocated] = [a for a in trainer.get_allocations(0) if a["name"] == "fp8-operands"]
    assert allocated["bytes"] == segment[0].bytes


# --------------------------------------------------------------------------
# The fp8 weight cache: each weight quantized once per update
# --------------------------------------------------------------------------

# Every projection of it runs in fp8: hidden 32, head_dim 16 (q 32, k/v 16
# wide), intermediate 64; 16 rows per device and micro-batch.
CACHE_CONFIG = nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1)
CACHE_SEQ, CACHE_STEPS, CACHE_ACCUM = 8, 3, 2


def cache_batch(seed, rows):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CACHE_CONFIG.vocab_size, (rows, CACHE_SEQ + 1), dtype=np.int32)
    return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])


def train_fp8(monkeypatch, cache, devices=1, backend="cuda_emulated", producer_maxima=True, forward_maxima=True,
              **options):
    """Statistics of every update and validate, and the weights after
    CACHE_STEPS optimizer steps of CACHE_ACCUM micro-batches in fp8 with the
    weight cache on or off (and producer and forward maxima on or off); the
    names of device 0's allocations; and the weights before the first step."""
    monkeypatch.setenv("NANOQ_FP8_WEIGHT_CACHE", "1" if cache else "0")
    monkeypatch.setenv("NANOQ_FP8_PRODUCER_MAXIMA", "1" if producer_maxima else "0")
    monkeypatch.setenv("NANOQ_FP8_FORWARD_MAXIMA", "1" if forward_maxima else "0")
    opts = nanoq.TrainOptions(backend=backend, dtype="bf16", matmul_dtype="fp8", devices=devices,
                              batch_size=2, seq_len=CACHE_SEQ, grad_accum=CACHE_ACCUM, seed=3, **options)
    stats = []
    with nanoq.Trainer(CACHE_CONFIG, opts) as trainer:
        trainer.init_weights(seed=4)
        initial = trainer.get_weights()
        for step in range(CACHE_STEPS):
            for micro in range(CACHE_ACCUM):
                trainer.step(*cache_batch(10 * step + micro, 2 * devices))
            result = trainer.update(lr=2e-2)
            check = trainer.validate(*cache_batch(1000 + step, 2 * devices))
            stats.append((result.loss, result.grad_norm, check.loss))
        weights = trainer.get_weights()
        names = {a["name"] for a in trainer.get_allocations(0)}
    return stats, weights, names, initial


CACHE_CASES = [
    (1, {"cuda_graphs": False}),
    (1, {"cuda_graphs": True, "recompute": ("block",)}),
    (2, {"cuda_graphs": True, "zero_stage": 1}),
    (2, {"cuda_graphs": True, "zero_stage": 3}),
]
CACHE_IDS = ["1-device", "1-device-graphs-recompute", "2-devices-zero1-graphs", "2-devices-zero3-graphs"]


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("devices, options", CACHE_CASES, ids=CACHE_IDS)
def test_the_fp8_weight_cache_trains_bitwise_like_quantizing_every_call(monkeypatch, devices, options):
    """The cached e4m3 weights are the ones every call would quantize: the
    same training, bitwise, across updates (so each update re-quantized
    them, also when update() and the steps replay captured graphs), with
    recomputation, and at ZeRO-3, where the layer weights live in reused
    gather buffers and there is no cache (it would serve another layer's)."""
    require_cuda_emulator()
    assert_cache_changes_nothing(train_fp8(monkeypatch, True, devices, **options),
                                 train_fp8(monkeypatch, False, devices, **options), options)


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("devices, options", CACHE_CASES, ids=CACHE_IDS)
def test_producer_maxima_train_bitwise_like_quantizations_taking_their_own(monkeypatch, devices, options):
    """SwiGLU's maxima taken for the fp8 quantizations of its output and
    gradients are the ones those quantizations would take themselves: the
    same training, bitwise, without and with graphs replayed, with
    recomputation, and on two devices at ZeRO-1 and ZeRO-3. (That the trainer takes them at all is what the
    mutation suite's "producer maximum" mutations show: this test catches a
    wrong one.)"""
    require_cuda_emulator()
    assert_same_training(train_fp8(monkeypatch, True, devices, **options),
                         train_fp8(monkeypatch, True, devices, producer_maxima=False, **options))


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("devices, options", CACHE_CASES, ids=CACHE_IDS)
def test_forward_maxima_train_bitwise_like_weight_gradients_taking_their_own(monkeypatch, devices, options):
    """The maxima the forward kept for the weight gradients' x^T are the ones
    those quantizations would take themselves: the same training, bitwise,
    as with NANOQ_FP8_FORWARD_MAXIMA=0, with graphs replayed, with the whole
    block recomputed (the backward's x then comes from the recompute), and
    on two devices at ZeRO-1 and ZeRO-3. (That the trainer takes them is
    what the "forward maxima" mutations show: this test catches a wrong one.)"""
    require_cuda_emulator()
    assert_same_training(train_fp8(monkeypatch, True, devices, **options),
                         train_fp8(monkeypatch, True, devices, forward_maxima=False, **options))


@pytest.mark.gpu
def test_forward_maxima_train_bitwise_like_weight_gradients_taking_their_own_on_the_gpu(monkeypatch, cuda_device):
    """The same on a GPU, graphs replayed and the block recomputed."""
    options = {"cuda_graphs": True, "recompute": ("block",)}
    assert_same_training(train_fp8(monkeypatch, True, backend="cuda", **options),
                         train_fp8(monkeypatch, True, backend="cuda", forward_maxima=False, **options))


def forward_maxima(probes, x, weight, dy, hints):
    """(y, dx, dweight, taken) of the forward maxima probe."""
    rows, k = x.shape
    n = weight.shape[0]
    y, dx, dweight = (np.zeros(shape, np.float32) for shape in ((rows, n), (rows, k), (n, k)))
    taken = ctypes.c_int(-1)
    message = ctypes.create_string_buffer(4096)
    probes.nanoq_emu_fp8_forward_maxima.restype = ctypes.c_int
    status = probes.nanoq_emu_fp8_forward_maxima(rows, n, k, float_ptr(f32(x)), float_ptr(f32(weight)),
                                                 float_ptr(f32(dy)), hints, float_ptr(y), float_ptr(dx),
                                                 float_ptr(dweight), ctypes.byref(taken), message, 4096)
    assert status == 0, message.value.decode()
    return y, dx, dweight, taken.value


@pytest.mark.cuda_emulated
def test_a_weight_gradient_takes_the_forward_maximum_of_its_input(probes, monkeypatch):
    """With the model's hints (projection_input: the forward defines the
    site, the backward takes it), the weight gradient's x^T takes the
    maximum the forward's quantization of x kept, though another op ran in
    between; without either hint it takes its own; the outputs are bitwise
    the same every way, and as float64 gives from x's own scale."""
    rng = np.random.default_rng(8)
    rows, n, k = 48, 32, 64
    x = bf16(rng.standard_normal((rows, k)) * 3.0)
    weight = bf16(rng.standard_normal((n, k)) * 0.05)
    dy = bf16(rng.standard_normal((rows, n)) * 1e-3)
    runs = [forward_maxima(probes, x, weight, dy, hints) for hints in range(4)]
    assert [run[3] for run in runs] == [0, 0, 0, 1]  # only a defined site is taken
    for run in runs[1:]:
        for got, want in zip(run[:3], runs[0][:3]):
            assert np.array_equal(got, want)
    want_dweight = fp8_value(dy, "e5m2").T @ fp8_value(x, "e4m3")
    assert_array_close(runs[3][2], want_dweight, 1e-6, "fp8 wgrad vs its dequantized operands")
    monkeypatch.setenv("NANOQ_FP8_FORWARD_MAXIMA", "0")
    off = forward_maxima(probes, x, weight, dy, 3)
    assert off[3] == 0 and all(np.array_equal(got, want) for got, want in zip(off[:3], runs[0][:3]))


@pytest.mark.gpu
def test_producer_maxima_train_bitwise_like_quantizations_taking_their_own_on_the_gpu(monkeypatch, cuda_device):
    """The same on a GPU: the blocks' atomic maxima run at once there."""
    options = {"cuda_graphs": True, "recompute": ("block",)}
    assert_same_training(train_fp8(monkeypatch, True, backend="cuda", **options),
                         train_fp8(monkeypatch, True, backend="cuda", producer_maxima=False, **options))


def assert_same_training(a, b):
    assert a[0] == b[0]
    for name, value in b[1].items():
        assert np.array_equal(a[1][name], value), name


@pytest.mark.gpu
def test_the_fp8_weight_cache_trains_bitwise_like_quantizing_every_call_on_the_gpu(monkeypatch, cuda_device):
    """The same on a GPU: real graph replays of the device-side checks."""
    options = {"cuda_graphs": True, "recompute": ("block",)}
    assert_cache_changes_nothing(train_fp8(monkeypatch, True, backend="cuda", **options),
                                 train_fp8(monkeypatch, False, backend="cuda", **options), options)


def assert_cache_changes_nothing(cached, uncached, options):
    assert cached[0] == uncached[0]
    for name, value in uncached[1].items():
        assert np.array_equal(cached[1][name], value), name
    assert "fp8-weight-cache" not in uncached[2]
    assert ("fp8-weight-cache" in cached[2]) == (options.get("zero_stage", 1) < 3)
    # The updates moved every weight, so that the equality above compares weights re-quantized after each
    # update (a frozen cache would serve the first ones). Not the held-out loss falling: on these random
    # tokens it moves by noise around ln(vocab) over three steps.
    moved = [name for name, value in cached[3].items() if not np.array_equal(cached[1][name], value)]
    assert sorted(moved) == sorted(cached[3]), f"the run did not train: unmoved {set(cached[3]) - set(moved)}"


@pytest.mark.cuda_emulated
def test_weights_set_between_steps_are_quantized_again(monkeypatch):
    """set_parameter() between two validations (captured, the second a
    replay): the second sees the new weights, bitwise as a trainer without
    the cache does."""
    require_cuda_emulator()
    inputs, targets = cache_batch(5, 2)

    def losses(cache):
        monkeypatch.setenv("NANOQ_FP8_WEIGHT_CACHE", "1" if cache else "0")
        opts = nanoq.TrainOptions(backend="cuda_emulated", dtype="bf16", matmul_dtype="fp8", batch_size=2,
                                  seq_len=CACHE_SEQ, seed=3, cuda_graphs=True)
        with nanoq.Trainer(CACHE_CONFIG, opts) as trainer:
            trainer.init_weights(seed=4)
            out = [trainer.validate(inputs, targets).loss for _ in range(2)]  # warm-up, capture
            weights = trainer.get_weights()
            for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
                weights[name] = weights[name] * 3.0
            trainer.set_weights(weights)
            out.append(trainer.validate(inputs, targets).loss)
        return out

    cached, uncached = losses(True), losses(False)
    assert cached == uncached
    assert cached[0] == cached[1] != cached[2]


@pytest.mark.cuda_emulated
def test_the_memory_plan_holds_the_fp8_weight_cache(monkeypatch):
    """Two e4m3 copies (as stored, transposed) of every projection weight,
    each with a 256-byte header and 256-byte aligned, after a 256-byte
    generation word; none at ZeRO-3 or with NANOQ_FP8_WEIGHT_CACHE=0."""
    kwargs = dict(backend="cuda_emulated", dtype="bf16", matmul_dtype="fp8", batch_size=2, seq_len=CACHE_SEQ)
    aligned = lambda n: (n + 255) // 256 * 256  # noqa: E731
    # q 32x32, k and v 16x32, o 32x32, gate and up 64x32, down 32x64.
    per_layer = sum(2 * (256 + aligned(n)) for n in (1024, 512, 512, 1024, 2048, 2048, 2048))
    monkeypatch.setenv("NANOQ_FP8_WEIGHT_CACHE", "1")
    [planned] = [a for a in estimate_memory(CACHE_CONFIG, nanoq.TrainOptions(**kwargs)).allocations
                 if a.name == "fp8-weight-cache"]
    assert planned.bytes == 256 + 2 * per_layer and planned.kind == "device"
    with nanoq.Trainer(CACHE_CONFIG, nanoq.TrainOptions(**kwargs)) as trainer:
        [allocated] = [a for a in trainer.get_allocations(0) if a["name"] == "fp8-weight-cache"]
    assert allocated["bytes"] == planned.bytes
    zero3 = estimate_memory(CACHE_CONFIG, nanoq.TrainOptions(devices=2, zero_stage=3, **kwargs)).allocations
    assert not [a for a in zero3 if a.name == "fp8-weight-cache"]
    monkeypatch.setenv("NANOQ_FP8_WEIGHT_CACHE", "0")
    off = estimate_memory(CACHE_CONFIG, nanoq.TrainOptions(**kwargs)).allocations
    assert not [a for a in off if a.name == "fp8-weight-cache"]


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
