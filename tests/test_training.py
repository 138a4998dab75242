"""nanoq.training: schedules, the config schema, the loop, its log and the exported model."""
import json
import math
import os

import numpy as np
import pytest
import torch

from nanoq.data import write_tokens
from nanoq.training import (
    JsonlLog,
    TrainConfig,
    learning_rate,
    load_config,
    read_log,
    schema_markdown,
    settings,
    train,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -- schedules ---------------------------------------------------------------------------

SCHEDULE = dict(peak=1.0, total_steps=110, warmup_steps=10, final_lr_fraction=0.1, cooldown_fraction=0.2)


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd", "constant"])
def test_warmup_is_linear_and_reaches_the_peak_at_its_last_step(kind):
    assert learning_rate(0, kind=kind, **SCHEDULE) == pytest.approx(0.1)
    assert learning_rate(4, kind=kind, **SCHEDULE) == pytest.approx(0.5)
    assert learning_rate(9, kind=kind, **SCHEDULE) == pytest.approx(1.0)
    assert learning_rate(10, kind=kind, **SCHEDULE) == pytest.approx(1.0)


@pytest.mark.parametrize("kind, midpoint, end", [("cosine", 0.55, 0.1), ("linear", 0.55, 0.1),
                                                 ("constant", 1.0, 1.0)])
def test_decay_midpoint_and_end(kind, midpoint, end):
    assert learning_rate(60, kind=kind, **SCHEDULE) == pytest.approx(midpoint)
    assert learning_rate(110, kind=kind, **SCHEDULE) == pytest.approx(end)


def test_cosine_is_above_linear_in_the_first_half_of_the_decay():
    assert learning_rate(35, kind="cosine", **SCHEDULE) > learning_rate(35, kind="linear", **SCHEDULE)


def test_wsd_holds_the_peak_then_decays_over_the_cooldown():
    # cooldown 0.2 of 110 steps: decay from step 88 to 110.
    assert learning_rate(87, kind="wsd", **SCHEDULE) == pytest.approx(1.0)
    assert learning_rate(88, kind="wsd", **SCHEDULE) == pytest.approx(1.0)
    assert learning_rate(99, kind="wsd", **SCHEDULE) == pytest.approx(0.55)
    assert learning_rate(110, kind="wsd", **SCHEDULE) == pytest.approx(0.1)
    no_cooldown = dict(SCHEDULE, cooldown_fraction=0.0)
    assert learning_rate(109, kind="wsd", **no_cooldown) == pytest.approx(1.0)


def test_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="schedule must be one of"):
        learning_rate(0, kind="step", **SCHEDULE)
    with pytest.raises(ValueError, match="warmup_steps"):
        learning_rate(0, kind="cosine", **dict(SCHEDULE, warmup_steps=200))


# -- config schema -----------------------------------------------------------------------


def test_example_config_parses_lists_every_setting_and_holds_the_defaults():
    path = os.path.join(REPO, "configs", "example.toml")
    assert load_config(path) == TrainConfig()
    text = open(path).read()
    for item in settings():
        assert f"\n{item.name} = " in text, f"configs/example.toml lacks {item.key}"


def test_settings_of_core_options_take_their_meaning_from_the_core():
    # One definition: a setting that is a core option (nanoq.options) says
    # what the core's schema says of it, then only what the TOML form adds.
    from nanoq import options as option_schema

    core = set(option_schema.names())
    shared = [item for item in settings() if item.name in core]
    assert len(shared) >= 20, [item.name for item in shared]
    for item in shared:
        spec = option_schema.option(item.name)
        assert item.help.startswith(spec["help"]), (item.key, item.help, spec["help"])
        if spec["kind"] in ("choice", "set") and item.name not in ("dtype", "master_dtype", "optimizer_dtype",
                                                                    "lora_targets"):
            for choice in spec["choices"]:  # listed with the core's help of it
                assert f"{choice['name']} = {choice['help']}" in item.help, (item.key, choice["name"])


def test_readme_documents_every_setting():
    readme = open(os.path.join(REPO, "README.md")).read()
    assert schema_markdown() in readme, "README's settings table is stale: paste schema_markdown()"


def test_config_file_errors_name_the_file_and_key(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nlr = 1e-3\nlearning_rate = 3\n")
    with pytest.raises(ValueError, match=r"c\.toml: unknown key 'train\.learning_rate'"):
        load_config(path)
    path.write_text("[train]\nsteps = \"ten\"\n")
    with pytest.raises(ValueError, match=r"c\.toml: train\.steps must be an integer, got 'ten'"):
        load_config(path)
    path.write_text("[model]\nlr = 1e-3\n")
    with pytest.raises(ValueError, match=r"c\.toml: key 'lr' belongs in \[train\], not \[model\]"):
        load_config(path)
    path.write_text("[train\nlr = 1\n")
    with pytest.raises(ValueError, match=r"c\.toml: not valid TOML"):
        load_config(path)
    path.write_text("[optim]\nlr = 1\n")
    with pytest.raises(ValueError, match=r"unknown section or top-level key 'optim'"):
        load_config(path)
    with pytest.raises(ValueError, match=r"train\.schedule must be one of cosine"):
        load_config(overrides={"schedule": "cosin"})
    with pytest.raises(ValueError, match=r"unknown setting 'stepz' \(did you mean 'steps'\?\)"):
        load_config(overrides={"stepz": 3})


def test_flags_override_the_file_and_the_config_round_trips(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nsteps = 7\nlr = 1\n[run]\nrun_name = \"a \\\"quoted\\\" name\"\n")
    config = load_config(path, overrides={"lr": 0.5})
    assert (config.steps, config.lr, config.run_name) == (7, 0.5, 'a "quoted" name')
    assert isinstance(load_config(overrides={"lr": 1}).lr, float)
    (tmp_path / "round.toml").write_text(config.to_toml())
    assert load_config(tmp_path / "round.toml") == config


# -- the loop ------------------------------------------------------------------------------

VOCAB = 64


def tiny_config(tmp_path, **overrides):
    """Token files of a learnable pattern and a tiny model config."""
    rng = np.random.default_rng(0)
    pattern = np.tile(np.arange(1, 17), 200) + rng.integers(0, 2, 3200) * 16
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    write_tokens(data / "train_000000.bin", pattern, VOCAB)
    write_tokens(data / "eval_000000.bin", pattern[:700], VOCAB)
    values = dict(train_data=str(data / "train_*.bin"), eval_data=str(data / "eval_000000.bin"),
                  hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, seq_len=16, batch_size=4, grad_accum=2, steps=8, warmup_steps=2,
                  lr=1e-2, eval_every=4, eval_batches=0, backend="cpu", threads=1, out_dir=str(tmp_path / "runs"),
                  run_name="run")
    values.update(overrides)
    return TrainConfig(**values)


def test_training_logs_every_step_and_eval_and_lowers_the_eval_loss(tmp_path):
    lines = []
    result = train(tiny_config(tmp_path), say=lines.append, progress=False)
    records = [json.loads(line) for line in open(result.log_path)]
    # The last step's sample (train.sample_every's default, 60, is past this run's 8 steps), after the
    # step's checkpoint: generation allocates the KV cache, which may fail.
    assert [r["type"] for r in records] == ["start", "eval"] + ["train"] * 4 + ["eval"] + ["train"] * 4 + \
        ["checkpoint", "sample", "eval", "end"]
    train_records = [r for r in records if r["type"] == "train"]
    assert [r["step"] for r in train_records] == list(range(1, 9))
    assert [r["tokens"] for r in train_records] == [4 * 16 * 2 * s for s in range(1, 9)]
    for record in train_records:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "time"} <= set(record)
        assert math.isfinite(record["loss"]) and record["grad_norm"] > 0
    assert [r["lr"] for r in train_records[:2]] == pytest.approx([5e-3, 1e-2])
    assert [step for step, _ in result.evals] == [0, 4, 8]
    assert result.evals[-1][1] < result.evals[0][1] - 0.5
    assert records[-2]["loss"] == pytest.approx(result.final_eval_loss)
    assert records[0]["parameters"] == result.parameters
    assert sum(line.startswith("step ") for line in lines) == 8
    assert any(line.startswith("eval @ step 8: loss") for line in lines)
    assert sorted(os.listdir(result.run_dir)) == ["checkpoints", "config.toml", "log.jsonl", "model"]
    assert load_config(os.path.join(result.run_dir, "config.toml")) == tiny_config(tmp_path)


def test_exported_model_loads_in_transformers_with_the_same_loss(tmp_path):
    from transformers import AutoConfig, LlamaForCausalLM

    result = train(tiny_config(tmp_path, steps=3, eval_every=0), say=lambda line: None, progress=False)
    config = json.load(open(os.path.join(result.model_dir, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["vocab_size"], config["num_key_value_heads"], config["head_dim"]) == (VOCAB, 2, 8)
    assert AutoConfig.from_pretrained(result.model_dir).tie_word_embeddings is True
    model = LlamaForCausalLM.from_pretrained(result.model_dir, torch_dtype=torch.float32).eval()
    rng = np.random.default_rng(0)  # the eval file's windows (17 tokens, stepping by 16), rebuilt
    tokens = (np.tile(np.arange(1, 17), 200) + rng.integers(0, 2, 3200) * 16)[:700]
    windows = tokens[np.arange((len(tokens) - 1) // 16)[:, None] * 16 + np.arange(17)]
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(windows[:, :-1]).long()).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                 torch.from_numpy(windows[:, 1:]).long().reshape(-1))
    assert float(loss) == pytest.approx(result.final_eval_loss, rel=1e-4)


def test_a_named_run_is_never_overwritten(tmp_path):
    config = tiny_config(tmp_path, steps=1, warmup_steps=0, eval_every=0)
    train(config, say=lambda line: None, progress=False)
    with pytest.raises(FileExistsError, match="already exists: to continue that run, resume it \\(nanoq train "
                                              "--resume, or train\\(config, resume=\"auto\"\\)\\); else choose "
                                              "another run_name or remove it"):
        train(config, say=lambda line: None, progress=False)


def test_inconsistent_settings_fail_before_training(tmp_path):
    # (A warmup longer than the run is cut to it with a warning: test_run_usability.py.)
    with pytest.raises(ValueError, match="smaller than the token files' vocab size"):
        train(tiny_config(tmp_path, vocab_size=8, run_name="small"), say=lambda line: None)
    assert not os.path.exists(tmp_path / "runs" / "small")  # a run that never started leaves nothing


def test_train_refuses_arguments_of_the_wrong_type_naming_the_argument_before_anything_else(tmp_path):
    quiet = lambda line: None  # noqa: E731
    with pytest.raises(TypeError, match=r"^config must be a nanoq\.training\.TrainConfig, got dict: "
                                        r"nanoq\.training\.TrainConfig\(\*\*settings\) makes one"):
        train({"steps": 3}, say=quiet)
    config = tiny_config(tmp_path, steps=1, warmup_steps=0, eval_every=0)
    bad = {"resume": (dict(resume=3), r"^resume must be None, \"auto\" or the path of a run directory to continue, "
                                      r"got int$"),
           "say": (dict(say="quiet"), r"^say must be a callable that receives each console line \(a str\), got str$"),
           "progress": (dict(say=quiet, progress="no"), r"^progress must be True, False or None .*got str$"),
           "processes": (dict(say=quiet, processes=2), r"^processes must be a nanoq\.distributed\.ProcessGroup, "
                                                       r"got int$")}
    for arguments, message in bad.values():
        with pytest.raises(TypeError, match=message):
            train(config, **arguments)
    assert not os.path.exists(tmp_path / "runs")  # refused before a run directory was made
    train(config, resume=None, say=quiet, progress=False, processes=None)  # the right types still train


def test_jsonl_log_lines_are_on_disk_as_soon_as_written(tmp_path):
    log = JsonlLog(tmp_path / "log.jsonl")
    log.write(type="train", step=1, loss=float("nan"))
    assert json.loads(open(tmp_path / "log.jsonl").read()) == {"type": "train", "step": 1, "loss": None}
    log.close()
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write('{"type": "train", "st')  # a writer killed mid-line
    with pytest.warns(UserWarning, match=r"log\.jsonl: skipped its last line 2, cut off before its newline"):
        assert read_log(tmp_path / "log.jsonl") == [{"type": "train", "step": 1, "loss": None}]
    # A resumed run's log cuts the fragment off before its first record, which else glued onto it.
    with JsonlLog(tmp_path / "log.jsonl") as log:
        log.write(type="resume", step=1)
    assert read_log(tmp_path / "log.jsonl") == [{"type": "train", "step": 1, "loss": None},
                                               {"type": "resume", "step": 1}]
    # A fragment longer than a read-back block, and one with no line before it.
    for before in ('{"type": "eval"}\n', ""):
        (tmp_path / "torn.jsonl").write_text(before + '{"type": "sample", "completion": "' + "x" * 70000)
        with JsonlLog(tmp_path / "torn.jsonl") as log:
            log.write(type="end")
        assert (tmp_path / "torn.jsonl").read_text() == before + '{"type": "end"}\n'
