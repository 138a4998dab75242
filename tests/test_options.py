"""The training options are defined once, in the core (cuda_core/include/nanoq/options.h).

These tests pin that every rule and limit of the core's schema fires with its message from Python, before a
Trainer exists; that the core itself refuses the same options when Python is bypassed; and that every choice
list Python, the TOML settings and the CLI show is the core's (so they cannot drift apart).
"""
import dataclasses
import os
import re

import numpy as np
import pytest
from click.testing import CliRunner

import nanoq
from nanoq import _core
from nanoq import options as schema
from nanoq.backends import BACKENDS
from nanoq.trainer_config import DTYPES, OFFLOAD, RECOMPUTE, STATE_DTYPES
from nanoq.lora import MODULES, TARGETS, LoraConfig, parse_targets
from nanoq.training.settings import TrainConfig, settings
from nanoq_cli.main import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config():
    return nanoq.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4)


# TrainOptions keyword arguments that break each rule of the schema (and keep every limit).
BREAKS = {
    "offload_gradients_needs_zero_stage_2": dict(backend="cpu", offload="gradients", zero_stage=1),
    "lora_needs_zero_stage_1": dict(backend="cpu", devices=2, zero_stage=2, lora=LoraConfig(rank=4)),
    "lora_needs_targets": None,  # LoraConfig refuses empty targets itself: see the test below
    "cpu_computes_in_fp32": dict(backend="cpu", master_dtype="bf16"),
    "world_holds_the_devices": dict(backend="cpu", devices=2, world_size=1),
    "devices_fit_in_the_world": dict(backend="cpu", devices=2, world_size=2, first_rank=1, comm_id=b"x"),
    "world_needs_comm_id": dict(backend="cpu", world_size=2),
    "cudnn_attention_needs_cuda": dict(backend="cpu", attention="cudnn"),
    "fp8_matmuls_need_cuda_and_bf16": dict(backend="cpu", matmul_dtype="fp8"),
    "inference_keeps_weights_only": dict(backend="cpu", inference=True, zero_stage=2),
}


def test_every_rule_of_the_core_has_a_case_here():
    assert set(BREAKS) == {rule["name"] for rule in schema.rules()}


@pytest.mark.parametrize("rule", [rule for rule in schema.rules() if BREAKS[rule["name"]]], ids=lambda r: r["name"])
def test_each_rule_fires_with_its_message_from_python(rule):
    with pytest.raises(ValueError) as caught:
        nanoq.TrainOptions(**BREAKS[rule["name"]])
    assert str(caught.value) == rule["message"]


def test_empty_lora_targets_fire_the_core_rule():
    message = schema.rule_message("lora_needs_targets")
    for make in (lambda: LoraConfig(rank=2, targets=" , "), lambda: parse_targets(""),
                 lambda: schema.check(dict(lora=dict(rank=2, alpha=1.0, dropout=0.0, targets=())))):
        with pytest.raises(ValueError) as caught:
            make()
        assert str(caught.value) == message


# The same, as the core's option dicts (what CoreTrainer takes once Python has resolved everything).
CORE_BREAKS = {
    "offload_gradients_needs_zero_stage_2": dict(offload=("gradients",), zero_stage=1),
    "lora_needs_zero_stage_1": dict(devices=2, zero_stage=2, lora=dict(rank=4, alpha=16.0, dropout=0.0,
                                                                       targets=("q",))),
    "lora_needs_targets": dict(lora=dict(rank=4, alpha=16.0, dropout=0.0, targets=())),
    "cpu_computes_in_fp32": dict(master_dtype="bf16"),
    "world_holds_the_devices": dict(devices=2, world_size=1),
    "devices_fit_in_the_world": dict(devices=2, world_size=2, first_rank=1, comm_id=b"x"),
    "world_needs_comm_id": dict(world_size=2),
    "cudnn_attention_needs_cuda": dict(attention="cudnn"),
    "fp8_matmuls_need_cuda_and_bf16": dict(matmul_dtype="fp8"),
    "inference_keeps_weights_only": dict(inference=True, offload=("optimizer",)),
}


@pytest.mark.parametrize("rule", schema.rules(), ids=lambda r: r["name"])
def test_the_core_refuses_what_breaks_a_rule_when_python_is_bypassed(rule):
    # Python's checks skipped: the options reach CoreTrainer, and the core's validate_options refuses them.
    options = dict(dataclasses.asdict(nanoq.TrainOptions(backend="cpu", seq_len=8)), dtype="fp32")
    options.update(CORE_BREAKS[rule["name"]])
    with pytest.raises(ValueError) as caught:
        _core.CoreTrainer(tiny_config().to_core(), options)
    assert str(caught.value) == rule["message"]


def test_the_core_refuses_a_value_past_a_limit_when_python_is_bypassed():
    options = dict(dataclasses.asdict(nanoq.TrainOptions(backend="cpu", seq_len=8)), dtype="fp32", zero_stage=4)
    with pytest.raises(ValueError, match=re.escape("zero_stage must be 1, 2 or 3, got 4")):
        _core.CoreTrainer(tiny_config().to_core(), options)


def test_limits_are_written_as_numbers_are():
    # Whole numbers whole: "[1, 2147483647]", not "[1, 2.14748e+09]" (C++ streams' six digits).
    with pytest.raises(ValueError, match=re.escape("seq_len must be an integer in [1, 2147483647], got -3")):
        nanoq.TrainOptions(backend="cpu", seq_len=-3)
    with pytest.raises(ValueError, match=r"lora_dropout must be .*\[0, 1\)"):
        schema.check(_options_with("lora_dropout", 1.0))


def _outside(spec, limit, is_minimum):
    """(a value just past ``limit``, the limit itself if it is allowed, else None)."""
    integer = spec["kind"] == "integer"
    step = 1 if integer else 1e-3
    value = int(limit["value"]) if integer else limit["value"]
    if not limit["inclusive"]:
        return value, None
    return (value - step if is_minimum else value + step), value


def _options_with(name, value):
    if name.startswith("lora_"):
        fields = dict(rank=4, alpha=16.0, dropout=0.0, targets=("q",))
        fields[name[len("lora_"):]] = value
        return dict(lora=fields)
    return {name: value}


NUMERIC = [spec for spec in _core.option_schema()["options"] if spec["kind"] in ("integer", "number")]


@pytest.mark.parametrize("spec", NUMERIC, ids=lambda s: s["name"])
def test_each_limit_fires_with_its_name_from_python_and_its_bounds_are_allowed(spec):
    for limit, is_minimum in ((spec["minimum"], True), (spec["maximum"], False)):
        if limit is None:
            continue
        bad, edge = _outside(spec, limit, is_minimum)
        kwargs = _options_with(spec["name"], bad)
        with pytest.raises(ValueError, match=re.escape(spec["name"])):
            schema.check(kwargs)
        if spec["name"] != "lora_rank":  # LoraConfig takes rank >= 1: rank 0 is lora=None
            with pytest.raises(ValueError, match=spec["name"].replace("lora_", "")):
                if "lora" in kwargs:
                    LoraConfig(**kwargs["lora"])
                else:
                    nanoq.TrainOptions(backend="cpu", **kwargs)
        if edge is not None:
            schema.check(_options_with(spec["name"], edge))


def test_lora_dropout_has_one_limit_everywhere():
    # The TOML setting once stopped at 0.99 while LoraConfig and the core took anything below 1.
    assert TrainConfig(lora_rank=4, lora_dropout=0.995).lora_dropout == 0.995
    assert LoraConfig(rank=4, dropout=0.995).dropout == 0.995
    schema.check(dict(lora=dict(rank=4, alpha=16.0, dropout=0.995, targets=("q",))))
    for refuse in (lambda: TrainConfig(lora_rank=4, lora_dropout=1.0), lambda: LoraConfig(rank=4, dropout=1.0),
                   lambda: schema.check(dict(lora=dict(rank=4, alpha=16.0, dropout=1.0, targets=("q",))))):
        with pytest.raises(ValueError, match="lora_dropout"):
            refuse()
    item = next(item for item in settings() if item.name == "lora_dropout")
    assert (item.minimum, item.below, item.maximum) == (0, 1, None)


def test_every_toml_limit_of_a_core_option_is_the_core_s():
    for item in settings():
        if item.name not in schema.names():
            continue
        low, high = schema.limits(item.name)
        assert (item.minimum, item.above) == ((low["value"], None) if low and low["inclusive"] else
                                              (None, low["value"]) if low else (None, None)), item.name
        assert (item.maximum, item.below) == ((high["value"], None) if high and high["inclusive"] else
                                              (None, high["value"]) if high else (None, None)), item.name


def test_python_choice_lists_equal_the_core_schema():
    core = {spec["name"]: tuple(c["name"] for c in spec["choices"]) for spec in _core.option_schema()["options"]}
    assert BACKENDS == core["backend"] == ("cpu", "cuda", "cuda_emulated")
    assert nanoq.trainer_config.BACKENDS == ("auto",) + core["backend"]
    assert DTYPES == ("auto",) + core["dtype"] and STATE_DTYPES == core["master_dtype"] == core["optimizer_dtype"]
    assert RECOMPUTE == core["recompute"] and OFFLOAD == core["offload"]
    assert TARGETS == core["lora_targets"] == tuple(MODULES)
    toml = {item.name: item for item in settings()}
    assert toml["backend"].choices == nanoq.trainer_config.BACKENDS
    assert toml["dtype"].choices == DTYPES
    assert toml["master_dtype"].choices == toml["optimizer_dtype"].choices == core["master_dtype"]
    for name in ("recompute", "offload"):  # comma-separated in TOML: the help lists them, each with its meaning
        assert all(f"{choice} = " in toml[name].help for choice in core[name]), name
    assert ", ".join(core["lora_targets"]) in toml["lora_targets"].help
    assert core["attention"] == ("auto", "cudnn", "native") == toml["attention"].choices
    assert core["matmul_dtype"] == ("auto", "fp8") == toml["matmul_dtype"].choices
    # What the core accepts is what the schema lists: each name alone, and nothing else.
    for name in ("recompute", "offload", "lora_targets"):
        for choice in core[name]:
            assert _core.set_option_names(name, [choice]) == (choice,)
        with pytest.raises(ValueError, match=f"choose from {', '.join(core[name])}"):
            _core.set_option_names(name, ["nonsense"])


def test_set_options_come_back_in_the_core_s_order_without_duplicates():
    assert nanoq.TrainOptions(recompute="block, ffn,ffn").recompute == ("ffn", "block")
    assert nanoq.TrainOptions(offload=["master", "optimizer"]).offload == ("optimizer", "master")
    assert LoraConfig(rank=2, targets="down,q_proj,q").targets == ("q", "down")


def test_recompute_implications_are_what_the_core_allocates():
    # The schema says block implies norms, qkv and ffn, and ffn implies swiglu; the core's trainer must
    # allocate the same activations for a choice as for the choice plus everything it implies.
    def closure(names):
        out = set(names)
        while True:
            more = {implied for name in out for implied in schema.implied("recompute").get(name, ())}
            if more <= out:
                return out
            out |= more

    assert schema.implied("recompute") == {"ffn": ("swiglu",), "block": ("norms", "qkv", "ffn")}

    def activations(recompute):
        options = nanoq.TrainOptions(backend="cpu", seq_len=8, batch_size=2, threads=1, recompute=recompute)
        with nanoq.Trainer(tiny_config(), options) as trainer:
            return sorted((a["name"], a["bytes"]) for a in trainer.get_allocations(0)
                          if a["context"] == "activations")

    for choice in ("ffn", "block"):
        assert activations((choice,)) == activations(tuple(closure([choice]))), choice
    assert activations(("block",)) != activations(("ffn",)) != activations(())


def test_undecided_options_skip_their_rules_until_decided():
    # backend "auto" may become cuda, where bf16 is fine: the cpu rule waits for the Trainer.
    options = nanoq.TrainOptions(backend="auto", dtype="bf16")
    with pytest.raises(ValueError, match=re.escape(schema.rule_message("cpu_computes_in_fp32"))):
        schema.check(dataclasses.replace(options, backend="cpu").core_fields())
    schema.check(options.core_fields(), undecided=("backend", "dtype"))


def test_bad_names_are_refused_by_the_core_s_conversion():
    with pytest.raises(ValueError, match="unknown offload option 'activations'; choose from optimizer, master"):
        _core.check_options(dict(offload=("activations",)))
    with pytest.raises(ValueError, match='optimizer_dtype must be "fp32" or "bf16", got "fp16"'):
        _core.check_options(dict(optimizer_dtype="fp16"))
    with pytest.raises(ValueError, match="unknown training option 'recompue'"):
        _core.check_options(dict(recompue=()))
    with pytest.raises(TypeError, match="tuple of strings"):
        _core.check_options(dict(recompute="ffn"))
    with pytest.raises(ValueError, match='attention must be "auto", "cudnn" or "native", got "flash"'):
        _core.check_options(dict(attention="flash"))
    with pytest.raises(ValueError, match='matmul_dtype must be "auto" or "fp8", got "fp16"'):
        _core.check_options(dict(matmul_dtype="fp16"))
    with pytest.raises(ValueError, match='attention must be "auto", "cudnn" or "native", got "flash"'):
        nanoq.TrainOptions(attention="flash")
    with pytest.raises(TypeError, match="cuda_graphs must be True or False"):
        nanoq.TrainOptions(cuda_graphs=1)


def test_the_fast_path_options_reach_the_core_and_the_toml_settings():
    # Every TrainConfig setting of the fast path becomes the TrainOptions field of the same name.
    from nanoq.training.settings import train_options
    config = TrainConfig(attention="native", cuda_graphs=False, matmul_dtype="auto")
    options = train_options(config)
    assert (options.attention, options.cuda_graphs, options.matmul_dtype) == ("native", False, "auto")
    assert _core.option_schema()["options"][[s["name"] for s in _core.option_schema()["options"]].index(
        "cuda_graphs")]["kind"] == "flag"
    schema.check(dict(attention="cudnn", backend="cuda_emulated", cuda_graphs=False))
    schema.check(dict(matmul_dtype="fp8", backend="cuda_emulated", dtype="bf16"))
    with pytest.raises(ValueError, match=re.escape(schema.rule_message("fp8_matmuls_need_cuda_and_bf16"))):
        schema.check(dict(matmul_dtype="fp8", backend="cuda_emulated", dtype="fp32"))


def test_readme_lists_the_core_s_rules():
    readme = open(os.path.join(REPO, "README.md")).read()
    assert schema.rules_markdown() in readme, "README's rules table is stale: paste nanoq.options.rules_markdown()"


def test_cli_help_shows_the_core_s_choices_and_rules():
    text = " ".join(CliRunner().invoke(cli, ["train", "--help"], terminal_width=400).output.split())
    for rule in schema.rules():
        assert rule["message"] in text
    for name in ("recompute", "offload"):  # each choice with the core's help of it
        for choice in schema.option(name)["choices"]:
            assert f"{choice['name']} = {choice['help']}" in text, (name, choice["name"])
    assert ", ".join(schema.choices("lora_targets")) in text
    flags = {param.name: param for param in cli.commands["train"].params}
    assert tuple(flags["backend"].type.choices) == nanoq.trainer_config.BACKENDS
    assert tuple(flags["dtype"].type.choices) == DTYPES
    assert tuple(flags["master_dtype"].type.choices) == STATE_DTYPES


def test_toml_settings_that_break_a_core_rule_are_refused_before_a_run_directory_exists(tmp_path):
    with pytest.raises(ValueError, match=re.escape(schema.rule_message("offload_gradients_needs_zero_stage_2"))):
        TrainConfig(offload="gradients", zero_stage=1)
    with pytest.raises(ValueError, match="unknown recompute option 'attention'"):
        TrainConfig(recompute="ffn,attention")
    with pytest.raises(ValueError, match=re.escape(schema.rule_message("lora_needs_zero_stage_1"))):
        TrainConfig(lora_rank=4, devices=2, zero_stage=3)
    assert TrainConfig(lora_rank=0, lora_targets="").lora_targets == ""  # no LoRA: its targets are not read
    out = tmp_path / "runs"
    result = CliRunner().invoke(cli, ["train", "--offload", "gradients", "--out_dir", str(out)])
    assert result.exit_code != 0
    assert schema.rule_message("offload_gradients_needs_zero_stage_2") in " ".join(result.output.split())
    assert not out.exists()


def test_numpy_scalars_are_taken_as_the_python_numbers_they_hold():
    # `vocab_size=tokens.max() + 1` is a numpy integer; before, it was refused as "not a positive integer".
    import json

    config = nanoq.ModelConfig(vocab_size=np.int64(96), hidden_size=np.int32(32), intermediate_size=64,
                               num_hidden_layers=np.uint8(2), num_attention_heads=4, rope_theta=np.float32(1e4),
                               dropout=np.float32(0.5))
    options = nanoq.TrainOptions(backend="cpu", batch_size=np.int64(2), seq_len=np.int32(16), seed=np.uint64(7),
                                 z_loss=np.float64(1e-4))
    for holder, names in ((config, ("vocab_size", "hidden_size", "num_hidden_layers")),
                          (options, ("batch_size", "seq_len", "seed"))):
        assert all(type(getattr(holder, name)) is int for name in names)
    assert type(config.rope_theta) is float and type(config.dropout) is float and type(options.z_loss) is float
    json.dumps(config.to_core()), json.dumps(dataclasses.asdict(options) | {"comm_id": None})  # JSON-ready
    with nanoq.Trainer(config, options) as trainer:
        assert trainer.options.batch_size == 2
    for bad in (np.float64(96.0), np.bool_(True), 96.0):
        with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
            nanoq.ModelConfig(vocab_size=bad, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4)
    with pytest.raises(ValueError, match="batch_size must be an integer"):
        nanoq.TrainOptions(batch_size=np.float32(2))
