"""What tests/test_checkpoint_processes.py and its mpiexec scripts share:
the options, the global batches and the training of one process's rows
(no torch here, so that the scripts start fast)."""
import numpy as np

import nanoq
from processes.world import CONFIG, global_batches

SEQ = 8
WORLD = 4  # devices in the tests' worlds, however split into processes
BATCHES = global_batches(8, WORLD, SEQ, seed=11)


def options(devices, **overrides):
    return nanoq.TrainOptions(**dict(dict(backend="cpu", devices=devices, batch_size=1, seq_len=SEQ, threads=1),
                                     **overrides))


def train(trainer, steps):
    """One update per global batch of `steps` (indices into BATCHES), on
    this trainer's rows; returns the losses."""
    rows_per_process = trainer.world_size * trainer.options.batch_size
    first = trainer.topology[1] * trainer.options.batch_size
    rows = slice(first, first + rows_per_process)
    losses = []
    for inputs, targets in (BATCHES[step] for step in steps):
        trainer.step(np.ascontiguousarray(inputs[rows]), np.ascontiguousarray(targets[rows]))
        losses.append(trainer.update(lr=1e-2).loss)
    return losses
