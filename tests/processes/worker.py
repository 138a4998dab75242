"""One process of a multi-process test world, started by mpiexec from
tests/test_processes.py. Argument: a JSON spec with
  mode:     "train" (default), "raise" (this process raises mid-run),
            "core_failure" (a device worker of this process fails mid-run),
            "kill" (this process SIGKILLs itself mid-run),
            "stall" (this process stops mid-run without failing: it sleeps)
  failing:  the process rank that fails (modes other than train)
  options:  TrainOptions fields (devices = this process's devices)
  steps:    optimizer steps; out: the directory for each rank's results;
  late_env: environment variables set once the trainer is made (optional).
Trains the tests' tiny model on seeded random global batches; each process
steps over its rows and writes out/rank<r>.npz (losses, norms, weights)."""
import json
import os
import signal
import sys
import time

import numpy as np

import nanoq
from nanoq import distributed
from nanoq.testing import fail_next_step

spec = json.loads(sys.argv[1])
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from processes.world import CONFIG, global_batches, to_options  # noqa: E402

group = distributed.processes()
options = to_options(spec["options"])
rows_per_process = options.devices * options.batch_size
rows = slice(group.rank * rows_per_process, (group.rank + 1) * rows_per_process)
mode, failing = spec.get("mode", "train"), spec.get("failing", 1)
losses, norms = [], []
with nanoq.Trainer(CONFIG, options) as trainer:
    trainer.init_weights(seed=3)
    os.environ.update(spec.get("late_env", {}))  # from here on (the set-up, slow under load, is not held to it)
    for index, (inputs, targets) in enumerate(global_batches(spec["steps"] * options.grad_accum,
                                                              group.size * rows_per_process, options.seq_len)):
        if group.rank == failing and index == 3:
            if mode == "raise":
                raise RuntimeError(f"deliberate failure on process {group.rank}")
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "core_failure":
                fail_next_step(trainer, 0)
            if mode == "stall":
                time.sleep(600)
        called = time.monotonic()
        try:
            trainer.step(np.ascontiguousarray(inputs[rows]), np.ascontiguousarray(targets[rows]))
            if (index + 1) % options.grad_accum == 0:
                stats = trainer.update(lr=1e-2)
                losses.append(stats.loss)
                norms.append(stats.grad_norm)
        except Exception:
            # How long the failing call waited (the stall tests' lower bound), before the error ends the run.
            print(json.dumps(dict(rank=group.rank, failed_after=time.monotonic() - called)), flush=True)
            raise
    weights = trainer.get_weights()  # collective: every process gathers the stage-3 shards
    np.savez(os.path.join(spec["out"], f"rank{group.rank}.npz"), losses=np.array(losses), norms=np.array(norms),
             topology=np.array(trainer.topology), **{f"w.{k}": v for k, v in weights.items()})
