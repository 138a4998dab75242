"""Writing weights as a Hugging Face model directory that transformers loads.

    config.json                    LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM
    model.safetensors              float32 tensors under Hugging Face names, or, above
    model-00001-of-0000N.safetensors   max_shard_bytes, shards and
    model.safetensors.index.json       {"metadata": {"total_size"}, "weight_map": {name: shard}}
    tokenizer.json, tokenizer_config.json, special_tokens_map.json   when a tokenizer is given

Which architecture a ModelConfig is: q/k norm makes it Qwen3; q/k/v biases
without an o bias make it Qwen2 (the one layout Qwen2 has); everything else is
Llama, whose ``attention_bias`` puts biases on q, k, v and o together (and
whose ``mlp_bias`` those on gate, up and down). A config none of them can
express (an o bias without q/k/v biases, MLP biases beside Qwen's attention,
a learned position table) is refused rather than written as something
transformers would load differently. Model dropout is a training setting:
the exported model is the same with or without it.

The config is written with transformers 4.x keys (``rope_theta``,
``rope_scaling``, ``torch_dtype``), which transformers 5.x also reads; the
directory appears only once it is complete (built under a temporary name, then
renamed).
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Dict, Optional

import numpy as np

from nanoq.agreement import on_root
from nanoq.trainer_config import ModelConfig
from nanoq.durable import new_directory, read_json_object, save_safetensors, write_json
from nanoq.hf_io import is_parameter, iter_weights, model_fingerprint
from nanoq.lora import LoraConfig, merge, split_adapters, write_peft_adapter

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# Copied from tokenizer_dir (an imported base's own folder, or nanoq tokenize's
# output): the tokenizer, its chat template (transformers 5 saves it apart
# from tokenizer_config.json) and the base's generation defaults.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
GENERATION_CONFIG = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class NotExportable(ValueError):
    """No Hugging Face class computes this model (the message says why)."""


def architecture(config: ModelConfig) -> str:
    """"LlamaForCausalLM", "Qwen2ForCausalLM" or "Qwen3ForCausalLM": the
    Hugging Face class that computes what ``config`` describes.
    NotExportable (a ValueError) if none does."""
    if not config.causal:
        raise NotExportable("a bidirectional model (causal False) has no Hugging Face causal-LM class to "
                            "export to; its checkpoints save, resume and run logits() as they are")
    if config.learned_positions:
        raise NotExportable("a model with learned position embeddings (position_embedding 'learned') has no Hugging "
                         "Face Llama/Qwen architecture: those classes only rotate q and k (RoPE) and would drop "
                         "the position table; such a model's checkpoints save, resume and generate in nanoq, but "
                         "do not export")
    if config.mlp_bias and (config.qk_norm or (config.qkv_bias and not config.o_bias)):
        raise NotExportable("mlp_bias is written as Llama's mlp_bias, but this config's attention is Qwen's "
                         f"(qk_norm={config.qk_norm}, qkv_bias={config.qkv_bias}, o_bias={config.o_bias}), whose "
                         "classes have no MLP biases; no Hugging Face architecture computes this model")
    if config.qk_norm:
        if config.qkv_bias != config.o_bias:
            raise NotExportable(f"qk_norm models are written as Qwen3ForCausalLM, whose attention_bias puts biases "
                             f"on q, k, v and o together; this config has qkv_bias={config.qkv_bias} and "
                             f"o_bias={config.o_bias}")
        return "Qwen3ForCausalLM"
    if config.qkv_bias and not config.o_bias:
        return "Qwen2ForCausalLM"
    if config.o_bias and not config.qkv_bias:
        raise NotExportable("o_bias without qkv_bias has no Hugging Face architecture (Llama's attention_bias "
                         "covers q, k, v and o together; Qwen2 has q/k/v biases only); set qkv_bias too, or "
                         "drop o_bias")
    return "LlamaForCausalLM"


def hf_config_dict(config: ModelConfig, max_position_embeddings: int, eos_token_id: Optional[int] = None,
                   bos_token_id: Optional[int] = None) -> dict:
    """The ``config.json`` (as a dict) of the architecture ``config`` describes
    (see ``architecture``). eos_token_id / bos_token_id None write null, so
    transformers does not assume the architecture's default ids."""
    arch = architecture(config)
    if isinstance(max_position_embeddings, bool) or not isinstance(max_position_embeddings, int) \
            or max_position_embeddings <= 0:
        raise ValueError(f"max_position_embeddings must be a positive integer, got {max_position_embeddings!r}")
    out = dict(
        architectures=[arch],
        model_type={"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[arch],
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
        rope_scaling=dict(config.rope_scaling) if config.rope_scaling is not None else None,
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        torch_dtype="float32",
        dtype="float32",
    )
    if arch == "LlamaForCausalLM":
        out.update(attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias)
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_hidden_layers)
        if arch == "Qwen3ForCausalLM":
            out["attention_bias"] = config.o_bias
    return out


def _shards(tensors: Dict[str, np.ndarray], max_shard_bytes: int) -> list[dict]:
    """Splits tensors, in order, into shards of at most max_shard_bytes
    (a bigger tensor gets a shard of its own), as transformers does."""
    shards, current, size = [], {}, 0
    for name, array in tensors.items():
        if current and size + array.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    if current:
        shards.append(current)
    return shards


def _tokenizer_eos_id(tokenizer_dir: str) -> Optional[int]:
    """The tokenizer's end-of-sequence id (see nanoq.tokenization.find_eos_id), or None."""
    from nanoq.tokenization import find_eos_id, load_tokenizer

    try:
        return find_eos_id(load_tokenizer(tokenizer_dir), source=tokenizer_dir)
    except ValueError:
        return None


def write_model(directory: str | os.PathLike, weights: Dict[str, np.ndarray], config: ModelConfig, *,
                max_position_embeddings: int, tokenizer_dir: str | os.PathLike | None = None,
                eos_token_id: Optional[int] = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                bos_token_id: Optional[int] = None, overwrite: bool = False,
                generation_config: str | os.PathLike | None = None) -> str:
    """Writes a Hugging Face model directory; returns its absolute path.

    weights: ``{Hugging Face name: array}`` as ``Trainer.get_weights()``
    returns, written as float32 (``lm_head.weight`` is left out of a tied
    model: transformers ties it to the embedding). Above max_shard_bytes of
    tensors, the weights are split into shards with an index file.
    tokenizer_dir: a directory whose tokenizer.json (required there),
    tokenizer_config.json, special_tokens_map.json, chat_template.jinja
    and generation_config.json (its ids made to agree with config.json's,
    see _generation_config) are copied in; ``generation_config``, a path,
    names the generation_config.json to carry when tokenizer_dir holds none
    (an imported base's).
    eos_token_id: None takes the tokenizer's, if it has one. bos_token_id:
    written as given (None: null).
    ``directory`` must not exist (FileExistsError), unless ``overwrite``: then
    an empty directory or a model directory (one holding a config.json) there
    is replaced, anything else is refused (FileExistsError). It appears,
    complete and fsynced, by a rename of ``<directory>.partial-<pid>`` (see
    nanoq.durable.new_directory).
    """
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be True or False, got {overwrite!r}")
    directory = os.path.abspath(os.fspath(directory))
    if overwrite and os.path.isdir(directory) and os.listdir(directory) \
            and not os.path.isfile(os.path.join(directory, "config.json")):
        raise FileExistsError(f"{directory} is not empty and holds no config.json: overwrite replaces only a "
                              f"model directory; choose another directory")
    if tokenizer_dir is not None:
        tokenizer_dir = os.fspath(tokenizer_dir)
        if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
            raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} holds no tokenizer.json")
        if eos_token_id is None:
            eos_token_id = _tokenizer_eos_id(tokenizer_dir)
    hf_config = hf_config_dict(config, max_position_embeddings, eos_token_id, bos_token_id)
    tensors = {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in weights.items()
               if not (name == "lm_head.weight" and config.tie_word_embeddings)}
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError("weights lack model.embed_tokens.weight: pass every parameter of the model "
                         "(Trainer.get_weights())")

    with new_directory(directory, overwrite=overwrite) as partial:
        write_json(os.path.join(partial, "config.json"), hf_config, sort_keys=True)
        shards = _shards(tensors, max_shard_bytes)
        if len(shards) == 1:
            save_safetensors(tensors, os.path.join(partial, SINGLE_FILE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for number, shard in enumerate(shards, start=1):
                file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
                save_safetensors(shard, os.path.join(partial, file), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, file))
            total = sum(array.nbytes for array in tensors.values())
            write_json(os.path.join(partial, INDEX_FILE), {"metadata": {"total_size": total},
                                                           "weight_map": weight_map}, sort_keys=True)
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(tokenizer_dir, name)):
                    shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(partial, name))
        if tokenizer_dir is not None and os.path.isfile(os.path.join(tokenizer_dir, GENERATION_CONFIG)):
            generation_config = os.path.join(tokenizer_dir, GENERATION_CONFIG)
        if generation_config is not None and os.path.isfile(generation_config):
            write_json(os.path.join(partial, GENERATION_CONFIG), _generation_config(generation_config, hf_config),
                       sort_keys=True)
    return os.path.abspath(os.fspath(directory))


def _generation_config(file: str, hf_config: dict) -> dict:
    """A base's generation_config.json made to agree with the exported
    config.json (generate() stops at its eos ids, not config.json's): its
    eos list stays when it holds config.json's eos (an instruct model's
    end-of-turn ids beside the EOS), else config.json's ids replace it."""
    def ids(value) -> set:
        return set(value) if isinstance(value, list) else {value}

    generation = read_json_object(file)
    eos, bos = hf_config.get("eos_token_id"), hf_config.get("bos_token_id")
    if eos is not None and not ids(eos) <= ids(generation.get("eos_token_id")):
        generation["eos_token_id"] = eos
    if bos is not None:
        generation["bos_token_id"] = bos
    return generation


def _model_dir(path) -> Optional[str]:
    """The Hugging Face model directory that ``path`` (what import_weights
    read: a directory, its model.safetensors or its index file) names; None
    for no path, or one that is not there any more."""
    if not path:
        return None
    if os.path.isdir(path):
        return path
    return os.path.dirname(path) if os.path.isfile(path) else None


def _from_base(base, tokenizer_dir, eos_token_id) -> tuple:
    """(tokenizer_dir, eos_token_id, bos_token_id, generation_config) of an
    export of weights imported from the Hugging Face model ``base`` (None:
    none): the caller's tokenizer_dir and eos_token_id where given, else the
    base's tokenizer files and config.json's eos_token_id (a list too); its
    bos_token_id; its generation_config.json (None without one), which
    write_model carries where tokenizer_dir holds none (an instruct model's
    end-of-turn ids, which a fine-tune on data tokenized elsewhere keeps).
    The base's ids come before a given tokenizer's eos (which
    ``write_model`` finds when there is none)."""
    base = _model_dir(base)
    if base is None:
        return tokenizer_dir, eos_token_id, None, None
    eos, bos = _special_ids(base)
    if tokenizer_dir is None and os.path.isfile(os.path.join(base, "tokenizer.json")):
        tokenizer_dir = base
    generation = os.path.join(base, GENERATION_CONFIG)
    return (tokenizer_dir, eos if eos_token_id is None else eos_token_id, bos,
            generation if os.path.isfile(generation) else None)


def _special_ids(model_dir: str) -> tuple:
    """(eos_token_id, bos_token_id) of a Hugging Face model directory's config.json (None where absent)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None, None
    return (hf.get("eos_token_id"), hf.get("bos_token_id")) if isinstance(hf, dict) else (None, None)


def export_model(trainer, directory: str | os.PathLike, *, max_position_embeddings: Optional[int] = None,
                 tokenizer_dir: str | os.PathLike | None = None, eos_token_id: Optional[int] = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, allow_non_finite: bool = False,
                 overwrite: bool = False) -> str:
    """Writes a ``nanoq.Trainer``'s current weights as a Hugging Face model
    directory (see ``write_model``, also for ``overwrite``); returns its
    absolute path. With LoRA
    the adapters are merged into the frozen weights (``nanoq.lora.merge``);
    ``export_adapter`` writes them unmerged. Collective in a world of
    several processes: every process calls it (the weights are gathered
    from all), process 0 writes, and every process returns the path once
    the directory is complete (or raises if writing failed).

    max_position_embeddings: default the config's (what an imported model
    declared), raised to the trainer's seq_len if that is longer; the seq_len
    for a model defined here. A model imported from a directory
    (``import_weights``) keeps what transformers needs of it: its
    config.json's eos_token_id (unless given) and bos_token_id, and its
    tokenizer files unless ``tokenizer_dir`` is given. Weights that hold a NaN
    or an infinity are refused (ValueError naming them) unless
    ``allow_non_finite``.
    """
    config = trainer.config
    architecture(config)  # refuses a model transformers cannot compute before gathering anything
    if max_position_embeddings is None:
        max_position_embeddings = max(config.max_position_embeddings or 0, trainer.options.seq_len)
    tokenizer_dir, eos_token_id, bos_token_id, generation = _from_base(trainer.base_model, tokenizer_dir,
                                                                       eos_token_id)
    weights = _finite(trainer.get_weights(), "the trainer", allow_non_finite, "export_model(..., "
                      "allow_non_finite=True)")

    def write() -> str:
        merged = merge(*split_adapters(weights), trainer.lora) if trainer.lora is not None else weights
        return write_model(directory, merged, config, max_position_embeddings=max_position_embeddings,
                           tokenizer_dir=tokenizer_dir, eos_token_id=eos_token_id, max_shard_bytes=max_shard_bytes,
                           bos_token_id=bos_token_id, overwrite=overwrite, generation_config=generation)

    return _written_by_root(trainer, write, f"exporting the model to {directory}")


def export_adapter(trainer, directory: str | os.PathLike, *, overwrite: bool = False) -> str:
    """Writes a LoRA trainer's adapters, unmerged, as a PEFT adapter directory
    (``adapter_config.json`` + ``adapter_model.safetensors``) that
    ``peft.PeftModel.from_pretrained`` loads onto the base model."""
    if trainer.lora is None:
        raise ValueError("this trainer has no LoRA adapters: use export_model")
    adapters = trainer.get_weights(trainable_only=True)
    return _written_by_root(trainer, lambda: write_peft_adapter(
        directory, adapters, trainer.lora, base_model_name_or_path=_model_dir(trainer.base_model) or "",
        overwrite=overwrite),
        f"exporting the adapters to {directory}")


def _written_by_root(trainer, write, action: str) -> str:
    """``write()``'s path: run here alone, or, for a trainer in a world of
    several processes (which all call this), on process 0 only, its path
    (or its failure) given to every process."""
    group = trainer.world_group
    if group is None or group.size == 1:
        return write()
    return on_root(group, write, action=action)


def _checkpoint_base(state: dict, base_model: str | os.PathLike | None) -> str:
    """The base model directory of a LoRA checkpoint: ``base_model`` if
    given, else the one the checkpoint recorded (which must still exist)."""
    base = os.fspath(base_model) if base_model is not None else state.get("base_model")
    if not base:
        raise ValueError(f"{state['path']}: the LoRA checkpoint records no base model; pass base_model "
                         f"(nanoq export --base-model)")
    if not os.path.exists(base):
        raise ValueError(f"{state['path']}: its base model {base} does not exist any more; pass base_model "
                         f"(nanoq export --base-model) with the model the adapters were trained on")
    return base


def export_checkpoint(checkpoint_path: str | os.PathLike, directory: str | os.PathLike, *,
                      max_position_embeddings: Optional[int] = None, tokenizer_dir: str | os.PathLike | None = None,
                      eos_token_id: Optional[int] = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      merge_adapters: bool = True, base_model: str | os.PathLike | None = None,
                      allow_non_finite: bool = False) -> str:
    """Writes the weights of a nanoq checkpoint (a step directory, or the
    newest valid step of a checkpoint root) as a Hugging Face model directory
    (see ``write_model``); returns its absolute path. No trainer is built.

    A LoRA checkpoint holds only adapters: with ``merge_adapters`` they are
    merged into its base model (``base_model``, default the one it
    recorded) and the result written as a full model; without, they are
    written as a PEFT adapter directory. Either way the base (when there)
    must be the model they were trained on (``_check_base``: ValueError). max_position_embeddings and
    tokenizer_dir default to what the checkpoint recorded; a recorded
    tokenizer directory that no longer holds a tokenizer.json is skipped
    with a warning. Weights imported from a Hugging Face model (the base
    the checkpoint recorded) keep its ids and tokenizer as ``export_model``
    says. Weights with a NaN or an infinity are refused
    (ValueError naming the tensors) unless ``allow_non_finite``.
    """
    from nanoq.checkpoint import read_state, read_weights, recorded_tokenizer_dir

    state = read_state(checkpoint_path)
    step_directory = state.get("path", checkpoint_path)  # weights of the very step whose state this is
    config = ModelConfig(**state["model_config"])
    architecture(config)
    lora = LoraConfig(**state["lora"]) if state.get("lora") else None
    if lora is None and base_model is not None:
        raise ValueError(f"{step_directory} is not a LoRA checkpoint: it holds every weight, so it takes no "
                         f"base model")
    if lora is not None and not merge_adapters:
        # The adapters need no base weights: a base that moved is only named (as recorded, with a warning).
        recorded = state.get("base_model")
        if base_model is None and recorded and not os.path.exists(recorded):
            warnings.warn(f"{step_directory}: its base model {recorded} is not there any more; the adapter's "
                          f"adapter_config.json names it as recorded (pass base_model, or nanoq export "
                          f"--base-model, to name its new place)", stacklevel=2)
            base_name = recorded
        else:
            base = _checkpoint_base(state, base_model)
            _check_base(base, state)  # the adapter names it: it must be the model they adapt
            base_name = _model_dir(base)
        return write_peft_adapter(directory, _finite(read_weights(step_directory), step_directory, allow_non_finite),
                                  lora, base_model_name_or_path=base_name)
    if max_position_embeddings is None:
        max_position_embeddings = state.get("max_position_embeddings")
        if max_position_embeddings is None:
            raise ValueError(f"{step_directory}: the checkpoint records no max_position_embeddings; "
                             f"pass max_position_embeddings (nanoq export --max-position-embeddings)")
    if tokenizer_dir is None and state.get("tokenizer_dir"):
        tokenizer_dir = recorded_tokenizer_dir(state)
        if tokenizer_dir is None:
            warnings.warn(f"the checkpoint's tokenizer directory {state['tokenizer_dir']} holds no tokenizer.json "
                          f"any more; exporting without a tokenizer (pass tokenizer_dir, or nanoq export "
                          f"--tokenizer, to include one)", stacklevel=2)
    weights = _finite(read_weights(step_directory), step_directory, allow_non_finite)
    base = state.get("base_model")  # the weights' origin (import_weights), for any checkpoint
    if lora is not None:
        base = _checkpoint_base(state, base_model)
        weights = merge(_base_weights(base, state), weights, lora)
    tokenizer_dir, eos_token_id, bos_token_id, generation = _from_base(base, tokenizer_dir, eos_token_id)
    return write_model(directory, weights, config,
                       max_position_embeddings=max_position_embeddings, tokenizer_dir=tokenizer_dir,
                       eos_token_id=eos_token_id, max_shard_bytes=max_shard_bytes, bos_token_id=bos_token_id,
                       generation_config=generation)


def _finite(weights: Dict[str, np.ndarray], source: str, allow_non_finite: bool,
            allow: str = "nanoq export --allow-non-finite") -> Dict[str, np.ndarray]:
    """``weights``, unless one holds a NaN or an infinity and that is not
    allowed (ValueError naming them, ``source`` and how to ``allow`` it)."""
    if not allow_non_finite:
        bad = [f"{name} ({int(np.count_nonzero(~np.isfinite(array)))} of {array.size})"
               for name, array in weights.items() if not np.isfinite(array).all()]
        if bad:
            earlier = "export an earlier checkpoint, or " if source != "the trainer" else ""
            raise ValueError(f"{source} has non-finite weights (NaN or infinity) in {', '.join(bad[:3])}"
                             f"{f' and {len(bad) - 3} more tensors' if len(bad) > 3 else ''}: {earlier}allow it "
                             f"({allow})")
    return weights


def _check_base(path: str, state: dict) -> None:
    """ValueError unless the Hugging Face model at ``path`` (what
    import_weights read: its directory, model.safetensors or index file) is
    the base the LoRA checkpoint of ``state`` was trained on: its
    architecture, and its weights by the fingerprint the checkpoint recorded
    (nanoq.hf_io.model_fingerprint; a moved or copied base passes)."""
    try:
        theirs = ModelConfig.from_pretrained(_model_dir(path) or path).to_core()
    except (OSError, ValueError) as e:
        raise ValueError(f"the base model {path} cannot be read as a Hugging Face model: {e}") from None
    # Dropout is a training setting: the base model has none, and needs none.
    differences = [f"{key}: {theirs.get(key)!r}, the checkpoint's {value!r}"
                   for key, value in ModelConfig(**state["model_config"]).to_core().items()
                   if theirs.get(key) != value and key != "dropout"]
    recorded = state.get("base_model_fingerprint")
    if not differences and recorded and model_fingerprint(path) != recorded:
        differences = [f"its weights are not those the run imported from {state.get('base_model')} (their "
                       f"fingerprint, nanoq.hf_io.model_fingerprint, differs)"]
    if differences:
        raise ValueError(f"the base model {path} is not the model the adapters were trained on: "
                         f"{'; '.join(differences[:3])}")


def _base_weights(path: str, state: dict) -> Dict[str, np.ndarray]:
    """The float32 parameters of the base model at ``path`` (``_check_base``)."""
    _check_base(path, state)
    tied = ModelConfig(**state["model_config"]).tie_word_embeddings
    return {name: array for name, array in iter_weights(path) if is_parameter(name, tied)}
