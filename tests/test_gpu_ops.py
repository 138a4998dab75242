"""Every op of the cuda backend against the cpu backend, on the same inputs.

The cpu backend is itself checked op by op against float64 numpy references
in test_ops.py, through the same harness (nanoq.testing.OpRunner). Each test
runs on two backends (conftest.cuda_cases):
  - "cuda", marked ``gpu`` (``pytest -m gpu``): without an NVIDIA GPU these
    skip; with one they fail unless the cuda backend is built and sees it;
  - "cuda_emulated", marked ``cuda_emulated``: the same kernels and host code
    on the CPU emulator of CUDA (cuda_core/cuda/emulator), on every machine,
    with shapes small enough for it but still off the kernels' tiles and
    block sizes (T = 1, 33, 70; head_dim 48 to 128; GQA groups 1, 2, 7;
    vocabularies that are not multiples of 128; rows below and above one block).

Tolerances, as max |cuda - cpu| over max |cpu| of each output:
  fp32: 1e-5 for elementwise ops and matmuls (cuBLASLt with fp32 compute, no
        TF32); 1e-4 where the two backends sum long rows in different orders
        (attention, norms, column sums, the classifier's statistics);
  bf16: 2e-2. Inputs are rounded to bf16 first, so both backends see the
        same values; the cpu computes in fp32 and the cuda outputs are
        rounded to bf16 (relative step 2^-8 = 4e-3).
Shapes stress the kernels' tiling: attention with T not a multiple of the
32-wide tiles (77, 300), head_dim 64, 80, 128, 256 and GQA groups 1, 2, 7;
vocab 50000; rows beyond 1024 and beyond 2048 * 64 for the column sums;
embeddings with heavily repeated tokens. Reductions must also be bitwise
reproducible run to run.
"""

import numpy as np
import pytest

from nanoq.testing import OpRunner
from conftest import IGNORE, assert_array_close, cuda_cases, rope_table, use_cuda_backend

DTYPES = ["fp32", "bf16"]
FP32_REL = 1e-5
FP32_SUM_REL = 1e-4
BF16_REL = 2e-2


@pytest.fixture(scope="module")
def cpu():
    return OpRunner("cpu")


_RUNNERS = {}


@pytest.fixture
def gpu(backend, request):
    """The OpRunner of the test's cuda backend (one per backend and session)."""
    use_cuda_backend(backend, request)
    if backend not in _RUNNERS:
        _RUNNERS[backend] = OpRunner(backend, 0)
    return _RUNNERS[backend]


def to_bf16(x):
    """x rounded to the nearest bf16 (ties to even), as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def inputs(dtype, *arrays):
    """The arrays as both backends will see them: bf16-rounded for bf16."""
    return [to_bf16(a) if dtype == "bf16" else np.asarray(a, np.float32) for a in arrays]


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def tolerance(dtype, fp32=FP32_REL):
    return BF16_REL if dtype == "bf16" else fp32


def assert_bitwise_equal(a, b, what):
    assert np.array_equal(a, b, equal_nan=True), f"{what}: two runs differ (max diff {np.nanmax(np.abs(a - b)):.3e})"


# --------------------------------------------------------------------------
# Casts, fill, elementwise
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", cuda_cases())
def test_copy_rounds_to_bf16_to_nearest_even_and_back_exactly(gpu):
    rng = np.random.default_rng(0)
    x = normal(rng, 100_003) * np.float32(10.0) ** rng.integers(-20, 20, 100_003).astype(np.float32)
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x3F807FFF], np.uint32).view(np.float32)
    x = np.concatenate([x, ties, np.float32([0.0, -0.0, 1.0])])
    assert np.array_equal(gpu.copy(x, "fp32", "bf16"), to_bf16(x))
    assert np.array_equal(gpu.copy(x, "bf16", "fp32"), to_bf16(x))
    assert np.array_equal(gpu.copy(x, "bf16", "bf16"), to_bf16(x))
    assert np.array_equal(gpu.copy(x, "fp32", "fp32"), x)


@pytest.mark.parametrize("backend", cuda_cases())
@pytest.mark.parametrize("dtype", DTYPES)
def test_fill(gpu, dtype):
    expected = to_bf16(np.float32([1.3]))[0] if dtype == "bf16" else np.float32(1.3)
    assert np.all(gpu.fill(70_001, 1.3, dtype=dtype) == expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend, n", cuda_cases([1_000_003], [70_001]))
def test_add_and_accumulate(cpu, gpu, dtype, n):
    rng = np.random.default_rng(1)
    a, b = inputs(dtype, normal(rng, n), normal(rng, n))
    assert_array_close(gpu.add(a, b, dtype=dtype), cpu.add(a, b), tolerance(dtype), "add")
    assert_array_close(gpu.accumulate(a, b, dtype=dtype), cpu.accumulate(a, b), tolerance(dtype), "accumulate")


# --------------------------------------------------------------------------
# Matmul and bias
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("backend, mnk", cuda_cases([((77, 130, 300),), ((1, 1031, 64),), ((1000, 96, 513),)],
                                                [((33, 70, 48),), ((1, 129, 64),)]))
def test_matmul(cpu, gpu, dtype, trans_a, trans_b, accumulate, mnk):
    M, N, K = mnk
    rng = np.random.default_rng(2)
    a = normal(rng, K, M) if trans_a else normal(rng, M, K)
    b = normal(rng, N, K) if trans_b else normal(rng, K, N)
    initial = normal(rng, M, N)
    a, b, initial = inputs(dtype, a, b, initial)
    acc = initial if accumulate else None
    expected = cpu.matmul(a, b, trans_a=trans_a, trans_b=trans_b, accumulate_into=acc)
    got = gpu.matmul(a, b, trans_a=trans_a, trans_b=trans_b, accumulate_into=acc, dtype=dtype)
    assert_array_close(got, expected, tolerance(dtype), "matmul")


@pytest.mark.parametrize("backend", cuda_cases())
def test_matmul_bf16_operands_into_fp32_weight_gradient(cpu, gpu):
    """The weight-gradient form: dW[N,K] += dy^T x with bf16 operands, fp32 out."""
    rng = np.random.default_rng(3)
    rows, n, k = 1500, 160, 96
    dy, x = inputs("bf16", normal(rng, rows, n), normal(rng, rows, k))
    dweight = normal(rng, n, k)
    expected = cpu.matmul(dy, x, trans_a=True, accumulate_into=dweight)
    got = gpu.matmul(dy, x, trans_a=True, accumulate_into=dweight, dtype="bf16", out_dtype="fp32")
    # fp32 output: only the fp32 accumulation orders differ.
    assert_array_close(got, expected, FP32_SUM_REL, "bf16 x bf16 -> fp32 matmul")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend, rows, cols", cuda_cases([(3000, 77), (140_001, 40), (5, 1030)],
                                                       [(300, 77), (140_001, 3), (5, 130)]))
def test_add_bias_and_bias_backward(cpu, gpu, dtype, rows, cols):
    rng = np.random.default_rng(4)
    out, bias, dout = inputs(dtype, normal(rng, rows, cols), normal(rng, cols), normal(rng, rows, cols))
    dbias = normal(rng, cols)
    assert_array_close(gpu.add_bias(out, bias, dtype=dtype), cpu.add_bias(out, bias), tolerance(dtype), "add_bias")
    got = gpu.bias_backward(dout, dbias, dtype=dtype)
    # dbias is fp32 for both dtypes: only summation orders differ.
    assert_array_close(got, cpu.bias_backward(dout, dbias), FP32_SUM_REL, "bias_backward")
    assert_bitwise_equal(got, gpu.bias_backward(dout, dbias, dtype=dtype), "bias_backward")


# --------------------------------------------------------------------------
# Embedding, rmsnorm, rope
# --------------------------------------------------------------------------

EMBEDDING_CASES = {  # name: (vocab, channels, rows, distinct tokens used)
    "sparse-50k": (50_000, 96, 4096, 50_000),
    "repeated": (1000, 130, 8192, 5),
    "one-token": (7, 64, 3000, 1),
    # the emulator's:
    "sparse-1k": (1000, 48, 700, 1000),
    "repeated-small": (100, 40, 2000, 5),
    "one-token-small": (7, 16, 300, 1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend, case", cuda_cases(["sparse-50k", "repeated", "one-token"],
                                                   ["sparse-1k", "repeated-small", "one-token-small"]))
def test_embedding_forward_and_backward(cpu, gpu, dtype, case):
    vocab, channels, rows, distinct = EMBEDDING_CASES[case]
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, distinct, rows).astype(np.int32)
    tokens[-1] = vocab - 1
    table, dout = inputs(dtype, normal(rng, vocab, channels), normal(rng, rows, channels))
    table_grad = normal(rng, vocab, channels)
    assert np.array_equal(gpu.embedding_forward(tokens, table, dtype=dtype), cpu.embedding_forward(tokens, table))
    got = gpu.embedding_backward(dout, tokens, table_grad, dtype=dtype)
    assert_array_close(got, cpu.embedding_backward(dout, tokens, table_grad), FP32_SUM_REL, "embedding_backward")
    assert_bitwise_equal(got, gpu.embedding_backward(dout, tokens, table_grad, dtype=dtype), "embedding_backward")


RMSNORM_SHAPES = cuda_cases([(3000, 1000), (2050, 77), (64, 4096), (8192, 128)],
                            [(33, 70), (300, 1000), (5, 1030), (2100, 40)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend, rows, channels", RMSNORM_SHAPES)
def test_rmsnorm_forward(cpu, gpu, dtype, rows, channels):
    rng = np.random.default_rng(6)
    x, w = inputs(dtype, normal(rng, rows, channels, scale=3.0), 1.0 + normal(rng, channels, scale=0.2))
    out, rstd = gpu.rmsnorm_forward(x, w, eps=1e-5, dtype=dtype)
    expected_out, expected_rstd = cpu.rmsnorm_forward(x, w, eps=1e-5)
    assert_array_close(out, expected_out, tolerance(dtype, FP32_SUM_REL), "rmsnorm out")
    assert_array_close(rstd, expected_rstd, FP32_SUM_REL, "rmsnorm rstd (fp32)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend, rows, channels", RMSNORM_SHAPES)
@pytest.mark.parametrize("mode", ["overwrite", "accumulate", "alias"])
def test_rmsnorm_backward(cpu, gpu, dtype, rows, channels, mode):
    rng = np.random.default_rng(7)
    x, w, dy, dinp0 = inputs(dtype, normal(rng, rows, channels), 1.0 + normal(rng, channels, scale=0.2),
                             normal(rng, rows, channels), normal(rng, rows, channels))
    _, rstd = cpu.rmsnorm_forward(x, w, eps=1e-5)
    dweight = normal(rng, channels)
    kwargs = dict(dweight=dweight, alias=mode == "alias", dinp_accumulate_into=dinp0 if mode == "accumulate" else None)
    dx, dw = gpu.rmsnorm_backward(dy, x, w, rstd, dtype=dtype, **kwargs)
    expected_dx, expected_dw = cpu.rmsnorm_backward(dy, x, w, rstd, **kwargs)
    assert_array_close(dx, expected_dx, tolerance(dtype, FP32_SUM_REL), "rmsnorm dinp")
    assert_array_close(dw, expected_dw, FP32_SUM_REL, "rmsnorm dweight (fp32)")
    assert_bitwise_equal(dw, gpu.rmsnorm_backward(dy, x, w, rstd, dtype=dtype, **kwargs)[1], "rmsnorm dweight")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend, shape", cuda_cases([((2, 77, 3, 80),), ((1, 300, 4, 128),), ((1, 33, 2, 256),),
                                                  ((3, 5, 7, 64),)],
                                                 [((2, 33, 3, 48),), ((1, 70, 2, 128),), ((3, 1, 7, 64),),
                                                  ((1, 5, 2, 256),)]))
def test_rope_forward_and_backward(cpu, gpu, dtype, shape):
    rng = np.random.default_rng(8)
    x, dy = inputs(dtype, normal(rng, *shape), normal(rng, *shape))
    cos_sin = rope_table(shape[1], shape[3])
    assert_array_close(gpu.rope_forward(x, cos_sin, dtype=dtype), cpu.rope_forward(x, cos_sin), tolerance(dtype),
                       "rope forward")
    assert_array_close(gpu.rope_backward(dy, cos_sin, dtype=dtype), cpu.rope_backward(dy, cos_sin),
                       tolerance(dtype), "rope backward")


# --------------------------------------------------------------------------
# Attention, swiglu
# --------------------------------------------------------------------------

ATTENTION_SHAPES = [  # (batch, time, heads, kv_heads, head_dim)
    (1, 77, 4, 4, 64),  # group 1
    (2, 300, 4, 2, 128),  # group 2
    (1, 300, 7, 1, 80),  # group 7, head_dim not a power of two
    (1, 33, 2, 1, 256),
    (2, 1, 2, 2, 64),  # a single position
    (1, 64, 2, 2, 96),  # T a multiple of the tile
]
EMULATED_ATTENTION_SHAPES = [
    (1, 70, 4, 4, 64),  # group 1, T not a multiple of the tile
    (2, 33, 4, 2, 48),  # group 2, head_dim below a warp's multiple
    (1, 70, 7, 1, 96),  # group 7
    (2, 1, 2, 2, 128),  # a single position
    (1, 33, 2, 1, 128),
    (1, 64, 2, 2, 64),  # T a multiple of the tile
]
ATTENTION_CASES = cuda_cases([(s,) for s in ATTENTION_SHAPES], [(s,) for s in EMULATED_ATTENTION_SHAPES])


def attention_inputs(rng, dtype, shape):
    B, T, H, Hkv, D = shape
    return inputs(dtype, normal(rng, B, T, H, D, scale=2.0), normal(rng, B, T, Hkv, D, scale=2.0),
                  normal(rng, B, T, Hkv, D), normal(rng, B, T, H, D))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend, shape", ATTENTION_CASES)
def test_attention_forward(cpu, gpu, dtype, shape):
    q, k, v, _ = attention_inputs(np.random.default_rng(9), dtype, shape)
    out, lse = gpu.attention_forward(q, k, v, dtype=dtype)
    expected_out, expected_lse = cpu.attention_forward(q, k, v)
    assert_array_close(out, expected_out, tolerance(dtype, FP32_SUM_REL), "attention out")
    assert_array_close(lse, expected_lse, FP32_SUM_REL, "attention lse (fp32)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend, shape", ATTENTION_CASES)
def test_attention_decode(cpu, gpu, dtype, shape):
    """Generation's one query (the last position's) over the cache: batch 1."""
    _, T, H, Hkv, D = shape
    q, k, v, _ = attention_inputs(np.random.default_rng(13), dtype, (1, T, H, Hkv, D))
    out = gpu.attention_decode(q[0, -1], k[0], v[0], dtype=dtype)
    expected = cpu.attention_decode(q[0, -1], k[0], v[0])
    assert_array_close(out, expected, tolerance(dtype, FP32_SUM_REL), "attention_decode out")
    assert_bitwise_equal(gpu.attention_decode(q[0, -1], k[0], v[0], dtype=dtype), out, "attention_decode")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend, shape", ATTENTION_CASES)
def test_attention_backward(cpu, gpu, dtype, shape):
    q, k, v, dout = attention_inputs(np.random.default_rng(10), dtype, shape)
    out, lse = cpu.attention_forward(q, k, v)
    (out,) = inputs(dtype, out)
    got = gpu.attention_backward(dout, out, lse, q, k, v, dtype=dtype)
    expected = cpu.attention_backward(dout, out, lse, q, k, v)
    # atol: at T = 1, dq is exactly zero up to fp32 rounding.
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert_array_close(g, e, tolerance(dtype, FP32_SUM_REL), f"attention {name}", atol=1e-5)
    again = gpu.attention_backward(dout, out, lse, q, k, v, dtype=dtype)
    for name, g, h in zip(("dq", "dk", "dv"), got, again):
        assert_bitwise_equal(g, h, f"attention {name}")


def document_positions(B, T, lengths):
    """positions [B, T] of documents of `lengths` packed in turn into each row (cut at T)."""
    row, t = [], 0
    while len(row) < T:
        n = lengths[t % len(lengths)]
        row.extend(range(n))
        t += 1
    return np.tile(np.array(row[:T], np.int32), (B, 1))


# Documents that start inside a tile, at a tile's edge and one longer than a tile.
MASKED_ATTENTION_CASES = cuda_cases([((2, 300, 4, 2, 128),), ((1, 77, 7, 1, 64),)],
                                    [((1, 70, 4, 2, 64),), ((2, 33, 2, 2, 48),), ((1, 130, 2, 1, 64),)])


# Document lengths per mask case: a mix around the tile size, and short ones,
# where most tile pairs below the diagonal are masked wholly and skipped.
DOCUMENT_LENGTHS = {"documents": [5, 32, 1, 40, 9], "short-documents": [3, 1, 9, 2, 31]}


@pytest.mark.parametrize("mask", ["documents", "short-documents", "bidirectional"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend, shape", MASKED_ATTENTION_CASES)
def test_attention_with_document_positions_or_bidirectional(cpu, gpu, dtype, shape, mask):
    """The native kernels' masks: per-token document positions (with the
    tile pairs they mask wholly skipped), and causal=False."""
    q, k, v, dout = attention_inputs(np.random.default_rng(14), dtype, shape)
    B, T = shape[:2]
    args = ({"positions": document_positions(B, T, DOCUMENT_LENGTHS[mask])} if mask in DOCUMENT_LENGTHS
            else {"causal": False})
    out, lse = gpu.attention_forward(q, k, v, dtype=dtype, **args)
    expected_out, expected_lse = cpu.attention_forward(q, k, v, **args)
    assert_array_close(out, expected_out, tolerance(dtype, FP32_SUM_REL), "attention out")
    assert_array_close(lse, expected_lse, FP32_SUM_REL, "attention lse (fp32)")
    cpu_out, lse = cpu.attention_forward(q, k, v, **args)
    (cpu_out,) = inputs(dtype, cpu_out)
    got = gpu.attention_backward(dout, cpu_out, lse, q, k, v, dtype=dtype, **args)
    expected = cpu.attention_backward(dout, cpu_out, lse, q, k, v, **args)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert_array_close(g, e, tolerance(dtype, FP32_SUM_REL), f"attention {name}", atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend, n", cuda_cases([1_000_003], [70_001]))
def test_swiglu_forward_and_backward(cpu, gpu, dtype, n):
    rng = np.random.default_rng(11)
    gate, up, dout = inputs(dtype, normal(rng, n, scale=3.0), normal(rng, n), normal(rng, n))
    assert_array_close(gpu.swiglu_forward(gate, up, dtype=dtype), cpu.swiglu_forward(gate, up), tolerance(dtype),
                       "swiglu out")
    for alias in (False, True):
        got = gpu.swiglu_backward(dout, gate, up, alias=alias, dtype=dtype)
        expected = cpu.swiglu_backward(dout, gate, up, alias=alias)
        for name, g, e in zip(("dgate", "dup"), got, expected):
            assert_array_close(g, e, tolerance(dtype), f"swiglu {name} (alias={alias})")


# --------------------------------------------------------------------------
# Classifier, reductions, optimizer
# --------------------------------------------------------------------------

CLASSIFIER_CASES = {  # name: (rows, vocab, first_position, time)
    "vocab-50k": (64, 50_000, 0, 64),
    "rows-past-1024": (1100, 512, 0, 1100),
    "chunk-from-1000": (300, 1000, 1000, 1200),
    # the emulator's:
    "vocab-1000": (20, 1000, 0, 20),
    "rows-from-1000": (300, 515, 1000, 1300),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend, case", cuda_cases(["vocab-50k", "rows-past-1024", "chunk-from-1000"],
                                                   ["vocab-1000", "rows-from-1000"]))
@pytest.mark.parametrize("z_loss, with_grad", [(0.0, True), (1e-4, True), (1e-4, False)])
def test_cross_entropy(cpu, gpu, dtype, case, z_loss, with_grad):
    rows, vocab, first, time = CLASSIFIER_CASES[case]
    rng = np.random.default_rng(12)
    (logits,) = inputs(dtype, normal(rng, rows, vocab, scale=3.0))
    targets = rng.integers(0, vocab, rows).astype(np.int32)
    targets[::5] = IGNORE
    stats_in = np.array([1.0, 2.0, 0.5, 1.0, 3.0, 4.0, 0.25], np.float32)
    kwargs = dict(first_position=first, time=time, z_loss=z_loss, with_grad=with_grad)
    got, stats = gpu.cross_entropy(logits, targets, stats_in, dtype=dtype, **kwargs)
    expected, expected_stats = cpu.cross_entropy(logits, targets, stats_in, **kwargs)
    if with_grad:
        assert_array_close(got, expected, tolerance(dtype), "cross_entropy grad")
        assert np.all(got[::5] == 0.0), "ignored rows must get zero gradients"
    else:
        assert np.array_equal(got, logits), "without grad the logits must be left alone"
    for i, name in enumerate(gpu.stat_slots):
        assert stats[i] == pytest.approx(expected_stats[i], rel=FP32_SUM_REL), name
    _, again = gpu.cross_entropy(logits, targets, stats_in, dtype=dtype, **kwargs)
    assert_bitwise_equal(stats, again, "cross_entropy stats")


@pytest.mark.parametrize("backend, n", cuda_cases([1, 1000, 16_385, 10_000_019], [1, 1000, 16_385, 2_100_001]))
def test_sum_squares(cpu, gpu, n):
    x = normal(np.random.default_rng(13), n)
    got = gpu.sum_squares(x, out=[3.0])[0]
    assert got == pytest.approx(cpu.sum_squares(x, out=[3.0])[0], rel=1e-5)
    assert got == gpu.sum_squares(x, out=[3.0])[0], "two runs differ"


@pytest.mark.parametrize("backend", cuda_cases())
@pytest.mark.parametrize(
    "tokens, squares, grad_clip",
    [([100, 50], [400.0, 500.0], 0.0), ([100, 50], [400.0, 500.0], 1.0),
     ([10, 20, 30], [900.0, 1600.0, 2500.0], 0.5), ([0, 0], [0.0, 0.0], 1.0), ([7], [1e-12], 1.0)],
)
def test_optimizer_scale(cpu, gpu, tokens, squares, grad_clip):
    gathered = np.zeros((len(tokens), cpu.gather_stride), np.float32)
    gathered[:, cpu.stat_slots.index("tokens")] = tokens
    gathered[:, -1] = squares
    assert_array_close(gpu.optimizer_scale(gathered, grad_clip), cpu.optimizer_scale(gathered, grad_clip), 1e-6,
                       "optimizer_scale")


@pytest.mark.parametrize("backend", cuda_cases())
@pytest.mark.parametrize("dtype, state_dtype", [("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "bf16")])
def test_adamw(cpu, gpu, dtype, state_dtype):
    """Three steps; each step gives both backends the cuda state so far, so a
    bf16 step differs from the fp32 one by one (stochastic) rounding only."""
    rng = np.random.default_rng(14)
    n = 1_000_003 if gpu.backend == "cuda" else 70_001
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    (param,) = inputs(dtype, normal(rng, n))
    # A state from earlier steps: v >= m^2 keeps the updates O(lr / (1 - beta1)).
    m0 = normal(rng, n, scale=0.1)
    m, v = inputs(state_dtype, m0, m0**2 + np.abs(normal(rng, n, scale=0.01)))
    for step in (1, 2, 3):
        grad = normal(rng, n)
        expected = cpu.adamw(param, grad, m, v, scale=0.5, step=step, **hyper)
        param, m, v = gpu.adamw(param, grad, m, v, scale=0.5, step=step, seed=5, dtype=dtype,
                                state_dtype=state_dtype, **hyper)
        for name, got, want, t in zip(("param", "m", "v"), (param, m, v), expected, (dtype, state_dtype, state_dtype)):
            assert_array_close(got, want, tolerance(t), f"adamw {name} after step {step}")


@pytest.mark.parametrize("backend", cuda_cases())
def test_adamw_bf16_stochastic_rounding_is_reproducible_per_seed(gpu):
    rng = np.random.default_rng(15)
    p, grad = to_bf16(normal(rng, 100_000)), normal(rng, 100_000)
    m = v = np.zeros_like(p)
    run = lambda seed: gpu.adamw(p, grad, m, v, lr=1e-3, step=1, seed=seed, dtype="bf16")  # noqa: E731
    first, again, other = run(1), run(1), run(2)
    for a, b in zip(first, again):
        assert_bitwise_equal(a, b, "adamw bf16, same seed")
    assert not np.array_equal(first[0], other[0]), "another seed must round some parameters differently"
