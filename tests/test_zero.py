"""ZeRO stages 2 and 3 against stage 1, on 1, 2 and 4 devices.

Stage 2 sums each micro-step's gradients over devices into the owner's shard
(stage 1 sums micro-steps first, then devices): the reduction order changes,
so they agree to fp32 rounding, not bitwise. Stage 3 does exactly stage 2's
arithmetic on gathered copies of the weights: bitwise equal to stage 2, also
with offload and recomputation, which change no arithmetic either.
"""
import numpy as np
import pytest

import nanoq

CONFIG = nanoq.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, qkv_bias=True)
UNTIED_QK = nanoq.ModelConfig(vocab_size=80, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True)
SEQ, ROWS, ACCUM = 16, 4, 2


def options(devices, backend_overrides=None, **kw):
    settings = dict(backend="cpu", devices=devices, batch_size=ROWS // devices, seq_len=SEQ, grad_accum=ACCUM,
                    seed=1)
    return nanoq.TrainOptions(**{**settings, **(backend_overrides or {}), **kw})


def batch(config, step, micro):
    tokens = np.random.default_rng(10 * step + micro).integers(0, config.vocab_size, (ROWS, SEQ + 1), dtype=np.int32)
    targets = np.ascontiguousarray(tokens[:, 1:])
    targets[:, :micro * 3] = -100  # micro-batches with different numbers of counted tokens
    return np.ascontiguousarray(tokens[:, :-1]), targets


def run(config=CONFIG, devices=1, steps=4, backend_overrides=None, **kw):
    with nanoq.Trainer(config, options(devices, backend_overrides, **kw)) as trainer:
        losses, gradients = [], None
        for step in range(steps):
            for micro in range(ACCUM):
                trainer.step(*batch(config, step, micro))
            if step == steps - 1:
                gradients = trainer.get_gradients()
            losses.append(trainer.update(lr=1e-2, weight_decay=0.1, grad_clip=0.5).loss)
        return losses, trainer.get_weights(), gradients


@pytest.fixture(scope="module")
def stage1():
    return {(config.hidden_size, devices): run(config, devices) for config in (CONFIG, UNTIED_QK)
            for devices in (1, 2, 4)}


@pytest.mark.parametrize("config", [CONFIG, UNTIED_QK], ids=["tied-bias", "untied-qknorm"])
@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("stage", [2, 3])
def test_stages_two_and_three_train_like_stage_one(stage1, config, devices, stage):
    losses, weights, gradients = run(config, devices, zero_stage=stage)
    base_losses, base_weights, base_gradients = stage1[(config.hidden_size, devices)]
    np.testing.assert_allclose(losses, base_losses, rtol=1e-6)
    for name, value in weights.items():
        # AdamW amplifies rounding-level gradient differences where v is tiny:
        # compare against a small fraction of one step (lr = 1e-2).
        np.testing.assert_allclose(value, base_weights[name], rtol=1e-4, atol=5e-5, err_msg=name)
    for name, value in gradients.items():
        scale = np.abs(base_gradients[name]).max() + 1e-12
        assert np.abs(value - base_gradients[name]).max() / scale < 1e-4, name


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_stage_three_is_bitwise_stage_two_also_with_offload_and_recompute(devices):
    losses, weights, gradients = run(devices=devices, zero_stage=2)
    for extra in [{}, dict(offload=("optimizer", "master"), recompute=("block",))]:
        other_losses, other_weights, other_gradients = run(devices=devices, zero_stage=3, **extra)
        assert other_losses == losses
        for name in weights:
            assert np.array_equal(other_weights[name], weights[name]), name
            assert np.array_equal(other_gradients[name], gradients[name]), name


def by_context(trainer):
    return trainer.memory_summary()[0]["contexts"]


def test_each_stage_keeps_less_per_device():
    devices = 4
    memory = {}
    for stage in (1, 2, 3):
        with nanoq.Trainer(CONFIG, options(devices, zero_stage=stage)) as trainer:
            memory[stage] = by_context(trainer)
            sizes = {name: int(np.prod(shape)) for name, shape, _ in trainer._parameters}
    shard = -(-sum(sizes.values()) // devices)
    layer = sum(n for name, n in sizes.items() if name.startswith("model.layers.0."))
    embed = sizes["model.embed_tokens.weight"]
    head = sizes["model.norm.weight"] + sizes["lm_head.weight"]
    # Stage 2: gradient shard + whole embedding/head gradients + two layer
    # buffers (one computing while the other is summed over devices).
    assert memory[2]["gradients"] == 4 * (shard + embed + head + 2 * layer)
    assert memory[2]["gradients"] < memory[1]["gradients"]
    assert memory[2]["weights"] == memory[1]["weights"]
    # Stage 3: weight shard + whole embedding/head + two layer buffers.
    assert memory[3]["weights"] == 4 * (shard + embed + head + 2 * layer)
    assert memory[3]["weights"] < memory[2]["weights"]


def test_validate_before_training_is_bitwise_equal_across_stages():
    inputs, targets = batch(CONFIG, 0, 1)
    losses = []
    for stage in (1, 2, 3):
        with nanoq.Trainer(CONFIG, nanoq.TrainOptions(backend="cpu", devices=2, batch_size=2, seq_len=SEQ,
                                                      zero_stage=stage)) as trainer:
            losses.append(trainer.validate(inputs, targets).loss)
    assert losses[0] == losses[1] == losses[2]


def test_checkpoints_move_between_stages_and_device_counts(tmp_path):
    with nanoq.Trainer(CONFIG, options(2, zero_stage=3)) as trainer:
        for step in range(2):
            for micro in range(ACCUM):
                trainer.step(*batch(CONFIG, step, micro))
            trainer.update(lr=1e-2)
        trainer.save_checkpoint(tmp_path, 2)
        weights = trainer.get_weights()
        state = trainer.get_optimizer_state()
    with nanoq.Trainer(CONFIG, options(1, zero_stage=1)) as trainer:
        trainer.load_checkpoint(tmp_path)
        for name, value in trainer.get_weights().items():
            assert np.array_equal(value, weights[name]), name
        for kind, arrays in trainer.get_optimizer_state().items():
            for name, value in arrays.items():
                assert np.array_equal(value, state[kind][name]), (kind, name)


def test_zero_stage_is_validated():
    with pytest.raises(ValueError, match="zero_stage"):
        nanoq.TrainOptions(zero_stage=4)


OFFLOADS = [(), ("optimizer",), ("master",), ("optimizer", "master"), ("optimizer", "master", "gradients")]
RECOMPUTES = [(), ("ffn",), ("block",)]


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_every_stage_offload_and_recompute_matches_the_plain_run(devices):
    """The whole matrix, against the plain run (stage 1, nothing offloaded or
    recomputed) on the same device count: bitwise at stage 1 (offload and
    recompute change no arithmetic); at stages 2 and 3 to fp32 rounding, and
    bitwise against plain stage 2."""
    plain = run(devices=devices, steps=3)
    plain_stage2 = run(devices=devices, steps=3, zero_stage=2)
    for stage in (1, 2, 3):
        for offload in OFFLOADS:
            if "gradients" in offload and stage == 1:
                continue
            for recompute in RECOMPUTES:
                label = f"stage {stage}, offload {offload}, recompute {recompute}"
                losses, weights, _ = run(devices=devices, steps=3, zero_stage=stage, offload=offload,
                                         recompute=recompute)
                reference = plain if stage == 1 else plain_stage2
                assert losses == reference[0], label
                for name, value in weights.items():
                    assert np.array_equal(value, reference[1][name]), (label, name)
                np.testing.assert_allclose(losses, plain[0], rtol=1e-6, err_msg=label)
