"""Asynchronous steps: step() queues a micro-batch's work on the device
workers and returns once the batch is the trainer's; the host waits for the
devices only in the calls that need results (update, validate, the getters).
Queued work gives the same bits as work that was waited for after every
step, the caller may reuse its arrays at once, and a failure of queued work
surfaces at the next waiting call (or step), naming the step."""
import dataclasses
import time

import numpy as np
import pytest

import nanoq
from nanoq import testing
from conftest import cuda_cases, random_batch, use_cuda_backend

CONFIG = nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
SEQ = 8


def options(devices, grad_accum=1, zero_stage=1, backend="cpu", batch_size=1):
    return nanoq.TrainOptions(backend=backend, devices=devices, batch_size=batch_size, seq_len=SEQ,
                              grad_accum=grad_accum, zero_stage=zero_stage, threads=1)


def batches(count, rows, seed=0):
    rng = np.random.default_rng(seed)
    return [random_batch(rng, rows, SEQ, CONFIG.vocab_size) for _ in range(count)]


def new_trainer(opts):
    trainer = nanoq.Trainer(CONFIG, opts)
    trainer.init_weights(seed=3)
    return trainer


def train(trainer, micro_batches, grad_accum, wait_after_step=False, validate_every=0, overwrite=False,
          delay=None):
    """Runs optimizer steps over `micro_batches`; returns every update's and
    validation's statistics and the final weights. `wait_after_step` makes
    the host wait for the devices after each step (a waiting getter);
    `overwrite` scribbles over the caller's arrays right after each step;
    `delay` = (rank, seconds) holds that worker back before the first step,
    which must then return at once."""
    results = []
    for index, (inputs, targets) in enumerate(micro_batches):
        inputs, targets = inputs.copy(), targets.copy()
        if delay and index == 0:
            testing.delay_next_step(trainer, *delay)
        start = time.monotonic()
        trainer.step(inputs, targets)
        if delay and index == 0:
            assert time.monotonic() - start < 0.5 * delay[1]
        if overwrite:
            inputs[:] = 0
            targets[:] = -100
        if wait_after_step:
            trainer.get_stack_info(0)
        if validate_every and index % validate_every == 0:
            results.append(trainer.validate(*micro_batches[(index + 1) % len(micro_batches)]))
        if (index + 1) % grad_accum == 0:
            results.append(trainer.update(lr=1e-2))
    return results, trainer.get_weights()


def assert_same_run(a, b):
    (stats_a, weights_a), (stats_b, weights_b) = a, b
    assert len(stats_a) == len(stats_b)
    for x, y in zip(stats_a, stats_b):
        # Every field, bitwise (NaN where both have none, as validate()'s grad_norm).
        for field in dataclasses.fields(x):
            u, v = getattr(x, field.name), getattr(y, field.name)
            assert u == v or (u != u and v != v), (field.name, x, y)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert np.array_equal(weights_a[name], weights_b[name]), name


@pytest.mark.parametrize("devices", [1, 2])
def test_step_returns_before_its_work_is_done_and_results_are_unchanged(devices):
    micro_batches = batches(2, devices)
    with new_trainer(options(devices, grad_accum=2)) as trainer:
        expected = train(trainer, micro_batches, 2, wait_after_step=True)
    with new_trainer(options(devices, grad_accum=2)) as trainer:
        testing.delay_next_step(trainer, devices - 1, 3.0)
        start = time.monotonic()
        trainer.step(*micro_batches[0])
        trainer.step(*micro_batches[1])  # queued behind the delayed one; its batch goes to the other slot
        assert time.monotonic() - start < 1.5  # neither step waited for the devices
        assert trainer._core.micro_steps == 2
        stats = trainer.update(lr=1e-2)
        assert time.monotonic() - start >= 3.0  # update() waited for the delayed work
        assert_same_run(([stats], trainer.get_weights()), expected)


def test_a_third_step_waits_only_for_the_oldest_staging_slot():
    micro_batches = batches(3, 1)
    with new_trainer(options(1, grad_accum=3)) as trainer:
        expected = train(trainer, micro_batches, 3, wait_after_step=True)
    with new_trainer(options(1, grad_accum=3)) as trainer:
        testing.delay_next_step(trainer, 0, 2.0)
        start = time.monotonic()
        trainer.step(*micro_batches[0])
        trainer.step(*micro_batches[1])
        assert time.monotonic() - start < 1.0
        # Both slots are in use until the delayed first step has read its batch.
        trainer.step(*micro_batches[2])
        assert time.monotonic() - start >= 2.0
        assert_same_run(([trainer.update(lr=1e-2)], trainer.get_weights()), expected)


@pytest.mark.parametrize("devices", [1, 3])
def test_the_caller_may_overwrite_its_arrays_right_after_step(devices):
    micro_batches = batches(4, devices, seed=1)
    with new_trainer(options(devices, grad_accum=2)) as trainer:
        expected = train(trainer, micro_batches, 2)
    with new_trainer(options(devices, grad_accum=2)) as trainer:
        # The first step's work starts after its arrays were overwritten.
        assert_same_run(train(trainer, micro_batches, 2, overwrite=True, delay=(0, 1.0)), expected)


@pytest.mark.parametrize("devices, zero_stage", [(1, 1), (3, 1), (3, 2), (3, 3)])
def test_many_queued_steps_with_accumulation_and_validation_match_waiting_after_every_step(devices, zero_stage):
    grad_accum = 3
    micro_batches = batches(6 * grad_accum, devices, seed=2)
    runs = []
    for wait in (True, False):
        with new_trainer(options(devices, grad_accum=grad_accum, zero_stage=zero_stage)) as trainer:
            runs.append(train(trainer, micro_batches, grad_accum, wait_after_step=wait, validate_every=2))
    assert len(runs[0][0]) == 6 + 9  # six updates, nine validations
    assert_same_run(*runs)


@pytest.mark.parametrize("zero_stage", [1, 3])  # stage 3: the peers wait in the layers' gathers
def test_an_error_in_queued_work_names_the_step_at_the_next_update_and_the_trainer_refuses_more_work(zero_stage):
    micro_batches = batches(6, 3, seed=4)
    with new_trainer(options(3, grad_accum=3, zero_stage=zero_stage)) as trainer:
        for batch in micro_batches[:3]:
            trainer.step(*batch)
        trainer.update(lr=1e-2)
        trainer.step(*micro_batches[3])
        testing.fail_next_step(trainer, 1)
        trainer.step(*micro_batches[4])  # returns: the fault is in the queued work
        with pytest.raises(nanoq.NanoqError) as error:
            trainer.step(*micro_batches[5])  # may already see the failure
            trainer.update(lr=1e-2)
        assert str(error.value) == ("step() #5 (micro-batch 2 of optimizer step 2) failed on device 1: "
                                    "injected fault in worker 1")
        for call in (lambda: trainer.update(lr=1e-2), lambda: trainer.validate(*micro_batches[0]),
                     trainer.get_weights):
            with pytest.raises(nanoq.NanoqError, match="stopped after a worker failure"):
                call()
        # The memory inspection still answers (as before queuing): it runs nothing on the devices.
        assert trainer.get_stack_info(0)["capacity"] > 0


def test_an_error_in_queued_work_surfaces_at_the_next_step():
    micro_batches = batches(3, 2, seed=5)
    with new_trainer(options(2, grad_accum=3)) as trainer:
        testing.fail_next_step(trainer, 0)
        trainer.step(*micro_batches[0])
        time.sleep(1.0)  # the failing work ends at once: by now it has failed
        with pytest.raises(nanoq.NanoqError) as error:
            trainer.step(*micro_batches[1])
        assert str(error.value) == ("step() #1 (micro-batch 1 of optimizer step 1) failed on device 0: "
                                    "injected fault in worker 0")
        assert trainer._core.micro_steps == 1  # nothing more was queued
        with pytest.raises(nanoq.NanoqError, match="stopped after a worker failure"):
            trainer.step(*micro_batches[2])


def test_a_queued_error_is_never_lost_at_close_or_wait():
    micro_batches = batches(2, 2, seed=8)
    expected = ("step() #1 (micro-batch 1 of optimizer step 1) failed on device 1: injected fault in worker 1")
    # close() after a failed step nobody waited for: the error comes out, the memory is freed anyway.
    trainer = new_trainer(options(2, grad_accum=2))
    testing.fail_next_step(trainer, 1)
    trainer.step(*micro_batches[0])
    with pytest.raises(nanoq.NanoqError) as error:
        trainer.close()
    assert str(error.value) == expected
    trainer.close()  # closed: nothing more to say
    with pytest.raises(RuntimeError, match="closed"):
        trainer.step(*micro_batches[1])
    # The end of a with block is a close(): same error.
    with pytest.raises(nanoq.NanoqError) as error:
        with new_trainer(options(2, grad_accum=2)) as trainer:
            testing.fail_next_step(trainer, 1)
            trainer.step(*micro_batches[0])
    assert str(error.value) == expected
    # ... unless another exception is already leaving the block: that one is seen.
    with pytest.raises(KeyError):
        with new_trainer(options(2, grad_accum=2)) as trainer:
            testing.fail_next_step(trainer, 1)
            trainer.step(*micro_batches[0])
            raise KeyError("the caller's own error")
    # wait() raises it too, and the trainer refuses work afterwards.
    with new_trainer(options(2, grad_accum=2)) as trainer:
        testing.fail_next_step(trainer, 1)
        trainer.step(*micro_batches[0])
        with pytest.raises(nanoq.NanoqError) as error:
            trainer.wait()
        assert str(error.value) == expected
        with pytest.raises(nanoq.NanoqError, match="stopped after a worker failure"):
            trainer.step(*micro_batches[1])
    # Without a failure, wait() returns once the queued work is done.
    with new_trainer(options(2, grad_accum=2)) as trainer:
        trainer.step(*micro_batches[0])
        trainer.wait()
        assert trainer._core.micro_steps == 1


@pytest.mark.parametrize("backend", cuda_cases())
def test_cuda_steps_are_queued_and_match_waiting_after_every_step(backend, request):
    use_cuda_backend(backend, request)
    grad_accum = 3
    micro_batches = batches(2 * grad_accum, 2, seed=6)
    with new_trainer(options(2, grad_accum=grad_accum, backend=backend)) as trainer:
        expected = train(trainer, micro_batches, grad_accum, wait_after_step=True, validate_every=2)
    with new_trainer(options(2, grad_accum=grad_accum, backend=backend)) as trainer:
        assert_same_run(train(trainer, micro_batches, grad_accum, validate_every=2, overwrite=True,
                              delay=(1, 1.0)), expected)
