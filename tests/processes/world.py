"""What tests/test_processes.py and its mpiexec worker share: the model,
the global batches and the options."""
import numpy as np

import nanoq

CONFIG = nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)


def global_batches(count, rows, seq_len, seed=0):
    """`count` seeded global batches of `rows` rows (targets with some -100s)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        inputs = rng.integers(0, CONFIG.vocab_size, size=(rows, seq_len), dtype=np.int32)
        targets = rng.integers(0, CONFIG.vocab_size, size=(rows, seq_len), dtype=np.int32)
        targets[rng.random((rows, seq_len)) < 0.1] = -100
        out.append((inputs, targets))
    return out


def to_options(fields: dict) -> nanoq.TrainOptions:
    fields = dict(dict(backend="cpu", batch_size=1, seq_len=8, grad_accum=2, threads=1), **fields)
    for name in ("recompute", "offload"):
        if name in fields:
            fields[name] = tuple(fields[name])
    return nanoq.TrainOptions(**fields)
