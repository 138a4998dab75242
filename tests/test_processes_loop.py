"""The training loop of several processes: P processes x D devices train
exactly like one process of P*D devices (ThreadWorld members in threads, and
one real `mpiexec -n 2 nanoq train`); only the root process writes the run
and prints; processes that disagree on settings or data refuse to start on
every process, naming the difference."""
import dataclasses
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
from safetensors.numpy import load_file

from nanoq import distributed
from nanoq.data import Dataset, write_tokens
from nanoq.testing.threads import ThreadWorld
from nanoq.training import TrainConfig, read_log, train
from nanoq.training.stop import StopRequest
from test_processes import mpiexec_path
from test_topology import in_threads

VOCAB = 64


def tiny_config(tmp_path, **overrides):
    """Token files of a learnable pattern and a tiny model of cpu devices."""
    rng = np.random.default_rng(0)
    pattern = np.tile(np.arange(1, 17), 200) + rng.integers(0, 2, 3200) * 16
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    write_tokens(data / "train_000000.bin", pattern, VOCAB)
    write_tokens(data / "eval_000000.bin", pattern[:700], VOCAB)
    values = dict(train_data=str(data / "train_*.bin"), eval_data=str(data / "eval_000000.bin"),
                  hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, seq_len=16, batch_size=2, grad_accum=2, steps=4, warmup_steps=1,
                  lr=1e-2, eval_every=2, eval_batches=0, backend="cpu", threads=1, checkpoint_every=0,
                  out_dir=str(tmp_path / "runs"), run_name="run")
    values.update(overrides)
    return TrainConfig(**values)


def train_in_world(configs, **options):
    """train(configs[r], **options) for every member r of one ThreadWorld,
    each in its own thread; (results, errors, console lines) per member."""
    world = ThreadWorld(len(configs))
    lines = [[] for _ in configs]
    results, errors = in_threads([
        (lambda r=r: train(configs[r], processes=world.member(r), say=lines[r].append, progress=False, **options))
        for r in range(len(configs))])
    return results, errors, lines


def losses(log_path):
    records = read_log(log_path)
    return ([(r["step"], r["loss"], r["grad_norm"], r["tokens"]) for r in records if r["type"] == "train"],
            [(r["step"], r["loss"], r["tokens"]) for r in records if r["type"] == "eval"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_processes_of_two_devices_train_like_one_process_of_four(tmp_path, stage):
    alone_lines = []
    alone = train(tiny_config(tmp_path / "alone", devices=4, zero_stage=stage), say=alone_lines.append,
                  progress=False)
    config = tiny_config(tmp_path / "world", devices=2, zero_stage=stage)
    (root, other), errors, lines = train_in_world([config, config])
    assert errors == [None, None]

    assert losses(root.log_path) == losses(alone.log_path)  # bitwise: same world, same order of sums
    assert root.evals == other.evals == alone.evals and len(alone.evals) == 3
    assert root.final_train_loss == other.final_train_loss == alone.final_train_loss
    assert root.model_dir == other.model_dir == os.path.join(root.run_dir, "model")
    exported = load_file(os.path.join(root.model_dir, "model.safetensors"))
    expected = load_file(os.path.join(alone.model_dir, "model.safetensors"))
    assert exported.keys() == expected.keys()
    assert all(np.array_equal(exported[name], expected[name]) for name in expected)

    # Only the root writes the run and prints; its lines speak of the world.
    assert sorted(os.listdir(root.run_dir)) == ["config.toml", "log.jsonl", "model"]
    assert lines[1] == []
    model_line = next(line for line in lines[0] if line.startswith("model: "))
    assert "on cpu x4 (2 processes x 2)" in model_line and "4 steps of 256 tokens" in model_line
    assert "4 steps of 256 tokens" in next(line for line in alone_lines if line.startswith("model: "))
    start = read_log(root.log_path)[0]
    alone_start = read_log(alone.log_path)[0]
    assert (start["devices"], start["processes"]) == (4, 2)
    assert [m["device"] for m in start["memory"]] == [0, 1, 2, 3]
    assert [m["contexts"] for m in start["memory"]] == [m["contexts"] for m in alone_start["memory"]]
    assert sum(line.startswith("memory per device (x4)") for line in lines[0]) == 1


def test_two_processes_resume_a_one_process_checkpoint_like_one_process(tmp_path):
    # A checkpoint of 1 x 4 devices (written by one process), continued by 2 x 2 and by 1 x 4.
    first = train(tiny_config(tmp_path / "first", devices=4, steps=2, checkpoint_every=2), say=lambda line: None,
                  progress=False)
    copy = tmp_path / "copy"
    shutil.copytree(first.run_dir, copy)
    alone = train(tiny_config(tmp_path / "first", devices=4, steps=4), resume=first.run_dir,
                  say=lambda line: None, progress=False)
    config = tiny_config(tmp_path / "first", devices=2, steps=4)
    (root, other), errors, lines = train_in_world([config, config], resume=str(copy))
    assert errors == [None, None]
    assert root.resumed_from == other.resumed_from == os.path.join(str(copy), "checkpoints", "step_00000002")
    resumed, expected = losses(root.log_path), losses(alone.log_path)
    assert [entry[0] for entry in resumed[0]] == [1, 2, 3, 4]  # the log goes on from the checkpoint's
    assert resumed == expected
    assert root.evals == other.evals == alone.evals
    assert lines[1] == [] and any("resuming from" in line for line in lines[0])


def test_processes_that_disagree_on_a_setting_refuse_on_every_process(tmp_path):
    config = tiny_config(tmp_path, devices=1)
    other = TrainConfig(**dict(vars(config), lr=2e-2, seq_len=8))
    _, errors, lines = train_in_world([config, other, config])
    for error in errors:
        assert isinstance(error, ValueError)
        message = str(error)
        assert "the 3 processes of this run disagree on the nanoq version and settings" in message
        assert message.endswith("\nthe nanoq version and settings must be the same on every process")
        assert "train.lr: 0.01 on processes 0, 2; 0.02 on process 1" in message
        assert "data.seq_len: 16 on processes 0, 2; 8 on process 1" in message
        assert "train.steps" not in message
    assert not os.path.exists(config.out_dir)  # refused before a run directory was made
    assert lines == [[], [], []]


def test_processes_that_see_other_data_files_refuse_on_every_process(tmp_path, monkeypatch):
    # One member's node holds another file under the same name (a stale copy, say).
    sizes = Dataset.file_sizes
    ranks = {}

    def file_sizes(dataset):
        found = sizes(dataset)
        if ranks.get(threading.get_ident()) == 1 and found[0][0] == "train_000000.bin":
            return [(found[0][0], found[0][1] + 4)] + found[1:]
        return found

    monkeypatch.setattr(Dataset, "file_sizes", file_sizes)
    config = tiny_config(tmp_path, devices=1)
    errors = train_two_members(config, ranks)
    size = os.path.getsize(tmp_path / "data" / "train_000000.bin")
    for error in errors:
        assert isinstance(error, ValueError)
        assert "disagree on the data files" in str(error)
        assert (f"data.train_data file train_000000.bin: '{size:,} bytes' on process 0; "
                f"'{size + 4:,} bytes' on process 1") in str(error)
        assert "eval_000000.bin" not in str(error)
    assert os.listdir(config.out_dir) == []  # the root removed the run it had begun


def train_two_members(config, ranks):
    """train(config) on both members of a ThreadWorld of 2, each in a thread
    whose ident ``ranks`` maps to its rank (for the patched functions);
    returns their errors."""
    world = ThreadWorld(2)

    def member(rank):
        ranks[threading.get_ident()] = rank
        return train(config, processes=world.member(rank), say=lambda line: None, progress=False)

    return in_threads([lambda: member(0), lambda: member(1)])[1]


def test_data_that_fails_to_open_on_one_process_fails_every_process(tmp_path, monkeypatch):
    opened = Dataset.__init__
    ranks = {}

    def open_dataset(dataset, paths, seq_len, **options):
        if ranks.get(threading.get_ident()) == 1:
            raise FileNotFoundError(f"token file {paths} is gone on this node")
        opened(dataset, paths, seq_len, **options)

    monkeypatch.setattr(Dataset, "__init__", open_dataset)
    config = tiny_config(tmp_path, devices=1)
    errors = train_two_members(config, ranks)
    assert isinstance(errors[1], FileNotFoundError) and "is gone on this node" in str(errors[1])
    assert isinstance(errors[0], FileNotFoundError)  # the same kind of error, naming the process
    assert str(errors[0]).startswith("opening the data failed on process 1 of 2: FileNotFoundError: token file")
    assert os.listdir(config.out_dir) == []  # the root removed the run it had begun


def test_processes_that_find_different_runs_to_resume_refuse_on_every_process(tmp_path, monkeypatch):
    # Each process looks for --resume auto's run from its own working directory and out_dir: one
    # found the run, the other none. Before, the root resumed while the other began a new run, and
    # their collectives paired the wrong actions.
    import nanoq.training.loop as loop

    config = tiny_config(tmp_path, devices=1, checkpoint_every=2)
    train(config, say=lambda line: None, progress=False)
    find_run = loop.find_run
    monkeypatch.setattr(loop, "find_run", lambda config, resume, say: None if say is loop._silent
                        else find_run(config, resume, say))  # the process that is not the root finds none
    _, errors, _ = train_in_world([config, config], resume="auto")
    for error in errors:
        assert isinstance(error, ValueError), errors
        assert "processes 0 found a run to resume and processes 1 found none" in str(error)


def test_an_error_whose_message_cannot_be_read_still_reaches_every_process():
    from nanoq.agreement import on_root

    class Unprintable(ValueError):
        def __str__(self):
            raise RuntimeError("no message")

    world = ThreadWorld(2)

    def member(rank):
        def work():
            raise Unprintable()
        return lambda: on_root(world.member(rank), work, action="the root's work")

    _, errors = in_threads([member(0), member(1)], timeout=30)  # before: the other waited for ever
    assert isinstance(errors[0], Unprintable), errors
    assert isinstance(errors[1], RuntimeError) and "the root's work failed on process 0 of 2: Unprintable: " \
        "(its message could not be read: RuntimeError)" in str(errors[1]), errors


def test_agreement_names_every_difference_and_the_processes_holding_each_value():
    world = ThreadWorld(3)
    values = [{"a": [1, 2], "b": 1, "c": "x"}, {"a": [1, 2], "b": 2}, {"a": [1, 3], "b": 1, "c": "x"}]
    # ``what`` comes with its article, as the training loop's "the nanoq version and settings" does.
    _, errors = in_threads([lambda r=r: distributed.check_agreement(world.member(r), values[r], "the things")
                            for r in range(3)])
    expected = ("the 3 processes of this run disagree on the things:\n"
                "  a: [1, 2] on processes 0, 1; [1, 3] on process 2\n"
                "  b: 1 on processes 0, 2; 2 on process 1\n"
                "  c: 'x' on processes 0, 2; absent on process 1\n"
                "the things must be the same on every process")
    assert [str(e) for e in errors] == [expected] * 3
    same, errors = in_threads([lambda r=r: distributed.check_agreement(world.member(r), values[0], "things")
                               for r in range(3)])
    assert errors == [None] * 3


def test_a_stop_signal_on_any_process_stops_every_process():
    world = ThreadWorld(2)
    requests = [StopRequest(), StopRequest()]
    assert in_threads([lambda r=r: requests[r].agreed(world.member(r)) for r in (0, 1)])[0] == [None, None]
    requests[1].signal_name = "SIGTERM"  # as its handler sets it
    assert in_threads([lambda r=r: requests[r].agreed(world.member(r)) for r in (0, 1)])[0] == ["SIGTERM"] * 2


def test_mpiexec_two_processes_of_the_demo_train_like_one_process_of_two_devices(tmp_path):
    mpiexec = mpiexec_path()
    flags = ["--hidden_size", "32", "--intermediate_size", "64", "--num_hidden_layers", "1",
             "--num_attention_heads", "2", "--seq_len", "32", "--batch_size", "2", "--threads", "1",
             "--backend", "cpu", "--steps", "3", "--warmup_steps", "0", "--eval_every", "0",
             "--eval_batches", "1", "--checkpoint_every", "0", "--run_name", "run"]
    command = [mpiexec, "-n", "2", sys.executable, "-m", "nanoq_cli.main", "train", *flags,
               "--devices", "1", "--out_dir", str(tmp_path / "mpi")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("run directory: ") == 1 and "on cpu x2 (2 processes x 1)" in done.stdout
    assert done.stdout.count("demo corpus: ") == 1

    from nanoq.training import load_config

    alone = train(load_config(overrides=dict(_flag_values(flags), devices=2, out_dir=str(tmp_path / "alone"))),
                  say=lambda line: None, progress=False)
    run = tmp_path / "mpi" / "run"
    assert sorted(os.listdir(run)) == ["config.toml", "data", "log.jsonl", "model"]
    assert losses(run / "log.jsonl") == losses(alone.log_path)


def _flag_values(flags):
    """{setting: value} of --name VALUE pairs, typed as TrainConfig's fields."""
    defaults = TrainConfig()
    return {name.lstrip("-"): type(getattr(defaults, name.lstrip("-")))(value)
            for name, value in zip(flags[::2], flags[1::2])}


def test_mpiexec_processes_that_read_other_files_refuse_naming_the_file(tmp_path):
    mpiexec = mpiexec_path()
    # The same relative data paths name other files on each "node" (another working directory).
    for node, tokens in (("node0", 400), ("node1", 408)):
        data = tmp_path / node / "data"
        data.mkdir(parents=True)
        write_tokens(data / "train_000000.bin", np.arange(tokens) % VOCAB, VOCAB)
    flags = ["train", "--train_data", "data/train_*.bin", "--hidden_size", "32", "--intermediate_size", "64",
             "--num_hidden_layers", "1", "--num_attention_heads", "2", "--seq_len", "16", "--backend", "cpu",
             "--threads", "1", "--steps", "1", "--warmup_steps", "0", "--checkpoint_every", "0", "--out_dir", "runs"]
    program = [sys.executable, "-m", "nanoq_cli.main", *flags]
    command = [mpiexec, "-n", "1", "-wdir", str(tmp_path / "node0"), *program, ":",
               "-n", "1", "-wdir", str(tmp_path / "node1"), *program]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    difference = "data.train_data file train_000000.bin: '2,624 bytes' on process 0; '2,656 bytes' on process 1"
    # Every process refuses (the threads' test sees each one's error); here the first to exit may end
    # the others before they print.
    assert difference in done.stderr, done.stdout + done.stderr
    assert os.listdir(tmp_path / "node0" / "runs") == []  # the root removed the run it had begun
    assert not os.path.exists(tmp_path / "node1" / "runs")  # the other process made nothing


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_signal_to_mpiexec_stops_every_process_after_one_step_with_a_checkpoint(tmp_path, signal_name):
    """mpiexec forwards the signal to every process; they agree on the step to
    stop after, checkpoint together and exit 0; a single process of the same
    world size resumes it and trains on bitwise like a run never stopped."""
    import signal as signals
    import time

    config = tiny_config(tmp_path / "mpi", devices=1, steps=100000, warmup_steps=0, schedule="constant",
                         eval_every=0, eval_data="")
    flags = [f"--{name}={value}" for name, value in dict(
        train_data=config.train_data, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, seq_len=16, batch_size=2, grad_accum=2, steps=100000,
        warmup_steps=0, schedule="constant", lr=1e-2, eval_every=0, backend="cpu", threads=1,
        checkpoint_every=0, out_dir=config.out_dir, run_name="run", devices=1).items()]
    process = subprocess.Popen([mpiexec_path(), "-n", "2", sys.executable, "-m", "nanoq_cli.main", "train", *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = os.path.join(config.out_dir, "run", "log.jsonl")
    deadline = time.monotonic() + 120
    while not (os.path.exists(log) and sum(r["type"] == "train" for r in read_log(log)) >= 3):
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "no three steps within 120 s"
        time.sleep(0.05)
    process.send_signal(getattr(signals, signal_name))
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert output.count(f"{signal_name}: stopped after step") == 1, output
    assert output.count(f"nanoq: {signal_name}: stopping after the current step") == 1, output  # the root's
    (stopped,) = [r for r in read_log(log) if r["type"] == "stopped"]
    from nanoq import checkpoint

    state = checkpoint.read_state(stopped["checkpoint"])
    assert state["step"] == stopped["step"] and state["parts"]["processes"] == 2

    # One process of two devices continues for two more steps ...
    steps = stopped["step"] + 2
    resumed = train(dataclasses.replace(config, devices=2, steps=steps), resume=os.path.join(config.out_dir, "run"),
                    say=lambda line: None, progress=False)
    # ... exactly as one that never stopped.
    alone = train(dataclasses.replace(config, devices=2, steps=steps, out_dir=str(tmp_path / "alone")),
                  say=lambda line: None, progress=False)
    assert losses(resumed.log_path)[0] == losses(alone.log_path)[0]


def test_a_run_moves_between_2x2_1x4_and_4x1_processes_like_one_that_never_stopped(tmp_path):
    """Real mpiexec: 2 processes x 2 devices train and checkpoint, one process
    of 4 devices resumes, then 4 processes of 1 device; every step's loss is
    that of one process x 4 devices that never stopped (same world, bitwise)."""
    config = tiny_config(tmp_path / "moved", steps=6, warmup_steps=0, schedule="constant", eval_every=0,
                         eval_data="", checkpoint_every=2, zero_stage=2)
    settings = dict(train_data=config.train_data, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, seq_len=16, batch_size=2, grad_accum=2,
                    warmup_steps=0, schedule="constant", lr=1e-2, eval_every=0, backend="cpu", threads=1,
                    checkpoint_every=2, zero_stage=2, out_dir=config.out_dir, run_name="run")

    def nanoq_train(processes, devices, steps, resume):
        flags = [f"--{name}={value}" for name, value in dict(settings, devices=devices, steps=steps).items()]
        program = [sys.executable, "-m", "nanoq_cli.main", "train", *flags] + (["--resume"] if resume else [])
        command = ([mpiexec_path(), "-n", str(processes)] if processes > 1 else []) + program
        done = subprocess.run(command, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr

    nanoq_train(2, 2, steps=2, resume=False)
    nanoq_train(1, 4, steps=4, resume=True)
    nanoq_train(4, 1, steps=6, resume=True)
    alone = train(dataclasses.replace(config, devices=4, out_dir=str(tmp_path / "alone")), say=lambda line: None,
                  progress=False)
    moved = losses(os.path.join(config.out_dir, "run", "log.jsonl"))[0]
    assert [step for step, *_ in moved] == [1, 2, 3, 4, 5, 6]
    assert moved == losses(alone.log_path)[0]
