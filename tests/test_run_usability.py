"""What a new user meets first (issue 18's paper cuts): the console line's
ETA and tokens/s, a warmup longer than the run, too little data for one
step, TOML paths, and `nanoq memory`'s flags and token files.
"""
import dataclasses
import json
import os
import re
import time

import numpy as np
import pytest
from click.testing import CliRunner

import nanoq.training.loop as loop
from nanoq.data import write_tokens
from nanoq.memory import estimate_memory
from nanoq.training import TrainConfig, load_config, train
from nanoq.training.lr_schedule import learning_rate
from nanoq.training.settings import settings, train_options
from nanoq_cli.main import cli

VOCAB = 64
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, seq_len=16,
             batch_size=2, backend="cpu", threads=1, eval_batches=1, checkpoint_every=0)


def token_data(folder, count=1200, mask=None):
    folder.mkdir(parents=True, exist_ok=True)
    tokens = np.arange(count) % VOCAB
    write_tokens(folder / "train_000000.bin", tokens, VOCAB, mask)
    write_tokens(folder / "eval_000000.bin", tokens[:200], VOCAB)
    return str(folder / "train_*.bin"), str(folder / "eval_*.bin")


def small_config(tmp_path, **overrides):
    train_data, eval_data = token_data(tmp_path / "data")
    values = dict(SMALL, train_data=train_data, eval_data=eval_data, out_dir=str(tmp_path / "runs"), run_name="run",
                  warmup_steps=0)
    return TrainConfig(**{**values, **overrides})


def run(config):
    lines = []
    result = train(config, say=lines.append, progress=False)
    records = [json.loads(line) for line in open(result.log_path)]
    return lines, records


def step_lines(lines):
    return [line for line in lines if line.startswith("step ")]


class SlowClock:
    """time.time() that jumps an hour whenever an evaluation runs (the loop's
    clock; the rest of the time module as it is)."""

    def __init__(self):
        self.offset = 0.0

    def time(self):
        return time.time() + self.offset

    def __getattr__(self, name):
        return getattr(time, name)


def test_the_eta_counts_training_steps_only_not_the_evaluations(tmp_path, monkeypatch):
    clock = SlowClock()
    evaluate = loop.evaluate

    def slow_evaluate(*args, **kwargs):
        clock.offset += 3600.0
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(loop, "evaluate", slow_evaluate)
    lines, _ = run(small_config(tmp_path, steps=4, eval_every=2))
    steps = step_lines(lines)
    assert len(steps) == 4
    # The step-0 evaluation took an "hour": elapsed shows it, the ETA (3 tiny steps to go) does not.
    assert "1:00:00 elapsed" in steps[0] or "1:00:01 elapsed" in steps[0], steps[0]
    assert all(re.search(r"ETA 0:0\d", line) for line in steps), steps


def test_the_console_shows_trained_tokens_per_second_next_to_the_total(tmp_path):
    mask = np.arange(1200) % 4 == 0  # a quarter of the targets count, as with SFT data
    train_data, eval_data = token_data(tmp_path / "masked", mask=mask)
    config = small_config(tmp_path, train_data=train_data, eval_data=eval_data, steps=3, eval_every=0)
    lines, records = run(config)
    steps = step_lines(lines)
    trains = [r for r in records if r["type"] == "train"]
    for line, record in zip(steps, trains):
        total, trained = (float(x.replace(",", "")) for x in
                          re.search(r"\| ([\d,]+) tok/s \(([\d,]+) trained\) \|", line).groups())
        fed = 2 * 16  # batch_size x seq_len
        assert record["trained_tokens"] < fed
        assert trained == pytest.approx(total * record["trained_tokens"] / fed, rel=0.02, abs=1)


def test_a_warmup_longer_than_the_run_is_cut_to_it_with_a_warning(tmp_path):
    config = small_config(tmp_path, steps=2, warmup_steps=20, eval_every=0)
    lines, records = run(config)
    warning = next(line for line in lines if "warmup_steps" in line)
    assert warning.startswith("warning:") and "--warmup_steps" in warning and "(20)" in warning
    lrs = [r["lr"] for r in records if r["type"] == "train"]
    assert lrs == [learning_rate(step, kind="cosine", peak=config.lr, total_steps=2, warmup_steps=2) for step in
                   range(2)]
    assert lrs == [config.lr / 2, config.lr]


def test_nanoq_train_steps_2_works_with_the_default_warmup(tmp_path):
    train_data, eval_data = token_data(tmp_path / "data")
    flags = [word for key, value in SMALL.items() for word in (f"--{key}", str(value))]
    result = CliRunner().invoke(cli, ["train", "--steps", "2", "--train_data", train_data, "--eval_data", eval_data,
                                      "--out_dir", str(tmp_path / "runs"), *flags], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "warning: train.warmup_steps (20)" in result.output and "step 2/2" in result.output


def test_data_smaller_than_one_step_is_a_warning_saying_how_often_a_step_repeats_it(tmp_path):
    train_data, eval_data = token_data(tmp_path / "tiny", count=3 * 16 + 1)  # 3 windows
    config = small_config(tmp_path, train_data=train_data, eval_data=eval_data, steps=1, eval_every=0, grad_accum=4)
    lines, _ = run(config)
    warnings = [line for line in lines if "repeats" in line]
    assert len(warnings) == 1
    # 8 sequences per step (batch_size 2 x grad_accum 4) from 3 windows.
    assert "data.train_data has 3 window(s)" in warnings[0] and "repeats that data 2.7 times" in warnings[0]
    enough = small_config(tmp_path / "enough", steps=1, eval_every=0, grad_accum=4)
    assert not [line for line in run(enough)[0] if "repeats" in line]


def test_toml_paths_are_relative_to_the_files_folder(tmp_path, monkeypatch):
    folder = tmp_path / "project" / "configs"
    folder.mkdir(parents=True)
    config = folder / "run.toml"
    config.write_text('[model]\ninit_from = "../models/base"\n'
                      '[data]\ntrain_data = "data/train_*.bin"\neval_data = "/abs/eval.bin"\n'
                      '[run]\nout_dir = "runs"\n')
    monkeypatch.chdir(tmp_path)  # elsewhere
    loaded = load_config(config)
    assert loaded.init_from == str(tmp_path / "project" / "models" / "base")
    assert loaded.train_data == str(folder / "data" / "train_*.bin")
    assert loaded.eval_data == "/abs/eval.bin"
    assert loaded.out_dir == "runs"  # where runs go: the working directory's
    # Flags are the command line's: relative to the working directory, made
    # absolute so that the run's own config.toml names the same files.
    assert load_config(config, {"train_data": "mine/*.bin"}).train_data == str(tmp_path / "mine" / "*.bin")
    config.write_text('[data]\ncurriculum = "a/train_*.bin|a/eval_*.bin@3; /b/train.bin| b/eval.bin @2"\n'
                      '[train]\nsteps = 5\n')
    assert load_config(config).curriculum == \
        f"{folder}/a/train_*.bin|{folder}/a/eval_*.bin@3; /b/train.bin|{folder}/b/eval.bin@2"


def test_a_toml_runs_from_any_folder_and_a_missing_file_names_the_folder_searched(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    token_data(folder / "data")
    config = folder / "run.toml"
    config.write_text('[data]\ntrain_data = "data/train_*.bin"\neval_data = "data/eval_*.bin"\n')
    monkeypatch.chdir(tmp_path)
    flags = [word for key, value in SMALL.items() for word in (f"--{key}", str(value))]
    result = CliRunner().invoke(cli, ["train", str(config), "--steps", "1", "--warmup_steps", "0", "--out_dir",
                                      str(tmp_path / "runs"), *flags], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    config.write_text('[data]\ntrain_data = "missing/train_*.bin"\n')
    result = CliRunner().invoke(cli, ["train", str(config), "--steps", "1", "--out_dir", str(tmp_path / "runs"),
                                      *flags], catch_exceptions=False)
    assert result.exit_code == 1 and str(folder / "missing" / "train_*.bin") in result.output


def memory_flags():
    """The --name flags of `nanoq memory` made from settings."""
    command = cli.get_command(None, "memory")
    names = {option.name for option in command.params}
    return {item.name for item in settings()} & names


def test_nanoq_memory_takes_only_the_settings_that_change_memory():
    # ... and those that change what it says of it (report: grad_accum, the tokens per step kept).
    marked = {item.name for item in settings() if item.memory_command_flag}
    assert memory_flags() == marked
    assert marked == {item.name for item in settings() if item.memory} | {"grad_accum"}
    assert {item.name for item in settings() if item.report} == {"grad_accum"}
    assert {"lr", "steps", "warmup_steps", "eval_every", "out_dir", "log_every"}.isdisjoint(marked)
    assert {"hidden_size", "seq_len", "batch_size", "zero_stage", "recompute", "offload", "train_data"} <= marked
    help_text = CliRunner().invoke(cli, ["memory", "--help"]).output
    assert "--hidden-size" in help_text and "--lr " not in help_text and "--warmup-steps" not in help_text


def other_value(item):
    """A valid value of the setting other than its default, or None."""
    if item.choices:
        return next((choice for choice in item.choices if choice not in (item.default, "auto", "cuda",
                                                                          "cuda_emulated")), None)
    if item.type is bool:
        return not item.default
    if item.type is int:
        return item.default + 1 if item.maximum is None or item.default < item.maximum else item.default - 1
    if item.type is float:
        high = item.maximum if item.maximum is not None else 2 * item.default + 1
        return (item.default + high) / 2 if high != item.default else item.default / 2
    return None


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_settings_not_marked_memory_do_not_change_the_memory_plan(lora_rank):
    base = TrainConfig(vocab_size=VOCAB, **{**SMALL, "devices": 2}, lora_rank=lora_rank, steps=30)

    def plan(config):
        model = loop.model_config(config, VOCAB)
        estimate = estimate_memory(model, train_options(config))
        return estimate.per_device, estimate.stack_capacities, estimate.generation

    expected = plan(base)
    checked = []
    for item in settings():
        value = other_value(item)
        if item.memory or value is None:
            continue
        try:
            changed = dataclasses.replace(base, **{item.name: value})
        except ValueError:
            continue
        assert plan(changed) == expected, f"{item.key} = {value!r} changes the memory: mark it memory=True"
        checked.append(item.name)
    assert {"grad_accum", "z_loss", "seed", "rope_theta", "cuda_graphs"} <= set(checked)
    assert lora_rank == 0 or "lora_alpha" in checked


def test_a_run_started_with_relative_flags_resumes_from_its_own_config_anywhere(tmp_path, monkeypatch):
    # Relative --train-data from the working directory; the run's config.toml
    # then names the same files, read from any directory.
    project = tmp_path / "project"
    token_data(project / "data")
    monkeypatch.chdir(project)
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in SMALL.items()]
    common = flags + ["--train-data=data/train_*.bin", "--eval-data=data/eval_*.bin", "--out-dir=runs",
                      "--run-name=run", "--warmup-steps=0", "--checkpoint-every=2", "--eval-every=0",
                      "--sample-every=0"]
    runner = CliRunner()
    first = runner.invoke(cli, ["train", "--steps=2", *common])
    assert first.exit_code == 0, first.output
    run_dir = project / "runs" / "run"
    monkeypatch.chdir(tmp_path)  # elsewhere
    resumed = runner.invoke(cli, ["train", str(run_dir / "config.toml"), "--steps=4", "--resume", str(run_dir)])
    assert resumed.exit_code == 0, resumed.output
    assert "step 4/4" in resumed.output


def test_a_checkpoint_that_saved_relative_paths_resumes_from_the_same_working_directory(tmp_path, monkeypatch):
    # Runs from before paths became absolute stored them as given.
    from nanoq.training.resume import config_changes
    monkeypatch.chdir(tmp_path)
    config = load_config(None, {"train_data": "data/train_*.bin", "steps": 3})
    assert config.train_data == str(tmp_path / "data" / "train_*.bin")
    saved = config.sections()
    saved["data"]["train_data"] = "data/train_*.bin"
    assert config_changes(saved, config) == {}
    saved["data"]["train_data"] = "other/train_*.bin"
    assert list(config_changes(saved, config)) == ["data.train_data"]
