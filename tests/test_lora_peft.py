"""LoRA adapters (nanoq.lora) against the real PEFT: what nanoq writes, PEFT
loads and computes with as nanoq's merge says; what PEFT saves, nanoq reads.
"""
import json
import os

import numpy as np
import peft
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import nanoq
from conftest import TINY
from nanoq.lora import (
    LoraConfig,
    adapter_shapes,
    init_adapters,
    merge,
    parse_targets,
    read_peft_adapter,
    split_adapters,
    write_peft_adapter,
)

CONFIG = nanoq.ModelConfig(**TINY)


def hf_model(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def numpy_weights(model):
    return {name: tensor.detach().numpy().copy() for name, tensor in model.state_dict().items()}


def random_adapters(lora, seed=0):
    """init_adapters with B made nonzero, so that the adapters change the output."""
    adapters = init_adapters(CONFIG, lora, seed)
    rng = np.random.default_rng(seed + 1)
    for name, array in adapters.items():
        if name.endswith("lora_B.weight"):
            adapters[name] = rng.normal(0, 0.2, array.shape).astype(np.float32)
    return adapters


def peft_adapters(model):
    """{nanoq name: array} of a PeftModel's ("default") adapters."""
    prefix = "base_model.model."
    return {name[len(prefix):].replace(".default.", "."): tensor.detach().float().numpy()
            for name, tensor in model.state_dict().items() if ".lora_" in name}


TOKENS = torch.tensor(np.random.default_rng(3).integers(0, TINY["vocab_size"], (2, 12)))


def test_adapter_shapes_follow_the_model_and_canonical_order():
    lora = LoraConfig(rank=4, targets="down, v,q")
    shapes = adapter_shapes(CONFIG, lora)
    assert list(shapes)[:6] == [
        "model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.0.self_attn.q_proj.lora_B.weight",
        "model.layers.0.self_attn.v_proj.lora_A.weight", "model.layers.0.self_attn.v_proj.lora_B.weight",
        "model.layers.0.mlp.down_proj.lora_A.weight", "model.layers.0.mlp.down_proj.lora_B.weight"]
    assert len(shapes) == 2 * 3 * TINY["num_hidden_layers"]
    assert shapes["model.layers.1.self_attn.q_proj.lora_B.weight"] == (32, 4)
    assert shapes["model.layers.1.self_attn.v_proj.lora_B.weight"] == (16, 4)  # 2 kv heads of 8
    assert shapes["model.layers.1.mlp.down_proj.lora_A.weight"] == (4, 64)
    # The same shapes as PEFT gives the transformers model.
    model = peft.get_peft_model(hf_model(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    assert {name: tuple(a.shape) for name, a in peft_adapters(model).items()} == shapes


def test_init_adapters_is_peft_default_and_deterministic():
    lora = LoraConfig(rank=4, targets="all")
    adapters = init_adapters(CONFIG, lora, seed=7)
    assert list(adapters) == list(adapter_shapes(CONFIG, lora))
    for name, array in adapters.items():
        assert array.dtype == np.float32
        if name.endswith("lora_B.weight"):
            assert not array.any()
        else:
            bound = 1 / np.sqrt(array.shape[1])
            assert np.abs(array).max() <= bound and np.abs(array).max() > 0.9 * bound
    again = init_adapters(CONFIG, lora, seed=7)
    assert all(np.array_equal(adapters[n], again[n]) for n in adapters)
    other = init_adapters(CONFIG, lora, seed=8)
    assert not np.array_equal(adapters["model.layers.0.self_attn.q_proj.lora_A.weight"],
                              other["model.layers.0.self_attn.q_proj.lora_A.weight"])
    # PEFT's own A has the same bound (kaiming-uniform, a=sqrt(5)).
    model = peft.get_peft_model(hf_model(), peft.LoraConfig(r=4, target_modules=["down_proj"]))
    peft_a = model.state_dict()["base_model.model.model.layers.0.mlp.down_proj.lora_A.default.weight"]
    assert peft_a.abs().max() <= 1 / np.sqrt(64) and peft_a.abs().max() > 0.9 / np.sqrt(64)


def test_peft_loads_what_nanoq_writes_and_computes_the_merge(tmp_path):
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.1, targets="q,v,down")
    adapters = random_adapters(lora)
    directory = write_peft_adapter(tmp_path / "adapter", adapters, lora, base_model_name_or_path="tiny-llama")
    assert sorted(os.listdir(directory)) == ["adapter_config.json", "adapter_model.safetensors"]

    base = hf_model()
    base_weights = numpy_weights(base)
    model = peft.PeftModel.from_pretrained(base, directory).eval()
    assert model.peft_config["default"].r == 4 and model.peft_config["default"].lora_alpha == 8.0
    assert sorted(model.peft_config["default"].target_modules) == ["down_proj", "q_proj", "v_proj"]
    loaded = peft_adapters(model)
    assert loaded.keys() == adapters.keys()
    for name in adapters:
        np.testing.assert_array_equal(loaded[name], adapters[name])

    merged = merge(base_weights, adapters, lora)
    assert list(merged) == list(base_weights)
    reference = hf_model(seed=1)
    reference.load_state_dict({name: torch.from_numpy(array) for name, array in merged.items()})
    with torch.no_grad():
        logits = model(TOKENS).logits
        expected = reference(TOKENS).logits
        plain = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
        plain.load_state_dict({name: torch.from_numpy(array) for name, array in base_weights.items()})
        assert (plain(TOKENS).logits - logits).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)

    unloaded = numpy_weights(model.merge_and_unload())
    assert unloaded.keys() == merged.keys()
    for name in merged:
        np.testing.assert_allclose(unloaded[name], merged[name], atol=1e-6, rtol=1e-6)


def test_nanoq_reads_what_peft_saves(tmp_path):
    torch.manual_seed(0)
    model = peft.get_peft_model(hf_model(), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["up_proj", "k_proj", "q_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "fp32")
    lora, adapters = read_peft_adapter(tmp_path / "fp32", config=CONFIG)
    assert lora == LoraConfig(rank=4, alpha=8.0, dropout=0.05, targets=("q", "k", "up"))
    assert list(adapters) == list(adapter_shapes(CONFIG, lora))
    expected = peft_adapters(model)
    assert adapters.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(adapters[name], expected[name])
        assert adapters[name].dtype == np.float32

    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    lora16, adapters16 = read_peft_adapter(tmp_path / "bf16")
    assert lora16 == lora
    for name, tensor in peft_adapters(model).items():  # bf16 values, widened exactly
        np.testing.assert_array_equal(adapters16[name], tensor)


def test_a_regex_target_modules_is_read_from_the_tensors(tmp_path):
    model = peft.get_peft_model(hf_model(), peft.LoraConfig(r=2, target_modules=r".*\.(v_proj|gate_proj)"))
    model.save_pretrained(tmp_path)
    lora, adapters = read_peft_adapter(tmp_path, config=CONFIG)
    assert lora.targets == ("v", "gate") and lora.rank == 2 and lora.alpha == 8.0  # PEFT's default alpha
    assert adapters.keys() == peft_adapters(model).keys()


def test_write_then_read_round_trips_and_overwrite_is_explicit(tmp_path):
    lora = LoraConfig(rank=2, alpha=3.0, targets=("gate_proj", "o"))
    adapters = random_adapters(lora, seed=4)
    directory = tmp_path / "adapter"
    write_peft_adapter(directory, adapters, lora)
    read_lora, read = read_peft_adapter(directory, config=CONFIG)
    assert read_lora == lora
    assert list(read) == list(adapters)
    assert all(np.array_equal(read[n], adapters[n]) for n in adapters)
    with open(directory / "adapter_config.json") as f:
        written = json.load(f)
    assert written["target_modules"] == ["o_proj", "gate_proj"] and written["base_model_name_or_path"] is None

    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_peft_adapter(directory, init_adapters(CONFIG, lora, 0), lora)
    write_peft_adapter(directory, init_adapters(CONFIG, lora, 0), lora, overwrite=True)
    assert not read_peft_adapter(directory)[1]["model.layers.0.mlp.gate_proj.lora_B.weight"].any()
    (tmp_path / "empty").mkdir()
    write_peft_adapter(tmp_path / "empty", adapters, lora)
    assert sorted(os.listdir(tmp_path)) == ["adapter", "empty"]  # nothing partial left behind


def test_merge_is_w_plus_scale_b_a():
    lora = LoraConfig(rank=2, alpha=4.0, targets="v")  # scale 2
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    a = np.array([[1.0, -1.0], [3.0, 1.0]], np.float32)          # [rank, in]
    b = np.array([[1.0, 0.0], [0.5, 0.0], [0.0, 0.0]], np.float32)  # [out, rank]; B @ A = [[1, -1], [.5, -.5], [0, 0]]
    base = {"model.layers.0.self_attn.v_proj.weight": w, "model.layers.0.self_attn.q_proj.weight": w,
            "model.norm.weight": np.ones(2, np.float32)}
    adapters = {"model.layers.0.self_attn.v_proj.lora_A.weight": a,
                "model.layers.0.self_attn.v_proj.lora_B.weight": b}
    merged = merge(base, adapters, lora)
    np.testing.assert_array_equal(merged["model.layers.0.self_attn.v_proj.weight"],
                                  [[2.0, -1.0], [3.0, 2.0], [4.0, 5.0]])
    assert merged["model.layers.0.self_attn.q_proj.weight"] is w
    assert merged["model.norm.weight"] is base["model.norm.weight"]
    assert split_adapters({**base, **adapters}) == (base, adapters)

    with pytest.raises(ValueError, match="no LoRA adapters"):
        merge(base, {}, lora)
    with pytest.raises(ValueError, match="lacks 2 adapter tensor.*layers.0.self_attn.v_proj.lora_A"):
        merge(base, {n.replace("layers.0", "layers.1"): x for n, x in adapters.items()}, lora)
    with pytest.raises(ValueError, match="no adapter for model.layers.1.self_attn.v_proj.weight"):
        merge({**base, "model.layers.1.self_attn.v_proj.weight": w}, adapters, lora)
    with pytest.raises(ValueError, match="no weight in base"):
        merge({"model.norm.weight": base["model.norm.weight"]}, adapters, lora)
    with pytest.raises(ValueError, match=r"v_proj.weight has shape \[3, 3\]"):
        merge({"model.layers.0.self_attn.v_proj.weight": np.zeros((3, 3), np.float32)}, adapters, lora)
    with pytest.raises(ValueError, match="split_adapters"):
        merge({**base, **adapters}, adapters, lora)


def test_targets_and_config_are_validated():
    assert parse_targets(" q , k,v,o ") == ("q", "k", "v", "o")
    assert parse_targets("all") == ("q", "k", "v", "o", "gate", "up", "down")
    assert parse_targets(["down_proj", "q", "q_proj"]) == ("q", "down")
    with pytest.raises(ValueError, match=r"unknown LoRA target 'qkv'; choose from q, k, v, o, gate, up, down"):
        parse_targets("q,qkv")
    with pytest.raises(ValueError, match="no LoRA targets"):
        parse_targets(" , ")
    with pytest.raises(ValueError, match="lm_head"):
        LoraConfig(rank=4, targets=["lm_head"])
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="rank"):
            LoraConfig(rank=bad)
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            LoraConfig(rank=4, alpha=bad)
    for bad in (1, 1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="dropout"):
            LoraConfig(rank=4, dropout=bad)
    lora = LoraConfig(rank=8, alpha=16, targets="v,q")
    assert lora.targets == ("q", "v") and lora.scale == 2.0 and isinstance(lora.alpha, float)


@pytest.mark.parametrize("change, words", [
    (dict(peft_type="IA3"), "peft_type is 'IA3'"),
    (dict(use_rslora=True), "use_rslora"),
    (dict(use_dora=True), "use_dora"),
    (dict(fan_in_fan_out=True), "fan_in_fan_out"),
    (dict(layers_to_transform=[0]), "layers_to_transform"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
    (dict(alpha_pattern={"q_proj": 8}), "alpha_pattern"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(bias="all"), "bias"),
    (dict(target_modules=["q_proj", "lm_head"]), "target module 'lm_head'"),
    (dict(target_modules=["q_proj", "k_proj"]), "lacks 4 adapter tensor"),
    (dict(r=8), "expected \\[rank, in\\] with rank 8"),
    (dict(r=0), "rank"),
])
def test_unsupported_peft_adapters_are_refused(tmp_path, change, words):
    lora = LoraConfig(rank=4, targets="q")
    directory = write_peft_adapter(tmp_path / "adapter", init_adapters(CONFIG, lora, 0), lora)
    config_file = os.path.join(directory, "adapter_config.json")
    with open(config_file) as f:
        raw = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**raw, **change}, f)
    with pytest.raises(ValueError, match=words):
        read_peft_adapter(directory)


def test_missing_or_mismatched_adapter_files_are_refused(tmp_path):
    lora = LoraConfig(rank=4, targets="q")
    with pytest.raises(ValueError, match="holds no adapter_config.json"):
        read_peft_adapter(tmp_path)
    directory = write_peft_adapter(tmp_path / "adapter", init_adapters(CONFIG, lora, 0), lora)
    os.remove(os.path.join(directory, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="holds no adapter_model.safetensors"):
        read_peft_adapter(directory)

    deeper = nanoq.ModelConfig(**dict(TINY, num_hidden_layers=3))
    directory = write_peft_adapter(tmp_path / "two_layers", init_adapters(CONFIG, lora, 0), lora)
    with pytest.raises(ValueError, match=r"layers.2.self_attn.q_proj.lora_A.weight should have shape \[4, 32\]"):
        read_peft_adapter(directory, config=deeper)
    with pytest.raises(ValueError, match="not among the LoRA targets"):
        write_peft_adapter(tmp_path / "x", init_adapters(CONFIG, LoraConfig(rank=4, targets="q,k"), 0), lora)
