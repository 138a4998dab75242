"""Absurd numbers on the command line and in config files are clear errors (never a traceback), and a
cpu run asking for more threads than the machine has cores says so."""
import importlib
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import nanoq
from nanoq.data import write_tokens
from nanoq.training import TrainConfig, settings, train
from nanoq_cli.main import cli

backends = importlib.import_module("nanoq.backends")  # the module (nanoq.backends is also a function's name)

# Not numbers at all in float (nan, inf) or beyond every range (1e400 is inf as a float, 10**30 fits no
# 64-bit integer, 1e39 no float32).
ABSURD = ["1e400", "nan", "inf", "-inf", str(10**30), "1e39"]
NUMERIC_SETTINGS = [item for item in settings() if item.type in (int, float)]


def invoke(*args):
    # catch_exceptions=False: an exception other than click's own reaches the test and fails it.
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def assert_one_line_error(result, *names):
    """Exit 1 (our error) or 2 (click usage error) and exactly one "Error:" line naming one of ``names``."""
    assert result.exit_code in (1, 2), result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert any(name in errors[0] for name in names), errors[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("item", NUMERIC_SETTINGS, ids=lambda item: item.name)
def test_every_numeric_setting_refuses_values_that_overflow_or_are_not_finite(item):
    names = (f"--{item.name}", f"--{item.name.replace('_', '-')}", item.key)
    for value in ABSURD:
        result = invoke("train", "--print-config", f"--{item.name}", value)
        if item.type is float and value == str(10**30) and result.exit_code == 0:
            # a finite float32 number: a legal (if absurd) value where the setting has no upper bound
            assert item.maximum is None and item.below is None
            assert f"{item.name} = 1e+30" in result.output
            continue
        assert_one_line_error(result, *names)


@pytest.mark.parametrize("key, text", [("train", "steps = 1000000000000000000000000000000"),
                                       ("train", "lr = 1e39"), ("train", "lr = nan"), ("train", "grad_clip = inf"),
                                       ("model", "hidden_size = inf"), ("run", "devices = 99999999999999999999")])
def test_config_files_refuse_the_same_numbers(tmp_path, key, text):
    path = tmp_path / "run.toml"
    path.write_text(f"[{key}]\n{text}\n")
    name = text.split(" = ")[0]
    assert_one_line_error(invoke("train", "--print-config", path), f"{key}.{name}")


def test_seeds_take_all_64_bits_and_no_more():
    assert invoke("train", "--print-config", "--seed", 2**64 - 1).exit_code == 0
    assert_one_line_error(invoke("train", "--print-config", "--seed", 2**64), "--seed")


def other_commands(tmp_path):
    """(option, the command line before it) of every numeric option outside the settings."""
    text = tmp_path / "corpus.txt"
    text.write_text("some words\n")
    out = tmp_path / "never-written"
    return [("--device-memory", ["memory"]), ("--reserve", ["memory"]), ("--processes", ["memory"]),
            ("--max-shard-size", ["export", tmp_path / "no-checkpoint", "-o", out]),
            ("--max-position-embeddings", ["export", tmp_path / "no-checkpoint", "-o", out]),
            ("--vocab-size", ["tokenize", text, "-o", out, "--train-tokenizer"]),
            ("--vocab-size", ["tokenize", text, "-o", out, "--format", "nano"]),
            ("--eos-id", ["tokenize", text, "-o", out, "--format", "nano", "--vocab-size", "64"]),
            ("--eval-fraction", ["tokenize", text, "-o", out, "--train-tokenizer", "--vocab-size", "300"]),
            ("--seed", ["tokenize", text, "-o", out, "--train-tokenizer", "--vocab-size", "300"]),
            ("--workers", ["tokenize", text, "-o", out, "--train-tokenizer", "--vocab-size", "300"]),
            ("--shard-tokens", ["tokenize", text, "-o", out, "--train-tokenizer", "--vocab-size", "300"]),
            ("--stage-steps", ["convert", "nano-config", tmp_path / "m.json", tmp_path / "t.json", "-o",
                               tmp_path / "out.toml"])]


def test_every_other_numeric_option_refuses_values_that_overflow_or_are_not_finite(tmp_path):
    for option, command in other_commands(tmp_path):
        for value in ABSURD:
            result = invoke(*command, option, value)
            assert_one_line_error(result, option)
            assert result.exit_code == 2, (option, value, result.output)  # refused by the option's type
    assert not os.path.exists(tmp_path / "never-written")


def test_sizes_keep_their_units_and_refuse_more_than_64_bits():
    result = invoke("memory", "--backend", "cpu", "--device-memory", "2GiB", "--reserve", "0")
    assert result.exit_code == 0, result.output
    assert "(2.1 GB) per device" in result.output
    assert_one_line_error(invoke("memory", "--device-memory", "9EiB"), "--device-memory")  # no such unit
    assert_one_line_error(invoke("memory", "--device-memory", "10000000TB"), "--device-memory")


def test_a_huge_trained_vocab_is_refused_before_the_tokenizer_allocates_it(tmp_path):
    # In a subprocess: without the check, the BPE trainer aborts the whole process allocating its tables.
    text = tmp_path / "corpus.txt"
    text.write_text("some words\n")
    result = subprocess.run([sys.executable, "-m", "nanoq_cli.main", "tokenize", str(text), "-o",
                             str(tmp_path / "out"), "--train-tokenizer", "--vocab-size", str(2**40)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"Error: vocab size must be at most {2**24} to train a tokenizer (the BPE trainer sizes its tables by it "
        f"before reading any text), got {2**40}"]


# -- cpu threads beyond the cores ------------------------------------------------------------


def test_usable_cores_are_the_affinity_mask():
    assert backends.usable_cores() == (len(os.sched_getaffinity(0)), "os.sched_getaffinity")


@pytest.mark.parametrize("devices, threads, cores, expected", [
    (1, 0, 2, None), (2, 0, 2, None), (2, 1, 2, None), (1, 2, 2, None),
    (3, 0, 2, "run.devices 3 asks for 3 cpu threads but this process may use 2 cores (os.sched_getaffinity)"),
    (1, 1000, 2, "run.devices 1 x run.threads 1000 asks for 1000 cpu threads but this process may use 2 cores"),
    (2, 2, 3, "run.devices 2 x run.threads 2 asks for 4 cpu threads but this process may use 3 cores"),
])
def test_cpu_oversubscription_is_named_with_the_cores(monkeypatch, devices, threads, cores, expected):
    monkeypatch.setattr(backends, "usable_cores", lambda: (cores, "os.sched_getaffinity"))
    warning = backends.cpu_oversubscription(devices, threads)
    if expected is None:
        assert warning is None
    else:
        assert warning.startswith(expected)


@pytest.mark.parametrize("devices, cores, machine_cores, expected", [
    (1, 4, 4, None), (2, 4, 4, None),
    (3, 4, 4, "run.devices 3 in each of the 2 processes on this node asks for 6 cpu threads but this process may "
              "use 4 cores (os.sched_getaffinity): the run is oversubscribed and much slower; use at most 4 in all"),
    (2, 2, 8, None),  # each process bound to 2 cores of its own: counted alone
    (3, 2, 8, "run.devices 3 asks for 3 cpu threads but this process may use 2 cores"),
])
def test_processes_sharing_a_node_s_cores_are_counted_together(monkeypatch, devices, cores, machine_cores,
                                                                expected):
    # Two processes of 2 devices on a 2-core node asked for 4 threads unwarned; two single-process nodes of
    # 2 devices and 2 cores each were warned about (the world's 4 devices were counted against one node).
    monkeypatch.setattr(backends, "usable_cores", lambda: (cores, "os.sched_getaffinity"))
    monkeypatch.setattr(backends.os, "cpu_count", lambda: machine_cores)
    warning = backends.cpu_oversubscription(devices, 0, processes=2)
    if expected is None:
        assert warning is None
    else:
        assert warning.startswith(expected)


def test_a_trainer_of_more_cpu_devices_than_cores_warns_from_python(monkeypatch):
    # Only nanoq train warned; Trainer(devices=64) on 2 cores trained slowly without a word.
    import warnings

    from nanoq.backends import OversubscriptionWarning

    monkeypatch.setattr(backends, "usable_cores", lambda: (1, "os.sched_getaffinity"))
    config = nanoq.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2)
    with pytest.warns(OversubscriptionWarning, match=r"^TrainOptions.devices 2 asks for 2 cpu threads but this "
                                                     r"process may use 1 core \(os.sched_getaffinity\).*"
                                                     r"\(TrainOptions.threads 0 shares the cores out\)$"):
        nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", devices=2, batch_size=1, seq_len=8)).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", devices=1, threads=1, batch_size=1,
                                                 seq_len=8)).close()


def tiny_run(tmp_path, **overrides):
    pattern = np.tile(np.arange(1, 17), 40)
    write_tokens(tmp_path / "train_000000.bin", pattern, 64)
    values = dict(train_data=str(tmp_path / "train_*.bin"), hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, seq_len=16, batch_size=1, steps=1, warmup_steps=0,
                  checkpoint_every=0, backend="cpu", out_dir=str(tmp_path / "runs"))
    lines = []
    train(TrainConfig(**{**values, **overrides}), say=lines.append, progress=False)
    return [line for line in lines if line.startswith("warning:")]


def test_training_warns_when_cpu_devices_or_threads_exceed_the_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(backends, "usable_cores", lambda: (1, "os.sched_getaffinity"))
    assert tiny_run(tmp_path, devices=1, threads=1) == []
    (warning,) = tiny_run(tmp_path, devices=2, threads=0)
    assert warning.startswith("warning: run.devices 2 asks for 2 cpu threads but this process may use 1 core ")
    (warning,) = tiny_run(tmp_path, devices=1, threads=3)
    assert warning.startswith("warning: run.devices 1 x run.threads 3 asks for 3 cpu threads")


# -- GPUs left idle ---------------------------------------------------------------------------


def test_idle_gpus_are_named_with_why_and_how(monkeypatch):
    monkeypatch.setattr(backends, "gpu_names", lambda: ["NVIDIA H100 80GB HBM3"])
    warning = backends.idle_gpus_warning("auto", "cpu")
    assert warning.startswith("this machine has 1 NVIDIA GPU (NVIDIA H100 80GB HBM3), but ")
    assert backends.cuda_unusable_reason() in warning and "training on the cpu backend" in warning
    if not backends._core.backend_built("cuda"):  # the README's install: how to build the cuda backend
        assert backends.cuda_unusable_reason().startswith("this install was built without the cuda backend")
        assert warning.endswith(" && ".join(backends.CUDA_BUILD_COMMANDS))
    assert backends.idle_gpus_warning("cpu", "cpu") is None  # asked for: no warning
    monkeypatch.setattr(backends, "gpu_names", lambda: [])
    assert backends.idle_gpus_warning("auto", "cpu") is None


def test_the_build_commands_are_the_readmes(pytestconfig):
    readme = (pytestconfig.rootpath / "README.md").read_text()
    assert "\n".join(backends.CUDA_BUILD_COMMANDS) in readme


def test_training_on_cpu_beside_idle_gpus_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(backends, "gpu_names", lambda: ["NVIDIA H200", "NVIDIA H200"])
    monkeypatch.setattr(backends, "cuda_unusable_reason", lambda: "the cuda backend sees no usable GPU")
    monkeypatch.setattr(backends, "usable_cores", lambda: (64, "os.sched_getaffinity"))
    (tmp_path / "cpu").mkdir()
    (tmp_path / "auto").mkdir()
    assert tiny_run(tmp_path / "cpu", backend="cpu") == []
    (warning,) = tiny_run(tmp_path / "auto", backend="auto")
    assert warning.startswith("warning: this machine has 2 NVIDIA GPUs (NVIDIA H200, NVIDIA H200), but the cuda "
                              "backend sees no usable GPU: training on the cpu backend")
