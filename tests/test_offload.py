"""Offload of the AdamW moments and master weights to host memory: bitwise
the same training (the same arithmetic, staged through device buffers), less
device memory, and checkpoints that move between offloaded and not."""
import numpy as np
import pytest

import nanoq

CONFIG = nanoq.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, qkv_bias=True)
SEQ, ROWS = 16, 4


def trainer(devices=1, **options):
    return nanoq.Trainer(CONFIG, nanoq.TrainOptions(backend="cpu", devices=devices, batch_size=ROWS // devices,
                                                    seq_len=SEQ, seed=1, **options))


def train(t, first, last):
    losses = []
    for step in range(first, last):
        tokens = np.random.default_rng(step).integers(0, CONFIG.vocab_size, (ROWS, SEQ + 1), dtype=np.int32)
        t.step(np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:]))
        losses.append(t.update(lr=1e-2, weight_decay=0.1, grad_clip=0.5).loss)
    return losses


def memory(t):
    summary = t.memory_summary()[0]
    return summary["contexts"], summary["host"]


COMBINATIONS = [("optimizer",), ("master",), ("optimizer", "master")]


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("offload", COMBINATIONS, ids=["+".join(c) for c in COMBINATIONS])
@pytest.mark.parametrize("recompute", [(), ("block",)], ids=["keep", "recompute-block"])
def test_offload_trains_bitwise_like_the_baseline(offload, devices, recompute):
    with trainer(devices) as base:
        expected = train(base, 0, 4)
        expected_weights = base.get_weights()
    with trainer(devices, offload=offload, recompute=recompute) as t:
        assert train(t, 0, 4) == expected
        for name, value in t.get_weights().items():
            assert np.array_equal(value, expected_weights[name]), name


def test_offload_moves_state_from_device_to_host_memory():
    with trainer() as base:
        device, host = memory(base)
        assert host == 0
    with trainer(offload=("optimizer", "master")) as t:
        offloaded, offloaded_host = memory(t)
    assert "adam-m" not in offloaded and "adam-v" not in offloaded and "master" not in offloaded
    # The moments and a separate master copy now live in host memory.
    assert offloaded_host == device["adam-m"] + device["adam-v"] + device["adam-m"]
    kinds = {(s["context"], s["kind"]) for s in t_allocations(offload=("optimizer", "master"))}
    assert {("adam-m", "pinned"), ("adam-v", "pinned"), ("master", "pinned")} <= kinds


def t_allocations(**options):
    with trainer(**options) as t:
        return t.get_allocations(0)


def test_checkpoints_move_between_offloaded_and_device_state(tmp_path):
    with trainer(offload=("optimizer", "master")) as t:
        train(t, 0, 3)
        t.save_checkpoint(tmp_path, 3)
        expected = train(t, 3, 6)
    with trainer(devices=2) as t:
        t.load_checkpoint(tmp_path)
        np.testing.assert_allclose(train(t, 3, 6), expected, rtol=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("devices", [1, 2])
def test_gradient_shard_offload_is_bitwise_the_same_stage(stage, devices):
    with trainer(devices, zero_stage=stage) as base:
        expected = train(base, 0, 3)
        expected_weights = base.get_weights()
    with trainer(devices, zero_stage=stage, offload=("optimizer", "master", "gradients")) as t:
        assert train(t, 0, 3) == expected
        for name, value in t.get_weights().items():
            assert np.array_equal(value, expected_weights[name]), name
        kinds = {(s["name"], s["kind"]) for s in t.get_allocations(0)}
        assert ("gradient-shard", "pinned") in kinds


def test_offload_options_are_validated():
    with pytest.raises(ValueError, match="unknown offload option 'activations'"):
        nanoq.TrainOptions(offload="activations")
    with pytest.raises(ValueError, match="offloading gradients needs zero_stage 2 or 3"):
        nanoq.TrainOptions(offload="gradients")
