"""Soak: thousands of optimizer steps, with validation, weight reads, memory
reports and trainers closed and re-created along the way, must not grow the
process's resident memory. A leak check for the core, the binding and the
Python wrapper together, not a timing test (about 5 s on two CPU cores).

Resident memory is sampled every SAMPLE_EVERY steps, while a trainer is live
and after each one closes. The first WARMUP_CYCLES trainers (one per ZeRO
stage) warm up the allocators and page in the code; every later sample must
stay within GROWTH_BOUND of the highest warm-up sample. With 7,200 measured
steps the bound catches any leak of about 1.2 KB or more per step.
"""

import gc
import os

import numpy as np
import pytest

import nanoq

VOCAB = 64
SEQ = 8
CYCLES = 12  # trainers, created and closed in turn
STEPS_PER_CYCLE = 800
WARMUP_CYCLES = 3
VALIDATE_EVERY = 10
INSPECT_EVERY = 100  # get_weights() and memory_summary()
SAMPLE_EVERY = 100
GROWTH_BOUND = 8 * 2**20
MIB = 2**20


def resident_bytes():
    """Resident set size of this process (second field of /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sanitizer_runtime_loaded():
    """Whether ASan or TSan is preloaded (tests/sanitize/run.sh): their shadow
    memory and ASan's quarantine of freed blocks make resident memory grow
    with or without a leak; LeakSanitizer checks leaks there instead."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    return "libasan.so" in maps or "libtsan.so" in maps


def tiny_config():
    return nanoq.ModelConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    )


def test_thousands_of_steps_and_trainer_restarts_do_not_grow_resident_memory():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(32, 2, SEQ + 1), dtype=np.int32)
    batches = [(np.ascontiguousarray(t[:, :-1]), np.ascontiguousarray(t[:, 1:])) for t in tokens]
    samples = []  # (cycle, step, resident bytes)
    first_loss = last_loss = None
    for cycle in range(CYCLES):
        options = nanoq.TrainOptions(backend="cpu", devices=2, batch_size=1, seq_len=SEQ,
                                     seed=cycle, zero_stage=cycle % 3 + 1)
        with nanoq.Trainer(tiny_config(), options) as trainer:
            allocated = [device["allocated"] for device in trainer.memory_summary()]
            for step in range(STEPS_PER_CYCLE):
                inputs, targets = batches[step % len(batches)]
                trainer.step(inputs, targets)
                stats = trainer.update(lr=3e-3)
                if step % VALIDATE_EVERY == 0:
                    trainer.validate(*batches[(step + 1) % len(batches)])
                if step % INSPECT_EVERY == 0:
                    weights = trainer.get_weights()
                    assert all(np.isfinite(w).all() for w in weights.values())
                    # The core's own accounting is fixed once the trainer exists.
                    assert [device["allocated"] for device in trainer.memory_summary()] == allocated
                if step % SAMPLE_EVERY == SAMPLE_EVERY - 1:
                    samples.append((cycle, step, resident_bytes()))
            if cycle == 0:
                first_loss = trainer.validate(*batches[0]).loss
            last_loss = trainer.validate(*batches[0]).loss
        gc.collect()
        samples.append((cycle, STEPS_PER_CYCLE, resident_bytes()))

    # The trainers did train: the 32 batches are memorised within a cycle.
    assert np.isfinite(stats.loss) and last_loss < 0.8 * first_loss

    if sanitizer_runtime_loaded():
        pytest.skip("the steps ran, but resident memory means nothing under a sanitizer")
    baseline = max(rss for cycle, _, rss in samples if cycle < WARMUP_CYCLES)
    cycle, step, peak = max((s for s in samples if s[0] >= WARMUP_CYCLES), key=lambda s: s[2])
    trace = ", ".join(f"{rss / MIB:.1f}" for c, s, rss in samples if s == STEPS_PER_CYCLE)
    assert peak - baseline <= GROWTH_BOUND, (
        f"resident memory grew by {(peak - baseline) / MIB:.1f} MiB (bound {GROWTH_BOUND / MIB:.0f} MiB) over "
        f"{(CYCLES - WARMUP_CYCLES) * STEPS_PER_CYCLE} steps after warm-up, peaking at cycle {cycle} step {step}; "
        f"MiB after each trainer closed: {trace}"
    )
