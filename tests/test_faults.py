"""Numerical and process faults: a non-finite loss or gradient skips its
update; training halts after too many in a row with a checkpoint of the last
good state; SIGINT/SIGTERM stop after the current step with a checkpoint."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import nanoq

CONFIG = nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4)


def batch(seed=0):
    tokens = np.random.default_rng(seed).integers(0, 64, (2, 9), dtype=np.int32)
    return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])


@pytest.mark.parametrize("devices", [1, 2])
def test_non_finite_loss_skips_the_update_and_changes_nothing(devices):
    with nanoq.Trainer(CONFIG, nanoq.TrainOptions(backend="cpu", devices=devices, batch_size=2 // devices,
                                                  seq_len=8)) as trainer:
        trainer.step(*batch())
        assert not trainer.update(lr=1e-2).skipped
        good = trainer.get_weights()
        state = trainer.get_optimizer_state()
        poisoned = dict(good, **{"model.norm.weight": np.full_like(good["model.norm.weight"], np.nan)})
        trainer.set_weights(poisoned)
        trainer.step(*batch(1))
        stats = trainer.update(lr=1e-2)
        assert stats.skipped and not np.isfinite(stats.loss)
        assert trainer.optimizer_steps == 1
        after = trainer.get_optimizer_state()
        for kind in ("adam_m", "adam_v"):
            for name, value in after[kind].items():
                assert np.array_equal(value, state[kind][name]), (kind, name)
        # Healthy weights again: training goes on from the last good state.
        trainer.set_weights(good)
        trainer.step(*batch(2))
        stats = trainer.update(lr=1e-2)
        assert not stats.skipped and np.isfinite(stats.loss) and trainer.optimizer_steps == 2
