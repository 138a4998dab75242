"""The cuda backend's packed projections run one matmul each
(cuda_core/cuda/cuda_backend.cpp, "Packed projections"): q|k|v as one
product into the qkv-packed scratch and one dgrad plus one wgrad matmul over
the packed gradient; gate|up forward and weight gradient as one strided
batch of two products.

What they compute is held to the default composition by test_composites.py
(`..._matches_default_composition`) and, in whole training steps, to the cpu
backend here and in test_gpu_training.py. These tests count the cuBLASLt
calls: the emulator's stand-in prints each one with NANOQ_EMU_LT_LOG=1
("nanoq emu cublasLtMatmul MxNxK batch B", in cuBLASLt's column-major terms:
M = our output's columns, N = its rows).
"""

import re

import numpy as np
import pytest

import nanoq
from nanoq.testing import OpRunner
from conftest import assert_tensors_close, random_batch, require_cuda_emulator

CALL = re.compile(r"nanoq emu cublasLtMatmul (\d+)x(\d+)x(\d+) batch (\d+)")

B, T, H, K, D, C = 2, 4, 4, 2, 8, 16
ROWS, WIDTH = B * T, (H + 2 * K) * D


@pytest.fixture(scope="module")
def runner():
    require_cuda_emulator()
    return OpRunner("cuda_emulated")


@pytest.fixture
def calls(monkeypatch, capfd):
    """Returns the cuBLASLt calls since its last call, as (m, n, k, batch) tuples."""
    monkeypatch.setenv("NANOQ_EMU_LT_LOG", "1")
    capfd.readouterr()

    def read():
        return [tuple(int(g) for g in m.groups()) for m in CALL.finditer(capfd.readouterr().err)]

    return read


def normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def qkv_arrays(rng, qk_norm, bias):
    a = dict(x=normal(rng, ROWS, C), qkv=normal(rng, WIDTH, C), cos_sin=np.ones((T, D // 2, 2), np.float32))
    if bias:
        a["qkv_bias"] = normal(rng, WIDTH)
    if qk_norm:
        a.update(q_norm=normal(rng, D), k_norm=normal(rng, D))
    return a


SHAPE = dict(batch=B, time=T, heads=H, kv_heads=K, head_dim=D)


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_the_packed_qkv_forward_is_one_matmul(runner, calls, qk_norm):
    rng = np.random.default_rng(0)
    a = qkv_arrays(rng, qk_norm, bias=True)
    runner.run("qkv_forward", **SHAPE, **a, dtype="bf16")
    assert calls() == [(WIDTH, ROWS, C, 1)]
    del a["cos_sin"]
    runner.run("qkv_projection", **SHAPE, **a, dtype="bf16")  # the LoRA path's half: a split, no RoPE
    assert calls() == [(WIDTH, ROWS, C, 1)]
    # The default composition: one product each for q, k and v.
    runner.run("qkv_projection", **SHAPE, **a, dtype="bf16", use_default=True)
    assert sorted(calls()) == sorted([(H * D, ROWS, C, 1), (K * D, ROWS, C, 1), (K * D, ROWS, C, 1)])


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("op", ["qkv_backward", "qkv_projection_backward"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_the_packed_qkv_backward_is_one_dgrad_and_one_wgrad(runner, calls, op, frozen):
    rng = np.random.default_rng(1)
    a = qkv_arrays(rng, qk_norm=False, bias=True)
    if op == "qkv_projection_backward":
        del a["cos_sin"]
    a.update(dq=normal(rng, ROWS, H, D), dk=normal(rng, ROWS, K, D), dv=normal(rng, ROWS, K, D))
    runner.run(op, **SHAPE, **a, dtype="bf16", frozen=frozen)
    dgrad, wgrad = (C, ROWS, WIDTH, 1), (C, WIDTH, ROWS, 1)
    assert calls() == ([dgrad] if frozen else [dgrad, wgrad])
    runner.run(op, **SHAPE, **a, dtype="bf16", frozen=frozen, use_default=True)
    assert len(calls()) == (3 if frozen else 6)


LAYERS, HIDDEN, INTERMEDIATE = 2, 32, 48


def tiny_config():
    return nanoq.ModelConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                             num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.cuda_emulated
def test_gate_up_runs_batched_in_training_and_matches_cpu(calls):
    """With the feed-forward recomputed, gate and up are pushed one after the
    other on the activation stack, as dgate and dup always are: every gate|up
    forward (the forward pass's and backward's recompute) and every gate|up
    weight gradient is one batch of two products, one call for each. The
    gradients are the cpu backend's."""
    require_cuda_emulator()
    rows, seq = 2, 8
    batch = random_batch(np.random.default_rng(2), rows=rows, seq_len=seq, vocab=64)
    gradients = {}
    for backend in ("cpu", "cuda_emulated"):
        options = nanoq.TrainOptions(backend=backend, batch_size=rows, seq_len=seq, recompute=("ffn",), seed=0,
                                     dtype="fp32")
        with nanoq.Trainer(tiny_config(), options) as trainer:
            trainer.step(*batch)
            gradients[backend] = trainer.get_gradients()
        made = calls()
    tokens = rows * seq
    forward = (INTERMEDIATE, tokens, HIDDEN, 2)
    weight_gradient = (HIDDEN, INTERMEDIATE, tokens, 2)
    batched = [c for c in made if c[3] == 2]
    assert sorted(batched) == sorted([forward] * 2 * LAYERS + [weight_gradient] * LAYERS), made
    # Of this shape per layer: down's forward product and the dx of gate|up, still two accumulating products
    # (a sum along K across two matrices).
    assert made.count((HIDDEN, tokens, INTERMEDIATE, 1)) == 3 * LAYERS
    assert_tensors_close(gradients["cuda_emulated"], gradients["cpu"], 1e-4, "gradients")
