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


# -- the training loop -------------------------------------------------------------------

from nanoq import checkpoint, testing  # noqa: E402
from nanoq.training import TrainingHalted, read_log, train  # noqa: E402
from test_resume import config as tiny_config  # noqa: E402

QUIET = dict(say=lambda line: None, progress=False)


def log_records(run_dir, kind=None):
    return [r for r in read_log(os.path.join(run_dir, "log.jsonl")) if kind is None or r["type"] == kind]


def test_runaway_training_halts_after_k_skipped_updates_with_a_checkpoint(tmp_path):
    # A learning rate this large blows the weights up within a few steps; from
    # then on every update is skipped, and the run stops after three of them.
    config = tiny_config(tmp_path, lr=1e5, warmup_steps=0, steps=40, checkpoint_every=0, max_skipped_steps=3,
                         eval_every=0)
    with pytest.raises(TrainingHalted, match="3 updates in a row had a non-finite loss or gradient") as error:
        train(config, **QUIET)
    run_dir = os.path.join(config.out_dir, config.run_name)
    skipped = log_records(run_dir, "skipped")
    assert [r["in_a_row"] for r in skipped] == [1, 2, 3]
    (halted,) = log_records(run_dir, "halted")
    assert halted["checkpoint"] in str(error.value)
    times = [r["time"] for r in log_records(run_dir) if "time" in r]
    assert times == sorted(times)  # the halted record comes after its checkpoint's
    # The checkpoint holds the last good state: the weights of the last update that was applied.
    state = checkpoint.read_state(halted["checkpoint"])
    assert state["step"] == skipped[-1]["step"]
    weights = checkpoint.read_weights(halted["checkpoint"])
    good_steps = skipped[0]["step"] - 1
    assert state["optimizer_steps"] == good_steps
    assert all(np.isfinite(w).all() for w in weights.values())


SIGNAL_RUN = """
import sys
from nanoq.training import train
sys.path.insert(0, {tests!r})
from test_resume import config
import pathlib
cfg = config(pathlib.Path({tmp!r}), steps=100000, checkpoint_every={every}, eval_every=0)
result = train(cfg, progress=False)
print("stopped_by", result.stopped_by, flush=True)
"""


def start_run(tmp_path, every=0, env=None, resume=False, cli_signals=False, catch=False):
    """A run of nanoq.training.train in a subprocess; cli_signals: a second
    signal ends the process, as in nanoq train; catch: the script catches a
    KeyboardInterrupt out of train and says so."""
    script = tmp_path / "run.py"
    source = SIGNAL_RUN.format(tests=os.path.dirname(__file__), tmp=str(tmp_path), every=every)
    if resume:
        source = source.replace("train(cfg, progress=False)", "train(cfg, progress=False, resume='auto')")
    if cli_signals:
        source = "from nanoq.training.stop import end_process_on_second_signal\nend_process_on_second_signal()\n" \
            + source
    if catch:
        source = source.replace("result = train(", "try:\n    result = train(").replace(
            "print(\"stopped_by\"", "except KeyboardInterrupt as e:\n    print(\"KeyboardInterrupt; run_dir\", "
            "e.run_dir, flush=True)\n    raise SystemExit(0)\nprint(\"stopped_by\"")
    script.write_text(source)
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, **(env or {})))


def wait_for(predicate, process, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert process.poll() is None, f"the run ended before {what}: {process.stdout.read()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_step_writes_a_checkpoint_and_exits_zero(tmp_path, signal_number):
    process = start_run(tmp_path)
    run_dir = tmp_path / "runs" / "run"
    wait_for(lambda: (run_dir / "log.jsonl").exists() and len(log_records(run_dir, "train")) >= 3, process,
             "three steps")
    process.send_signal(signal_number)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    name = signal.Signals(signal_number).name
    assert f"stopped_by {name}" in output and f"{name}: stopped after step" in output
    assert f"nanoq: {name}: stopping after the current step, with a checkpoint (a second signal stops at once, " \
           f"without one)" in output
    (stopped,) = log_records(run_dir, "stopped")
    assert checkpoint.read_state(stopped["checkpoint"])["step"] == stopped["step"]
    times = [r["time"] for r in log_records(run_dir) if "time" in r]
    assert times == sorted(times)  # the stopped record comes after its checkpoint's
    assert log_records(run_dir, "train")[-1]["step"] == stopped["step"]  # the step in flight was finished


def test_a_console_whose_reader_went_away_stops_the_run_with_a_checkpoint(tmp_path):
    # `nanoq train | head`: once head exits, writing a line raised BrokenPipeError, which ended the run
    # without a checkpoint. Now it stops after the step, as a signal does (SIGPIPE), and exits 0.
    script = tmp_path / "run.py"
    script.write_text(SIGNAL_RUN.format(tests=os.path.dirname(__file__), tmp=str(tmp_path), every=0))
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=stderr)
        run_dir = tmp_path / "runs" / "run"
        wait_for(lambda: (run_dir / "log.jsonl").exists() and len(log_records(run_dir, "train")) >= 3, process,
                 "three steps")
        process.stdout.close()  # the reader goes away
        assert process.wait(timeout=120) == 0
    errors = (tmp_path / "stderr.txt").read_text()
    assert "nanoq: SIGPIPE: stopping after the current step, with a checkpoint" in errors and "Error" not in errors
    (stopped,) = log_records(run_dir, "stopped")
    assert stopped["signal"] == "SIGPIPE"
    assert checkpoint.read_state(stopped["checkpoint"])["step"] == stopped["step"]
    assert log_records(run_dir, "train")[-1]["step"] == stopped["step"]


@pytest.mark.parametrize("cli_signals", [True, False], ids=["nanoq-train", "python"])
def test_a_second_sigint_aborts_at_once_and_the_last_checkpoint_survives(tmp_path, cli_signals):
    # A first run leaves complete checkpoints; the resumed run pauses inside its
    # next save (test hook), where the two signals arrive. nanoq train ends there and then; train()
    # called from Python raised KeyboardInterrupt, where the second signal ended the interpreter
    # too (a notebook's kernel, with all else it held).
    first = start_run(tmp_path, every=2)
    run_dir = tmp_path / "runs" / "run"
    wait_for(lambda: len(checkpoint.list_checkpoints(run_dir / "checkpoints")) >= 1, first, "a checkpoint")
    first.send_signal(signal.SIGINT)
    first.communicate(timeout=120)
    complete = checkpoint.list_checkpoints(run_dir / "checkpoints")
    marker = tmp_path / "paused"
    second = start_run(tmp_path, every=2, env={testing.PAUSE_IN_SAVE_ENV: str(marker)}, resume=True,
                       cli_signals=cli_signals, catch=not cli_signals)
    wait_for(marker.exists, second, "the paused save")
    second.send_signal(signal.SIGINT)  # asks to stop: the save in flight would finish first...
    time.sleep(0.5)
    second.send_signal(signal.SIGINT)  # ...but the second one stops there and then
    output, _ = second.communicate(timeout=60)
    if cli_signals:
        assert second.returncode == -signal.SIGINT
    else:
        assert second.returncode == 0 and f"KeyboardInterrupt; run_dir {run_dir}" in output, output
        assert not [name for name in os.listdir(run_dir / "checkpoints") if ".partial" in name]
    assert checkpoint.list_checkpoints(run_dir / "checkpoints") == complete
    latest = checkpoint.resolve(run_dir / "checkpoints")
    assert checkpoint.read_state(latest)["step"] == complete[-1]
    with nanoq.Trainer(nanoq.ModelConfig(**checkpoint.read_state(latest)["model_config"]),
                       nanoq.TrainOptions(backend="cpu", batch_size=4, seq_len=16)) as trainer:
        trainer.load_checkpoint(latest)


def test_import_with_a_bad_shard_loads_nothing(tmp_path):
    options = nanoq.TrainOptions(backend="cpu", batch_size=2, seq_len=8)
    with nanoq.Trainer(CONFIG, options) as source:
        source.init_weights(seed=5)
        source.export_model(tmp_path / "model", max_shard_bytes=20_000)
    shards = sorted((tmp_path / "model").glob("model-*.safetensors"))
    assert len(shards) > 2
    with open(shards[-1], "r+b") as f:  # the last shard is cut short
        f.truncate(f.seek(0, 2) - 4)
    with nanoq.Trainer(CONFIG, options) as trainer:
        before = trainer.get_weights()
        with pytest.raises(ValueError, match=shards[-1].name):
            trainer.import_weights(tmp_path / "model")
        for name, value in trainer.get_weights().items():
            assert np.array_equal(value, before[name]), name


TWO_SIGNALS = """
import hashlib, sys, time
from nanoq.training.stop import StopRequest
began = time.perf_counter()
hashlib.pbkdf2_hmac("sha256", b"x", b"salt", 20000)
rounds = int(20000 * 3.0 / max(time.perf_counter() - began, 1e-6))  # about three seconds in one C call
with StopRequest() as stop:
    print("ready", flush=True)
    hashlib.pbkdf2_hmac("sha256", b"x", b"salt", rounds)  # signals arriving now run the handler once, after it
    print("survived", stop.signal_name, flush=True)
"""


@pytest.mark.parametrize("cli_signals", [True, False], ids=["nanoq-train", "python"])
def test_two_signals_within_one_long_call_still_stop_at_once(cli_signals):
    # Python runs a handler between bytecodes: two SIGINTs during one long C call (a core step)
    # ran it once, and the second, meant to stop at once, was lost. The deliveries are counted
    # (a wakeup fd), so the second one ends the process (nanoq train) or raises KeyboardInterrupt.
    script = TWO_SIGNALS
    if cli_signals:
        script = "from nanoq.training.stop import end_process_on_second_signal\nend_process_on_second_signal()\n" + \
            script
    else:
        script = script.replace("with StopRequest() as stop:", "try:\n  with StopRequest() as stop:").replace(
            "\n    ", "\n      ") + "except KeyboardInterrupt:\n  print('KeyboardInterrupt', flush=True)\n"
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert "survived" not in output
    if cli_signals:
        assert process.returncode == -signal.SIGINT, output
    else:
        assert process.returncode == 0 and "KeyboardInterrupt" in output, output
    # One signal: the stop is asked for, and the process goes on to stop cleanly.
    process = subprocess.Popen([sys.executable, "-c", TWO_SIGNALS], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and "survived SIGINT" in output, output
