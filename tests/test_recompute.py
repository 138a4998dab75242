"""Activation recomputation: every option gives bitwise the same training as
keeping everything (the same ops run again on the same inputs), and keeps
less activation memory."""
import numpy as np
import pytest

import nanoq

# Qwen3-like (q/k norm) with biases and GQA, so every recomputed piece exists.
CONFIG = nanoq.ModelConfig(vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=12, qkv_bias=True, o_bias=True,
                           qk_norm=True)
SEQ, ROWS = 24, 4
OPTIONS = [("swiglu",), ("norms",), ("qkv",), ("ffn",), ("block",), ("norms", "ffn")]


def run(recompute=(), devices=1, steps=3):
    options = nanoq.TrainOptions(backend="cpu", devices=devices, batch_size=ROWS // devices, seq_len=SEQ, grad_accum=2,
                                 seed=3, recompute=recompute, z_loss=1e-3)
    with nanoq.Trainer(CONFIG, options) as trainer:
        losses = []
        for step in range(steps):
            for micro in range(2):
                rng = np.random.default_rng(100 * step + micro)
                tokens = rng.integers(0, CONFIG.vocab_size, (ROWS, SEQ + 1), dtype=np.int32)
                targets = np.ascontiguousarray(tokens[:, 1:])
                targets[rng.random(targets.shape) < 0.2] = -100
                trainer.step(np.ascontiguousarray(tokens[:, :-1]), targets)
            losses.append(trainer.update(lr=1e-2, grad_clip=0.5).loss)
        activations = sum(s["bytes"] for s in trainer.get_allocations(0) if s["context"] == "activations")
        return losses, trainer.get_weights(), activations


@pytest.fixture(scope="module")
def baseline():
    return {devices: run(devices=devices) for devices in (1, 2)}


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("recompute", OPTIONS, ids=[",".join(o) for o in OPTIONS])
def test_recompute_is_bitwise_identical_and_keeps_less(baseline, recompute, devices):
    losses, weights, activations = run(recompute, devices)
    base_losses, base_weights, base_activations = baseline[devices]
    assert losses == base_losses  # bitwise: the same arithmetic in the same order
    for name, value in weights.items():
        assert np.array_equal(value, base_weights[name]), name
    assert activations < base_activations


def test_block_keeps_only_the_residual_stream_and_final_norm():
    *_, activations = run(("block",), steps=1)
    rows = ROWS * SEQ
    residual_stream = (CONFIG.num_hidden_layers + 1) * rows * CONFIG.hidden_size * 4
    final_norm = rows * CONFIG.hidden_size * 4 + rows * 4
    assert activations == residual_stream + final_norm


def test_ffn_implies_swiglu():
    assert run(("ffn",), steps=1)[2] == run(("ffn", "swiglu"), steps=1)[2]


def test_recompute_options_are_validated():
    with pytest.raises(ValueError, match="unknown recompute option 'attention'"):
        nanoq.TrainOptions(recompute=("attention",))
    assert nanoq.TrainOptions(recompute="ffn, norms").recompute == ("norms", "ffn")
