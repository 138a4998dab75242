"""Each op and composite of nanoq's op table against PyTorch's equivalent, on one GPU, in one run.

Shapes are those of a Qwen2.5-0.5B training step (hidden 896, 14 query heads
and 2 kv heads of head_dim 64, intermediate 4864, vocab 151936) at B=8,
T=1024 (rows = B*T = 8192), dtype bf16. Every op of the core's table
(cuda_core/op_harness/op_table.cpp) has a case here (CASES; a test holds
the two lists equal): its arguments for nanoq's op harness, the same work
in PyTorch, and the work done (FLOPs, or bytes moved for memory-bound
ops). A composite op is timed twice: as the backend runs it (its fused
override, where there is one) and as its default composition of
primitives (use_default=True).

Timing:
- nanoq: ``OpRunner.time`` stages the call once, runs the op once untimed
  (plans, autotuning), then --repeats times back to back on the same device
  tensors; mean time of one run, from an idle device to the device done
  (host clock around a device synchronisation).
- PyTorch: the same on tensors made on the same device: one untimed run,
  then the call captured in a CUDA graph and --repeats replays of it
  between two CUDA events, so that torch's per-call Python and dispatch
  time (more than the small ops' kernels take) is not counted; a call that
  cannot be captured runs eagerly between the events, marked "(torch
  eager)", or "(torch eager, host-bound)" when issuing the calls took the
  host most of that time (on the CPU, for --smoke without a GPU: a host
  clock).
- ratio = torch time / nanoq time (> 1: nanoq is faster). Achieved TFLOP/s
  (matmuls, attention, the classifier) or GB/s (the rest: the bytes the op
  must read and write at least, in its dtypes) are nanoq's.

Causal attention counts half the T x T matmuls (forward 4*B*H*T*T*D/2
FLOPs, backward 2.5 times that); attention over packed documents (the
``-documents`` cases: rows of documents of DOCUMENT_LENGTHS tokens, as SFT
packs them) counts the query-key pairs of each document. Where the backend
has a fused attention library (cuDNN; the emulator's stand-in) the attention
cases run there, as training does, and again in nanoq's native kernels
(the "native" rows); the backward cases also run the library's
non-deterministic algorithm (the "nondeterministic" rows,
TrainOptions.attention_deterministic False: dq accumulated with atomics).
PyTorch runs SDPA, with a boolean document mask for the ``-documents`` cases.
embedding_backward-padded pads half of each row with one token, as SFT pads:
the backward adds each token's rows in order in one block, so this is its
longest run of one token.

    python bench/bench_ops.py [--out DIR] [--ops matmul,classifier] [--repeats 20]
    python bench/bench_ops.py --smoke --backend cuda_emulated   # tiny shapes, no GPU needed: the plumbing

Exit status: 0 when every case ran, 1 when one failed (recorded, the others
still run) or none ran, 3 when some ran, none failed and --time-limit skipped
the rest (bench_gpu.py's EXIT_PARTIAL), 2 when --backend cuda is asked for and
no GPU is visible.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import exit_status  # noqa: E402 - beside this file; one rule for both benchmarks' exit status

# Qwen2.5-0.5B at B=8, T=1024.
QWEN25_05B = dict(batch=8, time=1024, channels=896, heads=14, kv_heads=2, head_dim=64, intermediate=4864,
                  vocab=151936)
SMOKE = dict(batch=1, time=16, channels=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, vocab=64)
# The documents packed in turn into each row of the -documents attention cases (cut at the row's end).
DOCUMENT_LENGTHS = (300, 45, 700, 12, 130, 1, 512)
# The share of each row that is padding, one token id at the row's end as SFT pads, in the
# embedding_backward-padded case: the longest run of one token the backward's sum meets.
PAD_FRACTION = 0.5
ADAMW_ELEMENTS = {"full": 1 << 24, "smoke": 256}  # one shard-sized chunk (16.8M parameters)
CROSS_ENTROPY_ROWS = 1024  # the logits of one classifier chunk
EPS = 1e-6
BYTES = {"bf16": 2, "fp32": 4}


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


class Inputs:
    """Host arrays for nanoq (cached by name and shape: cases share them) and
    torch tensors made on the torch device."""

    def __init__(self, dims: dict, dtype: str, torch_device: str, seed: int = 0):
        import numpy as np
        import torch

        self.np, self.torch, self.dims, self.dtype = np, torch, dims, dtype
        self.rng = np.random.default_rng(seed)
        self.device = torch.device(torch_device)
        self.tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        self._cache = {}

    def normal(self, *shape, scale=1.0):
        key = ("normal", shape, scale)
        if key not in self._cache:
            self._cache[key] = (self.rng.standard_normal(shape, dtype=self.np.float32) * scale).astype(self.np.float32)
        return self._cache[key]

    def tokens(self, *shape):
        key = ("tokens", shape)
        if key not in self._cache:
            self._cache[key] = self.rng.integers(0, self.dims["vocab"], shape, dtype=self.np.int32)
        return self._cache[key]

    def rope_table(self):
        np, d = self.np, self.dims
        half = d["head_dim"] // 2
        angles = np.arange(d["time"])[:, None] * (1e6 ** (-np.arange(half) * 2.0 / d["head_dim"]))[None, :]
        return np.stack([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)

    def t(self, *shape, dtype=None, scale=1.0, grad=False):
        x = self.torch.randn(*shape, device=self.device, dtype=dtype or self.tdtype) * scale
        return x.requires_grad_(grad)

    def t_tokens(self, *shape):
        return self.torch.randint(0, self.dims["vocab"], shape, device=self.device)


# --------------------------------------------------------------------------
# Cases: one per op of the table
# --------------------------------------------------------------------------
#
# A case builder takes (Inputs, dims) and returns a dict:
#   nanoq: kwargs of the op harness call (dtype added by the runner),
#   torch: a function of no arguments doing the same work in PyTorch (its
#          tensors made in the builder),
#   flops or bytes: the work, for TFLOP/s or GB/s,
#   shape: a short description,
#   composite: True for a composite op (timed also with use_default=True).
# Builders are only called for the ops being run, so a case's tensors exist
# only while it runs.


def _rows(d):
    return d["batch"] * d["time"]


def _act(i):
    return BYTES[i.dtype]


def _matmul(n, k, name):
    def build(i, d):
        m = _rows(d)
        x, w = i.t(m, k), i.t(n, k)
        return dict(nanoq=dict(a=i.normal(m, k), b=i.normal(n, k, scale=0.05), trans_b=True),
                    torch=lambda: x @ w.T, flops=2.0 * m * n * k, shape=f"{name}: [{m}, {k}] x [{n}, {k}]^T")
    return build


def case_copy(i, d):
    n = _rows(d) * d["channels"]
    src, dst = i.t(n), i.t(n)
    return dict(nanoq=dict(x=i.normal(n), src_dtype=i.dtype, dst_dtype=i.dtype), torch=lambda: dst.copy_(src),
                bytes=2.0 * n * _act(i), shape=f"[{n}] {i.dtype} -> {i.dtype}")


def case_fill(i, d):
    n = _rows(d) * d["channels"]
    out = i.t(n)
    return dict(nanoq=dict(n=n, value=0.5), torch=lambda: out.fill_(0.5), bytes=1.0 * n * _act(i), shape=f"[{n}]")


def case_add_bias(i, d):
    m, n = _rows(d), d["channels"]
    out, bias = i.t(m, n), i.t(n)
    return dict(nanoq=dict(out=i.normal(m, n), bias=i.normal(n)), torch=lambda: out.add_(bias),
                bytes=2.0 * m * n * _act(i), shape=f"[{m}, {n}] + [{n}]")


def case_bias_backward(i, d):
    m, n = _rows(d), (d["heads"] + 2 * d["kv_heads"]) * d["head_dim"]
    dout, dbias = i.t(m, n), i.t(n, dtype=i.torch.float32)
    return dict(nanoq=dict(dout=i.normal(m, n), dbias=i.normal(n)),
                torch=lambda: dbias.add_(dout.sum(0, dtype=i.torch.float32)),
                bytes=1.0 * m * n * _act(i), shape=f"column sums of [{m}, {n}]")


def case_add(i, d):
    n = _rows(d) * d["channels"]
    a, b, out = i.t(n), i.t(n), i.t(n)
    return dict(nanoq=dict(a=i.normal(n), b=i.normal(n)), torch=lambda: i.torch.add(a, b, out=out),
                bytes=3.0 * n * _act(i), shape=f"[{n}]")


def case_accumulate(i, d):
    n = _rows(d) * d["channels"]
    out, a = i.t(n), i.t(n)
    return dict(nanoq=dict(out=i.normal(n), a=i.normal(n)), torch=lambda: out.add_(a), bytes=3.0 * n * _act(i),
                shape=f"[{n}]")


def case_scale_dropout(i, d):
    n = _rows(d) * d["channels"]
    x = i.t(n)
    return dict(nanoq=dict(x=i.normal(n), scale=1.0 / 0.9, drop=0.1, seed=1),
                torch=lambda: i.torch.nn.functional.dropout(x, p=0.1), bytes=2.0 * n * _act(i),
                shape=f"[{n}], p=0.1")


def case_embedding_forward(i, d):
    m, c, v = _rows(d), d["channels"], d["vocab"]
    tokens, table = i.t_tokens(m), i.t(v, c)
    return dict(nanoq=dict(tokens=i.tokens(m), table=i.normal(v, c)),
                torch=lambda: i.torch.nn.functional.embedding(tokens, table),
                bytes=2.0 * m * c * _act(i), shape=f"{m} rows of [{v}, {c}]")


def case_embedding_backward(i, d):
    m, c, v = _rows(d), d["channels"], d["vocab"]
    tokens, dout, grad = i.t_tokens(m), i.t(m, c), i.t(v, c, dtype=i.torch.float32)
    return dict(nanoq=dict(dout=i.normal(m, c), tokens=i.tokens(m), table_grad=i.normal(v, c)),
                torch=lambda: grad.index_add_(0, tokens, dout.float()),
                bytes=m * c * (_act(i) + 8.0), shape=f"{m} rows into [{v}, {c}] float32")


def case_embedding_backward_padded(i, d):
    m, c, v = _rows(d), d["channels"], d["vocab"]
    tokens = i.tokens(d["batch"], d["time"]).copy()
    tokens[:, d["time"] - int(d["time"] * PAD_FRACTION):] = v - 1
    tokens = tokens.reshape(m)
    torch_tokens = i.torch.as_tensor(tokens, device=i.device).long()
    dout, grad = i.t(m, c), i.t(v, c, dtype=i.torch.float32)
    return dict(nanoq=dict(dout=i.normal(m, c), tokens=tokens, table_grad=i.normal(v, c)),
                torch=lambda: grad.index_add_(0, torch_tokens, dout.float()),
                bytes=m * c * (_act(i) + 8.0),
                shape=f"{m} rows into [{v}, {c}] float32, {PAD_FRACTION:.0%} of each row one padding token")


def _rstd(x):
    """1 / rms of each row (float32), as rmsnorm_forward saves it."""
    import numpy as np

    return (1.0 / np.sqrt((x.astype(np.float64) ** 2).mean(-1) + EPS)).astype(np.float32)


def case_rmsnorm_forward(i, d):
    m, c = _rows(d), d["channels"]
    x, w = i.t(m, c), i.t(c)
    return dict(nanoq=dict(inp=i.normal(m, c), weight=i.normal(c)),
                torch=lambda: i.torch.nn.functional.rms_norm(x, (c,), w, EPS), bytes=2.0 * m * c * _act(i),
                shape=f"[{m}, {c}]")


def _torch_backward(outputs, inputs, grads):
    """A function running the backward of `outputs` (made once here) into `inputs`."""
    import torch

    return lambda: torch.autograd.grad(outputs, inputs, grads, retain_graph=True)


def case_rmsnorm_backward(i, d):
    m, c = _rows(d), d["channels"]
    x = i.normal(m, c)
    tx, tw = i.t(m, c, grad=True), i.t(c, grad=True)
    y = i.torch.nn.functional.rms_norm(tx, (c,), tw, EPS)
    return dict(nanoq=dict(dout=i.normal(m, c, scale=0.1), inp=x, weight=i.normal(c), rstd=_rstd(x)),
                torch=_torch_backward(y, (tx, tw), i.t(m, c)), bytes=3.0 * m * c * _act(i),
                shape=f"[{m}, {c}]")


def _torch_rope(x, cos, sin):
    """RoPE by rotate-half (pairs (i, i + D/2)), as transformers' Qwen2 applies it."""
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _rope_torch_tables(i, d):
    import torch

    table = torch.from_numpy(i.rope_table()).to(i.device)  # [T, D/2, 2]
    cos = torch.cat([table[..., 0]] * 2, -1)[None, :, None, :].to(i.tdtype)  # [1, T, 1, D]
    sin = torch.cat([table[..., 1]] * 2, -1)[None, :, None, :].to(i.tdtype)
    return cos, sin


def _rope_case(i, d, name):
    b, t, h, hd = d["batch"], d["time"], d["heads"], d["head_dim"]
    x = i.t(b, t, h, hd)
    cos, sin = _rope_torch_tables(i, d)
    sign = -1.0 if name == "rope_backward" else 1.0
    return dict(nanoq={"x" if name == "rope_forward" else "dx": i.normal(b, t, h, hd), "cos_sin": i.rope_table()},
                torch=lambda: _torch_rope(x, cos, sign * sin), bytes=2.0 * b * t * h * hd * _act(i),
                shape=f"[{b}, {t}, {h}, {hd}]")


def _attention_tensors(i, d, grad=False):
    b, t, h, k, hd = d["batch"], d["time"], d["heads"], d["kv_heads"], d["head_dim"]
    q, kk, v = i.t(b, t, h, hd, grad=grad), i.t(b, t, k, hd, grad=grad), i.t(b, t, k, hd, grad=grad)
    return q, kk, v


def _torch_sdpa(q, k, v):
    """q [B, T, H, D], k, v [B, T, K, D] (views, as nanoq lays them out) through SDPA's [B, H, T, D]."""
    import torch

    heads, kv_heads = q.shape[2], k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if heads != kv_heads:
        try:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        except TypeError:  # torch before 2.5
            k, v = (x.repeat_interleave(heads // kv_heads, 1) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _attention_flops(d):
    return 4.0 * d["batch"] * d["heads"] * d["time"] ** 2 * d["head_dim"] / 2


def _attention_shape(d):
    return f"causal, B={d['batch']} T={d['time']} H={d['heads']} KV={d['kv_heads']} D={d['head_dim']}"


def document_positions(d):
    """positions [B, T] of DOCUMENT_LENGTHS packed in turn into each row, each row starting one document later."""
    import numpy as np

    rows = []
    for b in range(d["batch"]):
        row, n = [], b
        while len(row) < d["time"]:
            row.extend(range(DOCUMENT_LENGTHS[n % len(DOCUMENT_LENGTHS)]))
            n += 1
        rows.append(row[:d["time"]])
    return np.array(rows, np.int32)


def _torch_document_sdpa(q, k, v, mask):
    """_torch_sdpa with a boolean [B, 1, T, T] mask (True: attend) instead of the causal flag; k and v
    widened to every query head (SDPA's GQA path does not take every mask)."""
    import torch

    heads, kv_heads = q.shape[2], k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    k, v = (x.repeat_interleave(heads // kv_heads, 1) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _document_mask(i, positions):
    """The boolean [B, 1, T, T] mask of `positions` on the torch device: key j <= query t, in t's document."""
    import torch

    pos = torch.from_numpy(positions).to(i.device)
    t = torch.arange(pos.shape[1], device=i.device)
    start = (t[None, :] - pos)[:, None, :, None]  # the first key of each query's document
    return ((t[None, None, None, :] <= t[None, None, :, None]) & (t[None, None, None, :] >= start))


def _attention_case(i, d, documents, backward, runner):
    b, t, h, kv, hd = d["batch"], d["time"], d["heads"], d["kv_heads"], d["head_dim"]
    q, k, v = i.normal(b, t, h, hd), i.normal(b, t, kv, hd), i.normal(b, t, kv, hd)
    tq, tk, tv = _attention_tensors(i, d, grad=backward)
    packed = {}
    if documents:
        positions = document_positions(d)
        packed = dict(positions=positions)
        mask = _document_mask(i, positions)
        torch_forward = lambda: _torch_document_sdpa(tq, tk, tv, mask)  # noqa: E731
        flops = 4.0 * h * hd * float((positions.astype("int64") + 1).sum())
        shape = f"{len(DOCUMENT_LENGTHS)} document lengths packed, " + _attention_shape(d)[len("causal, "):]
    else:
        torch_forward = lambda: _torch_sdpa(tq, tk, tv)  # noqa: E731
        flops, shape = _attention_flops(d), _attention_shape(d)
    if not backward:
        return dict(nanoq=dict(q=q, k=k, v=v, **packed), torch=torch_forward, flops=flops, shape=shape,
                    attention=True)
    out, lse = runner.attention_forward(q, k, v, dtype=i.dtype, **packed)  # the saved activations the backward reads
    y = torch_forward()
    return dict(nanoq=dict(dout=i.normal(b, t, h, hd), out=out, lse=lse, q=q, k=k, v=v, **packed),
                torch=_torch_backward(y, (tq, tk, tv), i.t(*y.shape)), flops=2.5 * flops, shape=shape,
                attention=True)


def case_attention_forward(i, d, runner=None):
    return _attention_case(i, d, documents=False, backward=False, runner=runner)


def case_attention_backward(i, d, runner=None):
    return _attention_case(i, d, documents=False, backward=True, runner=runner)


def case_attention_decode(i, d, runner=None):
    """One query (a sequence's next token) over `time` cached positions: torch's SDPA with one query row."""
    t, h, kv, hd = d["time"], d["heads"], d["kv_heads"], d["head_dim"]
    q, k, v = i.t(1, 1, h, hd), i.t(1, t, kv, hd), i.t(1, t, kv, hd)

    def torch_decode():
        import torch

        qq, kk, vv = (x.transpose(1, 2) for x in (q, k, v))
        # SDPA's own GQA (no mask here): no widened copies of k and v timed with it.
        return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, enable_gqa=h != kv)

    return dict(nanoq=dict(query=i.normal(h, hd), keys=i.normal(t, kv, hd), values=i.normal(t, kv, hd)),
                torch=torch_decode, flops=4.0 * h * t * hd,
                shape=f"one query over T={t} cached, H={h} KV={kv} D={hd}")


def case_swiglu_forward(i, d):
    n = _rows(d) * d["intermediate"]
    g, u = i.t(n), i.t(n)
    return dict(nanoq=dict(gate=i.normal(n), up=i.normal(n)), torch=lambda: i.torch.nn.functional.silu(g) * u,
                bytes=3.0 * n * _act(i), shape=f"[{_rows(d)}, {d['intermediate']}]")


def case_swiglu_backward(i, d):
    n = _rows(d) * d["intermediate"]
    g, u = i.t(n, grad=True), i.t(n, grad=True)
    y = i.torch.nn.functional.silu(g) * u
    return dict(nanoq=dict(dout=i.normal(n), gate=i.normal(n), up=i.normal(n)),
                torch=_torch_backward(y, (g, u), i.t(n)), bytes=5.0 * n * _act(i),
                shape=f"[{_rows(d)}, {d['intermediate']}]")


def _ce_rows(i, d):
    return min(CROSS_ENTROPY_ROWS, _rows(d))


def case_cross_entropy(i, d):
    import torch

    m, v = _ce_rows(i, d), d["vocab"]
    logits, targets = i.t(m, v, grad=True), i.t_tokens(m)

    def torch_ce():
        loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        return torch.autograd.grad(loss, logits)

    return dict(nanoq=dict(logits=i.normal(m, v), targets=i.tokens(m), time=d["time"]), torch=torch_ce,
                bytes=2.0 * m * v * _act(i), shape=f"[{m}, {v}] logits, loss and gradient in place")


def case_sum_squares(i, d):
    n = ADAMW_ELEMENTS["smoke" if d is SMOKE else "full"]
    x = i.t(n, dtype=i.torch.float32)
    return dict(nanoq=dict(x=i.normal(n)), torch=lambda: x.square().sum(dtype=i.torch.float64),
                bytes=4.0 * n, shape=f"[{n}] float32")


def case_optimizer_scale(i, d):
    import numpy as np
    import torch
    from nanoq.testing import OpRunner

    stride = OpRunner("cpu").gather_stride  # the same on every backend
    gathered = np.abs(i.normal(1, stride)).astype(np.float64)
    g = torch.from_numpy(gathered).to(i.device)

    def torch_scale():
        norm = g[:, -1].sum().sqrt()
        return torch.clamp(1.0 / (norm + 1e-6), max=1.0)

    return dict(nanoq=dict(gathered=gathered, grad_clip=1.0), torch=torch_scale, bytes=8.0 * stride,
                shape=f"[1, {stride}] float64 (one rank)")


def case_adamw(i, d):
    import torch

    n = ADAMW_ELEMENTS["smoke" if d is SMOKE else "full"]
    param = torch.nn.Parameter(i.t(n, dtype=torch.float32))
    param.grad = i.t(n, dtype=torch.float32)
    try:
        optimizer = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.1, fused=i.device.type == "cuda")
    except (TypeError, RuntimeError):
        optimizer = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.1)
    return dict(nanoq=dict(param=i.normal(n), grad=i.normal(n, scale=1e-3), m=i.normal(n, scale=1e-3),
                           v=i.np.abs(i.normal(n, scale=1e-6)), lr=1e-4, weight_decay=0.1, dtype="fp32",
                           state_dtype="fp32"),
                torch=optimizer.step, bytes=28.0 * n,
                shape=f"[{n}] float32 master, float32 moments (torch: AdamW fused={optimizer.defaults.get('fused')})")


def case_adamw_shard(i, d):
    """The whole shard in one call: four parameters, decay on every other one,
    and the weight copy in the run's dtype (bf16 on a GPU); PyTorch: fused
    AdamW over the same four tensors in two parameter groups, then the copies."""
    import torch

    n = ADAMW_ELEMENTS["smoke" if d is SMOKE else "full"]
    sizes = [n // 2, n // 8, n // 4, n - n // 2 - n // 8 - n // 4]
    begins = [sum(sizes[:k]) for k in range(4)]
    segments = i.np.array([[b, c, k % 2 == 0] for k, (b, c) in enumerate(zip(begins, sizes))], dtype=i.np.float64)
    params = [torch.nn.Parameter(i.t(c, dtype=torch.float32)) for c in sizes]
    for p in params:
        p.grad = i.t(p.numel(), dtype=torch.float32)
    copies = [i.t(c) for c in sizes]
    groups = [dict(params=params[0::2], weight_decay=0.1), dict(params=params[1::2], weight_decay=0.0)]
    try:
        optimizer = torch.optim.AdamW(groups, lr=1e-4, fused=i.device.type == "cuda")
    except (TypeError, RuntimeError):
        optimizer = torch.optim.AdamW(groups, lr=1e-4)

    def torch_step():
        optimizer.step()
        for copy, p in zip(copies, params):
            copy.copy_(p.detach())

    return dict(nanoq=dict(master=i.normal(n), grad=i.normal(n, scale=1e-3), m=i.normal(n, scale=1e-3),
                           v=i.np.abs(i.normal(n, scale=1e-6)), weights=i.normal(n), segments=segments, lr=1e-4,
                           weight_decay=0.1, chunk=max(n // 4, 1), dtype="fp32", state_dtype="fp32",
                           weight_dtype=i.dtype),
                torch=torch_step, bytes=(28.0 + _act(i)) * n, composite=True,
                shape=f"[{n}] float32 master in 4 segments, float32 moments, {i.dtype} weights "
                      f"(torch: AdamW fused={optimizer.defaults.get('fused')} + copies)")


def _qkv_sizes(d):
    return d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]


def _qkv_dims(d):
    return dict(batch=d["batch"], time=d["time"], heads=d["heads"], kv_heads=d["kv_heads"], head_dim=d["head_dim"])


def case_matmul_epilogue(i, d):
    m, c = _rows(d), d["channels"]
    qw, kw = _qkv_sizes(d)
    n = qw + 2 * kw
    x, w, b = i.t(m, c), i.t(n, c), i.t(n)
    return dict(nanoq=dict(a=i.normal(m, c), b=i.normal(n, c, scale=0.05), bias=i.normal(n), trans_b=True),
                torch=lambda: i.torch.nn.functional.linear(x, w, b), flops=2.0 * m * n * c, composite=True,
                shape=f"qkv + bias: [{m}, {c}] x [{n}, {c}]^T")


def case_matmul_input_grad(i, d):
    m, c, n = _rows(d), d["channels"], d["intermediate"]
    dy, w = i.t(m, c), i.t(c, n)
    return dict(nanoq=dict(dy=i.normal(m, c), weight=i.normal(c, n, scale=0.02)), torch=lambda: dy @ w,
                flops=2.0 * m * n * c, composite=True, shape=f"down-proj dx: [{m}, {c}] x [{c}, {n}]")


def case_matmul_weight_grad(i, d):
    m, c, n = _rows(d), d["channels"], d["intermediate"]
    dy, x = i.t(m, c), i.t(m, n)
    dw = i.t(c, n, dtype=i.torch.float32)
    return dict(nanoq=dict(dy=i.normal(m, c), x=i.normal(m, n), dweight=i.normal(c, n, scale=0.01)),
                torch=lambda: dw.add_((dy.T @ x).float()), flops=2.0 * m * n * c, composite=True,
                shape=f"down-proj dW: [{m}, {c}]^T x [{m}, {n}] into float32")


def case_matmul_backward(i, d):
    m, c, n = _rows(d), d["channels"], d["intermediate"]
    dy, w, x = i.t(m, c), i.t(c, n), i.t(m, n)
    dw = i.t(c, n, dtype=i.torch.float32)

    def torch_backward():
        dx = dy @ w
        dw.add_((dy.T @ x).float())
        return dx

    return dict(nanoq=dict(dy=i.normal(m, c), weight=i.normal(c, n, scale=0.02), x=i.normal(m, n),
                           dweight=i.normal(c, n, scale=0.01)),
                torch=torch_backward, flops=4.0 * m * n * c, composite=True,
                shape=f"down-proj dx and dW: [{m}, {c}] x [{c}, {n}], [{m}, {c}]^T x [{m}, {n}]")


def case_residual_rmsnorm_forward(i, d):
    m, c = _rows(d), d["channels"]
    r, delta, w = i.t(m, c), i.t(m, c), i.t(c)

    def torch_op():
        s = r + delta
        return s, i.torch.nn.functional.rms_norm(s, (c,), w, EPS)

    return dict(nanoq=dict(residual=i.normal(m, c), delta=i.normal(m, c), weight=i.normal(c)), torch=torch_op,
                bytes=4.0 * m * c * _act(i), composite=True, shape=f"[{m}, {c}]")


def case_residual_rmsnorm_backward(i, d):
    m, c = _rows(d), d["channels"]
    x = i.normal(m, c)
    tx, tw = i.t(m, c, grad=True), i.t(c, grad=True)
    y = i.torch.nn.functional.rms_norm(tx, (c,), tw, EPS)
    dres = i.t(m, c)
    backward = _torch_backward(y, (tx, tw), i.t(m, c))

    def torch_op():
        dx, dw = backward()
        return dres.add_(dx), dw

    return dict(nanoq=dict(dout=i.normal(m, c, scale=0.1), residual_out=x, weight=i.normal(c), rstd=_rstd(x),
                           dresidual=i.normal(m, c)),
                torch=torch_op, bytes=4.0 * m * c * _act(i), composite=True, shape=f"[{m}, {c}]")


def _torch_qkv(i, d, x, w, b, cos, sin, rope=True):
    bt, t = d["batch"], d["time"]
    qw, kw = _qkv_sizes(d)
    y = i.torch.nn.functional.linear(x, w, b)
    q, k, v = y.split([qw, kw, kw], -1)
    q = q.reshape(bt, t, d["heads"], d["head_dim"])
    k = k.reshape(bt, t, d["kv_heads"], d["head_dim"])
    if rope:
        q, k = _torch_rope(q, cos, sin), _torch_rope(k, cos, sin)
    return q, k, v


def _qkv_case(i, d, rope, backward):
    m, c = _rows(d), d["channels"]
    qw, kw = _qkv_sizes(d)
    n = qw + 2 * kw
    cos, sin = _rope_torch_tables(i, d)
    x, w, b = i.t(m, c, grad=backward), i.t(n, c, grad=backward), i.t(n, grad=backward)
    nanoq = dict(_qkv_dims(d), qkv=i.normal(n, c, scale=0.05), qkv_bias=i.normal(n), x=i.normal(m, c))
    if rope:
        nanoq["cos_sin"] = i.rope_table()
    shape = f"[{m}, {c}] x [{n}, {c}]^T + bias" + (", RoPE on q, k" if rope else "")
    if not backward:
        return dict(nanoq=nanoq, torch=lambda: _torch_qkv(i, d, x, w, b, cos, sin, rope), flops=2.0 * m * n * c,
                    composite=True, shape=shape)
    outputs = _torch_qkv(i, d, x, w, b, cos, sin, rope)
    grads = [i.t(*o.shape) for o in outputs]
    nanoq.update(dq=i.normal(m, d["heads"], d["head_dim"]), dk=i.normal(m, d["kv_heads"], d["head_dim"]),
                 dv=i.normal(m, d["kv_heads"], d["head_dim"]), dqkv=i.normal(n, c, scale=0.01),
                 dqkv_bias=i.normal(n, scale=0.01))
    return dict(nanoq=nanoq, torch=_torch_backward(outputs, (x, w, b), grads), flops=4.0 * m * n * c,
                composite=True, shape=shape + ": dx, dW, dbias")


def _qk_rope_case(i, d, backward):
    m = _rows(d)
    qw, kw = _qkv_sizes(d)
    cos, sin = _rope_torch_tables(i, d)
    bt, t, h, kv, hd = d["batch"], d["time"], d["heads"], d["kv_heads"], d["head_dim"]
    q, k = i.t(bt, t, h, hd), i.t(bt, t, kv, hd)
    sign = -1.0 if backward else 1.0
    names = ("dq", "dk") if backward else ("q", "k")
    nanoq = dict(_qkv_dims(d), cos_sin=i.rope_table(), **{names[0]: i.normal(m, h, hd), names[1]: i.normal(m, kv, hd)})
    return dict(nanoq=nanoq, torch=lambda: (_torch_rope(q, cos, sign * sin), _torch_rope(k, cos, sign * sin)),
                bytes=2.0 * m * (qw + kw) * _act(i), composite=True, shape=f"RoPE of q [{m}, {qw}] and k [{m}, {kw}]")


def case_qkv_projection_backward(i, d):
    c = _qkv_case(i, d, rope=False, backward=True)
    c["nanoq"]["dx"] = i.normal(_rows(d), d["channels"])
    return c


def case_qkv_backward(i, d):
    c = _qkv_case(i, d, rope=True, backward=True)
    c["nanoq"]["dx"] = i.normal(_rows(d), d["channels"])
    return c


def _gate_up_torch(i, x, w):
    g, u = i.torch.nn.functional.linear(x, w).chunk(2, -1)
    return g, u


def case_gate_up_projection(i, d):
    m, c, n = _rows(d), d["channels"], d["intermediate"]
    x, w = i.t(m, c), i.t(2 * n, c)
    return dict(nanoq=dict(x=i.normal(m, c), gate_up=i.normal(2, n, c, scale=0.05)),
                torch=lambda: _gate_up_torch(i, x, w), flops=2.0 * m * 2 * n * c, composite=True,
                shape=f"[{m}, {c}] x [2*{n}, {c}]^T")


def case_gate_up_swiglu_forward(i, d):
    m, c, n = _rows(d), d["channels"], d["intermediate"]
    x, w = i.t(m, c), i.t(2 * n, c)

    def torch_op():
        g, u = _gate_up_torch(i, x, w)
        return g, u, i.torch.nn.functional.silu(g) * u

    return dict(nanoq=dict(x=i.normal(m, c), gate_up=i.normal(2, n, c, scale=0.05)), torch=torch_op,
                flops=2.0 * m * 2 * n * c, composite=True, shape=f"[{m}, {c}] x [2*{n}, {c}]^T, then SwiGLU")


def _gate_up_backward_case(i, d, swiglu):
    m, c, n = _rows(d), d["channels"], d["intermediate"]
    x, w = i.t(m, c, grad=True), i.t(2 * n, c, grad=True)
    g, u = _gate_up_torch(i, x, w)
    nanoq = dict(x=i.normal(m, c), gate_up=i.normal(2, n, c, scale=0.05), dx=i.normal(m, c),
                 dgate_up=i.normal(2, n, c, scale=0.01))
    if swiglu:
        out = i.torch.nn.functional.silu(g) * u
        torch_op = _torch_backward(out, (x, w), i.t(m, n))
        nanoq.update(dout=i.normal(m, n), gate=i.normal(m, n), up=i.normal(m, n))
    else:
        torch_op = _torch_backward((g, u), (x, w), (i.t(m, n), i.t(m, n)))
        nanoq.update(dgate=i.normal(m, n), dup=i.normal(m, n))
    return dict(nanoq=nanoq, torch=torch_op, flops=4.0 * m * 2 * n * c, composite=True,
                shape=f"[{m}, {c}] x [2*{n}, {c}]^T" + (" after SwiGLU" if swiglu else "") + ": dx, dW")


def case_classifier(i, d):
    import torch

    m, c, v = _rows(d), d["channels"], d["vocab"]
    h, w, targets = i.t(m, c, grad=True), i.t(v, c, grad=True, scale=0.05), i.t_tokens(m)

    def torch_op():
        logits = h @ w.T
        loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        return torch.autograd.grad(loss, (h, w))

    return dict(nanoq=dict(hidden=i.normal(m, c), lm_head=i.normal(v, c, scale=0.05), targets=i.tokens(m),
                           chunk_rows=m, time=d["time"], dlm_head=i.normal(v, c, scale=0.01)),
                torch=torch_op, flops=6.0 * m * v * c, composite=True,
                shape=f"[{m}, {c}] x [{v}, {c}]^T, loss and gradients (one chunk; torch: fp32 logits)")


def _matmul_cases():
    """The projection matmuls of a layer and the LM head, forward: x [rows, k] by W [n, k]^T."""
    def sizes(d):
        qw, kw = _qkv_sizes(d)
        return dict(qkv=(qw + 2 * kw, d["channels"]), o_proj=(d["channels"], qw),
                    gate_up=(2 * d["intermediate"], d["channels"]), down=(d["channels"], d["intermediate"]),
                    lm_head=(d["vocab"], d["channels"]))

    def builder(name):
        return lambda i, d: _matmul(*sizes(d)[name], name)(i, d)

    return {f"matmul-{name}": ("matmul", builder(name)) for name in ("qkv", "o_proj", "gate_up", "down", "lm_head")}


# case id -> (op, builder). Every op of the table has at least one case.
CASES = {
    "copy": ("copy", case_copy),
    "fill": ("fill", case_fill),
    **_matmul_cases(),
    "add_bias": ("add_bias", case_add_bias),
    "bias_backward": ("bias_backward", case_bias_backward),
    "add": ("add", case_add),
    "accumulate": ("accumulate", case_accumulate),
    "scale_dropout": ("scale_dropout", case_scale_dropout),
    "embedding_forward": ("embedding_forward", case_embedding_forward),
    "embedding_backward": ("embedding_backward", case_embedding_backward),
    "embedding_backward-padded": ("embedding_backward", case_embedding_backward_padded),
    "rmsnorm_forward": ("rmsnorm_forward", case_rmsnorm_forward),
    "rmsnorm_backward": ("rmsnorm_backward", case_rmsnorm_backward),
    "rope_forward": ("rope_forward", lambda i, d: _rope_case(i, d, "rope_forward")),
    "rope_backward": ("rope_backward", lambda i, d: _rope_case(i, d, "rope_backward")),
    "attention_forward": ("attention_forward", case_attention_forward),
    "attention_backward": ("attention_backward", case_attention_backward),
    "attention_forward-documents": ("attention_forward",
                                    lambda i, d, runner=None: _attention_case(i, d, True, False, runner)),
    "attention_backward-documents": ("attention_backward",
                                     lambda i, d, runner=None: _attention_case(i, d, True, True, runner)),
    "attention_decode": ("attention_decode", case_attention_decode),
    "swiglu_forward": ("swiglu_forward", case_swiglu_forward),
    "swiglu_backward": ("swiglu_backward", case_swiglu_backward),
    "cross_entropy": ("cross_entropy", case_cross_entropy),
    "sum_squares": ("sum_squares", case_sum_squares),
    "optimizer_scale": ("optimizer_scale", case_optimizer_scale),
    "adamw": ("adamw", case_adamw),
    "adamw_shard": ("adamw_shard", case_adamw_shard),
    "matmul_epilogue": ("matmul_epilogue", case_matmul_epilogue),
    "matmul_input_grad": ("matmul_input_grad", case_matmul_input_grad),
    "matmul_weight_grad": ("matmul_weight_grad", case_matmul_weight_grad),
    "matmul_backward": ("matmul_backward", case_matmul_backward),
    "residual_rmsnorm_forward": ("residual_rmsnorm_forward", case_residual_rmsnorm_forward),
    "residual_rmsnorm_backward": ("residual_rmsnorm_backward", case_residual_rmsnorm_backward),
    "qkv_projection": ("qkv_projection", lambda i, d: _qkv_case(i, d, rope=False, backward=False)),
    "qk_norm_rope_forward": ("qk_norm_rope_forward", lambda i, d: _qk_rope_case(i, d, backward=False)),
    "qkv_forward": ("qkv_forward", lambda i, d: _qkv_case(i, d, rope=True, backward=False)),
    "qk_norm_rope_backward": ("qk_norm_rope_backward", lambda i, d: _qk_rope_case(i, d, backward=True)),
    "qkv_projection_backward": ("qkv_projection_backward", case_qkv_projection_backward),
    "qkv_backward": ("qkv_backward", case_qkv_backward),
    "gate_up_projection": ("gate_up_projection", case_gate_up_projection),
    "gate_up_swiglu_forward": ("gate_up_swiglu_forward", case_gate_up_swiglu_forward),
    "gate_up_projection_backward": ("gate_up_projection_backward",
                                    lambda i, d: _gate_up_backward_case(i, d, swiglu=False)),
    "swiglu_gate_up_backward": ("swiglu_gate_up_backward", lambda i, d: _gate_up_backward_case(i, d, swiglu=True)),
    "classifier": ("classifier", case_classifier),
}


# --------------------------------------------------------------------------
# Timing and report
# --------------------------------------------------------------------------


def time_torch(fn, repeats: int, device) -> tuple:
    """(mean seconds of fn() over `repeats` runs after one untimed run, how
    it ran). On a GPU: fn captured once in a CUDA graph and the graph
    replayed between two CUDA events ("graph"), so that torch's Python and
    dispatch time per call (tens of microseconds, more than the kernels of
    the small ops take) is not counted as kernel time; where the capture
    fails, fn itself between the events ("eager", or "eager, host-bound"
    when the host took at least 80% of that time to issue the calls: the
    figure is then the host's, not the kernels'). On the CPU: the host
    clock after the work is done ("host")."""
    import torch

    fn()
    if device.type != "cuda":
        begin = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - begin) / repeats, "host"
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph = None
    try:
        side = torch.cuda.Stream(device)  # warm-up on a side stream before capture, as torch asks
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - not capturable (a host sync inside, say): timed eagerly below
        graph = None
        torch.cuda.synchronize(device)
    run = graph.replay if graph is not None else fn
    start.record()
    issued = time.perf_counter()
    for _ in range(repeats):
        run()
    issued = time.perf_counter() - issued
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    if graph is not None:
        return seconds / repeats, "graph"
    return seconds / repeats, "eager, host-bound" if issued >= 0.8 * seconds else "eager"


def rate(case: dict, seconds: float) -> str:
    if "flops" in case:
        return f"{case['flops'] / seconds / 1e12:8.2f} TFLOP/s"
    return f"{case['bytes'] / seconds / 1e9:8.1f} GB/s"


def run_case(case_id: str, runner, inputs, dims, args) -> list[dict]:
    """Times one case: nanoq (and, for a composite, its default composition),
    then torch. Returns one result row per nanoq variant."""
    op, builder = CASES[case_id]
    case = builder(inputs, dims) if not op.startswith("attention_") else builder(inputs, dims, runner=runner)
    from nanoq.backends import attention_library
    from nanoq.testing import op_table

    kwargs = dict(case["nanoq"])
    if any(a["name"] == "dtype" for a in op_table()[op]["args"]):
        kwargs.setdefault("dtype", inputs.dtype)
    # (name, the call's extra arguments): as the backend runs it, then as its default composition (a
    # composite), or, for attention where the backend has a fused library, in nanoq's native kernels.
    variants = [("backend", {})] + ([("default composition", dict(use_default=True))] if case.get("composite") else [])
    if case.get("attention") and attention_library(args.backend):
        variants = [("backend", dict(fused=True)), ("native", dict(fused=False))]
        if op == "attention_backward":  # the library's other algorithm: dq accumulated with atomics
            variants.insert(1, ("nondeterministic", dict(fused=True, deterministic=False)))
    rows = []
    torch_seconds, torch_error, torch_timing = None, None, None
    try:
        torch_seconds, torch_timing = time_torch(case["torch"], args.repeats, inputs.device)
    except Exception as e:  # noqa: BLE001 - recorded; nanoq's figure still counts
        torch_error = f"{type(e).__name__}: {e}"
    for variant, extra in variants:
        row = dict(case=case_id, op=op, variant=variant, shape=case["shape"], dtype=kwargs.get("dtype", "fp32"),
                   torch_seconds=torch_seconds, torch_error=torch_error, torch_timing=torch_timing)
        call = dict(kwargs, **extra)
        try:
            row["nanoq_seconds"] = runner.time(op, repeats=args.repeats, **call)
            row["nanoq_rate"] = rate(case, row["nanoq_seconds"]).strip()
            if torch_seconds:
                row["torch_rate"] = rate(case, torch_seconds).strip()
                row["ratio"] = torch_seconds / row["nanoq_seconds"]
            row["ok"] = True
        except Exception as e:  # noqa: BLE001 - recorded, the next case still runs
            row.update(ok=False, error=f"{type(e).__name__}: {e}")
        rows.append(row)
    return rows


def format_row(row: dict) -> str:
    name = row["case"] + {"default composition": " (default)", "native": " (native)",
                          "nondeterministic": " (nondeterministic)"}.get(row["variant"], "")
    if not row["ok"]:
        return f"{name:<42} FAILED: {row['error']}"
    torch_part = (f"{1e3 * row['torch_seconds']:9.3f} ms {row['torch_rate']:>15}  {row['ratio']:6.2f}x"
                  if row.get("torch_seconds") else f"torch failed: {row['torch_error']}")
    if row.get("torch_seconds") and row.get("torch_timing") not in ("graph", "host"):
        torch_part += f"  (torch {row['torch_timing']})"
    return f"{name:<42} {1e3 * row['nanoq_seconds']:9.3f} ms {row['nanoq_rate']:>15}  |  {torch_part}"


def header(args, gpu: str) -> list[str]:
    d = args.dims
    return [f"nanoq ops ({args.backend}, {args.dtype}) vs PyTorch {args.torch_version} ({args.torch_device}) on {gpu}; "
            f"{args.shape_name}: B={d['batch']} T={d['time']} C={d['channels']} H={d['heads']} KV={d['kv_heads']} "
            f"D={d['head_dim']} I={d['intermediate']} V={d['vocab']}; mean of {args.repeats} runs after one",
            "ratio = torch time / nanoq time (> 1: nanoq faster); rates are each side's own",
            f"{'case':<42} {'nanoq':>12} {'':>15}  |  {'torch':>12} {'':>15}  {'ratio':>6}"]


def write_outputs(out_dir, report: dict, text: str) -> None:
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_ops.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out_dir, "bench_ops.txt"), "w") as f:
        f.write(text + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cuda", choices=["cuda", "cuda_emulated", "cpu"],
                        help="nanoq backend (default cuda; cuda_emulated or cpu check the plumbing only)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], help="activation dtype (default bf16; cpu: fp32)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (for the emulator and CI)")
    parser.add_argument("--ops", help="comma-separated case ids or op names (default: every case)")
    parser.add_argument("--repeats", type=int, help="timed runs per case (default 20; smoke 1)")
    parser.add_argument("--time-limit", type=float, default=0.0,
                        help="seconds; cases not started by then are listed as skipped (default: no limit)")
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="directory for bench_ops.json and bench_ops.txt (default: $OUT if set)")
    parser.add_argument("--list", action="store_true", help="print the case ids and their ops, then exit")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("fp32" if args.backend == "cpu" else "bf16")
    if args.backend == "cpu" and args.dtype != "fp32":
        parser.error("the cpu backend computes in float32 only: use --dtype fp32")
    args.repeats = args.repeats if args.repeats is not None else (1 if args.smoke else 20)
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    args.dims = SMOKE if args.smoke else QWEN25_05B
    args.shape_name = "smoke shapes" if args.smoke else "Qwen2.5-0.5B shapes"
    if args.ops:
        wanted = [w.strip() for w in args.ops.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in CASES and w not in {op for op, _ in CASES.values()}]
        if unknown:
            parser.error(f"unknown case or op: {', '.join(unknown)} (see --list)")
        args.cases = [c for c, (op, _) in CASES.items() if c in wanted or op in wanted]
    else:
        args.cases = list(CASES)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for case_id, (op, _) in CASES.items():
            print(f"{case_id:<32} {op}")
        return 0
    gpu = "no GPU"
    if args.backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            message = "bench_ops.py --backend cuda needs an NVIDIA GPU that torch can see; nothing was run"
            print(message, file=sys.stderr)
            write_outputs(args.out, dict(error=message), message)
            return 2
        gpu = torch.cuda.get_device_name(0)
    import torch
    from nanoq.testing import OpRunner

    args.torch_device = "cuda" if args.backend == "cuda" else "cpu"
    args.torch_version = torch.__version__
    runner = OpRunner(args.backend)
    inputs = Inputs(args.dims, args.dtype, args.torch_device)
    lines = header(args, gpu)
    print("\n".join(lines), flush=True)
    rows, start = [], time.perf_counter()
    for case_id in args.cases:
        if args.time_limit and time.perf_counter() - start > args.time_limit:
            rows.append(dict(case=case_id, op=CASES[case_id][0], variant="backend", ok=False,
                             error=f"skipped: the time limit ({args.time_limit:g} s) was reached"))
            lines.append(format_row(rows[-1]))
            print(lines[-1], flush=True)
            continue
        try:
            new = run_case(case_id, runner, inputs, args.dims, args)
        except Exception as e:  # noqa: BLE001 - a case that cannot even be built is recorded
            traceback.print_exc()
            new = [dict(case=case_id, op=CASES[case_id][0], variant="backend", ok=False,
                        error=f"{type(e).__name__}: {e}")]
        for row in new:
            rows.append(row)
            lines.append(format_row(row))
            print(lines[-1], flush=True)
        if args.torch_device == "cuda":
            torch.cuda.empty_cache()
        write_outputs(args.out, report(args, gpu, rows), "\n".join(lines))  # a stopped run keeps what it did
    failed = [r for r in rows if not r["ok"]]
    lines.append(f"{len(rows) - len(failed)} of {len(rows)} timings ran"
                 + (f"; failed or skipped: {', '.join(r['case'] for r in failed)}" if failed else ""))
    print(lines[-1])
    write_outputs(args.out, report(args, gpu, rows), "\n".join(lines))
    return exit_status(rows)


def report(args, gpu: str, rows: list) -> dict:
    return dict(backend=args.backend, dtype=args.dtype, dims=args.dims, repeats=args.repeats, gpu=gpu,
                torch_version=args.torch_version, torch_device=args.torch_device, rows=rows,
                date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))


if __name__ == "__main__":
    sys.exit(main())
