"""The composite ops (backend.h): each backend's implementation against the
interface's default body, and the default bodies against a float64 PyTorch
reference.

A composite's default body composes the primitives; a backend may override
it with a fused kernel. The `..._matches_default_composition` tests run every
composite through the op harness (its entries in op_table.cpp) twice on the
same inputs, once as the backend implements it and once with
use_default=True (the default body, and the default bodies of the composites
it calls, over the backend's primitives), on the cpu backend
(float32, bitwise) and the emulated cuda backend (float32 and bf16). `test_composite_matches_reference` holds both against an
independent PyTorch float64 composition, so a wrong default (or a wrong
override) fails there.
"""

import pathlib
import re

import numpy as np
import pytest
import torch

from nanoq.testing import OpRunner, op_table
from conftest import IGNORE, assert_array_close, cuda_cases, require_cuda_emulator, rope_table, use_cuda_backend

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Shapes: rows = B*T = 64, GQA with 4 query heads over 2 kv heads; rows at
# least every width, so that the cpu backend runs its fused overrides (it
# falls back to the default for fewer rows than columns), in two parts.
B, T, H, K, D, C, I = 2, 32, 4, 2, 8, 32, 48
ROWS = B * T
QW, KW = H * D, K * D
EPS = 1e-5


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def t64(x):
    return torch.tensor(np.asarray(x, dtype=np.float64), dtype=torch.float64)


def n64(x):
    return x.detach().numpy()


# --------------------------------------------------------------------------
# The float64 reference compositions (PyTorch, autograd for the backward ops)
# --------------------------------------------------------------------------


def ref_rmsnorm(x, w):
    rstd = torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS)
    return x * rstd * w, rstd[..., 0]


def ref_rope(x, cos_sin, heads):
    """x [rows, heads*D] rotated per position (half-split convention)."""
    x = x.reshape(B, T, heads, D)
    c = t64(cos_sin[..., 0])[None, :, None, :]
    s = t64(cos_sin[..., 1])[None, :, None, :]
    a, b = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], -1).reshape(ROWS, heads * D)


def ref_qkv(x, qkv, bias, q_norm, k_norm, cos_sin):
    """The packed projection, q/k norms and RoPE: q, k, v, q_raw, k_raw, q_rstd, k_rstd."""
    y = x @ qkv.T + (bias if bias is not None else 0.0)
    q_raw, k_raw, v = y[:, :QW], y[:, QW:QW + KW], y[:, QW + KW:]
    q, k, q_rstd, k_rstd = q_raw, k_raw, None, None
    if q_norm is not None:
        q, q_rstd = ref_rmsnorm(q_raw.reshape(-1, D), q_norm)
        k, k_rstd = ref_rmsnorm(k_raw.reshape(-1, D), k_norm)
        q, k = q.reshape(ROWS, QW), k.reshape(ROWS, KW)
    return ref_rope(q, cos_sin, H), ref_rope(k, cos_sin, K), v, q_raw, k_raw, q_rstd, k_rstd


def silu(x):
    return x * torch.sigmoid(x)


# --------------------------------------------------------------------------
# The cases: arrays and params of one call, and the reference of what it writes
# --------------------------------------------------------------------------


def qkv_params(qk_norm):
    return dict(batch=B, time=T, heads=H, kv_heads=K, head_dim=D, hidden=C, eps=EPS, qk_norm=int(qk_norm))


def qkv_inputs(rng, qk_norm, bias):
    a = dict(x=normal(rng, ROWS, C), qkv=normal(rng, QW + 2 * KW, C, scale=0.3), cos_sin=rope_table(T, D))
    if bias:
        a["qkv_bias"] = normal(rng, QW + 2 * KW, scale=0.5)
    if qk_norm:
        a["q_norm"] = 1.0 + normal(rng, D, scale=0.2)
        a["k_norm"] = 1.0 + normal(rng, D, scale=0.2)
    return a


def qkv_reference(a, qk_norm, grads=None):
    """The forward results as float64 numpy and, with `grads` (dq, dk, dv of
    the rotated q, k and v), the input gradients by autograd."""
    x, w = t64(a["x"]).requires_grad_(), t64(a["qkv"]).requires_grad_()
    b = t64(a["qkv_bias"]).requires_grad_() if "qkv_bias" in a else None
    qn = t64(a["q_norm"]).requires_grad_() if qk_norm else None
    kn = t64(a["k_norm"]).requires_grad_() if qk_norm else None
    q, k, v, q_raw, k_raw, q_rstd, k_rstd = ref_qkv(x, w, b, qn, kn, a["cos_sin"])
    out = dict(q=n64(q), k=n64(k), v=n64(v))
    if qk_norm:
        out.update(q_raw=n64(q_raw), k_raw=n64(k_raw), q_rstd=n64(q_rstd), k_rstd=n64(k_rstd))
    if grads is not None:
        torch.autograd.backward([q, k, v], [t64(g) for g in grads])
        out.update(dx=n64(x.grad), dqkv=n64(w.grad))
        if b is not None:
            out["dqkv_bias"] = n64(b.grad)
        if qk_norm:
            out.update(dq_norm=n64(qn.grad), dk_norm=n64(kn.grad))
    return out


def pre_rope_gradients(a, qk_norm, dq, dk):
    """d(loss)/d(projected q, k) for upstream dq, dk of the rotated ones, by autograd."""
    q_raw = t64(a["q_raw"] if qk_norm else a["q"]).requires_grad_()
    k_raw = t64(a["k_raw"] if qk_norm else a["k"]).requires_grad_()
    qn = t64(a["q_norm"]).requires_grad_() if qk_norm else None
    kn = t64(a["k_norm"]).requires_grad_() if qk_norm else None
    q, k = q_raw, k_raw
    if qk_norm:
        q = ref_rmsnorm(q_raw.reshape(-1, D), qn)[0].reshape(ROWS, QW)
        k = ref_rmsnorm(k_raw.reshape(-1, D), kn)[0].reshape(ROWS, KW)
    torch.autograd.backward([ref_rope(q, a["cos_sin"], H), ref_rope(k, a["cos_sin"], K)], [t64(dq), t64(dk)])
    out = dict(dq=n64(q_raw.grad), dk=n64(k_raw.grad))
    if qk_norm:
        out.update(dq_norm=n64(qn.grad), dk_norm=n64(kn.grad))
    return out


def forward_activations(a, qk_norm):
    """The saved activations the backward ops read, from the float64 reference (as float32)."""
    ref = qkv_reference(a, qk_norm)
    return {name: ref[name].astype(np.float32) for name in ("q_raw", "k_raw", "q_rstd", "k_rstd") if name in ref}


def case_matmul_epilogue(rng, accumulate, with_bias, scale, out_f32=False):
    M, N, Kd = 12, 20, 16
    a = dict(a=normal(rng, Kd, M), b=normal(rng, N, Kd), out=normal(rng, M, N))  # trans_a, trans_b
    if with_bias:
        a["bias"] = normal(rng, N)
    p = dict(M=M, N=N, K=Kd, trans_a=1, trans_b=1, accumulate=int(accumulate), scale=scale, out_f32=int(out_f32))

    def ref(a):
        y = scale * (t64(a["a"]).T @ t64(a["b"]).T) + (t64(a["bias"]) if with_bias else 0.0)
        return dict(out=n64(y + (t64(a["out"]) if accumulate else 0.0)))

    return a, p, ref


def case_matmul_input_grad(rng, accumulate):
    n, k = 24, 20
    a = dict(dy=normal(rng, ROWS, n), weight=normal(rng, n, k))
    if accumulate:
        a["dx"] = normal(rng, ROWS, k)

    def ref(a):
        return dict(dx=n64(t64(a["dy"]) @ t64(a["weight"]) + (t64(a["dx"]) if accumulate else 0.0)))

    return a, dict(rows=ROWS, n=n, k=k, accumulate=int(accumulate)), ref


def case_matmul_weight_grad(rng, with_bias):
    n, k = 24, 20
    a = dict(dy=normal(rng, ROWS, n), x=normal(rng, ROWS, k), dweight=normal(rng, n, k))
    if with_bias:
        a["dbias"] = normal(rng, n)

    def ref(a):
        out = dict(dweight=n64(t64(a["dweight"]) + t64(a["dy"]).T @ t64(a["x"])))
        if with_bias:
            out["dbias"] = n64(t64(a["dbias"]) + t64(a["dy"]).sum(0))
        return out

    return a, dict(rows=ROWS, n=n, k=k), ref


def case_matmul_backward(rng, accumulate, with_bias, frozen):
    n, k = 24, 20
    a = dict(dy=normal(rng, ROWS, n), weight=normal(rng, n, k), x=normal(rng, ROWS, k), dweight=normal(rng, n, k))
    if accumulate:
        a["dx"] = normal(rng, ROWS, k)
    if with_bias:
        a["dbias"] = normal(rng, n)

    def ref(a):
        out = dict(dx=n64(t64(a["dy"]) @ t64(a["weight"]) + (t64(a["dx"]) if accumulate else 0.0)),
                   dweight=n64(t64(a["dweight"]) + (0.0 if frozen else t64(a["dy"]).T @ t64(a["x"]))))
        if with_bias:
            out["dbias"] = n64(t64(a["dbias"]) + (0.0 if frozen else t64(a["dy"]).sum(0)))
        return out

    return a, dict(rows=ROWS, n=n, k=k, accumulate=int(accumulate), frozen=int(frozen)), ref


def case_residual_rmsnorm_forward(rng, into_delta):
    a = dict(residual=normal(rng, ROWS, C), delta=normal(rng, ROWS, C), weight=1.0 + normal(rng, C, scale=0.2))

    def ref(a):
        r = t64(a["residual"]) + t64(a["delta"])
        y, rstd = ref_rmsnorm(r, t64(a["weight"]))
        return {"residual_out": n64(r), "out": n64(y), "rstd": n64(rstd)}

    return a, dict(eps=EPS, into_delta=into_delta), ref


def case_residual_rmsnorm_backward(rng):
    r = normal(rng, ROWS, C)
    w = 1.0 + normal(rng, C, scale=0.2)
    rstd = (1.0 / np.sqrt((r.astype(np.float64) ** 2).mean(-1) + EPS)).astype(np.float32)
    a = dict(dresidual=normal(rng, ROWS, C), dweight=normal(rng, C), dout=normal(rng, ROWS, C), residual_out=r,
             weight=w, rstd=rstd)

    def ref(a):
        x, wt = t64(a["residual_out"]).requires_grad_(), t64(a["weight"]).requires_grad_()
        torch.autograd.backward(ref_rmsnorm(x, wt)[0], t64(a["dout"]))
        return dict(dresidual=n64(t64(a["dresidual"]) + x.grad), dweight=n64(t64(a["dweight"]) + wt.grad))

    return a, {}, ref


def case_qkv_forward(rng, qk_norm, bias):
    a = qkv_inputs(rng, qk_norm, bias)
    for name, width in (("q", QW), ("k", KW), ("v", KW)):
        a[name] = np.zeros((ROWS, width), np.float32)
    if qk_norm:
        a.update(q_raw=np.zeros((ROWS, QW), np.float32), k_raw=np.zeros((ROWS, KW), np.float32),
                 q_rstd=np.zeros(ROWS * H, np.float32), k_rstd=np.zeros(ROWS * K, np.float32))
    return a, qkv_params(qk_norm), lambda a: qkv_reference(a, qk_norm)


def case_qkv_projection(rng, qk_norm, bias):
    a = qkv_inputs(rng, qk_norm, bias)
    del a["cos_sin"]
    names = ("q_raw", "k_raw", "v") if qk_norm else ("q", "k", "v")
    for name, width in zip(names, (QW, KW, KW)):
        a[name] = np.zeros((ROWS, width), np.float32)

    def ref(a):
        y = t64(a["x"]) @ t64(a["qkv"]).T + (t64(a["qkv_bias"]) if bias else 0.0)
        return dict(zip(names, (n64(y[:, :QW]), n64(y[:, QW:QW + KW]), n64(y[:, QW + KW:]))))

    return a, qkv_params(qk_norm), ref


def case_qk_norm_rope_forward(rng, qk_norm):
    a = dict(cos_sin=rope_table(T, D))
    if qk_norm:
        a.update(q_norm=1.0 + normal(rng, D, scale=0.2), k_norm=1.0 + normal(rng, D, scale=0.2),
                 q_raw=normal(rng, ROWS, QW), k_raw=normal(rng, ROWS, KW), q=np.zeros((ROWS, QW), np.float32),
                 k=np.zeros((ROWS, KW), np.float32), q_rstd=np.zeros(ROWS * H, np.float32),
                 k_rstd=np.zeros(ROWS * K, np.float32))
    else:
        a.update(q=normal(rng, ROWS, QW), k=normal(rng, ROWS, KW))

    def ref(a):
        q, k = t64(a["q_raw"] if qk_norm else a["q"]), t64(a["k_raw"] if qk_norm else a["k"])
        out = {}
        if qk_norm:
            q, q_rstd = ref_rmsnorm(q.reshape(-1, D), t64(a["q_norm"]))
            k, k_rstd = ref_rmsnorm(k.reshape(-1, D), t64(a["k_norm"]))
            q, k = q.reshape(ROWS, QW), k.reshape(ROWS, KW)
            out.update(q_rstd=n64(q_rstd), k_rstd=n64(k_rstd))
        out.update(q=n64(ref_rope(q, a["cos_sin"], H)), k=n64(ref_rope(k, a["cos_sin"], K)))
        return out

    return a, qkv_params(qk_norm), ref


def case_qk_norm_rope_backward(rng, qk_norm):
    a = dict(cos_sin=rope_table(T, D), dq=normal(rng, ROWS, QW), dk=normal(rng, ROWS, KW))
    if qk_norm:
        full = qkv_inputs(rng, True, False)
        a.update(q_norm=full["q_norm"], k_norm=full["k_norm"], dq_norm=normal(rng, D), dk_norm=normal(rng, D))
        a.update(forward_activations(full, True))
    else:
        a.update(q=normal(rng, ROWS, QW), k=normal(rng, ROWS, KW))  # the reference's inputs only

    def ref(a):
        g = pre_rope_gradients(a, qk_norm, a["dq"], a["dk"])
        if qk_norm:
            g["dq_norm"] = g["dq_norm"] + a["dq_norm"]
            g["dk_norm"] = g["dk_norm"] + a["dk_norm"]
        return g

    if not qk_norm:  # q and k are the reference's only, not the op's
        return a, qkv_params(qk_norm), ref, ("q", "k")
    return a, qkv_params(qk_norm), ref


def case_qkv_projection_backward(rng, bias, accumulate, frozen):
    a = qkv_inputs(rng, False, bias)
    del a["cos_sin"]
    a.update(dq=normal(rng, ROWS, QW), dk=normal(rng, ROWS, KW), dv=normal(rng, ROWS, KW), dx=normal(rng, ROWS, C))
    if not frozen:
        a["dqkv"] = normal(rng, QW + 2 * KW, C)
        if bias:
            a["dqkv_bias"] = normal(rng, QW + 2 * KW)

    def ref(a):
        dy = torch.cat([t64(a["dq"]), t64(a["dk"]), t64(a["dv"])], 1)
        out = dict(dx=n64(dy @ t64(a["qkv"]) + (t64(a["dx"]) if accumulate else 0.0)))
        if not frozen:
            out["dqkv"] = n64(t64(a["dqkv"]) + dy.T @ t64(a["x"]))
            if bias:
                out["dqkv_bias"] = n64(t64(a["dqkv_bias"]) + dy.sum(0))
        return out

    p = dict(qkv_params(False), accumulate=int(accumulate), frozen=int(frozen))
    return a, p, ref


def case_qkv_backward(rng, qk_norm, bias, accumulate, frozen=False):
    a = qkv_inputs(rng, qk_norm, bias)
    a.update(forward_activations(a, qk_norm))
    a.update(dq=normal(rng, ROWS, QW), dk=normal(rng, ROWS, KW), dv=normal(rng, ROWS, KW), dx=normal(rng, ROWS, C))
    if not frozen:
        a["dqkv"] = normal(rng, QW + 2 * KW, C)
        if bias:
            a["dqkv_bias"] = normal(rng, QW + 2 * KW)
    if qk_norm:
        a.update(dq_norm=normal(rng, D), dk_norm=normal(rng, D))

    def ref(a):
        g = qkv_reference(a, qk_norm, grads=(a["dq"], a["dk"], a["dv"]))
        # (RoPE is linear: without q/k norms the gradient needs no values of q and k.)
        zeros = dict(q=np.zeros((ROWS, QW), np.float32), k=np.zeros((ROWS, KW), np.float32))
        pre = pre_rope_gradients(dict(a, **zeros), qk_norm, a["dq"], a["dk"])
        out = dict(dx=g["dx"] + (a["dx"] if accumulate else 0.0), dq=pre["dq"], dk=pre["dk"])
        if not frozen:
            out["dqkv"] = g["dqkv"] + a["dqkv"]
            if bias:
                out["dqkv_bias"] = g["dqkv_bias"] + a["dqkv_bias"]
        if qk_norm:
            out.update(dq_norm=g["dq_norm"] + a["dq_norm"], dk_norm=g["dk_norm"] + a["dk_norm"])
        return out

    return a, dict(qkv_params(qk_norm), accumulate=int(accumulate), frozen=int(frozen)), ref


def case_gate_up_forward(rng, op):
    a = dict(x=normal(rng, ROWS, C), gate_up=normal(rng, 2 * I, C, scale=0.3), gate=np.zeros((ROWS, I), np.float32),
             up=np.zeros((ROWS, I), np.float32))
    if op == "gate_up_swiglu_forward":
        a["out"] = np.zeros((ROWS, I), np.float32)

    def ref(a):
        y = t64(a["x"]) @ t64(a["gate_up"]).T
        g, u = y[:, :I], y[:, I:]
        out = dict(gate=n64(g), up=n64(u))
        if op == "gate_up_swiglu_forward":
            out["out"] = n64(silu(g) * u)
        return out

    return a, {}, ref


def case_gate_up_projection_backward(rng, accumulate, frozen):
    a = dict(x=normal(rng, ROWS, C), gate_up=normal(rng, 2 * I, C, scale=0.3), dgate=normal(rng, ROWS, I),
             dup=normal(rng, ROWS, I), dx=normal(rng, ROWS, C))
    if not frozen:
        a["dgate_up"] = normal(rng, 2 * I, C)

    def ref(a):
        dy = torch.cat([t64(a["dgate"]), t64(a["dup"])], 1)
        out = dict(dx=n64(dy @ t64(a["gate_up"]) + (t64(a["dx"]) if accumulate else 0.0)))
        if not frozen:
            out["dgate_up"] = n64(t64(a["dgate_up"]) + dy.T @ t64(a["x"]))
        return out

    return a, dict(accumulate=int(accumulate), frozen=int(frozen)), ref


def case_swiglu_gate_up_backward(rng, accumulate, alias):
    x, w = normal(rng, ROWS, C), normal(rng, 2 * I, C, scale=0.3)
    y = x.astype(np.float64) @ w.T.astype(np.float64)
    a = dict(x=x, gate_up=w, gate=y[:, :I].astype(np.float32), up=y[:, I:].astype(np.float32),
             dx=normal(rng, ROWS, C), dgate_up=normal(rng, 2 * I, C))
    dout = normal(rng, ROWS, I)
    a["dout"] = dout

    def ref(a):
        g, u = t64(a["gate"]).requires_grad_(), t64(a["up"]).requires_grad_()
        torch.autograd.backward(silu(g) * u, t64(dout))
        dy = torch.cat([g.grad, u.grad], 1)
        return dict(dgate=n64(g.grad), dup=n64(u.grad),
                    dx=n64(dy @ t64(a["gate_up"]) + (t64(a["dx"]) if accumulate else 0.0)),
                    dgate_up=n64(t64(a["dgate_up"]) + dy.T @ t64(a["x"])))

    return a, dict(accumulate=int(accumulate), alias=int(alias)), ref


def case_classifier(rng, with_grad, rows, vocab, chunk_rows, z_loss=1e-3):
    channels, time = 16, 96
    targets = rng.integers(0, vocab, rows).astype(np.int32)
    targets[::7] = IGNORE
    a = dict(hidden=normal(rng, rows, channels), lm_head=normal(rng, vocab, channels, scale=0.5), targets=targets,
             stats=np.array([1.5, 2.0, 1.0, 1.0, 3.0, 4.0, 0.5]))
    if with_grad:
        a["dlm_head"] = normal(rng, vocab, channels)
    p = dict(chunk_rows=chunk_rows, time=time, z_loss=z_loss, with_grad=int(with_grad))

    def ref(a):
        h, w = t64(a["hidden"]).requires_grad_(), t64(a["lm_head"]).requires_grad_()
        logits = h @ w.T
        lse = torch.logsumexp(logits, -1)
        counted = torch.tensor(targets != IGNORE)
        picked = logits.gather(1, torch.tensor(np.where(targets != IGNORE, targets, 0)).long()[:, None])[:, 0]
        loss = (lse - picked)[counted]
        z = z_loss * lse[counted] ** 2
        first_1k = torch.tensor((np.arange(rows) % time) < 1024) & counted
        stats = a["stats"].astype(np.float64).copy()
        stats[0] += float(loss.detach().sum())
        stats[1] += float(counted.sum())
        stats[2] += float((lse - picked)[first_1k].detach().sum())
        stats[3] += float(first_1k.sum())
        stats[4] += float(lse[counted].detach().sum())
        stats[5] = max(stats[5], float(lse[counted].detach().max()))
        stats[6] += float(z.detach().sum())
        out = dict(stats=stats)
        if with_grad:
            (loss.sum() + z.sum()).backward()
            out.update(dhidden=n64(h.grad), dlm_head=n64(t64(a["dlm_head"]) + w.grad))
        return out

    return a, p, ref


# id -> (op, case builder). Each builder takes an rng and returns the arrays,
# the params, the reference (arrays -> the expected written arrays) and
# optionally the names that are the reference's inputs only.
CASES = {
    "matmul_epilogue": ("matmul_epilogue", lambda r: case_matmul_epilogue(r, False, True, 0.5)),
    "matmul_epilogue-accumulate": ("matmul_epilogue", lambda r: case_matmul_epilogue(r, True, True, 1.0)),
    "matmul_epilogue-nobias": ("matmul_epilogue", lambda r: case_matmul_epilogue(r, False, False, 1.0)),
    "matmul_epilogue-float32-out": ("matmul_epilogue", lambda r: case_matmul_epilogue(r, True, True, 1.0, True)),
    "matmul_input_grad": ("matmul_input_grad", lambda r: case_matmul_input_grad(r, False)),
    "matmul_input_grad-accumulate": ("matmul_input_grad", lambda r: case_matmul_input_grad(r, True)),
    "matmul_weight_grad": ("matmul_weight_grad", lambda r: case_matmul_weight_grad(r, True)),
    "matmul_weight_grad-nobias": ("matmul_weight_grad", lambda r: case_matmul_weight_grad(r, False)),
    "matmul_backward": ("matmul_backward", lambda r: case_matmul_backward(r, False, True, False)),
    "matmul_backward-accumulate-nobias": ("matmul_backward", lambda r: case_matmul_backward(r, True, False, False)),
    "matmul_backward-frozen": ("matmul_backward", lambda r: case_matmul_backward(r, True, True, True)),
    "residual_rmsnorm_forward": ("residual_rmsnorm_forward", lambda r: case_residual_rmsnorm_forward(r, False)),
    "residual_rmsnorm_forward-into-delta": ("residual_rmsnorm_forward",
                                            lambda r: case_residual_rmsnorm_forward(r, True)),
    "residual_rmsnorm_backward": ("residual_rmsnorm_backward", case_residual_rmsnorm_backward),
    "qkv_forward": ("qkv_forward", lambda r: case_qkv_forward(r, False, False)),
    "qkv_forward-bias": ("qkv_forward", lambda r: case_qkv_forward(r, False, True)),
    "qkv_forward-qk_norm": ("qkv_forward", lambda r: case_qkv_forward(r, True, False)),
    "qkv_forward-qk_norm-bias": ("qkv_forward", lambda r: case_qkv_forward(r, True, True)),
    "qkv_projection": ("qkv_projection", lambda r: case_qkv_projection(r, False, False)),
    "qkv_projection-bias": ("qkv_projection", lambda r: case_qkv_projection(r, False, True)),
    "qkv_projection-qk_norm": ("qkv_projection", lambda r: case_qkv_projection(r, True, False)),
    "qk_norm_rope_forward": ("qk_norm_rope_forward", lambda r: case_qk_norm_rope_forward(r, False)),
    "qk_norm_rope_forward-qk_norm": ("qk_norm_rope_forward", lambda r: case_qk_norm_rope_forward(r, True)),
    "qk_norm_rope_backward": ("qk_norm_rope_backward", lambda r: case_qk_norm_rope_backward(r, False)),
    "qk_norm_rope_backward-qk_norm": ("qk_norm_rope_backward", lambda r: case_qk_norm_rope_backward(r, True)),
    "qkv_projection_backward-bias": ("qkv_projection_backward",
                                     lambda r: case_qkv_projection_backward(r, True, False, False)),
    "qkv_projection_backward-accumulate-frozen": ("qkv_projection_backward",
                                                  lambda r: case_qkv_projection_backward(r, False, True, True)),
    "qkv_projection_backward-bias-accumulate": ("qkv_projection_backward",
                                                lambda r: case_qkv_projection_backward(r, True, True, False)),
    "qkv_backward-bias": ("qkv_backward", lambda r: case_qkv_backward(r, False, True, False)),
    "qkv_backward-qk_norm-accumulate": ("qkv_backward", lambda r: case_qkv_backward(r, True, False, True)),
    "qkv_backward-qk_norm-bias-frozen": ("qkv_backward", lambda r: case_qkv_backward(r, True, True, False, True)),
    "qkv_backward": ("qkv_backward", lambda r: case_qkv_backward(r, False, False, False)),
    "gate_up_projection": ("gate_up_projection", lambda r: case_gate_up_forward(r, "gate_up_projection")),
    "gate_up_swiglu_forward": ("gate_up_swiglu_forward", lambda r: case_gate_up_forward(r, "gate_up_swiglu_forward")),
    "gate_up_projection_backward": ("gate_up_projection_backward",
                                    lambda r: case_gate_up_projection_backward(r, False, False)),
    "gate_up_projection_backward-accumulate-frozen": ("gate_up_projection_backward",
                                                      lambda r: case_gate_up_projection_backward(r, True, True)),
    "swiglu_gate_up_backward": ("swiglu_gate_up_backward", lambda r: case_swiglu_gate_up_backward(r, False, False)),
    "swiglu_gate_up_backward-aliased-accumulate": ("swiglu_gate_up_backward",
                                                   lambda r: case_swiglu_gate_up_backward(r, True, True)),
    "classifier": ("classifier", lambda r: case_classifier(r, True, 40, 96, 16)),  # chunks of 16, 16 and 8 rows
    "classifier-loss-only": ("classifier", lambda r: case_classifier(r, False, 40, 96, 16)),
    "classifier-one-chunk": ("classifier", lambda r: case_classifier(r, True, 40, 96, 64)),
}


def build(case_id, seed=0):
    op, builder = CASES[case_id]
    built = builder(np.random.default_rng(seed))
    arrays, params, ref = built[:3]
    reference_only = built[3] if len(built) > 3 else ()
    op_arrays = {name: value for name, value in arrays.items() if name not in reference_only}
    return op, op_arrays, params, ref, arrays


# The table's shapes of the tensors the cases build flat: q/k/v-like ones
# are [rows, heads, head_dim], the packed gate|up weight [2, I, C].
TABLE_SHAPES = {
    **{name: (ROWS, H, D) for name in ("q", "q_raw", "dq")},
    **{name: (ROWS, K, D) for name in ("k", "k_raw", "v", "dk", "dv")},
    "q_rstd": (ROWS, H), "k_rstd": (ROWS, K),
    "gate_up": (2, I, C), "dgate_up": (2, I, C),
}


def call(runner, op, arrays, params, dtype="fp32", default=False):
    """Runs `op` through the op harness; returns its results by name. Outputs
    among `arrays` are the op's (left out), as are in/outs that only
    accumulate (out, dx) when `accumulate` is off; sizes the table infers
    from the tensors are left out of the params."""
    spec = op_table()[op]
    roles = {a["name"]: a["role"] for a in spec["args"]}
    kwargs = {}
    accumulating = bool(params.get("accumulate", 0))
    for name, value in arrays.items():
        assert name in roles, (op, name)
        if roles[name] == "output" or (name in ("out", "dx") and not accumulating):
            continue
        value = np.asarray(value)
        kwargs[name] = value.reshape(TABLE_SHAPES[name]) if name in TABLE_SHAPES else value
    for name, value in params.items():
        if name == "out_f32":
            if value:
                kwargs["out_dtype"] = "fp32"
        elif name in roles:
            kwargs[name] = bool(value) if roles[name] == "bool" else value
    results = runner.run(op, **kwargs, dtype=dtype, use_default=default)
    results = results if isinstance(results, tuple) else (results,)
    return dict(zip(spec["results"], results))


def composite_ops():
    """The composite ops of the op interface: backend.h's methods after its composite marker."""
    text = (ROOT / "cuda_core" / "backend.h").read_text()
    section = text[text.index("---- Composite ops"):]
    return set(re.findall(r"virtual void (\w+)\(", section[:section.index("};")]))


def test_every_composite_has_a_harness_entry_and_cases():
    ops = composite_ops()
    assert {"qkv_forward", "classifier", "swiglu_gate_up_backward"} <= ops
    assert ops <= set(op_table())
    assert {op for op, _ in CASES.values()} == ops


@pytest.fixture(scope="module")
def cpu():
    return OpRunner("cpu")


@pytest.fixture(scope="module")
def emulated():
    require_cuda_emulator()
    return OpRunner("cuda_emulated")


# Tolerances of an override against the default: float32 fusions reorder
# sums (relative 1e-5 of the array's scale); in bf16 the two may round an
# intermediate differently (a few bf16 ulps).
OVERRIDE_REL = {"fp32": 1e-5, "bf16": 3e-2}


def assert_same_nans_and_close(actual, expected, rel, what):
    """Outputs an op does not write (q_raw without q/k norms) come back NaN from both."""
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual), nan, what)
    if (~nan).any():
        assert_array_close(actual[~nan], expected[~nan].astype(np.float64), rel, what, atol=1e-6)


@pytest.mark.parametrize("case_id", list(CASES))
def test_cpu_backend_matches_default_composition_bitwise(cpu, case_id):
    """The cpu overrides are bitwise their default composition (each thread
    runs the unfused ops' very arithmetic on its block of rows), which
    recompute relies on: it reruns parts of a fused forward unfused."""
    op, arrays, params, _, _ = build(case_id)
    own = call(cpu, op, arrays, params)
    default = call(cpu, op, arrays, params, default=True)
    assert own.keys() == default.keys()
    for name in own:
        np.testing.assert_array_equal(own[name], default[name], f"{op} {name}")


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_backend_matches_default_composition_cuda_emulated(emulated, case_id, dtype):
    op, arrays, params, _, _ = build(case_id)
    own = call(emulated, op, arrays, params, dtype=dtype)
    default = call(emulated, op, arrays, params, dtype=dtype, default=True)
    assert own.keys() == default.keys()
    for name in own:
        assert_same_nans_and_close(own[name], default[name], OVERRIDE_REL[dtype], f"{op} {name}")


@pytest.fixture(scope="module")
def gpu(cuda_device):
    return OpRunner("cuda", cuda_device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_backend_matches_default_composition_on_gpu(gpu, case_id, dtype):
    """The same on the real cuda backend, where the overrides' blocks run
    concurrently and the matmuls are cuBLASLt's."""
    op, arrays, params, _, _ = build(case_id)
    own = call(gpu, op, arrays, params, dtype=dtype)
    default = call(gpu, op, arrays, params, dtype=dtype, default=True)
    assert own.keys() == default.keys()
    for name in own:
        assert_same_nans_and_close(own[name], default[name], OVERRIDE_REL[dtype], f"{op} {name}")


def check_against_reference(runner, case_id, default, rel):
    op, arrays, params, ref, all_arrays = build(case_id, seed=1)
    result = call(runner, op, arrays, params, default=default)
    expected = ref(all_arrays)
    assert expected, case_id
    for name, value in expected.items():
        assert_array_close(result[name], np.asarray(value, np.float64).reshape(result[name].shape), rel,
                           f"{op} {name}")


@pytest.mark.parametrize("default", [True, False], ids=["default", "cpu-override"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_composite_matches_reference(cpu, case_id, default):
    check_against_reference(cpu, case_id, default, 2e-5)


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("case_id", ["qkv_forward-qk_norm", "qkv_backward-qk_norm-accumulate",
                                     "swiglu_gate_up_backward", "residual_rmsnorm_forward-into-delta", "classifier"])
def test_cuda_emulated_composite_matches_reference(emulated, case_id):
    check_against_reference(emulated, case_id, False, 2e-5)


def test_classifier_over_many_chunks_matches_reference(cpu):
    """600 rows of 8192 logits, in chunks of 128 rows (the last one 88)."""
    arrays, params, ref = case_classifier(np.random.default_rng(3), True, 600, 8192, 128)
    result = call(cpu, "classifier", arrays, params)
    for name, value in ref(arrays).items():
        assert_array_close(result[name], np.asarray(value).reshape(result[name].shape), 2e-5, name)


def test_bad_composite_calls_raise_value_errors(cpu):
    op, arrays, params, _, _ = build("matmul_epilogue-accumulate")
    with pytest.raises(ValueError, match="a scale applies to a fresh product only"):
        call(cpu, op, arrays, dict(params, scale=2.0))
    op, arrays, params, _, _ = build("qkv_forward-qk_norm")
    with pytest.raises(ValueError, match="give q_norm and k_norm together"):
        call(cpu, op, {k: v for k, v in arrays.items() if k != "k_norm"}, params)
    with pytest.raises(ValueError, match=r"qkv must have \(heads \+ 2 kv_heads\) \* head_dim rows"):
        call(cpu, op, dict(arrays, qkv=arrays["qkv"][:-1]), params)
    with pytest.raises(ValueError, match="float32 only"):
        call(cpu, op, arrays, params, dtype="bf16")


# --------------------------------------------------------------------------
# The cuda overrides' other paths. The shapes above take the fused kernels'
# 16-byte vector path in float32 and, for head_dim 8, the element-wise one in
# bf16; these add head_dims with several lanes per head (vectors in bf16
# too), head_dims and channels that are no multiple of the 16-byte chunk
# (element-wise), rows of several chunks per thread, and the determinism of
# the one-kernel weight-gradient sums, whose last block changes with the
# emulator's block order (shuffled per launch).
# --------------------------------------------------------------------------


@pytest.fixture
def cuda_runner(backend, request):
    """The OpRunner of the test's cuda backend: the emulator everywhere, a GPU where there is one."""
    return request.getfixturevalue("gpu" if use_cuda_backend(backend, request) == "cuda" else "emulated")


def run_own_and_default(runner, op, dtype, **kwargs):
    spec = op_table()[op]
    own = runner.run(op, **kwargs, dtype=dtype, use_default=False)
    default = runner.run(op, **kwargs, dtype=dtype, use_default=True)
    return dict(zip(spec["results"], own)), dict(zip(spec["results"], default))


def assert_override_close(own, default, dtype, op):
    assert own.keys() == default.keys()
    for name in own:
        assert_same_nans_and_close(own[name], default[name], OVERRIDE_REL[dtype], f"{op} {name}")


def qk_norm_inputs(rng, head_dim, batch=2, time=4, heads=4, kv_heads=2):
    rows = batch * time
    shape = dict(batch=batch, time=time, heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=EPS)
    return shape, dict(q_raw=normal(rng, rows, heads, head_dim), k_raw=normal(rng, rows, kv_heads, head_dim),
                       q_norm=1.0 + normal(rng, head_dim, scale=0.2), k_norm=1.0 + normal(rng, head_dim, scale=0.2),
                       cos_sin=rope_table(time, head_dim))


@pytest.mark.parametrize("backend", cuda_cases())
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [12, 16, 64])
def test_fused_qk_norm_rope_matches_default_composition_at_other_head_dims(cuda_runner, head_dim, dtype):
    """head_dim 12: element-wise (6 pairs per half); 16: vectors in both
    dtypes; 64: 4 (bf16) or 8 (fp32) lanes per head."""
    rng = np.random.default_rng(head_dim)
    shape, a = qk_norm_inputs(rng, head_dim)
    own, default = run_own_and_default(cuda_runner, "qk_norm_rope_forward", dtype, **shape, **a)
    assert_override_close(own, default, dtype, "qk_norm_rope_forward")
    backward = dict(q_raw=a["q_raw"], k_raw=a["k_raw"], q_norm=a["q_norm"], k_norm=a["k_norm"],
                    cos_sin=a["cos_sin"], q_rstd=default["q_rstd"], k_rstd=default["k_rstd"],
                    dq=normal(rng, *a["q_raw"].shape), dk=normal(rng, *a["k_raw"].shape),
                    dq_norm=normal(rng, head_dim), dk_norm=normal(rng, head_dim))
    own, default = run_own_and_default(cuda_runner, "qk_norm_rope_backward", dtype, **shape, **backward)
    assert_override_close(own, default, dtype, "qk_norm_rope_backward")
    # Without the norms: RoPE alone on q and k, in place.
    rope = dict(q=a["q_raw"], k=a["k_raw"], cos_sin=a["cos_sin"])
    own, default = run_own_and_default(cuda_runner, "qk_norm_rope_forward", dtype, **shape, **rope)
    assert_override_close(own, default, dtype, "qk_norm_rope_forward without norms")
    own, default = run_own_and_default(cuda_runner, "qk_norm_rope_backward", dtype, **shape,
                                       dq=backward["dq"], dk=backward["dk"], cos_sin=a["cos_sin"])
    assert_override_close(own, default, dtype, "qk_norm_rope_backward without norms")


@pytest.mark.parametrize("backend", cuda_cases())
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("channels", [36, 4100])
def test_fused_residual_rmsnorm_is_bitwise_the_composition(cuda_runner, channels, dtype):
    """The fused forward gives bitwise the add and the norm of the default
    (recompute reruns the norm alone); 36 channels are element-wise in bf16,
    4100 take two chunks per thread in float32 (and are element-wise in both
    dtypes). The backward (the one-kernel rmsnorm_backward) against float64."""
    rng = np.random.default_rng(channels)
    rows = 6
    a = dict(residual=normal(rng, rows, channels), delta=normal(rng, rows, channels),
             weight=1.0 + normal(rng, channels, scale=0.2))
    for into_delta in (False, True):
        own, default = run_own_and_default(cuda_runner, "residual_rmsnorm_forward", dtype, **a, eps=EPS,
                                           into_delta=into_delta)
        for name in own:
            np.testing.assert_array_equal(own[name], default[name], f"residual_rmsnorm_forward {name}")
    r, w = own["residual_out"], a["weight"]
    rstd = (1.0 / np.sqrt((r.astype(np.float64) ** 2).mean(-1) + EPS)).astype(np.float32)
    b = dict(dout=normal(rng, rows, channels), residual_out=r, weight=w, rstd=rstd,
             dresidual=normal(rng, rows, channels), dweight=normal(rng, channels))
    dresidual, dweight = cuda_runner.run("residual_rmsnorm_backward", **b, dtype="fp32")
    x, wt = t64(r).requires_grad_(), t64(w).requires_grad_()
    torch.autograd.backward(ref_rmsnorm(x, wt)[0], t64(b["dout"]))
    assert_array_close(dresidual, n64(t64(b["dresidual"]) + x.grad), 2e-5, "dresidual")
    assert_array_close(dweight, n64(t64(b["dweight"]) + wt.grad), 2e-5, "dweight")


@pytest.mark.parametrize("backend", cuda_cases())
def test_fused_weight_gradient_sums_are_deterministic(cuda_runner):
    """The q/k norm and rmsnorm weight gradients of the one-kernel backwards
    are bitwise equal over runs (each launch shuffles the emulator's block
    order, and a GPU's blocks race, so the block that adds the partials
    differs)."""
    rng = np.random.default_rng(7)
    shape, a = qk_norm_inputs(rng, 16, batch=4, time=16, heads=4, kv_heads=2)  # 384 head rows: 12 blocks in fp32
    fwd = dict(zip(op_table()["qk_norm_rope_forward"]["results"],
                   cuda_runner.run("qk_norm_rope_forward", **shape, **a)))
    b = dict(q_raw=a["q_raw"], k_raw=a["k_raw"], q_norm=a["q_norm"], k_norm=a["k_norm"], cos_sin=a["cos_sin"],
             q_rstd=fwd["q_rstd"], k_rstd=fwd["k_rstd"], dq=normal(rng, *a["q_raw"].shape),
             dk=normal(rng, *a["k_raw"].shape))
    runs = [cuda_runner.run("qk_norm_rope_backward", **shape, **b) for _ in range(3)]
    for other in runs[1:]:
        for first, again in zip(runs[0], other):
            np.testing.assert_array_equal(first, again)
    x, w = normal(rng, 600, 8), 1.0 + normal(rng, 8, scale=0.2)  # 600 rows: 150 blocks of 4 rows
    rstd = (1.0 / np.sqrt((x.astype(np.float64) ** 2).mean(-1) + EPS)).astype(np.float32)
    dy = normal(rng, 600, 8)
    runs = [cuda_runner.run("residual_rmsnorm_backward", dout=dy, residual_out=x, weight=w, rstd=rstd)
            for _ in range(3)]
    for other in runs[1:]:
        for first, again in zip(runs[0], other):
            np.testing.assert_array_equal(first, again)


@pytest.mark.cuda_emulated
def test_rmsnorm_rows_beyond_the_cuda_kernels_reach_raise_value_error(emulated):
    """8192 16-byte chunks per row at most: 32768 float32 channels."""
    w = np.ones(32772, np.float32)
    with pytest.raises(ValueError, match="rmsnorm of 32772 channels: at most 32768 are supported"):
        emulated.rmsnorm_forward(np.ones((1, 32772), np.float32), w)
