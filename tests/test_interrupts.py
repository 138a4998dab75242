"""Ctrl-C in a Python script: KeyboardInterrupt arrives at once while step(), update(), validate() or wait()
wait for a slow micro-batch, and the trainer then trains on as if the interrupted step's micro-batch (for
step()) or the micro-batches since the last update (the other calls) had never been given (compared with a
trainer that never had them)."""
import json
import signal
import subprocess
import sys

# Each scenario queues a micro-batch whose work starts 3 s late (delay_next_step), then makes a call that
# waits for it and has SIGINT sent to the process 0.3 s later. Without prompt interrupts the
# KeyboardInterrupt would come only when the call returns, ~2.7 s after the signal.
SCRIPT = r"""
import json, os, signal, sys, threading, time
import numpy as np
import nanoq
from nanoq.testing.hooks import delay_next_step, delay_next_validate

config = nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
options = nanoq.TrainOptions(backend="cpu", devices=2, batch_size=2, seq_len=16, grad_accum=3, threads=1,
                             zero_stage=int(sys.argv[1]))
rng = np.random.default_rng(0)
windows = [rng.integers(0, 64, (4, 17), dtype=np.int32) for _ in range(12)]
batches = [(np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])) for w in windows]
HYPER = dict(lr=1e-2, weight_decay=0.1, grad_clip=1.0)
SIGNAL_AFTER = 0.3


def interrupted(trainer, call, then=(), slow_step=True):
    # Seconds from SIGINT to the KeyboardInterrupt out of call(), which waits for a slow micro-batch
    # (queued first, then the micro-batches `then`), or else is a slow validate.
    if slow_step:
        delay_next_step(trainer, 0, 3.0)
        trainer.step(*batches[7])  # queued: returns at once
    else:
        delay_next_validate(trainer, 1, 3.0)
    for index in then:
        trainer.step(*batches[index])
    threading.Timer(SIGNAL_AFTER, os.kill, (os.getpid(), signal.SIGINT)).start()
    began = time.monotonic()
    try:
        call()
    except KeyboardInterrupt:
        return time.monotonic() - began - SIGNAL_AFTER
    raise AssertionError("no KeyboardInterrupt")


def train_steps(trainer, indices):
    for index in indices:
        trainer.step(*batches[index])
    return trainer.update(**HYPER)


report = {"latency": {}, "after": {}}
with nanoq.Trainer(config, options) as trainer:
    first = train_steps(trainer, [0, 1, 2])
    # step(4) waits for the batch slot of the slow micro-batch, two steps back
    report["latency"]["step"] = interrupted(trainer, lambda: trainer.step(*batches[4]), then=[3])
    report["after"]["step"] = [trainer.micro_steps, trainer.optimizer_steps]
    # ... discards micro-batch 4 alone: the two before it (7 and 3) stay and update() applies them.
    kept = trainer.update(**HYPER)
    report["latency"]["update"] = interrupted(trainer, lambda: trainer.update(**HYPER))
    report["after"]["update"] = [trainer.micro_steps, trainer.optimizer_steps]
    report["latency"]["validate"] = interrupted(trainer, lambda: trainer.validate(*batches[5]))
    report["after"]["validate"] = [trainer.micro_steps, trainer.optimizer_steps]
    report["latency"]["wait"] = interrupted(trainer, trainer.wait)
    report["after"]["wait"] = [trainer.micro_steps, trainer.optimizer_steps]
    # validate's own forward pass, slow on device 1, after a micro-batch that it discards too
    report["latency"]["forward"] = interrupted(trainer, lambda: trainer.validate(*batches[6]), then=[3],
                                               slow_step=False)
    report["after"]["forward"] = [trainer.micro_steps, trainer.optimizer_steps]
    try:
        trainer.update(**HYPER)
    except ValueError as e:
        report["update_without_step"] = str(e)
    second = train_steps(trainer, [8, 9, 10])
    evaluation = trainer.validate(*batches[11])
    weights = trainer.get_weights()
with nanoq.Trainer(config, options) as fresh:  # never had the interrupted micro-batches
    fresh_first = train_steps(fresh, [0, 1, 2])
    fresh_kept = train_steps(fresh, [7, 3])
    fresh_second = train_steps(fresh, [8, 9, 10])
    fresh_evaluation = fresh.validate(*batches[11])
    fresh_weights = fresh.get_weights()
same = lambda a, b: repr(a) == repr(b)  # noqa: E731 - StepStats, with nan where a statistic has none
report["same_stats"] = [same(first, fresh_first), same(kept, fresh_kept), same(second, fresh_second),
                        same(evaluation, fresh_evaluation)]
report["same_weights"] = all(np.array_equal(weights[name], fresh_weights[name]) for name in weights)
report["loss"] = second.loss
print(json.dumps(report))
"""


def run_script(zero_stage):
    # SIGINT as a terminal leaves it (Python then raises KeyboardInterrupt), also where pytest itself was
    # started with it ignored: a shell without job control does that to `pytest ... &`, and children inherit it.
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(zero_stage)], capture_output=True, text=True,
                            timeout=180, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_ctrl_c_interrupts_a_waiting_call_at_once_and_discards_the_micro_batches_since_the_update():
    report = run_script(zero_stage=1)
    for call, seconds in report["latency"].items():
        assert seconds < 1.0, f"KeyboardInterrupt out of {call}() came {seconds:.2f} s after SIGINT"
    # step() keeps the two micro-batches before the interrupted one; the other calls discard all since the update.
    assert report["after"] == dict({call: [0, 2] for call in ("update", "validate", "wait", "forward")},
                                   step=[2, 1])
    assert report["update_without_step"] == "update() called before any step(): there are no gradients to apply"
    assert report["same_stats"] == [True, True, True, True] and report["same_weights"]
    assert 0 < report["loss"] < 10


def test_interrupted_micro_batches_are_discarded_with_sharded_gradients_too():
    # Stage 2 sums each micro-batch's gradients into the owners' shards as its backward ends.
    report = run_script(zero_stage=2)
    assert max(report["latency"].values()) < 1.0
    assert report["same_stats"] == [True, True, True, True] and report["same_weights"]
