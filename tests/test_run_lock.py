"""One trainer per run directory: a second train() or `nanoq train` on a running run fails at once naming
the holder's process id, and a lock left by a killed run never blocks (nanoq.training.run_lock)."""
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner

from nanoq.data import write_tokens
from nanoq.testing.threads import ThreadWorld
from nanoq.training import RunInUse, TrainConfig, read_log, train
from nanoq.training.run_lock import LOCK_FILE, RunLock, lock_run
from nanoq_cli.main import cli
from test_resume import snapshot

QUIET = dict(say=lambda line: None, progress=False)


def config(tmp_path, **overrides):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    write_tokens(data / "train_000000.bin", np.tile(np.arange(1, 17), 100), 32)
    values = dict(train_data=str(data / "train_*.bin"), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, seq_len=16, batch_size=2, steps=4, warmup_steps=0, lr=1e-2,
                  schedule="constant", checkpoint_every=2, backend="cpu", threads=1, out_dir=str(tmp_path / "runs"),
                  run_name="run")
    return TrainConfig(**{**values, **overrides})


# A resume of the run that stops (holding the run, as a long step would) once it has started.
HOLDER = """
import sys, time
from nanoq.training import load_config, train

def say(line):
    if line.startswith("resuming from"):
        print("holding", flush=True)
        time.sleep(600)

train(load_config(sys.argv[1]), resume=sys.argv[2], say=say, progress=False)
"""


def start_holder(toml, run_dir):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(toml), str(run_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    line = holder.stdout.readline()
    if line != "holding\n":
        holder.kill()
        pytest.fail(f"the holder did not start: {line!r} {holder.stderr.read()}")
    return holder


def test_a_second_trainer_on_a_running_run_fails_at_once_and_a_killed_holder_never_blocks(tmp_path):
    first = train(config(tmp_path), **QUIET)
    run_dir = first.run_dir
    more = config(tmp_path, steps=8)
    toml = tmp_path / "more.toml"
    toml.write_text(more.to_toml())
    holder = start_holder(toml, run_dir)
    try:
        before = snapshot(run_dir)
        assert open(os.path.join(run_dir, LOCK_FILE)).read().startswith(f"pid {holder.pid} on ")
        began = time.monotonic()
        with pytest.raises(RunInUse, match=re.escape(f"run directory {run_dir} is in use by another trainer "
                                                     f"(pid {holder.pid} on ")):
            train(more, resume=run_dir, **QUIET)
        assert time.monotonic() - began < 5
        result = CliRunner().invoke(cli, ["train", str(toml), "--resume", run_dir], catch_exceptions=False)
        assert result.exit_code == 1
        (error,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert f"is in use by another trainer (pid {holder.pid} on " in error
        assert snapshot(run_dir) == before  # neither touched the run: no log line, no config rewrite
    finally:
        holder.kill()  # SIGKILL: the holder never releases anything itself
        holder.wait(timeout=30)
    assert os.path.exists(os.path.join(run_dir, LOCK_FILE))  # a stale lock file, naming a dead process

    resumed = train(more, resume=run_dir, **QUIET)
    assert resumed.resumed_from.endswith("step_00000004") and resumed.steps == 8
    assert not os.path.exists(os.path.join(run_dir, LOCK_FILE))  # removed when the run ends
    straight = train(config(tmp_path, steps=8, run_name="straight"), **QUIET)
    losses = lambda run: {r["step"]: r["loss"] for r in read_log(os.path.join(run, "log.jsonl"))  # noqa: E731
                          if r["type"] == "train"}
    assert losses(resumed.run_dir) == losses(straight.run_dir)


def test_the_lock_is_released_when_a_run_ends_or_fails(tmp_path):
    result = train(config(tmp_path), **QUIET)
    assert LOCK_FILE not in os.listdir(result.run_dir)
    more = config(tmp_path, steps=8)
    os.rename(tmp_path / "data" / "train_000000.bin", tmp_path / "moved.bin")
    with pytest.raises(ValueError, match="matches no files"):  # the resume fails opening its data, after the lock
        train(more, resume=result.run_dir, **QUIET)
    assert LOCK_FILE not in os.listdir(result.run_dir)
    with RunLock.acquire(result.run_dir):  # nothing left it locked
        pass
    os.rename(tmp_path / "moved.bin", tmp_path / "data" / "train_000000.bin")
    failing = config(tmp_path, run_name="fails", vocab_size=8)  # smaller than the data's vocab: fails in setup
    with pytest.raises(ValueError, match="vocab_size 8"):
        train(failing, **QUIET)
    assert not os.path.exists(os.path.join(failing.out_dir, "fails"))


def test_a_lock_held_in_this_process_refuses_another_and_is_reusable_after_release(tmp_path):
    lock = RunLock.acquire(str(tmp_path))
    with pytest.raises(RunInUse, match=f"pid {os.getpid()} on "):
        RunLock.acquire(str(tmp_path))
    lock.release()
    lock.release()  # idempotent
    assert not os.path.exists(tmp_path / LOCK_FILE)
    with RunLock.acquire(str(tmp_path)):
        assert os.path.exists(tmp_path / LOCK_FILE)


def run_members(size, body):
    """body(group) on every member of a ThreadWorld of ``size``, each in its thread: results or exceptions."""
    world, outcomes = ThreadWorld(size, timeout=30), [None] * size

    def member(rank):
        try:
            outcomes[rank] = body(world.member(rank))
        except Exception as e:  # noqa: BLE001 - handed to the test
            outcomes[rank] = e

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes


def test_under_a_launcher_only_the_root_locks_and_every_process_learns_a_refusal(tmp_path):
    root_lock, other = run_members(2, lambda group: lock_run(str(tmp_path), group))
    assert isinstance(root_lock, RunLock) and other is None
    outcomes = run_members(2, lambda group: lock_run(str(tmp_path), group))  # held by the first world's root
    assert all(isinstance(outcome, RunInUse) for outcome in outcomes)
    assert f"pid {os.getpid()} on " in str(outcomes[0]) and f"pid {os.getpid()} on " in str(outcomes[1])
    root_lock.release()
    root_lock, other = run_members(2, lambda group: lock_run(str(tmp_path), group))
    assert isinstance(root_lock, RunLock) and other is None
    root_lock.release()


def test_a_run_still_before_its_first_checkpoint_is_reported_busy_not_empty_or_taken(tmp_path):
    """A second `nanoq train` on a named run that has no checkpoint yet, with or without --resume auto,
    names the running trainer rather than saying the run holds no checkpoint or merely exists."""
    settings = config(tmp_path)
    run_dir = os.path.join(settings.out_dir, settings.run_name)
    os.makedirs(run_dir)
    snapshot_before = sorted(os.listdir(run_dir))
    with RunLock.acquire(run_dir):
        busy = re.escape(f"run directory {run_dir} is in use by another trainer (pid {os.getpid()} on ")
        with pytest.raises(RunInUse, match=busy):
            train(settings, resume="auto", **QUIET)
        with pytest.raises(RunInUse, match=busy):
            train(settings, **QUIET)
        assert sorted(os.listdir(run_dir)) == snapshot_before + [LOCK_FILE]
    # Without a holder (none, or a lock file a dead process left) the run is what it is: empty, or taken.
    with open(os.path.join(run_dir, LOCK_FILE), "w") as stale:
        stale.write("pid 1 on elsewhere\n")
    with pytest.raises(ValueError, match="holds no checkpoint"):
        train(settings, resume="auto", **QUIET)
    with pytest.raises(FileExistsError, match="already exists"):
        train(settings, **QUIET)
