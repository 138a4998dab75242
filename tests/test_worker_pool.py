"""Per-device workers: failures surface as nanoq.NanoqError without hangs or
leaked threads, and the memory bookkeeping reports what lives on a device."""

import os
import threading
import time

import numpy as np
import pytest

import nanoq
from nanoq import testing
from conftest import open_trainer, random_batch, run_steps

BATCH = random_batch(np.random.default_rng(40), rows=4)


def call_with_timeout(fn, timeout=30.0):
    """Run fn in a helper thread; fail (instead of hanging the suite) if it
    does not return in time. Re-raises fn's exception."""
    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"call did not return within {timeout}s"
    if "error" in result:
        raise result["error"]
    return result.get("value")


def os_thread_count():
    """All OS threads of this process (C++ workers included)."""
    return len(os.listdir("/proc/self/task"))


def wait_for_thread_count(at_most, timeout=5.0):
    """Exiting threads can linger in /proc for a moment after being joined."""
    deadline = time.monotonic() + timeout
    while os_thread_count() > at_most and time.monotonic() < deadline:
        time.sleep(0.02)
    return os_thread_count()


@pytest.fixture(scope="module")
def clean_loss(checkpoints):
    with open_trainer(checkpoints.path("llama"), devices=2, batch_size=2) as tr:
        return run_steps(tr, [BATCH], lr=1e-3).loss


def test_nanoq_error_is_a_runtime_error():
    assert issubclass(nanoq.NanoqError, RuntimeError)


@pytest.mark.parametrize("devices, rank", [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_worker_fault_raises_promptly_and_process_recovers(checkpoints, clean_loss, devices, rank):
    path = checkpoints.path("llama")
    tr = open_trainer(path, devices=devices, batch_size=4 // devices)
    testing.fail_next_step(tr, rank)
    start = time.monotonic()
    # step() only queues the work: the fault surfaces at the next call that waits for it.
    call_with_timeout(lambda: tr.step(*BATCH))
    with pytest.raises(nanoq.NanoqError, match=rf"^step\(\) #1 \(micro-batch 1 of optimizer step 1\) failed on "
                                               rf"device {rank}: injected fault in worker {rank}$"):
        call_with_timeout(lambda: tr.update(lr=1e-3))
    assert time.monotonic() - start < 2.0  # the failure reaches Python at once, not after a time limit
    with pytest.raises(nanoq.NanoqError, match="stopped after a worker failure"):
        call_with_timeout(lambda: tr.update(lr=1e-3))
    call_with_timeout(tr.close)
    # A new trainer in the same process trains exactly like one that never saw a fault.
    with open_trainer(path, devices=2, batch_size=2) as fresh:
        assert run_steps(fresh, [BATCH], lr=1e-3).loss == clean_loss


def test_trainers_do_not_leak_threads(checkpoints):
    path = checkpoints.path("llama")
    # Warm-up: anything created once per process (pools, timers) is counted
    # in the baseline and is not a leak.
    with open_trainer(path, devices=4, batch_size=1) as tr:
        run_steps(tr, [BATCH], lr=1e-3)
    baseline = wait_for_thread_count(0, timeout=0.2)
    for _ in range(3):
        with open_trainer(path, devices=4, batch_size=1) as tr:
            run_steps(tr, [BATCH], lr=1e-3)
            # workers exist while open, so the final count is a real check
            assert os_thread_count() > baseline
    tr = open_trainer(path, devices=2, batch_size=2)
    testing.fail_next_step(tr, 1)
    call_with_timeout(lambda: tr.step(*BATCH))
    with pytest.raises(nanoq.NanoqError, match="injected fault in worker 1"):
        call_with_timeout(lambda: tr.update(lr=1e-3))
    call_with_timeout(tr.close)
    assert wait_for_thread_count(baseline) <= baseline


CONTEXTS = {"weights", "gradients", "adam-m", "adam-v", "activations"}


def _bytes_by_context(allocations):
    out = {}
    for a in allocations:
        out[a["context"]] = out.get(a["context"], 0) + a["bytes"]
    return out


def _allocations_after_one_update(path, devices):
    tr = open_trainer(path, devices=devices, batch_size=4 // devices)
    with tr:
        run_steps(tr, [BATCH], lr=1e-3)
        return [tr.get_allocations(d) for d in range(devices)], tr.get_weights()


def test_allocations_list_every_context_with_positive_bytes(checkpoints):
    (allocs,), weights = _allocations_after_one_update(checkpoints.path("llama"), 1)
    assert CONTEXTS <= {a["context"] for a in allocs}
    for a in allocs:
        assert set(a) >= {"context", "name", "bytes", "kind"}
        assert isinstance(a["name"], str) and a["name"]
        assert isinstance(a["bytes"], int) and a["bytes"] > 0, a
    by_context = _bytes_by_context(allocs)
    n_params = sum(w.size for w in weights.values())
    assert by_context["weights"] >= 4 * n_params  # fp32 master weights
    assert by_context["gradients"] > 0 and by_context["activations"] > 0


def test_adam_state_is_sharded_across_devices(checkpoints):
    path = checkpoints.path("llama")
    (one,), _ = _allocations_after_one_update(path, 1)
    two, _ = _allocations_after_one_update(path, 2)
    single = _bytes_by_context(one)
    for device, allocs in enumerate(two):
        assert CONTEXTS <= {a["context"] for a in allocs}, device
        per_device = _bytes_by_context(allocs)
        for ctx in ("adam-m", "adam-v"):
            ratio = per_device[ctx] / single[ctx]
            assert 0.4 <= ratio <= 0.6, f"device {device} {ctx}: {per_device[ctx]} vs {single[ctx]} on 1 device"


def test_stack_high_water_is_positive_and_within_capacity(checkpoints):
    with open_trainer(checkpoints.path("llama"), devices=2, batch_size=2) as tr:
        tr.step(*BATCH)
        for device in range(2):
            info = tr.get_stack_info(device)
            assert {"capacity", "high_water", "live_at_high_water"} <= set(info)
            assert 0 < info["high_water"] <= info["capacity"], info


def test_calls_release_the_gil():
    """While a step runs in one Python thread, another keeps running Python."""
    cfg = nanoq.ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                            num_attention_heads=4)
    options = nanoq.TrainOptions(backend="cpu", batch_size=4, seq_len=256, grad_accum=4, threads=1)
    rng = np.random.default_rng(5)
    inputs = rng.integers(0, 512, (4, 256), dtype=np.int32)
    with nanoq.Trainer(cfg, options) as tr:
        done = threading.Event()
        ticks = 0

        def train():
            for _ in range(4):
                tr.step(inputs, inputs)
            done.set()

        worker = threading.Thread(target=train)
        worker.start()
        while not done.is_set():
            ticks += 1
            time.sleep(0.001)
        worker.join()
    # Four steps of this model take well over 20 ms; a held GIL would leave ~0 ticks.
    assert ticks > 10


def test_concurrent_calls_from_two_threads_are_serialised(checkpoints):
    """Two Python threads validating on one trainer get the serial answer."""
    with open_trainer(checkpoints.path("llama"), devices=2, batch_size=2) as tr:
        expected = tr.validate(*BATCH).loss
        results = []

        def validate_many():
            for _ in range(20):
                results.append(tr.validate(*BATCH).loss)

        threads = [threading.Thread(target=validate_many) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == [expected] * 40


CLOSE_DURING_CALLS = r"""
import threading, time
import numpy as np
import nanoq
from nanoq import generation

config = nanoq.ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2)
tokens = np.random.default_rng(0).integers(0, 4096, (8, 256), dtype=np.int32)
for call in ("logits", "generate"):
    trainer = nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", batch_size=8, seq_len=256, threads=1,
                                                       inference=True))
    expected = trainer.logits(tokens) if call == "logits" else None  # a few tenths of a second
    outcome, inside = {}, threading.Event()
    rows = generation.logits

    def logits_inside(*args):  # Trainer.logits's own work: the call has begun (and holds the trainer)
        inside.set()
        return rows(*args)

    def use():
        try:
            if call == "logits":
                generation.logits = logits_inside
                outcome["result"] = trainer.logits(tokens)
            else:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # until close() comes
                    outcome["result"] = trainer.generate([1, 2, 3], 4, temperature=0.0)
                    inside.set()
        except RuntimeError as e:
            outcome["error"] = str(e)
        outcome["returned"] = time.monotonic()

    user = threading.Thread(target=use)
    user.start()
    inside.wait()
    time.sleep(0.05)
    trainer.close()
    closed = time.monotonic()
    user.join()
    if call == "logits":  # close() waited for the call in flight, which got its answer
        assert "error" not in outcome and outcome["returned"] <= closed, outcome
        assert np.array_equal(outcome["result"], expected)
    else:  # a later call of the loop is refused cleanly
        assert outcome.get("error") == "this Trainer is closed", outcome
    print(call, "ok")
"""


def test_close_from_another_thread_waits_for_the_call_in_flight(tmp_path):
    """close() from one thread while another is inside a core call: the call
    finishes (or the next one raises), never a use of freed memory (before,
    a crash: close() freed the core under a thread still in it)."""
    import subprocess
    import sys

    script = tmp_path / "close_during_calls.py"
    script.write_text(CLOSE_DURING_CALLS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["logits", "ok", "generate", "ok"]
