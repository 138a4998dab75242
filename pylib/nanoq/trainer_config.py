"""Model configuration (the Llama family) and trainer options."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional, Tuple

import numpy as np

from nanoq import options as option_schema
from nanoq.backends import BACKENDS as _CORE_BACKENDS
from nanoq.backends import CUDA_BACKENDS
from nanoq.durable import read_json_object

# What transformers' config class of each family takes for a field its config.json leaves out, where that
# differs from nanoq's own default (num_key_value_heads = num_attention_heads, head_dim = hidden / heads):
# Qwen2Config and Qwen3Config default to 32 key/value heads, Qwen3Config to head_dim 128.
_HF_DEFAULTS = {"llama": {}, "qwen2": {"num_key_value_heads": 32},
                "qwen3": {"num_key_value_heads": 32, "head_dim": 128}}
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
POSITION_EMBEDDINGS = ("rope", "learned")
# The core holds sizes as C ints.
MAX_SIZE = 2**31 - 1


def _plain(value):
    """A numpy integer or float scalar as the Python number it holds
    (``vocab_size=tokens.max() + 1``); anything else as it is."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def _positive_int(name: str, value) -> int:
    value = _plain(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SIZE:
        raise ValueError(f"{name} must be a positive integer up to {MAX_SIZE}, got {value!r}")
    return value


def head_shape(hidden_size: int, num_attention_heads: int, num_key_value_heads: int,
               head_dim: Optional[int] = None, prefix: str = "") -> int:
    """The head_dim of a model of these sizes (hidden_size /
    num_attention_heads where ``head_dim`` is None), or ValueError for
    heads that do not fit: query heads not a multiple of the key/value
    heads, a hidden size the heads do not divide (without head_dim), an odd
    head_dim (rotary embeddings rotate pairs). ``prefix`` goes before each
    name in the errors ("model." for nanoq train's settings, which have no
    head_dim of their own)."""
    if num_attention_heads % num_key_value_heads:
        raise ValueError(f"{prefix}num_attention_heads ({num_attention_heads}) must be a multiple of "
                         f"{prefix}num_key_value_heads ({num_key_value_heads})")
    derived = head_dim is None
    if derived:
        if hidden_size % num_attention_heads:
            explicit = "" if prefix else (", or give head_dim explicitly (ModelConfig.head_dim, or head_dim in a "
                                          "Hugging Face config.json)")
            raise ValueError(f"{prefix}hidden_size ({hidden_size}) is not divisible by {prefix}num_attention_heads "
                             f"({num_attention_heads}): choose a head count that divides it{explicit}")
        head_dim = hidden_size // num_attention_heads
    head_dim = _positive_int("head_dim", head_dim)
    if head_dim % 2:
        size = (f"head_dim ({prefix}hidden_size / {prefix}num_attention_heads = {head_dim})" if derived
                else f"head_dim ({head_dim})")
        raise ValueError(f"{size} must be even for rotary embeddings: choose sizes that give an even one")
    return head_dim


def _is_finite(value) -> bool:
    """math.isfinite, also for ints too large for a float (which are not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _finite_positive(name: str, value) -> float:
    value = _plain(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _is_finite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return float(value)


@dataclasses.dataclass
class ModelConfig:
    """Shape and flavour of a Llama-family model.

    One config covers Llama 2/3 (optional Llama-3 ``rope_scaling``, ``o_bias``
    and ``qkv_bias`` for ``attention_bias``), Qwen2/2.5 (``qkv_bias``) and Qwen3
    (``qk_norm``: RMSNorm over each head's ``head_dim`` on q and k).
    ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
    ``rope_scaling`` is None or a dict with ``factor``, ``low_freq_factor``,
    ``high_freq_factor`` and ``original_max_position_embeddings`` (Llama-3 rules).
    ``max_position_embeddings`` is the context length a Hugging Face config
    declared (None for a model defined here); training does not use it, an
    export writes it back.

    Nano-style options (Nano's ``use_rope``, ``bias`` and ``dropout``):
    ``position_embedding`` "rope" (the default) or "learned": a trained
    ``[max_position_embeddings, hidden_size]`` table
    (``model.embed_positions.weight``) added to the token embedding, and no
    RoPE; ``max_position_embeddings`` is then required and bounds seq_len.
    ``mlp_bias`` puts biases on gate, up and down (with ``qkv_bias`` and
    ``o_bias``: Nano's ``bias = true``). ``dropout`` in [0, 1) drops elements
    of the embedding, of each attention output and of each MLP output
    (before they join the residual stream, as Nano does) in ``step()`` only;
    ``validate``, ``logits`` and ``generate`` run without it.
    ``causal`` False makes attention bidirectional (every token attends
    every token of its sequence, as Nano's ``is_causal = false``); such a
    model generates by iterative unmasking (``Trainer.denoise``), not token
    by token, and has no Hugging Face export.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    causal: bool = True
    max_position_embeddings: Optional[int] = None
    position_embedding: str = "rope"
    mlp_bias: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            setattr(self, name, _positive_int(name, getattr(self, name)))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.num_key_value_heads = _positive_int("num_key_value_heads", self.num_key_value_heads)
        self.head_dim = head_shape(self.hidden_size, self.num_attention_heads, self.num_key_value_heads,
                                   self.head_dim)
        for name in ("rope_theta", "rms_norm_eps"):  # (an int stays an int: config.json writes it as given)
            setattr(self, name, _plain(getattr(self, name)))
            _finite_positive(name, getattr(self, name))
        if self.rope_scaling is not None:
            self.rope_scaling = _llama3_scaling(self.rope_scaling)
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "qk_norm", "causal"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.max_position_embeddings is not None:
            self.max_position_embeddings = _positive_int("max_position_embeddings", self.max_position_embeddings)
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"position_embedding must be one of {', '.join(POSITION_EMBEDDINGS)}, got "
                             f"{self.position_embedding!r}")
        if self.position_embedding == "learned" and self.max_position_embeddings is None:
            raise ValueError("position_embedding 'learned' needs max_position_embeddings (the table's rows)")
        if not isinstance(self.mlp_bias, bool):
            raise TypeError(f"mlp_bias must be a bool, got {self.mlp_bias!r}")
        self.dropout = _plain(self.dropout)
        if (isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float))
                or not 0 <= self.dropout < 1):
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        self.dropout = float(self.dropout)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Reads a Hugging Face ``config.json`` (a model directory or the file).

        Both transformers 4.x (``rope_theta``/``rope_scaling``, ``torch_dtype``)
        and 5.x (``rope_parameters``, ``dtype``) styles are understood. Raises
        ValueError for architectures or options nanoq does not implement.
        """
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            raw = read_json_object(file)
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {file}") from None
        return cls.from_hf_dict(raw, source=file)

    @classmethod
    def from_hf_dict(cls, raw: dict, source: str = "config") -> "ModelConfig":
        """Builds a config from the dict of a Hugging Face ``config.json``.
        Raises ValueError naming ``source`` for anything nanoq cannot train."""
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: a config must be a JSON object, got {type(raw).__name__}")
        architectures = raw.get("architectures") or []
        if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
            raise ValueError(f"{source}: architectures must be a list of class names, got {architectures!r}")
        model_type = raw.get("model_type")
        known = [SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if known:
            family = known[0]
        elif not architectures and model_type in SUPPORTED_ARCHITECTURES.values():
            family = model_type
        else:
            raise ValueError(
                f"{source}: unsupported architecture {architectures or model_type!r}; nanoq trains "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("mlp_bias") and family != "llama":
            raise ValueError(f"{source}: mlp_bias is supported for Llama only")
        if raw.get("use_sliding_window"):
            raise ValueError(f"{source}: sliding-window attention is not supported")

        theta, scaling = _hf_rope(raw, family, source)

        attention_bias = bool(raw.get("attention_bias", False))
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in raw]
        if missing:
            raise ValueError(f"{source}: missing {', '.join(missing)}")
        try:
            return cls(
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=raw["num_attention_heads"],
                num_key_value_heads=raw.get("num_key_value_heads", _HF_DEFAULTS[family].get("num_key_value_heads")),
                head_dim=raw.get("head_dim", _HF_DEFAULTS[family].get("head_dim")),
                rope_theta=theta,
                rope_scaling=scaling,
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                tie_word_embeddings=raw.get("tie_word_embeddings", False),
                qkv_bias=attention_bias or family == "qwen2",
                o_bias=attention_bias and family in ("llama", "qwen3"),
                qk_norm=family == "qwen3",
                mlp_bias=bool(raw.get("mlp_bias", False)),
                max_position_embeddings=raw.get("max_position_embeddings"),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    @property
    def learned_positions(self) -> bool:
        """Whether the model adds a learned position table (and has no RoPE)."""
        return self.position_embedding == "learned"

    def to_core(self) -> dict:
        """The fields the C++ core reads (max_position_embeddings is metadata,
        unless it sizes a learned position table). ``ModelConfig(**to_core())``
        is this config again, but for that metadata."""
        core = dataclasses.asdict(self)
        if not self.learned_positions:
            del core["max_position_embeddings"]
        return core


def _hf_rope(raw: dict, family: str, source: str) -> Tuple[float, Optional[dict]]:
    """RoPE's (theta, scaling or None) of a config.json of ``family``, read
    as transformers 5 reads it (4.x's files included): the parameters are
    ``rope_scaling`` if set, else ``rope_parameters`` (one dict, or for
    Qwen's families, which have layer types, one per layer type named in
    ``layer_types``, which must then agree); theta is theirs, else the top-level
    ``rope_theta``, else 10000; a llama3 scaling without
    ``original_max_position_embeddings`` takes ``max_position_embeddings``.
    Any scaling but llama3 is refused: run unscaled, the model would compute
    other numbers than transformers does."""
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{source}: rope scaling must be an object, got {rope!r}")
    layer_types = raw.get("layer_types") or (() if family == "llama" else ("full_attention",))
    nested = [rope[key] for key in rope if isinstance(layer_types, (list, tuple)) and key in layer_types]
    if nested:  # per layer type: {"full_attention": {...}, ...}
        if any(not isinstance(value, dict) or value != nested[0] for value in nested):
            raise ValueError(f"{source}: RoPE parameters that differ between layer types are not supported: "
                             f"{rope!r}")
        rope = nested[0]
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"{source}: rope scaling {kind!r} is not supported (only llama3)")
    scaling = dict(rope)
    if "original_max_position_embeddings" not in scaling and raw.get("max_position_embeddings") is not None:
        scaling["original_max_position_embeddings"] = raw["max_position_embeddings"]
    return theta, scaling


def _llama3_scaling(scaling: dict) -> dict:
    if not isinstance(scaling, dict):
        raise TypeError(f"rope_scaling must be a dict or None, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "llama3"))
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported (only llama3)")
    missing = [k for k in LLAMA3_SCALING_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"llama3 rope_scaling lacks {', '.join(missing)}")
    out = {k: _finite_positive(f"rope_scaling.{k}", scaling[k]) for k in LLAMA3_SCALING_KEYS}
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError("rope_scaling.high_freq_factor must exceed low_freq_factor")
    out["original_max_position_embeddings"] = _positive_int("rope_scaling.original_max_position_embeddings",
                                                            int(out["original_max_position_embeddings"]))
    return dict(rope_type="llama3", **out)


BACKENDS = ("auto",) + _CORE_BACKENDS
DTYPES = ("auto",) + option_schema.choices("dtype")
STATE_DTYPES = option_schema.choices("master_dtype")
RECOMPUTE = option_schema.choices("recompute")
OFFLOAD = option_schema.choices("offload")


def auto_dtype(backend: str) -> str:
    """What dtype "auto" means on ``backend``: bf16 on the cuda backends, fp32 on cpu."""
    return "bf16" if backend in CUDA_BACKENDS else "fp32"


# C types of the core's integer fields: (lowest, highest) a Python int may be.
_C_INT = (-2**31, MAX_SIZE)
_C_UINT64 = (0, 2**64 - 1)


def _integer(name: str, value, bounds=_C_INT) -> int:
    """``value`` if it is an int (not a bool) the core's field can hold; its
    limits are the core's to check."""
    value = _plain(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not bounds[0] <= value <= bounds[1]:
        span = "a non-negative integer below 2**64" if bounds == _C_UINT64 else \
            f"an integer in [{bounds[0]}, {bounds[1]}]"
        raise ValueError(f"{name} must be {span}, got {value!r}")
    return value


def _number(name: str, value) -> float:
    """``value`` as a float if it is a finite int or float (not a bool); its
    limits are the core's to check."""
    value = _plain(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _is_finite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclasses.dataclass
class TrainOptions:
    """How to train: where, how many devices, and the shape of a micro-batch.

    ``batch_size`` is per device: a ``step()`` takes ``devices * batch_size``
    rows of ``seq_len`` tokens. ``grad_accum`` is the number of ``step()``
    calls allowed per ``update()``. ``z_loss`` adds ``z_loss * lse**2`` per
    token to the gradient (reported separately). ``threads`` is per device on
    the cpu backend (0: the machine's cores shared out). ``dtype`` is that of
    weights and activations ("auto": bf16 on cuda, fp32 on cpu; "fp32"
    everywhere is the parity-testing mode), ``master_dtype`` that of the
    master weights the optimizer updates and ``optimizer_dtype`` that of the
    AdamW moments ("bf16" ones are written with stochastic rounding).
    ``memory_limit`` caps the device memory each device may allocate, in
    bytes (0: what the device has); going past it raises
    nanoq.OutOfMemoryError, as a smaller device would. ``recompute`` lists
    activations that backward recomputes instead of keeping (less memory,
    more compute, bitwise the same results): "swiglu", "norms" (the RMSNorm
    outputs), "qkv" (the attention inputs), "ffn" (gate, up and swiglu; implies
    swiglu) and "block" (everything but each layer's input; implies all).
    ``offload`` keeps "optimizer" (the AdamW moments), "master" (the master
    weights) and, at zero_stage 2 or 3, "gradients" (the gradient shard) in
    host memory, pinned on GPUs, streamed through device buffers during
    update(). Both may be given as comma-separated strings.
    ``zero_stage`` shards across devices 1: the master weights and AdamW
    state, 2: also the gradients (reduced as each layer's backward ends), 3:
    also the weights (each layer gathered when used; the embedding and head
    stay whole on every device).
    ``lora`` (a nanoq.lora.LoraConfig, or a dict of its fields) freezes the
    model's weights and trains low-rank adapters instead (zero_stage 1).
    The choices, limits and rules between these fields are the core's
    (``nanoq.options``); breaking one raises ValueError here.
    ``world_size``, ``first_rank`` and ``comm_id`` place this trainer's
    devices in a larger world (other processes, or other Trainers of this
    process, each driven from its own thread): they are global ranks
    ``first_rank .. first_rank + devices - 1`` of ``world_size`` (0: the
    devices are the whole world), and ``comm_id`` (bytes from
    ``nanoq.new_comm_id(backend)``, the same for every member) names
    the world. Sharding, statistics and the optimizer then span the world.
    ``first_device`` is the machine's index of the first device this trainer
    drives (cuda: GPUs first_device .. first_device + devices - 1), for
    several processes on one node; under a launcher nanoq sets it itself
    (see nanoq.distributed.local_devices).
    ``attention`` picks the attention implementation: "auto" (cuDNN's fused
    attention where the backend has it and supports the shape, else nanoq's
    own kernel), "cudnn" (an error where it is not available) or "native".
    ``attention_deterministic`` (cuDNN) keeps the attention backward bitwise
    repeatable (the default); False lets cuDNN accumulate dq with atomics:
    less workspace, not repeatable in the last bits. nanoq's
    own kernels are deterministic either way.
    ``cuda_graphs`` (cuda) captures step() and update() once as CUDA graphs
    and replays them; the results are the same without. ``matmul_dtype``
    "fp8" runs the projection matmuls, forward and backward, on fp8 operands
    with per-tensor scales (e4m3 activations and weights, e5m2 gradients;
    cuda, dtype bf16); "auto" in the activations' dtype.
    ``packed_documents`` says that step() and validate() will take
    ``positions`` (packed documents, data.packing "pack"): the cuda backend
    then reserves their attention mask (bf16, batch_size x seq_len x seq_len)
    so that cuDNN's fused attention runs them (seq_len a multiple of 8);
    without it packed rows run in nanoq's own attention kernels. It needs a
    causal model.
    ``inference`` makes a trainer for forward passes only (logits, generate,
    validate, reading and writing weights): it allocates no gradients,
    master weights or AdamW state (Qwen2.5-7B in bf16 on cuda: 14 GiB of
    state instead of 128) and keeps activations as recompute "block"
    whatever ``recompute`` says; step(), update(), the gradients, the
    optimizer state and save_checkpoint refuse. It needs zero_stage 1 and
    nothing offloaded.
    """

    backend: str = "auto"
    devices: int = 1
    batch_size: int = 1
    seq_len: int = 256
    grad_accum: int = 1
    seed: int = 0
    z_loss: float = 0.0
    threads: int = 0
    dtype: str = "auto"
    master_dtype: str = "fp32"
    optimizer_dtype: str = "fp32"
    memory_limit: int = 0
    recompute: tuple = ()
    offload: tuple = ()
    zero_stage: int = 1
    lora: Optional[Any] = None
    world_size: int = 0
    first_rank: int = 0
    comm_id: bytes = b""
    first_device: int = 0
    attention: str = "auto"
    attention_deterministic: bool = True
    cuda_graphs: bool = True
    matmul_dtype: str = "auto"
    packed_documents: bool = False
    inference: bool = False

    def _check_topology(self):
        # Forms only: how the topology fits the devices is the core's rules
        # (nanoq.options), checked with the others below.
        for name in ("world_size", "first_rank", "first_device"):
            setattr(self, name, _integer(name, getattr(self, name)))
        if not isinstance(self.comm_id, bytes):
            raise TypeError(f"comm_id must be bytes (from nanoq.new_comm_id), got "
                            f"{type(self.comm_id).__name__}")

    def __post_init__(self):
        # Python's forms and types here; the values' limits and the rules
        # between options are the core's (nanoq.options.check).
        for name, allowed in (("backend", BACKENDS), ("dtype", DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("master_dtype", "optimizer_dtype"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be one of {', '.join(STATE_DTYPES)}, got {getattr(self, name)!r}")
        for name in ("attention", "matmul_dtype"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be one of {', '.join(option_schema.choices(name))}, "
                                 f"got {getattr(self, name)!r}")
        for name in ("attention_deterministic", "cuda_graphs", "packed_documents", "inference"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("devices", "batch_size", "seq_len", "grad_accum", "threads", "zero_stage"):
            setattr(self, name, _integer(name, getattr(self, name)))
        self.seed = _integer("seed", self.seed, _C_UINT64)
        self.memory_limit = _integer("memory_limit", self.memory_limit, _C_UINT64)
        self.z_loss = _number("z_loss", self.z_loss)
        self._check_topology()
        if self.lora is not None:
            from nanoq.lora import LoraConfig  # nanoq.lora imports this module

            if isinstance(self.lora, dict):
                self.lora = LoraConfig(**self.lora)
            if not isinstance(self.lora, LoraConfig):
                raise TypeError(f"lora must be a nanoq.lora.LoraConfig or None, got {type(self.lora).__name__}")
        self.recompute = option_schema.canonical_names("recompute", option_schema.split_names("recompute",
                                                                                              self.recompute))
        self.offload = option_schema.canonical_names("offload", option_schema.split_names("offload", self.offload))
        fields = self.core_fields()
        if self.backend != "auto" and self.dtype == "auto":
            fields["dtype"] = auto_dtype(self.backend)
        option_schema.check(fields, [name for name in ("backend", "dtype") if fields[name] == "auto"])

    def core_fields(self) -> dict:
        """The fields as the core's option check takes them (``lora`` a dict or None)."""
        return dataclasses.asdict(self)
