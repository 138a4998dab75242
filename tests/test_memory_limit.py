"""Out-of-memory errors that explain themselves (provoked with the cpu
backend's memory limit), and the per-device memory summary."""
import os

import numpy as np
import pytest

import nanoq

CONFIG = nanoq.ModelConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4)


def options(**overrides):
    return nanoq.TrainOptions(**dict(dict(backend="cpu", devices=2, batch_size=2, seq_len=64), **overrides))


def test_memory_summary_matches_allocations():
    with nanoq.Trainer(CONFIG, options()) as trainer:
        summary = trainer.memory_summary()
        assert [entry["device"] for entry in summary] == [0, 1]
        for entry in summary:
            segments = trainer.get_allocations(entry["device"])
            expected = {}
            for s in segments:
                expected[s["context"]] = expected.get(s["context"], 0) + s["bytes"]
            assert entry["contexts"] == expected
            assert entry["allocated"] == sum(expected.values())
            # Host memory has no device figure on the cpu backend.
            assert entry["free"] is None and entry["total"] is None and entry["other"] is None
            assert {"weights", "gradients", "adam-m", "adam-v", "activations", "workspace", "stack"} <= set(expected)


def allocated_bytes():
    with nanoq.Trainer(CONFIG, options()) as trainer:
        return trainer.memory_summary()[0]["allocated"]


def last_allocation():
    with nanoq.Trainer(CONFIG, options()) as trainer:
        return trainer.get_allocations(0)[-1]


def test_activations_that_do_not_fit_suggest_smaller_micro_batches():
    with nanoq.Trainer(CONFIG, options()) as trainer:
        segments = trainer.get_allocations(0)
    first = next(i for i, s in enumerate(segments) if s["context"] == "activations")
    before_activations = sum(s["bytes"] for s in segments[:first])
    with pytest.raises(nanoq.OutOfMemoryError, match=r"(?s)\(activations, float32.*suggestion: lower batch_size"):
        nanoq.Trainer(CONFIG, options(memory_limit=before_activations + 1024))


def test_limit_below_need_raises_out_of_memory_naming_tensor_context_and_device():
    need = allocated_bytes()
    with pytest.raises(nanoq.OutOfMemoryError) as error:
        nanoq.Trainer(CONFIG, options(memory_limit=need - 1))
    message = str(error.value)
    assert "out of memory on device" in message
    # The last allocation is the one that no longer fits.
    last = last_allocation()
    assert f"allocating '{last['name']}' ({last['context']}, float32 [" in message
    assert "memory limit of" in message
    for context in ("weights", "gradients", "adam-m", "adam-v", "activations"):
        assert f"\n  {context}: " in message
    assert "suggestion: " in message
    assert isinstance(error.value, nanoq.NanoqError)


def test_weights_that_do_not_fit_suggest_more_devices():
    with pytest.raises(nanoq.OutOfMemoryError, match=r"(?s)'weights' \(weights, float32 \[\d+\].*already "
                                                     r"allocated on this device: nothing.*suggestion: use more devices"):
        nanoq.Trainer(CONFIG, options(memory_limit=1024))


def test_exact_limit_fits_and_trains():
    need = allocated_bytes()
    with nanoq.Trainer(CONFIG, options(memory_limit=need)) as trainer:
        assert trainer.memory_summary()[0]["limit"] == need
        tokens = np.random.default_rng(0).integers(0, 4096, (4, 64), dtype=np.int32)
        trainer.step(tokens, tokens)
        assert np.isfinite(trainer.update(lr=1e-3).loss)


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_out_of_memory_leaks_nothing_and_the_process_goes_on():
    need = allocated_bytes()
    # Each failed attempt allocates everything but the stack (~10 MB) first.
    for _ in range(3):
        with pytest.raises(nanoq.OutOfMemoryError):
            nanoq.Trainer(CONFIG, options(memory_limit=need - 1))
    before = rss_bytes()
    for _ in range(30):
        with pytest.raises(nanoq.OutOfMemoryError):
            nanoq.Trainer(CONFIG, options(memory_limit=need - 1))
    assert rss_bytes() - before < need * 3, "failed constructions must free what they allocated"
    assert allocated_bytes() == need


def test_memory_limit_must_be_a_byte_count():
    with pytest.raises(ValueError, match="memory_limit"):
        options(memory_limit=-1)
    with pytest.raises(ValueError, match="memory_limit"):
        options(memory_limit=1.5)
