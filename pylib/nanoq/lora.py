"""LoRA adapters: names, shapes, initialisation, merging, and the PEFT layout.

A targeted projection of layer ``l`` (weight W, [out, in], Hugging Face name
``model.layers.{l}.self_attn.q_proj.weight`` and so on) gets two trainable
matrices next to its frozen weight::

    model.layers.{l}.self_attn.q_proj.lora_A.weight   A  [rank, in]
    model.layers.{l}.self_attn.q_proj.lora_B.weight   B  [out, rank]

    y = x W^T (+ bias) + (alpha / rank) * dropout(x) A^T B^T

which is PEFT's plain LoRA (no rsLoRA, no DoRA, no fan_in_fan_out). The
targets are q, k, v, o (``self_attn.*_proj``) and gate, up, down
(``mlp.*_proj``). Adapters are ordered layer-major, then by target in that
canonical order, A before B. A starts as PEFT's default (kaiming-uniform with
a=sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))), B as zeros, so training starts
from the base model exactly.

On disk an adapter is a PEFT directory, which ``PeftModel.from_pretrained``
loads and which ``read_peft_adapter`` reads back (also when PEFT wrote it)::

    adapter_config.json         peft_type "LORA", r, lora_alpha, lora_dropout,
                                target_modules (["q_proj", "v_proj", ...]), ...
    adapter_model.safetensors   "base_model.model." + the names above, float32

This module is numpy only: it never imports torch or peft.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Dict, Iterable, Optional, Tuple

import numpy as np

from nanoq import options as option_schema
from nanoq.trainer_config import MAX_SIZE, ModelConfig, _number, _plain
from nanoq.durable import new_directory, read_json_object, save_safetensors, write_json
from nanoq.hf_io import read_safetensors

TARGETS = option_schema.choices("lora_targets")
MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
# PEFT's target_modules names: q -> "q_proj".
PEFT_NAMES = {target: MODULES[target].split(".")[1] for target in TARGETS}
PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_MODULE_PATTERN = "|".join(re.escape(module) for module in MODULES.values())
_ADAPTER_NAME = re.compile(rf"^model\.layers\.(\d+)\.({_MODULE_PATTERN})\.lora_([AB])\.weight$")
_BASE_WEIGHT = re.compile(rf"^model\.layers\.(\d+)\.({_MODULE_PATTERN})\.weight$")
_TARGET_OF_MODULE = {module: target for target, module in MODULES.items()}
_ALIASES = {**{target: target for target in TARGETS}, **{name: target for target, name in PEFT_NAMES.items()}}

# adapter_config.json fields that change what the adapter computes or holds
# beyond plain LoRA; each must be absent, null, false or empty.
_UNSUPPORTED_PEFT_FIELDS = {
    "use_rslora": "rank-stabilised scaling (alpha / sqrt(r))",
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "fan_in_fan_out": "transposed (Conv1D-style) weights",
    "lora_bias": "a trainable bias on lora_B",
    "layers_to_transform": "adapters on some layers only",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "modules_to_save": "fully trained extra modules",
    "trainable_token_indices": "trained token embeddings",
    "layer_replication": "replicated layers",
    "target_parameters": "adapters on parameters rather than modules",
    "alora_invocation_tokens": "activated LoRA",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
}


def parse_targets(value: str | Iterable[str]) -> Tuple[str, ...]:
    """The LoRA targets named by ``value``, in canonical order (q, k, v, o,
    gate, up, down), without duplicates.

    value: a comma-separated string ("q,k,v,o"; spaces allowed; "all" means
    every target) or an iterable of names. PEFT's module names ("q_proj",
    "gate_proj") are accepted too. Raises ValueError for an unknown name or
    an empty selection (the core's messages, nanoq.options).
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    names = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"LoRA targets must be names, got {item!r}")
        item = item.strip()
        if item:
            names += TARGETS if item == "all" else [_ALIASES.get(item, item)]
    if not names:
        raise ValueError(option_schema.rule_message("lora_needs_targets"))
    try:
        return option_schema.canonical_names("lora_targets", names)
    except ValueError as e:
        raise ValueError(f"{e} (or {', '.join(PEFT_NAMES.values())}, or all)") from None


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which projections get adapters and how they scale.

    rank: the inner dimension r of A [r, in] and B [out, r]. alpha: the
    adapter's output is scaled by ``alpha / rank`` (``scale``). dropout: on
    the adapter's input x only, in training. targets: see ``parse_targets``
    (a comma-separated string is accepted and stored as a tuple).
    """

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple = ("q", "k", "v", "o")

    def __post_init__(self):
        # rank 0 is the core's "no LoRA", which is lora=None here.
        object.__setattr__(self, "rank", _plain(self.rank))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_SIZE:
            raise ValueError(f"LoRA rank must be an integer >= 1 (for no adapters, leave lora None), got {self.rank!r}")
        object.__setattr__(self, "alpha", _number("lora_alpha", self.alpha))
        object.__setattr__(self, "dropout", _number("lora_dropout", self.dropout))
        object.__setattr__(self, "targets", parse_targets(self.targets))
        option_schema.check(dict(lora=dataclasses.asdict(self)))

    @property
    def scale(self) -> float:
        """alpha / rank: the factor on the adapter's output."""
        return self.alpha / self.rank


def projection_shape(config: ModelConfig, target: str) -> Tuple[int, int]:
    """(out_features, in_features) of a target's projection weight."""
    attention = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, intermediate = config.hidden_size, config.intermediate_size
    return {
        "q": (attention, hidden),
        "k": (kv, hidden),
        "v": (kv, hidden),
        "o": (hidden, attention),
        "gate": (intermediate, hidden),
        "up": (intermediate, hidden),
        "down": (hidden, intermediate),
    }[target]


def _adapter_names(layer: int, target: str) -> Tuple[str, str]:
    prefix = f"model.layers.{layer}.{MODULES[target]}"
    return f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"


def adapter_shapes(config: ModelConfig, lora: LoraConfig) -> Dict[str, Tuple[int, int]]:
    """{adapter name: shape} in the trainer's order: layer-major, targets in
    canonical order, A [rank, in] before B [out, rank]."""
    shapes = {}
    for layer in range(config.num_hidden_layers):
        for target in lora.targets:
            out_features, in_features = projection_shape(config, target)
            a_name, b_name = _adapter_names(layer, target)
            shapes[a_name] = (lora.rank, in_features)
            shapes[b_name] = (out_features, lora.rank)
    return shapes


def init_adapters(config: ModelConfig, lora: LoraConfig, seed: int) -> Dict[str, np.ndarray]:
    """Fresh float32 adapters in ``adapter_shapes`` order, as PEFT initialises
    them: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform, a=sqrt(5)), B = 0.
    The same seed gives the same arrays (numpy's default Generator)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    rng = np.random.default_rng(int(seed))
    adapters = {}
    for name, shape in adapter_shapes(config, lora).items():
        if name.endswith(".lora_A.weight"):
            bound = 1.0 / math.sqrt(shape[1])
            adapters[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
        else:
            adapters[name] = np.zeros(shape, np.float32)
    return adapters


def split_adapters(weights: Dict[str, np.ndarray]) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
    """(base, adapters): the tensors of ``weights`` that are not LoRA adapters,
    and those that are (by name), each in the given order."""
    base, adapters = {}, {}
    for name, array in weights.items():
        (adapters if _ADAPTER_NAME.match(name) else base)[name] = array
    return base, adapters


def _check_adapters(adapters: Dict[str, np.ndarray], lora: LoraConfig, source: str) -> None:
    """ValueError naming ``source`` unless ``adapters`` holds exactly an A and
    a B of ``lora.rank`` for every target of ``lora`` on layers 0..n-1."""
    layers = set()
    for name, array in adapters.items():
        match = _ADAPTER_NAME.match(name)
        if match is None:
            raise ValueError(f"{source}: {name!r} is not a LoRA adapter name (expected "
                             f"model.layers.<l>.<module>.lora_A.weight or .lora_B.weight, module one of "
                             f"{', '.join(MODULES.values())})")
        target = _TARGET_OF_MODULE[match.group(2)]
        if target not in lora.targets:
            raise ValueError(f"{source}: {name} adapts {PEFT_NAMES[target]}, which is not among the LoRA targets "
                             f"({', '.join(lora.targets)})")
        shape = np.shape(array)
        rank_axis = 0 if match.group(3) == "A" else 1
        if len(shape) != 2 or shape[rank_axis] != lora.rank:
            expected = "[rank, in]" if rank_axis == 0 else "[out, rank]"
            raise ValueError(f"{source}: {name} has shape {list(shape)}; expected {expected} with rank "
                             f"{lora.rank}")
        layers.add(int(match.group(1)))
    if not layers:
        raise ValueError(f"{source}: holds no LoRA adapters")
    expected = [name for layer in range(max(layers) + 1) for target in lora.targets
                for name in _adapter_names(layer, target)]
    missing = [name for name in expected if name not in adapters]
    if missing:
        raise ValueError(f"{source}: lacks {len(missing)} adapter tensor(s), e.g. {missing[0]}; nanoq needs an A "
                         f"and a B for every target ({', '.join(lora.targets)}) on every layer")


def merge(base: Dict[str, np.ndarray], adapters: Dict[str, np.ndarray], lora: LoraConfig) -> Dict[str, np.ndarray]:
    """The base weights with the adapters folded in: a new dict, in ``base``'s
    order, where every targeted projection W [out, in] becomes
    ``W + scale * B @ A`` (computed in float64, returned float32) and every
    other tensor is passed through as is.

    Raises ValueError if a targeted W lacks its adapters, an adapter has no W
    in ``base``, ``base`` holds adapters itself (see ``split_adapters``), or
    shapes disagree.
    """
    _check_adapters(adapters, lora, "adapters")
    merged, used = {}, set()
    for name, weight in base.items():
        if _ADAPTER_NAME.match(name):
            raise ValueError(f"base holds the adapter tensor {name}; separate base and adapters first "
                             f"(nanoq.lora.split_adapters)")
        match = _BASE_WEIGHT.match(name)
        target = _TARGET_OF_MODULE[match.group(2)] if match else None
        if target not in lora.targets:
            merged[name] = weight
            continue
        a_name, b_name = _adapter_names(int(match.group(1)), target)
        if a_name not in adapters:
            raise ValueError(f"no adapter for {name}: adapters lack {a_name} and {b_name}")
        a, b = np.asarray(adapters[a_name], np.float64), np.asarray(adapters[b_name], np.float64)
        w = np.asarray(weight, np.float64)
        if w.ndim != 2 or a.shape[1] != w.shape[1] or b.shape[0] != w.shape[0]:
            raise ValueError(f"{name} has shape {list(w.shape)}, but its adapters {a_name} {list(a.shape)} and "
                             f"{b_name} {list(b.shape)} need [{b.shape[0]}, {a.shape[1]}]")
        merged[name] = (w + lora.scale * (b @ a)).astype(np.float32)
        used.update((a_name, b_name))
    unused = [name for name in adapters if name not in used]
    if unused:
        raise ValueError(f"{len(unused)} adapter tensor(s) have no weight in base, e.g. {unused[0]} "
                         f"(base lacks {unused[0].rsplit('.lora_', 1)[0]}.weight)")
    return merged


def peft_config_dict(lora: LoraConfig, base_model_name_or_path: str = "") -> dict:
    """The ``adapter_config.json`` (as a dict) of a plain LoRA adapter for a
    causal LM, with the fields PEFT writes that bear on what it computes."""
    return dict(
        peft_type="LORA",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path or None,
        revision=None,
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=[PEFT_NAMES[target] for target in lora.targets],
        bias="none",
        fan_in_fan_out=False,
        inference_mode=True,
        init_lora_weights=True,
        use_rslora=False,
        use_dora=False,
        lora_bias=False,
        layers_to_transform=None,
        layers_pattern=None,
        rank_pattern={},
        alpha_pattern={},
        modules_to_save=None,
    )


def write_peft_adapter(directory: str | os.PathLike, adapters: Dict[str, np.ndarray], lora: LoraConfig, *,
                       base_model_name_or_path: str = "", overwrite: bool = False) -> str:
    """Writes adapters as a PEFT LoRA directory (``adapter_config.json`` and
    ``adapter_model.safetensors``, float32 tensors under
    ``"base_model.model." + name``) that ``PeftModel.from_pretrained`` loads;
    returns its absolute path.

    adapters: {nanoq adapter name: array [rank, in] or [out, rank]}, an A and
    a B for every target of ``lora`` on every layer. The directory appears
    complete or not at all: it is built as ``<directory>.partial-<pid>``,
    fsynced and renamed. An existing non-empty directory raises
    FileExistsError unless ``overwrite``, which replaces it.
    """
    _check_adapters(adapters, lora, "adapters")
    tensors = {PEFT_PREFIX + name: np.ascontiguousarray(array, dtype=np.float32) for name, array in adapters.items()}
    directory = os.path.abspath(os.fspath(directory))
    if os.path.isdir(directory) and not os.path.islink(directory) and os.listdir(directory) and not overwrite:
        raise FileExistsError(f"{directory} already exists and is not empty; choose a new directory or pass "
                              f"overwrite=True")
    empty = os.path.isdir(directory) and not os.path.islink(directory) and not os.listdir(directory)
    with new_directory(directory, overwrite=overwrite or empty) as partial:
        write_json(os.path.join(partial, CONFIG_FILE), peft_config_dict(lora, base_model_name_or_path),
                   sort_keys=True)
        save_safetensors(tensors, os.path.join(partial, WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


def _lora_config_from_peft(raw: dict, source: str, tensor_names: list) -> LoraConfig:
    """The LoraConfig of a PEFT ``adapter_config.json``; ValueError naming
    ``source`` for anything but plain LoRA on nanoq's targets."""
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{source}: peft_type is {raw.get('peft_type')!r}; nanoq reads LORA adapters only")
    for field, what in _UNSUPPORTED_PEFT_FIELDS.items():
        if raw.get(field):
            raise ValueError(f"{source}: {field} is {raw[field]!r} ({what}); nanoq supports plain LoRA only "
                             f"(scale alpha / r on every targeted module of every layer)")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{source}: bias is {raw['bias']!r}; nanoq supports bias \"none\" only")
    modules = raw.get("target_modules")
    if isinstance(modules, list):
        # PEFT matches a list entry against the end of a module's dotted name.
        names = [module.rsplit(".", 1)[-1] if isinstance(module, str) else module for module in modules]
        unknown = [module for module, name in zip(modules, names) if name not in PEFT_NAMES.values()]
        if unknown:
            raise ValueError(f"{source}: target module {unknown[0]!r} is not one nanoq adapts; it adapts "
                             f"{', '.join(PEFT_NAMES.values())}")
        targets = names
    elif isinstance(modules, str):  # a regular expression: the tensors say what it matched
        targets = sorted({_TARGET_OF_MODULE[m.group(2)] for m in map(_ADAPTER_NAME.match, tensor_names) if m})
    else:
        raise ValueError(f"{source}: target_modules must be a list of module names, got {modules!r}")
    try:
        return LoraConfig(rank=raw.get("r"), alpha=raw.get("lora_alpha"), dropout=raw.get("lora_dropout", 0.0),
                          targets=targets)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def read_peft_adapter(directory: str | os.PathLike,
                      config: Optional[ModelConfig] = None) -> Tuple[LoraConfig, Dict[str, np.ndarray]]:
    """Reads a PEFT LoRA adapter directory (written by ``write_peft_adapter``
    or by PEFT's ``save_pretrained``): its LoraConfig and {nanoq adapter name:
    float32 array} in ``adapter_shapes`` order (bf16 and fp16 are widened).

    config: when given, the adapters must have exactly the shapes
    ``adapter_shapes(config, lora)`` (every layer of that model).
    Raises ValueError for a missing file and for anything but plain LoRA on
    q/k/v/o/gate/up/down of every layer: another peft_type, use_rslora,
    use_dora, fan_in_fan_out, layers_to_transform, rank_pattern/alpha_pattern,
    other modules, missing or extra tensors.
    """
    directory = os.fspath(directory)
    config_file = os.path.join(directory, CONFIG_FILE)
    weights_file = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.isfile(config_file):
        raise ValueError(f"{directory} is not a PEFT adapter: it holds no {CONFIG_FILE}")
    if not os.path.isfile(weights_file):
        hint = " (it holds adapter_model.bin: load it with peft and save_pretrained again, which writes " \
               "safetensors)" if os.path.isfile(os.path.join(directory, "adapter_model.bin")) else ""
        raise ValueError(f"{directory} holds no {WEIGHTS_FILE}{hint}")
    raw = read_json_object(config_file)
    tensors = {}
    for name, array in read_safetensors(weights_file):
        if not name.startswith(PEFT_PREFIX):
            raise ValueError(f"{weights_file}: tensor {name!r} does not start with {PEFT_PREFIX!r}, "
                             f"as PEFT names a causal LM's adapters")
        tensors[name[len(PEFT_PREFIX):]] = array
    lora = _lora_config_from_peft(raw, config_file, list(tensors))
    _check_adapters(tensors, lora, weights_file)
    if config is not None:
        shapes = adapter_shapes(config, lora)
        for name, shape in shapes.items():
            if name not in tensors or tensors[name].shape != shape:
                found = list(tensors[name].shape) if name in tensors else "nothing"
                raise ValueError(f"{weights_file}: {name} should have shape {list(shape)} for this model, "
                                 f"found {found}")
        extra = [name for name in tensors if name not in shapes]
        if extra:
            raise ValueError(f"{weights_file}: {extra[0]} is for a layer this model "
                             f"({config.num_hidden_layers} layers) does not have")
    return lora, {name: tensors[name] for name in sorted(tensors, key=_adapter_order)}


def _adapter_order(name: str) -> tuple:
    """Sort key of an adapter name: layer, canonical target, A before B."""
    match = _ADAPTER_NAME.match(name)
    return int(match.group(1)), TARGETS.index(_TARGET_OF_MODULE[match.group(2)]), match.group(3)
