"""Every op of the cpu backend against an independent float64 numpy reference.

The ops run one at a time through nanoq.testing.OpRunner, the harness that
test_gpu_ops.py uses to compare the cuda backend with the cpu one; these
tests prove the harness itself (shapes, in/out roles, accumulation, aliasing,
NaN-filled outputs) as well as the cpu backend. Tolerances: fp32 results
within 1e-5 of the largest reference magnitude (2e-5 where long fp32 sums
meet cancellation: attention backward, rmsnorm backward, the classifier).
"""

import math

import numpy as np
import pytest

from nanoq.testing import OpRunner
from conftest import IGNORE, assert_array_close, require_cuda_emulator, rope_table

REL = 1e-5
SUM_REL = 2e-5


@pytest.fixture(scope="module")
def cpu():
    return OpRunner("cpu")


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def f64(x):
    return np.asarray(x, dtype=np.float64)


# --------------------------------------------------------------------------
# Float64 references
# --------------------------------------------------------------------------


def ref_rmsnorm(x, w, eps):
    x = f64(x)
    rstd = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return x * rstd * f64(w), rstd[..., 0]


def ref_rmsnorm_backward(dy, x, w, rstd):
    """Gradients of y = (x * rstd(x)) * w, rstd = 1 / sqrt(mean(x^2) + eps)."""
    dy, x, w, rstd = f64(dy), f64(x), f64(w), f64(rstd)[..., None]
    n = x * rstd
    dn = dy * w
    dx = rstd * (dn - n * (dn * n).mean(-1, keepdims=True))
    dw = (dy * n).reshape(-1, x.shape[-1]).sum(0)
    return dx, dw


def ref_rope(x, cos_sin, direction=1.0):
    """Half-split rotation: (x[i], x[i + D/2]) by angle direction * theta[t, i]."""
    x = f64(x)
    half = x.shape[-1] // 2
    c = f64(cos_sin[..., 0])[None, :, None, :]
    s = direction * f64(cos_sin[..., 1])[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def attention_mask(B, T, positions=None, causal=True):
    """[B, T, T] bool: whether query t attends key u. Causal: u <= t and, with
    per-token positions [B, T] (packed documents), u in t's document, which
    starts at t - positions[t]; not causal: every key."""
    if not causal:
        return np.ones((B, T, T), dtype=bool)
    t, u = np.arange(T)[:, None], np.arange(T)[None, :]
    mask = np.broadcast_to(u <= t, (B, T, T))
    if positions is not None:
        start = np.arange(T)[None, :] - np.asarray(positions)  # [B, T]: each query's document start
        mask = mask & (u[None] >= start[:, :, None])
    return mask


def packed_positions(rng, B, T):
    """Random document lengths packed into each row: positions [B, T] int32."""
    positions = np.zeros((B, T), np.int32)
    for b in range(B):
        t = 0
        while t < T:
            n = int(rng.integers(1, max(2, T // 2) + 1))
            positions[b, t:t + n] = np.arange(min(n, T - t))
            t += n
    return positions


def ref_attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(D)) v, kv head h // (H / Hkv), over the keys of
    `mask` (attention_mask; default causal). Returns out, lse [B,H,T], probs."""
    q, k, v = f64(q), f64(k), f64(v)
    B, T, H, D = q.shape
    group = H // k.shape[2]
    kh = np.repeat(k, group, axis=2)  # [B, T, H, D]
    vh = np.repeat(v, group, axis=2)
    scores = np.einsum("bthd,buhd->bhtu", q, kh) / math.sqrt(D)
    visible = attention_mask(B, T) if mask is None else mask
    scores = np.where(visible[:, None], scores, -np.inf)
    m = scores.max(-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(scores - m).sum(-1))
    probs = np.exp(scores - lse[..., None])
    out = np.einsum("bhtu,buhd->bthd", probs, vh)
    return out, lse, probs


def ref_attention_backward(dout, q, k, v, mask=None):
    q, k, v, dout = f64(q), f64(k), f64(v), f64(dout)
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    group = H // Hkv
    _, _, probs = ref_attention(q, k, v, mask)
    kh = np.repeat(k, group, axis=2)
    vh = np.repeat(v, group, axis=2)
    dprobs = np.einsum("bthd,buhd->bhtu", dout, vh)
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True)) / math.sqrt(D)
    dq = np.einsum("bhtu,buhd->bthd", dscores, kh)
    dkh = np.einsum("bhtu,bthd->buhd", dscores, q)
    dvh = np.einsum("bhtu,bthd->buhd", probs, dout)
    dk = dkh.reshape(B, T, Hkv, group, D).sum(3)
    dv = dvh.reshape(B, T, Hkv, group, D).sum(3)
    return dq, dk, dv


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def ref_cross_entropy(logits, targets, first_position, time, z_loss, stats_in):
    """(gradient of sum(CE + z_loss * lse^2), statistics) of one chunk of rows."""
    x = f64(logits)
    counted = targets != IGNORE
    m = x.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(-1))
    picked = x[np.arange(len(x)), np.where(counted, targets, 0)]
    loss = lse - picked
    first_1k = ((first_position + np.arange(len(x))) % time < 1024) & counted
    stats = f64(stats_in).copy()
    stats[0] += loss[counted].sum()
    stats[1] += counted.sum()
    stats[2] += loss[first_1k].sum()
    stats[3] += first_1k.sum()
    stats[4] += lse[counted].sum()
    if counted.any():
        stats[5] = max(stats[5], lse[counted].max())
    stats[6] += (z_loss * lse[counted] ** 2).sum()
    grad = np.exp(x - lse[:, None]) * (1.0 + 2.0 * z_loss * lse[:, None])
    grad[np.arange(len(x)), np.where(counted, targets, 0)] -= counted
    grad[~counted] = 0.0
    return grad, stats


def ref_adamw(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step):
    """torch.optim.AdamW's update (decoupled decay first, bias-corrected moments)."""
    p, g, m, v = f64(p), f64(g), f64(m), f64(v)
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    step_size = lr / (1.0 - beta1**step)
    denom = np.sqrt(v) / math.sqrt(1.0 - beta2**step) + eps
    return p - step_size * m / denom, m, v


# --------------------------------------------------------------------------
# Harness basics
# --------------------------------------------------------------------------


def test_copy_and_fill_roundtrip_float32(cpu):
    rng = np.random.default_rng(0)
    x = normal(rng, 3, 5, 7)
    assert np.array_equal(cpu.copy(x), x)
    assert np.array_equal(cpu.fill(36, -2.5).reshape(4, 9), np.full((4, 9), -2.5, np.float32))


def test_inputs_are_not_modified_and_results_are_new_arrays(cpu):
    rng = np.random.default_rng(1)
    logits, keep = normal(rng, 4, 10), None
    keep = logits.copy()
    grad, _ = cpu.cross_entropy(logits, np.array([1, 2, IGNORE, 3]))
    assert np.array_equal(logits, keep)
    assert not np.shares_memory(grad, logits)


def test_bad_calls_raise_value_errors_that_say_what_is_wrong(cpu):
    table = np.zeros((10, 4), np.float32)
    with pytest.raises(ValueError, match=r"tokens\[2\] = 10 is outside \[0, vocab_size 10\)"):
        cpu.embedding_forward(np.array([0, 1, 10]), table)
    with pytest.raises(ValueError, match=r"targets\[0\] = -1"):
        cpu.cross_entropy(np.zeros((1, 10), np.float32), np.array([-1]))
    with pytest.raises(ValueError, match="float32 only"):
        cpu.add(np.ones(3), np.ones(3), dtype="bf16")
    with pytest.raises(ValueError, match='"fp32" or "bf16"'):
        cpu.add(np.ones(3), np.ones(3), dtype="fp16")
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        x = np.zeros((1, 4, 3, 8), np.float32)
        cpu.attention_forward(x, x[:, :, :2], x[:, :, :2])
    with pytest.raises(ValueError, match=r"b has shape \(4, 5\); expected \[K,N\] with K = 3 \(from a\)"):
        cpu.matmul(np.zeros((2, 3)), np.zeros((4, 5)))
    with pytest.raises(ValueError, match="device 5000000 of the cpu backend"):
        OpRunner("cpu", 5_000_000)


# --------------------------------------------------------------------------
# Matmul, bias, elementwise
# --------------------------------------------------------------------------


def check_matmul(runner, M, N, K, trans_a, trans_b, accumulate, seed=2):
    """runner's op(a) @ op(b) [M, N] (added to an initial out with
    `accumulate`) against float64 numpy; returns runner's result."""
    rng = np.random.default_rng(seed)
    a = normal(rng, K, M) if trans_a else normal(rng, M, K)
    b = normal(rng, N, K) if trans_b else normal(rng, K, N)
    initial = normal(rng, M, N) if accumulate else None
    out = runner.matmul(a, b, trans_a=trans_a, trans_b=trans_b, accumulate_into=initial)
    expected = (f64(a).T if trans_a else f64(a)) @ (f64(b).T if trans_b else f64(b))
    if accumulate:
        expected += initial
    assert_array_close(out, expected, REL, f"matmul {M}x{N}x{K} trans_a={trans_a} trans_b={trans_b}")
    return out


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_all_transposes_and_accumulate(cpu, trans_a, trans_b, accumulate):
    check_matmul(cpu, 37, 70, 53, trans_a, trans_b, accumulate)  # N = 70 >= 64 takes the threaded split


def test_add_bias_and_bias_backward_accumulates(cpu):
    rng = np.random.default_rng(3)
    out, bias = normal(rng, 1100, 19), normal(rng, 19)
    assert_array_close(cpu.add_bias(out, bias), f64(out) + f64(bias), REL, "add_bias")
    dout, dbias = normal(rng, 1100, 19), normal(rng, 19)
    assert_array_close(cpu.bias_backward(dout), f64(dout).sum(0), REL, "bias_backward")
    assert_array_close(cpu.bias_backward(dout, dbias), f64(dbias) + f64(dout).sum(0), REL, "bias_backward +=")


def test_add_and_accumulate(cpu):
    rng = np.random.default_rng(4)
    a, b = normal(rng, 3, 1001), normal(rng, 3, 1001)
    assert_array_close(cpu.add(a, b), f64(a) + f64(b), REL, "add")
    assert_array_close(cpu.accumulate(a, b), f64(a) + f64(b), REL, "accumulate")


# --------------------------------------------------------------------------
# Embedding, rmsnorm, rope
# --------------------------------------------------------------------------


def test_embedding_forward_and_backward_with_repeated_tokens(cpu):
    rng = np.random.default_rng(5)
    vocab, channels = 11, 40
    tokens = rng.integers(0, 4, size=(3, 50)).astype(np.int32)  # 150 rows over 4 ids
    tokens[0, 0] = vocab - 1
    table = normal(rng, vocab, channels)
    out = cpu.embedding_forward(tokens, table)
    assert out.shape == (3, 50, channels)
    assert np.array_equal(out, table[tokens])
    dout = normal(rng, 3, 50, channels)
    initial = normal(rng, vocab, channels)
    expected = f64(initial).copy()
    np.add.at(expected, tokens.reshape(-1), f64(dout).reshape(-1, channels))
    assert_array_close(cpu.embedding_backward(dout, tokens, initial), expected, REL, "embedding_backward")


def test_rmsnorm_forward(cpu):
    rng = np.random.default_rng(6)
    x, w = normal(rng, 2, 33, 72, scale=3.0), normal(rng, 72)
    out, rstd = cpu.rmsnorm_forward(x, w, eps=1e-5)
    expected, expected_rstd = ref_rmsnorm(x, w, 1e-5)
    assert_array_close(out, expected, REL, "rmsnorm out")
    assert_array_close(rstd, expected_rstd.reshape(-1), REL, "rmsnorm rstd")


@pytest.mark.parametrize("mode", ["overwrite", "accumulate", "alias"])
def test_rmsnorm_backward(cpu, mode):
    rng = np.random.default_rng(7)
    rows, channels = 70, 48
    x, w, dy = normal(rng, rows, channels), normal(rng, channels), normal(rng, rows, channels)
    _, rstd = cpu.rmsnorm_forward(x, w, eps=1e-6)
    dweight, dinp0 = normal(rng, channels), normal(rng, rows, channels)
    dx, dw = cpu.rmsnorm_backward(dy, x, w, rstd, dweight=dweight, alias=mode == "alias",
                                  dinp_accumulate_into=dinp0 if mode == "accumulate" else None)
    expected_dx, expected_dw = ref_rmsnorm_backward(dy, x, w, rstd)
    if mode == "accumulate":
        expected_dx += dinp0
    assert_array_close(dx, expected_dx, SUM_REL, "rmsnorm dinp")
    assert_array_close(dw, f64(dweight) + expected_dw, SUM_REL, "rmsnorm dweight")


def test_rmsnorm_backward_matches_finite_differences(cpu):
    """Pins the analytic reference above to the forward op itself."""
    rng = np.random.default_rng(8)
    x, w, dy = f64(normal(rng, 3, 6)), f64(normal(rng, 6)), f64(normal(rng, 3, 6))
    eps, h = 1e-6, 1e-6
    _, rstd = ref_rmsnorm(x, w, eps)
    dx, dw = ref_rmsnorm_backward(dy, x, w, rstd)
    loss = lambda x_, w_: float((ref_rmsnorm(x_, w_, eps)[0] * dy).sum())  # noqa: E731
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        assert abs((loss(x + e, w) - loss(x - e, w)) / (2 * h) - dx[i]) < 1e-6
    for j in range(6):
        e = np.zeros_like(w)
        e[j] = h
        assert abs((loss(x, w + e) - loss(x, w - e)) / (2 * h) - dw[j]) < 1e-6


def test_rope_forward_and_backward(cpu):
    rng = np.random.default_rng(9)
    B, T, H, D = 2, 13, 3, 16
    x, cos_sin = normal(rng, B, T, H, D), rope_table(T, D)
    y = cpu.rope_forward(x, cos_sin)
    assert_array_close(y, ref_rope(x, cos_sin), REL, "rope forward")
    dy = normal(rng, B, T, H, D)
    # The backward is the transposed rotation, i.e. the rotation by -theta.
    assert_array_close(cpu.rope_backward(dy, cos_sin), ref_rope(dy, cos_sin, -1.0), REL, "rope backward")
    assert_array_close(cpu.rope_backward(y, cos_sin), x, REL, "rope backward(forward(x))")
    # <rope(x), dy> == <x, rope_backward(dy)>
    lhs = float((f64(y) * dy).sum())
    rhs = float((f64(x) * cpu.rope_backward(dy, cos_sin)).sum())
    assert abs(lhs - rhs) <= 1e-5 * abs(lhs) + 1e-5


# --------------------------------------------------------------------------
# Attention, swiglu
# --------------------------------------------------------------------------

ATTENTION_SHAPES = [  # (batch, time, heads, kv_heads, head_dim)
    (1, 1, 2, 2, 8),
    (2, 17, 4, 4, 8),  # group 1
    (1, 23, 4, 2, 16),  # group 2
    (2, 9, 7, 1, 6),  # group 7, head_dim not a power of two
]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_forward(cpu, shape):
    B, T, H, Hkv, D = shape
    rng = np.random.default_rng(10)
    q, k, v = normal(rng, B, T, H, D, scale=2.0), normal(rng, B, T, Hkv, D, scale=2.0), normal(rng, B, T, Hkv, D)
    out, lse = cpu.attention_forward(q, k, v)
    expected_out, expected_lse, _ = ref_attention(q, k, v)
    assert_array_close(out, expected_out, REL, "attention out")
    assert_array_close(lse, expected_lse, REL, "attention lse")


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_decode_is_the_last_row_of_causal_attention(cpu, shape):
    """Generation's one query over the cache (one sequence: the shapes' batch is unused)."""
    _, T, H, Hkv, D = shape
    rng = np.random.default_rng(12)
    q, k, v = normal(rng, 1, T, H, D, scale=2.0), normal(rng, 1, T, Hkv, D, scale=2.0), normal(rng, 1, T, Hkv, D)
    out = cpu.attention_decode(q[0, -1], k[0], v[0])
    expected_out, _, _ = ref_attention(q, k, v)
    assert out.shape == (H, D)
    assert_array_close(out, expected_out[0, -1], REL, "attention_decode out")


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_backward(cpu, shape):
    B, T, H, Hkv, D = shape
    rng = np.random.default_rng(11)
    q, k, v = normal(rng, B, T, H, D, scale=2.0), normal(rng, B, T, Hkv, D, scale=2.0), normal(rng, B, T, Hkv, D)
    dout = normal(rng, B, T, H, D)
    out, lse = cpu.attention_forward(q, k, v)
    dq, dk, dv = cpu.attention_backward(dout, out, lse, q, k, v)
    expected = ref_attention_backward(dout, q, k, v)
    # atol: at T = 1, dq is exactly zero but fp32 rounding of the softmax leaves ~1e-7.
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        assert_array_close(got, want, SUM_REL, f"attention {name}", atol=1e-6)


MASKED_ATTENTION_SHAPES = [(2, 17, 4, 2, 8), (1, 40, 2, 1, 6)]


@pytest.mark.parametrize("mask", ["documents", "bidirectional"])
@pytest.mark.parametrize("shape", MASKED_ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_with_document_positions_or_bidirectional_matches_reference(cpu, shape, mask):
    """positions keep each query inside its packed document; causal=False attends every key."""
    B, T, H, Hkv, D = shape
    rng = np.random.default_rng(14)
    q, k, v = normal(rng, B, T, H, D, scale=2.0), normal(rng, B, T, Hkv, D, scale=2.0), normal(rng, B, T, Hkv, D)
    dout = normal(rng, B, T, H, D)
    if mask == "documents":
        positions = packed_positions(rng, B, T)
        assert (positions == 0).sum() > B  # several documents per row
        args, reference_mask = {"positions": positions}, attention_mask(B, T, positions)
    else:
        args, reference_mask = {"causal": False}, attention_mask(B, T, causal=False)
    out, lse = cpu.attention_forward(q, k, v, **args)
    expected_out, expected_lse, _ = ref_attention(q, k, v, reference_mask)
    assert_array_close(out, expected_out, REL, "attention out")
    assert_array_close(lse, expected_lse, REL, "attention lse")
    # The mask matters: the plain causal attention differs.
    assert np.abs(out - cpu.attention_forward(q, k, v)[0]).max() > 1e-3
    got = cpu.attention_backward(dout, out, lse, q, k, v, **args)
    for name, g, want in zip(("dq", "dk", "dv"), got, ref_attention_backward(dout, q, k, v, reference_mask)):
        assert_array_close(g, want, SUM_REL, f"attention {name}", atol=1e-6)


def test_attention_refuses_positions_without_the_causal_mask(cpu):
    rng = np.random.default_rng(15)
    q = normal(rng, 1, 4, 2, 8)
    with pytest.raises(ValueError, match="causal"):
        cpu.attention_forward(q, q, q, positions=np.zeros((1, 4), np.int32), causal=False)


def test_swiglu_forward_and_backward(cpu):
    rng = np.random.default_rng(12)
    gate, up, dout = normal(rng, 5, 301, scale=3.0), normal(rng, 5, 301), normal(rng, 5, 301)
    g, u, d = f64(gate), f64(up), f64(dout)
    assert_array_close(cpu.swiglu_forward(gate, up), g * sigmoid(g) * u, REL, "swiglu out")
    expected_dgate = d * u * (sigmoid(g) + g * sigmoid(g) * (1.0 - sigmoid(g)))
    expected_dup = d * g * sigmoid(g)
    for alias in (False, True):
        dgate, dup = cpu.swiglu_backward(dout, gate, up, alias=alias)
        assert_array_close(dgate, expected_dgate, REL, f"swiglu dgate (alias={alias})")
        assert_array_close(dup, expected_dup, REL, f"swiglu dup (alias={alias})")


# --------------------------------------------------------------------------
# Classifier, reductions, optimizer
# --------------------------------------------------------------------------


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
@pytest.mark.parametrize("with_grad", [True, False])
def test_cross_entropy(cpu, z_loss, with_grad):
    rng = np.random.default_rng(13)
    rows, vocab = 40, 300
    logits = normal(rng, rows, vocab, scale=3.0)
    targets = rng.integers(0, vocab, rows).astype(np.int32)
    targets[::7] = IGNORE
    stats_in = np.array([1.0, 2.0, 0.5, 1.0, 3.0, 4.0, 0.25], np.float32)  # statistics of earlier chunks
    got, stats = cpu.cross_entropy(logits, targets, stats_in, z_loss=z_loss, with_grad=with_grad)
    grad, expected_stats = ref_cross_entropy(logits, targets, 0, rows, z_loss, stats_in)
    if with_grad:
        assert_array_close(got, grad, REL, "cross_entropy grad")
        assert np.all(got[::7] == 0.0)
    else:
        assert np.array_equal(got, logits)
    slots = cpu.stat_slots
    assert stats[slots.index("tokens")] == stats_in[1] + (targets != IGNORE).sum()
    for i, name in enumerate(slots):
        assert stats[i] == pytest.approx(expected_stats[i], rel=SUM_REL), name


def test_cross_entropy_counts_only_the_first_1024_positions_in_the_1k_slots(cpu):
    rng = np.random.default_rng(14)
    vocab, time = 16, 1200
    # A chunk starting at position 1000 of a 1200-long sequence and wrapping
    # into the next sequence: positions 1000..1199, then 0..99.
    rows, first = 300, 1000
    logits = normal(rng, rows, vocab)
    targets = rng.integers(0, vocab, rows).astype(np.int32)
    targets[5] = IGNORE  # position 1005: not counted anywhere
    _, stats = cpu.cross_entropy(logits, targets, first_position=first, time=time, with_grad=False)
    _, expected = ref_cross_entropy(logits, targets, first, time, 0.0, [0, 0, 0, 0, 0, -np.inf, 0])
    slots = cpu.stat_slots
    assert stats[slots.index("tokens_1k")] == 23 + 100
    assert stats[slots.index("tokens")] == rows - 1
    for i, name in enumerate(slots):
        assert stats[i] == pytest.approx(expected[i], rel=SUM_REL), name


def test_cross_entropy_of_only_ignored_rows_adds_nothing(cpu):
    logits = np.ones((3, 8), np.float32)
    grad, stats = cpu.cross_entropy(logits, np.full(3, IGNORE, np.int32))
    assert np.all(grad == 0.0)
    slots = cpu.stat_slots
    assert stats[slots.index("lse_max")] == -np.inf
    assert all(stats[i] == 0.0 for i, name in enumerate(slots) if name != "lse_max")


# Float32 statistics count exactly only up to 2^24 = 16,777,216 tokens: 2^24 + 1
# is no float32 (it rounds back to 2^24), and a loss sum of that many tokens
# (~4e7) is held to +-2 only. The statistics are float64, on every backend.
FLOAT32_EXACT_COUNTS = 2**24


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda_emulated", marks=pytest.mark.cuda_emulated)])
def stats_runner(request):
    if request.param == "cuda_emulated":
        require_cuda_emulator()
    return OpRunner(request.param)


def stats_after(runner, tokens, **sums):
    """Statistics of earlier chunks: `tokens` counted (all in the first 1024 positions), and `sums`."""
    slots = runner.stat_slots
    stats = np.zeros(len(slots), np.float64)
    stats[slots.index("lse_max")] = -np.inf
    stats[slots.index("tokens")] = stats[slots.index("tokens_1k")] = tokens
    for name, value in sums.items():
        stats[slots.index(name)] = value
    return stats


def test_cross_entropy_counts_stay_exact_past_2_pow_24_tokens(stats_runner):
    rng = np.random.default_rng(20)
    slots = stats_runner.stat_slots
    logits = normal(rng, 9, 32)
    targets = rng.integers(0, 32, 9).astype(np.int32)
    targets[[2, 5]] = IGNORE  # 7 counted rows
    stats = stats_after(stats_runner, FLOAT32_EXACT_COUNTS)
    _, stats = stats_runner.cross_entropy(logits, targets, stats, with_grad=False)
    # As Python numbers: numpy would round the right-hand side to a float32 stats' dtype.
    assert float(stats[slots.index("tokens")]) == FLOAT32_EXACT_COUNTS + 7
    assert float(stats[slots.index("tokens_1k")]) == FLOAT32_EXACT_COUNTS + 7
    assert stats.dtype == np.float64
    # One counted row at a time: each chunk adds exactly one token.
    for _ in range(3):
        _, stats = stats_runner.cross_entropy(logits[:1], targets[:1], stats, with_grad=False)
    assert float(stats[slots.index("tokens")]) == FLOAT32_EXACT_COUNTS + 10
    assert float(stats[slots.index("tokens_1k")]) == FLOAT32_EXACT_COUNTS + 10


def test_cross_entropy_adds_to_large_loss_sums_at_float64_precision(stats_runner):
    rng = np.random.default_rng(21)
    rows, vocab = 64, 50
    logits = normal(rng, rows, vocab, scale=2.0)
    targets = rng.integers(0, vocab, rows).astype(np.int32)
    # 2^24 earlier tokens at a loss near 2.5 and an lse near 4.
    earlier = dict(loss_sum=41_943_039.123456789, loss_1k_sum=41_943_041.987654321, lse_sum=67_108_863.55,
                   z_loss_sum=16_777.216123)
    stats_in = stats_after(stats_runner, FLOAT32_EXACT_COUNTS, **earlier)
    _, stats = stats_runner.cross_entropy(logits, targets, stats_in, z_loss=1e-3, with_grad=False)
    _, expected = ref_cross_entropy(logits, targets, 0, rows, 1e-3, stats_in)  # float64
    slots = stats_runner.stat_slots
    for name in earlier:
        i = slots.index(name)
        # What this chunk added (~64 losses of ~4): float32 sums would be off by up to 2 here.
        assert stats[i] - stats_in[i] == pytest.approx(expected[i] - stats_in[i], rel=SUM_REL), name


def test_sum_squares_accumulates_over_several_blocks(cpu):
    rng = np.random.default_rng(15)
    x = normal(rng, 100_003)  # several of the backend's 16384-element blocks
    assert cpu.sum_squares(x)[0] == pytest.approx(float((f64(x) ** 2).sum()), rel=1e-6)
    assert cpu.sum_squares(x, out=[7.0])[0] == pytest.approx(7.0 + float((f64(x) ** 2).sum()), rel=1e-6)


def gathered_rows(runner, tokens, squares):
    gathered = np.zeros((len(tokens), runner.gather_stride), np.float32)
    gathered[:, runner.stat_slots.index("tokens")] = tokens
    gathered[:, runner.gather_stride - 1] = squares
    return gathered


@pytest.mark.parametrize(
    "tokens, squares, grad_clip",
    [
        ([100, 50], [400.0, 500.0], 0.0),  # no clipping
        ([100, 50], [400.0, 500.0], 1.0),  # norm 0.2 < 1: not clipped
        ([10, 20, 30], [900.0, 1600.0, 2500.0], 0.5),  # norm ~1.17 > 0.5: clipped
        ([0, 0], [0.0, 0.0], 1.0),  # no counted tokens: nothing to learn from, the update is skipped
    ],
)
def test_optimizer_scale(cpu, tokens, squares, grad_clip):
    scale, norm, skip = cpu.optimizer_scale(gathered_rows(cpu, tokens, squares), grad_clip)
    n = sum(tokens)
    assert skip == (1.0 if n == 0 else 0.0)
    if n == 0:
        assert (scale, norm) == (0.0, 0.0)
        return
    expected_norm = math.sqrt(sum(squares)) / n
    clip = grad_clip / expected_norm if 0 < grad_clip < expected_norm else 1.0
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    assert scale == pytest.approx(clip / n, rel=1e-6)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_optimizer_scale_flags_non_finite_squares_and_losses(cpu, bad):
    rows = gathered_rows(cpu, [10, 20], [4.0, 9.0])
    rows[1, cpu.stat_slots.index("loss_sum")] = bad
    assert cpu.optimizer_scale(rows, 1.0)[2] == 1.0
    rows = gathered_rows(cpu, [10, 20], [4.0, bad])
    assert cpu.optimizer_scale(rows, 1.0)[2] == 1.0


def test_adamw_follows_pytorch_formula_over_steps(cpu):
    rng = np.random.default_rng(16)
    n = 1000
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    p, m, v = normal(rng, n), np.zeros(n, np.float32), np.zeros(n, np.float32)
    rp, rm, rv = f64(p), f64(m), f64(v)
    for step in (1, 2, 3):
        grad, scale = normal(rng, n), 0.25
        p, m, v = cpu.adamw(p, grad, m, v, scale=scale, step=step, **hyper)
        rp, rm, rv = ref_adamw(rp, f64(grad) * scale, rm, rv, step=step, **hyper)
        assert_array_close(p, rp, REL, f"param after step {step}")
        assert_array_close(m, rm, REL, f"m after step {step}")
        assert_array_close(v, rv, REL, f"v after step {step}")


def test_adamw_reference_matches_torch_adamw():
    """Pins ref_adamw to torch.optim.AdamW itself."""
    import torch

    rng = np.random.default_rng(17)
    p0 = normal(rng, 50)
    param = torch.nn.Parameter(torch.from_numpy(p0.astype(np.float64)))
    opt = torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    rp, rm, rv = f64(p0), np.zeros(50), np.zeros(50)
    for step in (1, 2, 3):
        grad = f64(normal(rng, 50))
        param.grad = torch.from_numpy(grad)
        opt.step()
        rp, rm, rv = ref_adamw(rp, grad, rm, rv, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                               step=step)
    np.testing.assert_allclose(rp, param.detach().numpy(), rtol=1e-12, atol=1e-14)
