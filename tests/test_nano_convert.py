"""Nano migration: `nanoq convert nano-config` (nanoq.nano_config) and the data.curriculum setting it writes."""
import base64
import dataclasses
import json
import os
import pickle
import re
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import nanoq
from nanoq.checkpoint import list_checkpoints, step_dir_name
from nanoq.nano_config import (
    MODEL_KEYS,
    TRAIN_KEYS,
    convert_nano_config,
    nano_learning_rate,
    read_nano_configs,
    write_nano_toml,
)
from nanoq.trainer import Trainer
from nanoq.training import TrainConfig, load_config, read_log, train
from nanoq.training.settings import parse_curriculum, resolve_paths
from nanoq.training.lr_schedule import learning_rate
from nanoq_cli.main import cli

QUIET = dict(say=lambda line: None, progress=False)

# Nano's shipped config/model.json and config/lora.json (github.com/bd4sur/Nano), paths shortened.
NANO_MODEL = {"block_size": 512, "vocab_size": 16384, "n_layer": 24, "n_embd": 768, "n_head": 16, "n_kv_head": 8,
              "n_hidden": 2048, "dropout": 0.0, "use_rope": True, "norm_eps": 1e-5, "is_causal": True}
NANO_LORA = {"use_lora": True, "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0,
             "from_checkpoint": "/nano/checkpoint/nano_56m_pt_99000.pt", "save_checkpoint_to": "/nano/checkpoint",
             "dataset_path": [["/nano/sft_train.base64", "/nano/sft_val.base64"]],
             "tokenizer_path": "/nano/tokenizer/tokenizer_16384_v2.json", "random_seed": 39, "batch_size": 8,
             "gradient_accumulation_steps": 1, "grad_clip": 1.0, "dropout": 0.0, "learning_rate": 3e-5,
             "weight_decay": 1e-1, "beta1": 0.9, "beta2": 0.95, "decay_lr": False, "warmup_iters": 500,
             "lr_decay_iters": 1e9, "min_lr": 1e-8, "eval_interval": 100, "log_interval": 1, "eval_iters": 5,
             "backend": "nccl", "device": "cuda", "sdp_kernel": "flash", "dtype": "bfloat16", "use_amp": True}


def nano_train(**changes):
    return {**NANO_LORA, **changes}


def reported_keys(conversion):
    """The Nano keys (model.x / train.x) named by the unmapped entries."""
    return [re.match(r"(model|train)\.\w+", entry).group(0) for entry in conversion.unmapped]


# -- mapping ---------------------------------------------------------------------------------


def test_architecture_fields_map_to_the_model_section():
    config = convert_nano_config(NANO_MODEL, NANO_LORA, stage_steps=[10]).config
    assert (config.seq_len, config.vocab_size, config.num_hidden_layers, config.hidden_size) == (512, 16384, 24, 768)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (16, 8, 2048)
    assert config.rms_norm_eps == 1e-5 and config.tie_word_embeddings


def test_cosine_schedule_matches_nanos_after_warmup():
    nano = nano_train(decay_lr=True, learning_rate=6e-4, warmup_iters=10, lr_decay_iters=100, min_lr=6e-5)
    conversion = convert_nano_config(NANO_MODEL, nano, stage_steps=[100])
    config = conversion.config
    assert (config.schedule, config.warmup_steps, config.steps, config.lr) == ("cosine", 10, 100, 6e-4)
    assert config.final_lr_fraction == pytest.approx(0.1)
    assert "train.lr_decay_iters" in conversion.mapped and "train.lr_decay_iters" not in reported_keys(conversion)
    for step in range(10, 100):  # Nano's warmup starts at 0, nanoq's at lr / warmup: equal from the peak on
        ours = learning_rate(step, kind="cosine", peak=config.lr, total_steps=config.steps, warmup_steps=10,
                             final_lr_fraction=config.final_lr_fraction)
        assert ours == pytest.approx(nano_learning_rate(step, 6e-4, 10, 100, 6e-5), rel=1e-5)


def test_schedule_without_decay_is_constant_and_a_far_decay_end_is_reported():
    constant = convert_nano_config(NANO_MODEL, NANO_LORA, stage_steps=[50])
    assert (constant.config.schedule, constant.config.warmup_steps) == ("constant", 0)
    assert constant.mapped["train.warmup_iters"] == "(unused: decay_lr is false, as in Nano)"
    # Nano's shipped pretrain.json: cosine over 1e9 steps is flat over any real run, and nanoq's ends where it stands.
    far = convert_nano_config(NANO_MODEL, nano_train(decay_lr=True, learning_rate=5e-4, min_lr=6e-5), stage_steps=[50])
    assert far.config.schedule == "cosine" and far.config.final_lr_fraction == pytest.approx(1.0, abs=1e-6)
    assert "train.lr_decay_iters" in reported_keys(far)
    assert convert_nano_config(NANO_MODEL, nano_train(decay_lr=True), stage_steps=[50]).config.warmup_steps == 50


def test_dataset_path_pairs_become_curriculum_stages():
    pairs = [["/nano/pt_train_0.base64", "/nano/pt_val_0.base64"], ["/nano/sft_train.base64", "/nano/sft_val.base64"]]
    conversion = convert_nano_config(NANO_MODEL, nano_train(dataset_path=pairs), data_dir="imported",
                                     stage_steps=[400, 200])
    assert conversion.config.steps == 600 and conversion.config.train_data == ""
    assert parse_curriculum(conversion.config.curriculum) == [
        ("imported/pt_train_0/train_*.bin", "imported/pt_val_0/train_*.bin", 400),
        ("imported/sft_train/train_*.bin", "imported/sft_val/train_*.bin", 200)]
    assert [(i.source, i.output) for i in conversion.imports] == [
        (pairs[0][0], "imported/pt_train_0"), (pairs[0][1], "imported/pt_val_0"),
        (pairs[1][0], "imported/sft_train"), (pairs[1][1], "imported/sft_val")]
    assert conversion.imports[0].command(16384) == ("nanoq tokenize --format nano /nano/pt_train_0.base64 "
                                                    "-o imported/pt_train_0 --vocab-size 16384")


def test_one_pair_trains_on_it_for_one_pass_over_its_lines(tmp_path):
    train_file, val_file = tmp_path / "t.base64", tmp_path / "v.base64"
    train_file.write_text("line\n" * 100 + "\n")
    val_file.write_text("line\n")
    nano = nano_train(dataset_path=[[str(train_file), str(val_file)]], batch_size=8, gradient_accumulation_steps=2)
    config = convert_nano_config(NANO_MODEL, nano).config
    assert (config.train_data, config.eval_data, config.steps) == ("data/t/train_*.bin", "data/v/train_*.bin", 6)
    assert config.curriculum == ""
    with pytest.raises(ValueError, match=r"dataset_path\[0\]\[0\] /nano/sft_train.base64 cannot be read here"):
        convert_nano_config(NANO_MODEL, NANO_LORA)


def test_lora_settings_map_to_the_lora_section():
    config = convert_nano_config(NANO_MODEL, NANO_LORA, stage_steps=[10]).config
    assert (config.lora_rank, config.lora_alpha, config.lora_dropout, config.lora_targets) == (8, 16.0, 0.0,
                                                                                                "q,k,v,o")
    off = convert_nano_config(NANO_MODEL, nano_train(use_lora=False, lora_rank=16), stage_steps=[10])
    assert off.config.lora_rank == 0 and off.mapped["train.lora_rank"] == "(unused: use_lora is false, as in Nano)"
    # Nano's base model is a .pt pickle: a Hugging Face directory stands in for it.
    based = convert_nano_config(NANO_MODEL, NANO_LORA, stage_steps=[10], init_from="nanoq-out/pretrain/model")
    assert based.config.init_from == "nanoq-out/pretrain/model" and "train.from_checkpoint" in based.mapped
    assert "train.from_checkpoint" in reported_keys(convert_nano_config(NANO_MODEL, NANO_LORA, stage_steps=[10]))


def test_every_nano_key_is_mapped_or_reported_never_both():
    model = dict(NANO_MODEL, bias=True, n_hidden=None, rope_scaling=2.0)
    nano = nano_train(dropout=0.1, device="cuda:1", dtype="float16", compile=True)
    conversion = convert_nano_config(model, nano, stage_steps=[10])
    reported = reported_keys(conversion)
    given = {f"model.{k}" for k in model} | {f"train.{k}" for k in nano}
    assert set(conversion.mapped) | set(reported) == given
    assert not set(conversion.mapped) & set(reported)
    assert {"model.n_hidden", "model.rope_scaling", "train.dropout", "train.device", "train.dtype",
            "train.compile", "train.from_checkpoint", "train.tokenizer_path"} == set(reported)
    assert conversion.config.linear_bias is True and "model.bias" in conversion.mapped
    assert conversion.config.intermediate_size == TrainConfig().intermediate_size
    assert set(MODEL_KEYS) <= set(NANO_MODEL) | {"bias"} and set(TRAIN_KEYS) == set(NANO_LORA)


def test_nanos_cuda_and_bfloat16_become_auto_and_other_choices_stay_explicit():
    # Nano's stock device cuda, dtype bfloat16: nanoq's auto is cuda/bf16 on a GPU and cpu/fp32 without one.
    stock = convert_nano_config(NANO_MODEL, NANO_LORA, stage_steps=[10])
    assert (stock.config.backend, stock.config.dtype) == ("auto", "auto")
    assert stock.mapped["train.device"] == ("run.backend = 'auto' (cuda where a GPU is usable, as Nano's cuda; cpu "
                                            "where none is)")
    assert stock.mapped["train.dtype"].startswith("run.dtype = 'auto' (bf16 on cuda")
    settings = {(device, dtype, use_amp): convert_nano_config(NANO_MODEL, nano_train(device=device, dtype=dtype,
                                                                                     use_amp=use_amp),
                                                              stage_steps=[10]).config
                for device in ("cuda", "cpu") for dtype in ("bfloat16", "float32") for use_amp in (True, False)}
    assert {key: (config.backend, config.dtype) for key, config in settings.items()} == {
        ("cuda", "bfloat16", True): ("auto", "auto"), ("cuda", "float32", True): ("auto", "fp32"),
        ("cuda", "bfloat16", False): ("auto", "fp32"), ("cuda", "float32", False): ("auto", "fp32"),
        ("cpu", "bfloat16", True): ("cpu", "fp32"), ("cpu", "float32", True): ("cpu", "fp32"),
        ("cpu", "bfloat16", False): ("cpu", "fp32"), ("cpu", "float32", False): ("cpu", "fp32")}
    one_gpu = convert_nano_config(NANO_MODEL, nano_train(device="cuda:1"), stage_steps=[10])
    assert one_gpu.config.backend == "auto" and "CUDA_VISIBLE_DEVICES=1" in one_gpu.unmapped[-1]


def test_a_model_nanoq_cannot_build_is_refused_with_the_model_configs_message():
    with pytest.raises(ValueError, match=r"the Nano model config is not a valid nanoq model: hidden_size \(64\) is "
                                         r"not divisible by num_attention_heads \(5\)"):
        convert_nano_config(dict(NANO_MODEL, n_embd=64, n_head=5, n_kv_head=None), NANO_LORA, stage_steps=[10])


def test_stage_steps_of_the_wrong_count_say_how_many():
    with pytest.raises(ValueError, match=r"stage steps must be one positive integer \(dataset_path has one pair\), "
                                         r"got \[5, 5\]"):
        convert_nano_config(NANO_MODEL, NANO_LORA, stage_steps=[5, 5])
    pairs = [["/nano/a.base64", "/nano/a_val.base64"], ["/nano/b.base64", "/nano/b_val.base64"]]
    with pytest.raises(ValueError, match=r"stage steps must be 2 positive integers \(one per dataset_path pair\), "
                                         r"got \[5\]"):
        convert_nano_config(NANO_MODEL, nano_train(dataset_path=pairs), stage_steps=[5])


def test_a_train_file_shorter_than_one_step_is_a_caveat(tmp_path):
    train_file = tmp_path / "t.base64"
    train_file.write_text("line\n" * 3)
    nano = nano_train(dataset_path=[[str(train_file), str(train_file)]], batch_size=4, gradient_accumulation_steps=2)
    conversion = convert_nano_config(NANO_MODEL, nano)
    assert conversion.config.steps == 1
    assert conversion.caveats == [f"train.batch_size = 4: {train_file} has 3 lines, fewer than one optimizer step "
                                  f"takes (8: batch_size x gradient_accumulation_steps), so its stage trains 1 step, "
                                  f"which repeats lines; lower batch_size or give the steps of each stage"]
    assert convert_nano_config(NANO_MODEL, dict(nano, batch_size=1)).caveats == []


def test_bad_nano_values_name_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"Nano model.n_layer must be an integer, got '24'"):
        convert_nano_config(dict(NANO_MODEL, n_layer="24"), NANO_LORA, stage_steps=[1])
    with pytest.raises(ValueError, match="lacks block_size, n_head"):
        convert_nano_config({k: v for k, v in NANO_MODEL.items() if k not in ("block_size", "n_head")}, NANO_LORA)
    with pytest.raises(ValueError, match=r"dataset_path\[0\] must be \[train file, val file\]"):
        convert_nano_config(NANO_MODEL, nano_train(dataset_path=[["only-one"]]), stage_steps=[1])
    with pytest.raises(ValueError, match="no dataset_path"):
        convert_nano_config(NANO_MODEL, {k: v for k, v in NANO_LORA.items() if k != "dataset_path"})
    with pytest.raises(ValueError, match="train.use_amp must be true or false"):
        convert_nano_config(NANO_MODEL, nano_train(use_amp="yes"), stage_steps=[1])
    with pytest.raises(ValueError, match="converted config is not valid: model.num_hidden_layers must be >= 1"):
        convert_nano_config(dict(NANO_MODEL, n_layer=0), NANO_LORA, stage_steps=[1])
    with pytest.raises(TypeError, match="must be a JSON object"):
        convert_nano_config([NANO_MODEL], NANO_LORA)
    broken = tmp_path / "model.json"
    broken.write_text("{\"block_size\": 512,")
    with pytest.raises(ValueError, match="model.json is not valid JSON"):
        read_nano_configs(broken, broken)
    with pytest.raises(FileNotFoundError, match="Nano config .*missing.json does not exist"):
        read_nano_configs(tmp_path / "missing.json", broken)


def in_folder(config, folder):
    """``config`` as a TOML file in ``folder`` means it: its relative paths joined to the folder."""
    return TrainConfig.from_dict(resolve_paths(dataclasses.asdict(config), str(folder)))


def test_written_toml_loads_and_round_trips(tmp_path):
    pairs = [["/nano/a.base64", "/nano/a_val.base64"], ["/nano/b.base64", "/nano/b_val.base64"]]
    conversion = convert_nano_config(NANO_MODEL, nano_train(dataset_path=pairs), stage_steps=[30, 20])
    path = write_nano_toml(conversion, tmp_path / "nanoq.toml", sources=("model.json", "lora.json"))
    text = open(path).read()
    assert text.startswith("# nanoq config converted from Nano's model.json and lora.json")
    assert "#   nanoq tokenize --format nano /nano/a.base64 -o data/a --vocab-size 16384" in text
    assert all(f"#   {entry}" in text for entry in conversion.unmapped)
    loaded = load_config(path)
    assert loaded == in_folder(conversion.config, tmp_path)  # a TOML's relative paths are its folder's
    again = tmp_path / "again.toml"
    again.write_text(loaded.to_toml())
    assert load_config(again) == loaded
    with pytest.raises(FileExistsError, match="pass --force"):
        write_nano_toml(conversion, path)
    write_nano_toml(conversion, path, force=True)
    assert not [name for name in os.listdir(tmp_path) if "partial" in name]


def test_an_output_in_a_missing_folder_is_refused_naming_the_folder(tmp_path):
    conversion = convert_nano_config(NANO_MODEL, NANO_LORA, stage_steps=[10])
    with pytest.raises(FileNotFoundError, match=f"cannot write {tmp_path}/missing/o.toml: its folder "
                                                f"{tmp_path}/missing does not exist; create it or choose another "
                                                f"output$"):
        write_nano_toml(conversion, tmp_path / "missing" / "o.toml")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match=f"{tmp_path}/file is not a folder"):
        write_nano_toml(conversion, tmp_path / "file" / "o.toml")
    assert sorted(os.listdir(tmp_path)) == ["file"]


# -- data.curriculum -------------------------------------------------------------------------


def test_curriculum_syntax_errors_name_the_stage():
    assert parse_curriculum(" a/*.bin | a/eval.bin @ 3 ; b.bin|c.bin@2;") == [("a/*.bin", "a/eval.bin", 3),
                                                                               ("b.bin", "c.bin", 2)]
    for text, message in (("a.bin@3; b.bin", r"stage 2 \('b.bin'\) has no '@STEPS'"),
                          ("a.bin@3;; b.bin@1", "stage 2 is empty"),
                          ("a.bin@0", r"stage 1 \('a.bin@0'\): the steps after '@' must be a positive integer"),
                          ("a.bin|@2", r"stage 1 \('a.bin\|@2'\) has '\|' but no eval files"),
                          ("|e.bin@2", r"stage 1 \('\|e.bin@2'\) names no training files"),
                          ("a.bin|e.bin@2; b.bin@2", "stage 2 has no eval files but other stages have")):
        with pytest.raises(ValueError, match=f"data.curriculum {message}"):
            parse_curriculum(text)


def test_curriculum_steps_must_add_up_to_train_steps_and_replace_train_data(tmp_path):
    with pytest.raises(ValueError, match=r"train.steps \(240\) must equal .* \(5\); set train.steps = 5"):
        TrainConfig(curriculum="a.bin@2; b.bin@3")
    with pytest.raises(ValueError, match="data.curriculum replaces data.train_data"):
        TrainConfig(curriculum="a.bin@2", steps=2, train_data="x.bin")
    with pytest.raises(ValueError, match="data.curriculum stage 1"):
        TrainConfig(curriculum="a.bin", steps=2)
    missing = TrainConfig(curriculum=f"{tmp_path}/a.bin@2", steps=2, warmup_steps=0, out_dir=str(tmp_path / "runs"),
                          backend="cpu")
    with pytest.raises(FileNotFoundError, match="data.curriculum stage 1: token file .*a.bin' does not exist"):
        train(missing, **QUIET)
    assert os.listdir(tmp_path / "runs") == []


# -- end to end: Nano files -> convert -> import -> train with a curriculum -> resume --------------

SEQ = 8


def write_nano_lines(path, lines):
    path.write_text("".join(base64.b64encode(pickle.dumps(line)).decode() + "\n" for line in lines))


@pytest.fixture
def nano_project(tmp_path):
    """A Nano setup in tmp_path: configs and four line files in Nano's own formats. Stage 1 (pretraining,
    [ids, None]) uses token ids 1-7, stage 2 (SFT, [ids, mask]) ids 9-15, so a batch tells its stage."""
    rng = np.random.default_rng(0)
    lines = lambda count, low, high: [rng.integers(low, high, SEQ + 1).tolist() for _ in range(count)]  # noqa: E731
    write_nano_lines(tmp_path / "pt_train.base64", [[ids, None] for ids in lines(24, 1, 8)])
    write_nano_lines(tmp_path / "pt_val.base64", [[ids, None] for ids in lines(6, 1, 8)])
    write_nano_lines(tmp_path / "sft_train.base64", [[ids, [0, 0] + [1] * (SEQ - 1)] for ids in lines(16, 9, 16)])
    write_nano_lines(tmp_path / "sft_val.base64", [[ids, [0, 0] + [1] * (SEQ - 1)] for ids in lines(3, 9, 16)])
    model = dict(block_size=SEQ, vocab_size=16, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, n_hidden=64,
                 dropout=0.0, use_rope=True, norm_eps=1e-5, is_causal=True)
    nano = dict(NANO_LORA, use_lora=False, from_checkpoint="", save_checkpoint_to=str(tmp_path / "runs"),
                dataset_path=[[str(tmp_path / f"{stage}_train.base64"), str(tmp_path / f"{stage}_val.base64")]
                              for stage in ("pt", "sft")],
                batch_size=4, learning_rate=1e-2, decay_lr=True, warmup_iters=2, lr_decay_iters=10, min_lr=1e-3,
                eval_interval=2, log_interval=1, eval_iters=0, device="cpu")
    (tmp_path / "model.json").write_text(json.dumps(model))
    (tmp_path / "train.json").write_text(json.dumps(nano))
    return tmp_path


def convert_with_cli(project, *extra):
    return CliRunner().invoke(cli, ["convert", "nano-config", str(project / "model.json"),
                                    str(project / "train.json"), "-o", str(project / "nanoq.toml"),
                                    "--data-dir", str(project / "data"), *extra])


def test_cli_writes_the_config_warns_and_refuses_to_overwrite(nano_project):
    result = convert_with_cli(nano_project)
    assert result.exit_code == 0, result.output
    assert "warning: not mapped: train.tokenizer_path" in result.stderr
    assert "mapped with a caveat" not in result.stderr
    assert f"nanoq tokenize --format nano {nano_project}/pt_train.base64 -o {nano_project}/data/pt_train " \
           f"--vocab-size 16" in result.stdout
    config = load_config(nano_project / "nanoq.toml")
    assert config.steps == 6 + 4 and config.backend == "cpu" and config.dtype == "fp32"  # 24 and 16 lines / 4
    again = convert_with_cli(nano_project)
    assert again.exit_code == 1 and "already exists; choose another output or pass --force" in again.output
    assert convert_with_cli(nano_project, "--force", "--stage-steps", "3,2").exit_code == 0
    assert load_config(nano_project / "nanoq.toml").steps == 5
    bad = convert_with_cli(nano_project, "--force", "--stage-steps", "3,x")
    assert bad.exit_code == 2 and "expected comma-separated integers" in bad.output
    missing = CliRunner().invoke(cli, ["convert", "nano-config", "nope.json", "nope.json", "-o", "x.toml"])
    assert missing.exit_code == 1 and "Nano config nope.json does not exist" in missing.output


def test_cli_shows_the_caveats_of_what_it_mapped(nano_project):
    model = json.loads((nano_project / "model.json").read_text())
    (nano_project / "model.json").write_text(json.dumps(dict(model, dropout=0.1)))
    result = convert_with_cli(nano_project)
    assert result.exit_code == 0, result.output
    caveat = ("model.dropout = 0.1: nanoq drops the embedding and the two block outputs, as Nano does; Nano's "
              "attention also drops attention probabilities, nanoq's does not")
    assert f"warning: mapped with a caveat: {caveat}\n" in result.stderr
    assert "(1 with a caveat)" in result.stdout
    assert f"# Mapped with a caveat:\n#   {caveat}\n" in (nano_project / "nanoq.toml").read_text()


@pytest.fixture
def batch_stages(monkeypatch):
    """The stage (1 or 2) of every batch the trainer gets, in order."""
    stages = []
    step = Trainer.step

    def recording_step(self, inputs, targets):
        low, high = int(inputs.min()), int(inputs.max())
        assert high < 8 or low > 8, "a batch mixes the two stages"
        stages.append(1 if high < 8 else 2)
        return step(self, inputs, targets)

    monkeypatch.setattr(Trainer, "step", recording_step)
    return stages


def converted_run(project, **overrides):
    result = convert_with_cli(project, "--import-data")
    assert result.exit_code == 0, result.output
    assert "imported" in result.stdout and os.path.isfile(project / "data" / "sft_val" / "train_000000.bin")
    config = load_config(project / "nanoq.toml", {"threads": 1, **overrides})
    return dataclasses.replace(config, run_name="nano")


def test_two_stage_curriculum_switches_data_and_eval_at_the_stage_boundary(nano_project, batch_stages):
    config = converted_run(nano_project)
    assert [stage.steps for stage in parse_curriculum(config.curriculum)] == [6, 4]
    lines = []
    result = train(config, say=lines.append, progress=False)
    assert batch_stages == [1] * 6 + [2] * 4
    # Eval after a stage's last step still uses its eval set (6 windows), then stage 2's (3 windows).
    records = [r for r in read_log(result.log_path) if r["type"] == "eval"]
    evals = {r["step"]: r["tokens"] for r in records}
    assert evals == {0: 6 * SEQ, 2: 6 * SEQ, 4: 6 * SEQ, 6: 6 * SEQ, 8: 3 * (SEQ - 1), 10: 3 * (SEQ - 1)}
    assert np.isfinite(result.final_eval_loss)
    # The summary compares evaluations on one eval set: stage 2's first (step 8) with the last.
    (summary,) = [line for line in lines if line.startswith("done in ")]
    losses = {r["step"]: r["loss"] for r in records}
    assert summary.endswith(f", eval loss {losses[8]:.4f} (step 8) -> {losses[10]:.4f} (step 10)"), summary


def test_resume_in_the_second_stage_continues_exactly(nano_project, batch_stages):
    config = converted_run(nano_project, keep_last=10)
    straight = train(config, **QUIET)
    assert batch_stages == [1] * 6 + [2] * 4
    # Interrupted after step 8 (stage 2, 2 of its 4 steps done): the later checkpoints and the model never existed.
    run_dir = os.path.join(config.out_dir, "resumed")
    shutil.copytree(straight.run_dir, run_dir)
    checkpoints = os.path.join(run_dir, "checkpoints")
    for step in list_checkpoints(checkpoints):
        if step > 8:
            shutil.rmtree(os.path.join(checkpoints, step_dir_name(step)))
    shutil.rmtree(os.path.join(run_dir, "model"))
    batch_stages.clear()
    resumed = train(dataclasses.replace(config, run_name="resumed"), resume="auto", **QUIET)
    assert resumed.resumed_from.endswith(step_dir_name(8))
    assert batch_stages == [2, 2]
    logs = [read_log(result.log_path) for result in (straight, resumed)]
    assert [r["loss"] for r in logs[1] if r["type"] == "train"][-2:] == \
           [r["loss"] for r in logs[0] if r["type"] == "train"][-2:]
    assert resumed.final_eval_loss == straight.final_eval_loss
    with open(os.path.join(straight.model_dir, "model.safetensors"), "rb") as a, \
            open(os.path.join(resumed.model_dir, "model.safetensors"), "rb") as b:
        assert a.read() == b.read()
    with pytest.raises(ValueError, match="data.curriculum"):
        changed = config.curriculum.replace("@6", "@5").replace("@4", "@5")
        train(dataclasses.replace(config, run_name="resumed", curriculum=changed), resume="auto", **QUIET)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(model_changes=st.dictionaries(st.sampled_from(MODEL_KEYS) | st.text(max_size=6), json_values, max_size=3),
       train_changes=st.dictionaries(st.sampled_from(TRAIN_KEYS), json_values, max_size=3))
def test_fuzz_any_nano_values_give_a_loadable_config_or_a_value_error(tmp_path_factory, model_changes,
                                                                       train_changes):
    """Whatever the keys and JSON values: a TOML that load_config reads back, or ValueError/TypeError."""
    try:
        conversion = convert_nano_config({**NANO_MODEL, **model_changes},
                                         {**NANO_LORA, "dataset_path": [["a\nb", "b"]], **train_changes},
                                         stage_steps=[10])
    except (ValueError, TypeError):
        return
    path = tmp_path_factory.getbasetemp() / "fuzz-nano.toml"
    write_nano_toml(conversion, path, force=True)
    assert load_config(path) == in_folder(conversion.config, path.parent)


# -- Nano's model options ----------------------------------------------------------------------

# Nano's shipped model shape, scaled down (same heads ratio, GQA, SwiGLU width ratio).
SMALL_NANO_MODEL = dict(NANO_MODEL, block_size=16, vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_kv_head=2,
                        n_hidden=88)


@pytest.mark.parametrize("option,expected", [
    (dict(use_rope=False), dict(position_embedding="learned", max_position_embeddings=16)),
    (dict(bias=True), dict(qkv_bias=True, o_bias=True, mlp_bias=True)),
    (dict(dropout=0.1), dict(dropout=0.1)),
    (dict(use_rope=False, bias=True, dropout=0.2), dict(position_embedding="learned", mlp_bias=True, dropout=0.2)),
])
def test_a_nano_model_of_each_kind_converts_and_trains(option, expected):
    from nanoq.nano_config import nano_model_config

    config = nano_model_config(dict(SMALL_NANO_MODEL, **option))
    assert {name: getattr(config, name) for name in expected} == expected
    assert (config.num_key_value_heads, config.intermediate_size, config.tie_word_embeddings) == (2, 88, True)
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, 64, size=(2, 16), dtype=np.int32)
    targets = np.roll(inputs, -1, axis=1)
    with Trainer(config, nanoq.TrainOptions(backend="cpu", batch_size=2, seq_len=16, seed=1)) as trainer:
        trainer.init_weights(0)
        losses = []
        for _ in range(6):
            trainer.step(inputs, targets)
            losses.append(trainer.update(lr=1e-2).loss)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1


def test_a_bidirectional_nano_model_is_a_non_causal_model():
    from nanoq.nano_config import nano_model_config

    assert nano_model_config(dict(SMALL_NANO_MODEL, is_causal=False)).causal is False
    assert nano_model_config(SMALL_NANO_MODEL).causal is True


def test_nano_model_options_map_to_model_settings():
    model = dict(NANO_MODEL, use_rope=False, bias=True, is_causal=False, dropout=0.1)
    conversion = convert_nano_config(model, nano_train(dropout=0.1), stage_steps=[10])
    config = conversion.config
    assert (config.position_embedding, config.linear_bias, config.causal, config.dropout) == ("learned", True,
                                                                                              False, 0.1)
    # Nano trains a non-causal model on its same-length seq2seq task.
    assert config.objective == "seq2seq"
    assert {"model.use_rope", "model.bias", "model.is_causal", "model.dropout"} <= set(conversion.mapped)
    assert not [entry for entry in conversion.unmapped if entry.startswith("model.")]
    # Mapped, with a caveat saying what it does not reproduce: Nano's attention-probability dropout.
    assert conversion.mapped["model.dropout"] == "model.dropout = 0.1"
    assert conversion.caveats == [
        "model.dropout = 0.1: nanoq drops the embedding and the two block outputs, as Nano does; Nano's attention "
        "also drops attention probabilities, nanoq's does not"]
    assert "train.dropout" in conversion.mapped  # the model's dropout is the one Nano applies
