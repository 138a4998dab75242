"""The flat parameter layout (cuda_core/layout.cpp): q/k/v and gate/up lie
back to back, so that the packed projections see one [q; k; v] and one
[gate; up] matrix, while every parameter keeps its Hugging Face name.

That the import, export and checkpoint formats are unchanged by the order is
shown by their own tests (test_export.py, test_checkpoint.py, test_resume.py,
test_reference.py), which go by name.
"""

import pytest

import nanoq
from conftest import NANOQ_CONFIG, train_options


def layer_names(variant, layer=0):
    cfg = nanoq.ModelConfig(**NANOQ_CONFIG[variant])
    with nanoq.Trainer(cfg, train_options()) as tr:
        parameters = tr._core.parameters()
    prefix = f"model.layers.{layer}."
    return [name[len(prefix):] for name, *_ in parameters if name.startswith(prefix)], parameters, cfg


@pytest.mark.parametrize("variant", ["llama", "llama_attn_bias", "qwen3"])
def test_each_layer_keeps_qkv_and_gate_up_contiguous(variant):
    names, _, cfg = layer_names(variant)
    attn = [f"self_attn.{p}_proj.weight" for p in "qkv"]
    assert names[1:4] == attn
    after = 4
    if cfg.qkv_bias:
        assert names[4:7] == [f"self_attn.{p}_proj.bias" for p in "qkv"]
        after = 7
    assert names[after] == "self_attn.o_proj.weight"
    gate = names.index("mlp.gate_proj.weight")
    assert names[gate:gate + 3] == ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    assert names[0] == "input_layernorm.weight"
