"""Writing trained weights as a Hugging Face model directory that transformers loads.

    model/config.json          LlamaForCausalLM config (transformers 4.x keys, which 5.x also reads)
    model/model.safetensors    float32 tensors under Hugging Face names
    model/tokenizer.json       (+ tokenizer_config.json) when the tokenizer is known
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Optional

import numpy as np

from nanoq.config import ModelConfig


def llama_config_dict(config: ModelConfig, max_position_embeddings: int, eos_token_id: Optional[int] = None) -> dict:
    """The ``config.json`` of a LlamaForCausalLM with ``config``'s shape.

    Only plain Llama shapes can be written (no q/k norm; attention biases on
    q, k, v and o together or not at all): ValueError otherwise.
    """
    if config.qk_norm or config.qkv_bias != config.o_bias:
        raise ValueError("only Llama-shaped models (no qk_norm; qkv_bias == o_bias) can be written as "
                         "LlamaForCausalLM")
    out = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        attention_bias=config.qkv_bias,
        mlp_bias=False,
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        torch_dtype="float32",
    )
    if eos_token_id is not None:
        out["eos_token_id"] = eos_token_id
    return out


def write_hf_model(directory: str | os.PathLike, weights: Dict[str, np.ndarray], config: ModelConfig,
                   max_position_embeddings: int, tokenizer_dir: Optional[str] = None,
                   eos_token_id: Optional[int] = None) -> str:
    """Writes ``directory`` (which must not exist) atomically: built under a
    temporary name and renamed when complete.

    weights: ``{Hugging Face name: float32 array}`` as ``Trainer.get_weights()``
    returns. tokenizer_dir: a directory whose tokenizer.json (and
    tokenizer_config.json) are copied in. Returns the directory.
    """
    from safetensors.numpy import save_file

    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory):
        raise FileExistsError(f"{directory} already exists; not overwriting it")
    partial = f"{directory}.partial-{os.getpid()}"
    os.makedirs(partial)
    try:
        with open(os.path.join(partial, "config.json"), "w", encoding="utf-8") as f:
            json.dump(llama_config_dict(config, max_position_embeddings, eos_token_id), f, indent=2)
            f.write("\n")
        tensors = {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in weights.items()}
        save_file(tensors, os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
        if tokenizer_dir is not None:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                if os.path.isfile(os.path.join(tokenizer_dir, name)):
                    shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(partial, name))
        os.replace(partial, directory)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return directory
