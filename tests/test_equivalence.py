"""Invariances of the training loop: how a batch is cut into micro-batches or
spread over devices must not change the math, and runs are reproducible.

Different splits only change fp32 reduction order, so losses agree to ~1e-6;
weights are compared per tensor relative to max |w| with a bound that allows
Adam's amplification of rounding in near-zero gradients over a few steps.
"""

import numpy as np
import pytest

import nanoq
from conftest import (
    IGNORE,
    NANOQ_CONFIG,
    SEQ,
    assert_same_tensors,
    assert_tensors_close,
    model_weights,
    open_trainer,
    random_batch,
    split_rows,
    torch_backward,
    train_options,
)

LOSS_REL = 1e-5
GRAD_REL = 3e-5
WEIGHT_REL = 2e-4


def masked_batch(rng, row_mask_fracs, seq_len=SEQ):
    """One batch whose rows are masked at very different rates, so that
    micro-batches / devices count different numbers of tokens."""
    inputs, targets = random_batch(rng, rows=len(row_mask_fracs), seq_len=seq_len)
    for row, frac in enumerate(row_mask_fracs):
        targets[row, rng.random(seq_len) < frac] = IGNORE
        targets[row, 0] = inputs[row, 0]  # at least one counted token per row
    return inputs, targets


def train(tr, batches, parts, lr=1e-3):
    """One optimizer step per batch, each fed as `parts` micro-batches."""
    out = []
    for batch in batches:
        for micro in split_rows(*batch, parts):
            tr.step(*micro)
        out.append(tr.update(lr=lr, weight_decay=0.1, grad_clip=1.0))
    return out, tr.get_weights()


def assert_runs_match(run, base, what):
    stats, weights = run
    base_stats, base_weights = base
    for i, (s, b) in enumerate(zip(stats, base_stats)):
        assert s.tokens == b.tokens, f"{what} update {i}"
        assert s.loss == pytest.approx(b.loss, rel=LOSS_REL), f"{what} update {i}"
        assert s.grad_norm == pytest.approx(b.grad_norm, rel=1e-5), f"{what} update {i}"
        assert s.lse_max == pytest.approx(b.lse_max, rel=LOSS_REL), f"{what} update {i}"
    assert_tensors_close(weights, base_weights, WEIGHT_REL, f"{what} weight")


ROW_MASKS = [0.9, 0.8, 0.0, 0.1, 0.5, 0.3]  # 6 rows -> 3 micro-batches of 2


def test_grad_accumulation_matches_one_large_batch(checkpoints):
    rng = np.random.default_rng(20)
    batches = [masked_batch(rng, ROW_MASKS) for _ in range(4)]

    # Self-check: the micro-batches count unequal tokens, and a mean of
    # per-micro-batch means differs from the global token mean.
    micro = split_rows(*batches[0], 3)
    counts = [int((t != IGNORE).sum()) for _, t in micro]
    assert len(set(counts)) == 3
    per_micro = [torch_backward(checkpoints.model("llama"), [m]).loss for m in micro]
    global_loss = torch_backward(checkpoints.model("llama"), micro).loss
    assert abs(np.mean(per_micro) - global_loss) > 100 * LOSS_REL * global_loss

    with open_trainer(checkpoints.path("llama"), batch_size=2, grad_accum=3) as tr:
        accumulated = train(tr, batches, parts=3)
    with open_trainer(checkpoints.path("llama"), batch_size=6, grad_accum=1) as tr:
        one_batch = train(tr, batches, parts=1)
    assert accumulated[0][0].loss == pytest.approx(global_loss, rel=LOSS_REL)
    assert_runs_match(accumulated, one_batch, "grad_accum=3")


def test_token_count_and_mean_loss_stay_exact_past_2_pow_24_tokens_per_step():
    # Float32 statistics count exactly only up to 2^24 = 16,777,216 tokens. A
    # model so small that 17 micro-batches of 2^20 tokens take a few seconds.
    config = nanoq.ModelConfig(vocab_size=4, hidden_size=2, intermediate_size=2, num_hidden_layers=1,
                               num_attention_heads=1, num_key_value_heads=1, head_dim=2)
    batch, seq, accum = 2**17, 8, 17
    rng = np.random.default_rng(7)
    inputs = rng.integers(0, 4, (batch, seq)).astype(np.int32)
    targets = rng.integers(0, 4, (batch, seq)).astype(np.int32)
    targets[0, 0] = IGNORE  # 2^20 - 1 counted tokens per micro-batch: the total is odd
    options = nanoq.TrainOptions(backend="cpu", batch_size=batch, seq_len=seq, grad_accum=accum)
    with nanoq.Trainer(config, options) as trainer:
        one = trainer.validate(inputs, targets)
        for _ in range(accum):
            trainer.step(inputs, targets)
        step = trainer.update(lr=1e-3)
    assert one.tokens == 2**20 - 1
    assert step.tokens == accum * (2**20 - 1) == 17_825_775
    # The same micro-batch 17 times: the mean loss is one micro-batch's, to float64 rounding.
    assert step.loss == pytest.approx(one.loss, rel=1e-12)
    assert step.loss_1k == pytest.approx(one.loss_1k, rel=1e-12)


@pytest.mark.parametrize("variant", ["llama_tied", "qwen2"])
def test_one_two_and_four_devices_train_identically(checkpoints, variant):
    rng = np.random.default_rng(21)
    batches = [masked_batch(rng, [0.9, 0.0, 0.6, 0.2]) for _ in range(5)]
    path = checkpoints.path(variant)
    with open_trainer(path, devices=1, batch_size=4) as tr:
        base = train(tr, batches, parts=1)
    for devices, batch_size, accum in [(2, 2, 1), (4, 1, 1), (2, 1, 2)]:
        with open_trainer(path, devices=devices, batch_size=batch_size, grad_accum=accum) as tr:
            assert tr.world_size == devices
            run = train(tr, batches, parts=accum)
        assert_runs_match(run, base, f"devices={devices} accum={accum}")


def test_two_device_gradients_are_the_full_batch_gradient(checkpoints):
    """Rows [0, B) go to device 0 and [B, 2B) to device 1; get_gradients()
    returns the gradient of the global token mean, summed over devices."""
    batch = masked_batch(np.random.default_rng(22), [0.8, 0.0, 0.5, 0.1])
    ref = torch_backward(checkpoints.model("llama_tied"), [batch])
    with open_trainer(checkpoints.path("llama_tied"), devices=2, batch_size=2) as tr:
        tr.step(*batch)
        grads = tr.get_gradients()
        stats = tr.update(lr=1e-3)
    assert_tensors_close(grads, ref.grads, GRAD_REL, "2-device grad")
    assert stats.tokens == ref.tokens
    assert stats.loss == pytest.approx(ref.loss, rel=LOSS_REL)
    assert stats.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)


def test_same_seed_runs_are_bitwise_identical():
    """Two fresh trainers (2 devices, accumulation, z-loss) from init_weights
    with the same seed produce exactly the same stats and weights."""
    rng = np.random.default_rng(23)
    batches = [masked_batch(rng, [0.5, 0.0, 0.2, 0.7]) for _ in range(3)]
    runs = []
    for _ in range(2):
        cfg = nanoq.ModelConfig(**NANOQ_CONFIG["qwen3"])
        with nanoq.Trainer(cfg, train_options(devices=2, batch_size=1, grad_accum=2, z_loss=1e-3)) as tr:
            tr.init_weights(seed=3)
            stats, weights = train(tr, batches, parts=2)
            runs.append(([(s.loss, s.z_loss, s.grad_norm, s.lse_max, s.lse_mean, s.tokens) for s in stats], weights))
    assert runs[0][0] == runs[1][0]
    assert_same_tensors(runs[0][1], runs[1][1], "weight")


def test_init_weights_is_identical_on_one_and_two_devices(checkpoints):
    cfg = nanoq.ModelConfig(**NANOQ_CONFIG["llama_attn_bias"])
    inits = {}
    for devices, seed in [(1, 5), (2, 5), (1, 6)]:
        with nanoq.Trainer(cfg, train_options(devices=devices)) as tr:
            tr.init_weights(seed=seed)
            inits[devices, seed] = tr.get_weights()
    assert_same_tensors(inits[2, 5], inits[1, 5], "init weight")
    # Same names and shapes as the HF model; a different seed gives other weights.
    hf = model_weights(checkpoints.model("llama_attn_bias"))
    assert {n: w.shape for n, w in inits[1, 5].items()} == {n: w.shape for n, w in hf.items()}
    for name, w in inits[1, 5].items():
        assert np.all(np.isfinite(w)), name
        if w.ndim >= 2:
            assert w.std() > 0, name
            assert not np.array_equal(w, inits[1, 6][name]), name
