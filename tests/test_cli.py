"""The `nanoq` command line: tokenize -> train -> plot end to end, config errors, info, the demo."""
import json
import os
import re
import sys
import tomllib

import numpy as np
import pytest
from click.testing import CliRunner

from nanoq.install import extra_install_command
from nanoq_cli.main import cli

TINY_MODEL = ["--hidden_size", "32", "--intermediate_size", "64", "--num_hidden_layers", "1",
              "--num_attention_heads", "2", "--seq_len", "32", "--batch_size", "2", "--threads", "1",
              "--backend", "cpu"]


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_tokenize_train_plot_end_to_end(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n\n" for i in range(60)))
    result = invoke("tokenize", corpus, "-o", tmp_path / "data", "--split", "paragraph", "--train-tokenizer",
                    "--vocab-size", "300", "--eval-fraction", "0.2")
    assert result.exit_code == 0, result.output
    assert "60 documents (12 held out)" in result.output and "vocab 300" in result.output

    result = invoke("train", "--train_data", tmp_path / "data" / "train_*.bin", "--eval-data",
                    tmp_path / "data" / "eval_000000.bin", *TINY_MODEL, "--steps", "6", "--warmup_steps", "1",
                    "--eval_every", "3", "--out_dir", tmp_path / "runs", "--run_name", "tiny")
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / "tiny"
    assert f"run directory: {run}" in result.output
    assert "step 6/6 | loss" in result.output and "eval @ step 6: loss" in result.output
    records = [json.loads(line) for line in open(run / "log.jsonl")]
    assert [r["step"] for r in records if r["type"] == "eval"] == [0, 3, 6]
    assert sorted(os.listdir(run / "model")) == ["config.json", "model.safetensors", "tokenizer.json",
                                                 "tokenizer_config.json"]
    assert json.load(open(run / "model" / "config.json"))["eos_token_id"] == 0

    result = invoke("plot", run, "-o", tmp_path / "loss.png")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_runs_with_no_data_settings(tmp_path):
    result = invoke("train", *TINY_MODEL, "--steps", "2", "--warmup_steps", "0", "--eval_batches", "1",
                    "--out_dir", tmp_path)
    assert result.exit_code == 0, result.output
    assert "demo corpus: 12 Shakespeare plays" in result.output
    assert "eval @ step 0: loss" in result.output and "eval @ step 2: loss" in result.output
    (run,) = os.listdir(tmp_path)
    assert sorted(os.listdir(tmp_path / run)) == ["checkpoints", "config.toml", "data", "log.jsonl", "model"]

    # --resume alone finds this run (the newest in out_dir with a checkpoint) and reuses its corpus.
    result = invoke("train", *TINY_MODEL, "--steps", "3", "--warmup_steps", "0", "--eval_batches", "1",
                    "--out_dir", tmp_path, "--resume")
    assert result.exit_code == 0, result.output
    assert f"resuming from {tmp_path / run / 'checkpoints' / 'step_00000002'} at step 2" in result.output
    assert f"demo corpus: {tmp_path / run / 'data'}" in result.output and "step 3/3 | loss" in result.output
    assert os.listdir(tmp_path) == [run] and os.path.isdir(tmp_path / run / "model-step3")


def test_an_interrupt_says_whether_there_is_a_checkpoint_to_resume(tmp_path, monkeypatch):
    import nanoq.training.loop as loop

    args = [*TINY_MODEL, "--steps", "2", "--warmup_steps", "0", "--eval_batches", "1", "--out_dir", tmp_path,
            "--run_name", "run"]
    real = loop.Trainer

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(loop, "Trainer", interrupted)  # Ctrl-C while the new run is set up
    result = CliRunner().invoke(cli, [str(a) for a in ["train", *args]])
    assert result.exit_code == 130
    assert "interrupted before the run's first checkpoint: nothing to resume" in result.output
    assert "--resume continues" not in result.output and not (tmp_path / "run").exists()
    monkeypatch.setattr(loop, "Trainer", real)
    assert invoke("train", *args).exit_code == 0
    monkeypatch.setattr(loop, "Trainer", interrupted)  # while a resumed run is set up: its checkpoints stay
    result = CliRunner().invoke(cli, [str(a) for a in ["train", *args, "--steps", "3", "--resume"]])
    assert result.exit_code == 130
    assert (f"the log and checkpoints so far are in {tmp_path / 'run'} (the same command with --resume continues"
            in result.output)


def test_print_config_merges_defaults_file_and_flags(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[train]\nsteps = 7\nlr = 1.0\n")
    result = invoke("train", config, "--lr", "0.5", "--tie-word-embeddings", "false", "--print-config")
    assert result.exit_code == 0, result.output
    merged = tomllib.loads(result.output)
    assert merged["train"]["steps"] == 7 and merged["train"]["lr"] == 0.5
    assert merged["model"]["tie_word_embeddings"] is False and merged["model"]["hidden_size"] == 256


def test_a_file_valid_only_with_the_flags_is_taken(tmp_path):
    # The file's settings are checked with the flags applied (flags override the file): a rule
    # between two settings holds when a flag gives the other one.
    config = tmp_path / "offload.toml"
    config.write_text('[run]\nbackend = "cpu"\ndevices = 2\noffload = "gradients"\n')
    result = invoke("train", config, "--zero_stage", "2", "--print-config")
    assert result.exit_code == 0, result.output
    merged = tomllib.loads(result.output)
    assert merged["run"]["offload"] == "gradients" and merged["run"]["zero_stage"] == 2
    # Where the file is at fault on its own, the error still names it; where the flags are, it does not.
    result = invoke("train", config, "--print-config")
    assert result.exit_code == 1 and f"{config}: offloading gradients needs zero_stage 2 or 3" in result.output
    plain = tmp_path / "plain.toml"
    plain.write_text('[run]\nbackend = "cpu"\ndevices = 2\n')
    result = invoke("train", plain, "--offload", "gradients", "--print-config")
    assert result.exit_code == 1 and "offloading gradients needs zero_stage 2 or 3" in result.output
    assert str(plain) not in result.output


def test_config_errors_name_the_key_or_file(tmp_path):
    result = invoke("train", "--stepz", "3")
    assert result.exit_code == 2 and "No such option" in result.output and "--stepz" in result.output
    result = invoke("train", "--steps", "ten")
    assert result.exit_code == 2 and "--steps" in result.output and "'ten' is not a valid integer" in result.output
    result = invoke("train", "--schedule", "cosin")
    assert result.exit_code == 2 and "--schedule" in result.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nhidden = 3\n")
    result = invoke("train", bad, "--print-config")
    assert result.exit_code == 1 and f"{bad}: unknown key 'model.hidden'" in result.output
    bad.write_text("[model\n")
    result = invoke("train", bad)
    assert result.exit_code == 1 and f"{bad}: not valid TOML" in result.output
    result = invoke("train", "--steps", "0", "--print-config")
    assert result.exit_code == 1 and "train.steps must be >= 1, got 0" in result.output


def test_tokenize_reports_bad_input_and_usage(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n{"body": 1}\n')
    result = invoke("tokenize", data, "-o", tmp_path / "out", "--train-tokenizer", "--vocab-size", "300")
    assert result.exit_code == 1 and f"{data}:2: has no field 'text'" in result.output
    result = invoke("tokenize", data, "-o", tmp_path / "out")
    assert result.exit_code == 2 and "--tokenizer PATH or --train-tokenizer" in result.output
    result = invoke("tokenize", data, "-o", tmp_path / "out", "--format", "nano")
    assert result.exit_code == 2 and "needs --vocab-size" in result.output
    result = invoke("tokenize", data, "-o", tmp_path / "out", "--train-tokenizer", "--vocab-size", "0")
    assert result.exit_code == 2 and "Invalid value for '--vocab-size': 0 is not in the range x>=1" in result.output
    assert not (tmp_path / "out").exists()
    # A corpus too small for the vocabulary asked: the tokenizer is smaller, and the output says so.
    (tmp_path / "small.txt").write_text("to be or not to be, that is the question\n")
    result = invoke("tokenize", tmp_path / "small.txt", "-o", tmp_path / "small", "--train-tokenizer",
                    "--vocab-size", "8192")
    assert result.exit_code == 0, result.output
    assert re.search(r"note: the trained tokenizer has \d+ tokens, fewer than --vocab-size 8192", result.output)



def test_tokenize_counts_text_spelling_special_tokens_and_says_what_it_became(tmp_path):
    from nanoq.demo import DEMO_DIR

    data = tmp_path / "web.jsonl"
    data.write_text('{"text": "a <|endoftext|> b"}\n{"text": "plain"}\n{"text": "<|user|> and <|endoftext|>"}\n')
    result = invoke("tokenize", data, "-o", tmp_path / "tokens", "--tokenizer", DEMO_DIR)
    assert result.exit_code == 0, result.output
    assert ("note: 2 document(s) spell special tokens of the tokenizer in their text (documents per token: "
            "<|endoftext|> (2), <|user|> (1)); that text became those tokens; --special-text text encodes such "
            "text as ordinary text") in result.output
    result = invoke("tokenize", data, "-o", tmp_path / "text", "--tokenizer", DEMO_DIR, "--special-text", "text")
    assert result.exit_code == 0, result.output
    assert "that text became ordinary text (--special-text text)" in result.output
    (tmp_path / "plain.jsonl").write_text('{"text": "a < |endoftext| > b"}\n')
    result = invoke("tokenize", tmp_path / "plain.jsonl", "-o", tmp_path / "plain", "--tokenizer", DEMO_DIR)
    assert result.exit_code == 0 and "note" not in result.output, result.output
    result = invoke("tokenize", data, "-o", tmp_path / "nano", "--format", "nano", "--vocab-size", "8",
                    "--special-text", "text")
    assert result.exit_code == 2 and "--special-text is for text" in result.output


def test_info_lists_version_and_backends():
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("nanoq 0.1.0 (Python ")
    assert "backend cpu: " in result.output and "device(s)" in result.output
    assert "backend cuda: " in result.output
    assert "backend cuda_emulated: " in result.output


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    log = tmp_path / "log.jsonl"
    log.write_text('{"type": "train", "step": 1, "loss": 3.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = invoke("plot", log, "-o", tmp_path / "loss.png")
    assert result.exit_code == 1 and extra_install_command("plot") in result.output


def test_the_extra_install_hint_names_the_source_folder_of_a_source_install(monkeypatch, tmp_path):
    import importlib.metadata

    class Installed:
        def __init__(self, direct_url):
            self.direct_url = direct_url

        def read_text(self, name):
            return self.direct_url if name == "direct_url.json" else None

    source = tmp_path / "my src"
    local = json.dumps({"url": source.as_uri(), "dir_info": {"editable": True}})
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Installed(local))
    assert extra_install_command("plot") == f'pip install "{source}[plot]"'
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Installed(None))  # from an index
    assert extra_install_command("plot") == 'pip install "nanoq[plot]"'
    wheel = json.dumps({"url": "file:///tmp/nanoq-0.1.0-cp311-linux_x86_64.whl", "archive_info": {}})
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Installed(wheel))
    assert extra_install_command("plot") == 'pip install "nanoq[plot]"'


def test_recompute_and_offload_settings_reach_the_trainer_and_change_nothing_but_memory(tmp_path):
    def run(name, *extra):
        result = invoke("train", *TINY_MODEL, "--steps", "3", "--warmup_steps", "0", "--eval_every", "0",
                        "--eval_batches", "1", "--checkpoint_every", "0", "--out_dir", tmp_path, "--run_name", name,
                        *extra)
        assert result.exit_code == 0, result.output
        records = [json.loads(line) for line in open(tmp_path / name / "log.jsonl")]
        losses = [r["loss"] for r in records if r["type"] == "train"]
        memory = next(r for r in records if r["type"] == "start")["memory"][0]
        return losses, memory

    base_losses, base_memory = run("base")
    losses, memory = run("lean", "--recompute", "block", "--offload", "optimizer,master")
    assert losses == base_losses
    assert memory["contexts"]["activations"] < base_memory["contexts"]["activations"]
    assert "adam-m" not in memory["contexts"] and memory["host"] > 0


def test_every_numeric_option_of_every_command_refuses_overflow_and_non_finite_values():
    import click

    from nanoq_cli.main import Size
    from nanoq_cli.numbers import FiniteFloat, Integer

    numeric = (click.types.IntParamType, click.types.FloatParamType)
    checked = 0
    for name, command in cli.commands.items():
        for param in command.params:
            if isinstance(param.type, numeric) or isinstance(param.type, Size):
                assert isinstance(param.type, (Integer, FiniteFloat, Size)), f"nanoq {name} {param.opts[0]}"
                checked += 1
    assert checked > 30
    for flag, value in (("--temperature", "nan"), ("--temperature", "1e400"), ("--seed", str(10**29)),
                        ("--top-p", "inf"), ("--max-new-tokens", str(2**70))):
        result = invoke("generate", "some-model", "--prompt", "hi", flag, value)
        assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output, (flag, result.output)


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_help_describes_only_real_bounds(command):
    # Every numeric option goes through Integer/FiniteFloat; an option
    # without bounds has no range text (click would print "[x<=None]"), one
    # with a bound keeps it.
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert "None]" not in result.output and "x<=None" not in result.output
    if command == "memory":
        assert "[x>=1]" in result.output  # --processes


def test_help_lists_the_choices_of_every_setting_that_has_them():
    # The settings' flags took the type's name as metavar ("--schedule STR"), hiding the choices.
    from nanoq.training.settings import settings

    with_choices = [item for item in settings() if item.choices]
    assert len(with_choices) >= 5
    for command in ("train", "memory"):
        text = " ".join(invoke(command, "--help").output.split())
        for item in with_choices:
            if command == "train" or item.memory_command_flag:
                flags = f"--{item.name}" + (f", --{item.name.replace('_', '-')}" if "_" in item.name else "")
                assert f"{flags} [{'|'.join(item.choices)}]" in text, (command, item.name)


def test_sigterm_ends_a_command_as_ctrl_c_does_leaving_no_partial_output(tmp_path):
    # A scheduler cancelling `nanoq tokenize` (SIGTERM) killed it at once and left its
    # <out>.partial-<pid> staging folder behind; now SIGTERM unwinds like Ctrl-C.
    import signal
    import subprocess
    import time

    from nanoq.demo import DEMO_DIR

    corpus = tmp_path / "big.txt"
    corpus.write_text("".join(f"paragraph {i} of the quick brown fox, who jumps over the lazy dog again.\n\n"
                              for i in range(300_000)))
    command = [sys.executable, "-c", "from nanoq_cli.main import main; main()", "tokenize", str(corpus), "-o",
               str(tmp_path / "out"), "--tokenizer", DEMO_DIR, "--split", "paragraph"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not any(name.startswith("out.partial-") for name in os.listdir(tmp_path)):
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0 and process.returncode != -signal.SIGTERM, output
    assert sorted(os.listdir(tmp_path)) == ["big.txt"], output


@pytest.mark.parametrize("sizes, python_error, train_error", [
    ((100, 3, 3), r"hidden_size \(100\) is not divisible by num_attention_heads \(3\): choose a head count that "
                  r"divides it, or give head_dim explicitly \(ModelConfig.head_dim",
     "model.hidden_size (100) is not divisible by model.num_attention_heads (3): choose a head count that divides "
     "it\n"),
    ((96, 3, 2), r"num_attention_heads \(3\) must be a multiple of num_key_value_heads \(2\)",
     "model.num_attention_heads (3) must be a multiple of model.num_key_value_heads (2)"),
    ((120, 8, 8), r"head_dim \(hidden_size / num_attention_heads = 15\) must be even",
     "head_dim (model.hidden_size / model.num_attention_heads = 15) must be even for rotary embeddings")],
    ids=["indivisible", "kv_heads", "odd_head_dim"])
def test_heads_that_do_not_fit_are_named_in_each_interface_s_words(tmp_path, sizes, python_error, train_error):
    # nanoq train has no head_dim setting: its errors named ModelConfig.head_dim and unprefixed sizes.
    import nanoq
    hidden, heads, kv_heads = sizes
    with pytest.raises(ValueError, match=python_error):
        nanoq.ModelConfig(vocab_size=64, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=heads, num_key_value_heads=kv_heads)
    result = invoke("train", "--hidden_size", hidden, "--num_attention_heads", heads, "--num_key_value_heads",
                    kv_heads, "--steps", "1", "--out_dir", tmp_path)
    assert result.exit_code == 1 and train_error in result.output and "ModelConfig" not in result.output
    assert not os.listdir(tmp_path)  # refused before a run directory was made
    # An explicit odd head_dim is named as given.
    with pytest.raises(ValueError, match=r"head_dim \(7\) must be even"):
        nanoq.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, head_dim=7)


def test_settings_audit_mends(tmp_path):
    import tomllib

    # An empty bool flag was taken for false (`--causal "$UNSET"` changed the model); a file's "" is refused.
    result = invoke("train", "--print-config", "--tie-word-embeddings", "")
    assert result.exit_code == 2 and "an empty value is not true or false" in result.output
    assert 'tie_word_embeddings = false' in invoke("train", "--print-config", "--tie-word-embeddings", "no").output
    # LoRA targets are names to check even without lora_rank (the value goes into config.toml).
    result = invoke("train", "--print-config", "--lora-targets", "xyz")
    assert result.exit_code == 1 and "lora.lora_targets: unknown LoRA target 'xyz'" in result.output
    assert invoke("train", "--print-config", "--lora-targets", "q,gate").exit_code == 0
    # A model.init_from that is not there says so, naming the setting.
    result = invoke("train", *TINY_MODEL, "--steps", "1", "--init-from", tmp_path / "nowhere", "--out_dir", tmp_path)
    assert result.exit_code == 1 and f"model.init_from {tmp_path / 'nowhere'} does not exist" in result.output
    # Warnings about the schedule come once the run is set up, not before a refusal of something else.
    result = invoke("train", *TINY_MODEL, "--steps", "2", "--warmup_steps", "5", "--init-from", tmp_path / "nowhere",
                    "--out_dir", tmp_path)
    assert result.exit_code == 1 and "does not exist" in result.output and "warmup" not in result.output
    # A wsd decay the warmup cuts short, or one shorter than a step, is said.
    args = [*TINY_MODEL, "--steps", "10", "--schedule", "wsd", "--eval_every", "0", "--checkpoint_every", "0",
            "--sample_every", "0", "--out_dir", tmp_path]
    output = invoke("train", *args, "--warmup_steps", "5", "--cooldown_fraction", "0.8", "--run_name", "a").output
    assert "warning: the wsd decay runs over the last 5 steps, not the 8 that train.cooldown_fraction 0.8 asks " \
           "for: the warmup takes the first 5" in output
    output = invoke("train", *args, "--warmup_steps", "2", "--cooldown_fraction", "0.05", "--run_name", "b").output
    assert "warning: train.cooldown_fraction 0.05 of 10 steps is less than one step: no update decays" in output
    output = invoke("train", *args, "--warmup_steps", "2", "--cooldown_fraction", "0.2", "--run_name", "c").output
    assert "wsd decay" not in output and "cooldown_fraction" not in output
    # --print-config of a resumed run's settings is TOML on stdout alone (the "settings:" line went there).
    result = CliRunner().invoke(cli, ["train", "--resume", str(tmp_path / "c"), "--print-config"])
    assert result.exit_code == 0 and tomllib.loads(result.stdout)["train"]["steps"] == 10
    assert "settings: " in result.stderr


def test_the_model_line_says_how_much_of_the_data_the_run_reads(tmp_path):
    # A user choosing train.steps (llm.q's default is one epoch) saw no epoch figure anywhere.
    from nanoq.data import write_tokens

    write_tokens(tmp_path / "train_000000.bin", np.arange(1, 32 * 50 + 2) % 60, 64)  # 50 windows of 32
    args = [*TINY_MODEL, "--train_data", tmp_path / "train_*.bin", "--eval_every", "0", "--checkpoint_every", "0",
            "--sample_every", "0", "--seq_len", "32", "--out_dir", tmp_path / "runs", "--warmup_steps", "0"]
    lines = invoke("train", *args, "--steps", "5").output.splitlines()  # 5 steps x 2 rows: 10 of 50 windows
    assert next(line for line in lines if line.startswith("model: ")).endswith(
        "(1 layer, hidden 32, vocab 64) on cpu x1 (fp32); 5 steps of 64 tokens (20% of an epoch)")
    lines = invoke("train", *args, "--steps", "50", "--grad_accum", "2").output.splitlines()
    assert next(line for line in lines if line.startswith("model: ")).endswith("(4.0 epochs)")
