"""Converting Nano's two JSON configs into one nanoq training config.

Nano (https://github.com/bd4sur/Nano) trains with ``python train.py -m
config/model.json -t config/pretrain.json``, adding ``-c`` (its README says)
to continue pretraining from a checkpoint, which the train config's
``from_checkpoint`` names. The key names below come from its README and its
config/model.json, pretrain.json, sft.json and lora.json; how they act comes
from its train.py, dataloader.py, data.py and export.py.

- model config: block_size, vocab_size, n_layer, n_embd, n_head, n_kv_head,
  n_hidden, dropout, bias, use_rope, norm_eps, is_causal. Nano's model is
  Llama-style (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings), so nanoq trains
  the same architecture; ``nano_model_config`` gives its nanoq.ModelConfig,
  Nano's options included (use_rope false: a learned position table; bias:
  biases on every projection; dropout on the embedding and each block's
  attention and MLP outputs; is_causal false needs ModelConfig.causal). The
  training config maps them to model.position_embedding, model.linear_bias,
  model.dropout and model.causal where it has those settings, and reports
  them where it does not.
- train config: use_lora, lora_rank, lora_alpha, lora_dropout,
  from_checkpoint, save_checkpoint_to, dataset_path (a list of [train file,
  val file] pairs, trained one after another: Nano's curriculum),
  tokenizer_path, random_seed, batch_size, gradient_accumulation_steps,
  grad_clip, dropout, learning_rate, weight_decay, beta1, beta2, decay_lr,
  warmup_iters, lr_decay_iters, min_lr, eval_interval, log_interval,
  eval_iters, backend, device, sdp_kernel, dtype, use_amp.

Every key present in either file ends up in ``NanoConversion.mapped`` (with
the nanoq setting it became, or why none is needed) or in ``unmapped`` (why
nanoq cannot do the same, or only approximately); none is dropped. A mapped
key that still differs from Nano in a way worth knowing (model.dropout: no
dropout on attention probabilities) is also in ``caveats``. Keys a
file leaves out keep nanoq's defaults, except the architecture keys and
dataset_path, which are required.

Nano's data files are base64-pickled line files; ``nanoq tokenize --format
nano`` imports each into a directory of token files (``NanoImport``), and the
converted config points at those. Nano trains until stopped, so nanoq trains
each stage for one pass over its lines (``lines // (batch_size *
gradient_accumulation_steps)`` steps, counted from the files) unless the
stage lengths are given.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
from typing import Any, Dict, List, Optional, Sequence

from nanoq.durable import read_json_object, replace_text
from nanoq.trainer_config import ModelConfig
from nanoq.training.settings import TrainConfig, settings

SECTION_OF = {item.name: item.section for item in settings()}

MODEL_KEYS = ("block_size", "vocab_size", "n_layer", "n_embd", "n_head", "n_kv_head", "n_hidden", "dropout", "bias",
              "use_rope", "norm_eps", "is_causal")
TRAIN_KEYS = ("use_lora", "lora_rank", "lora_alpha", "lora_dropout", "from_checkpoint", "save_checkpoint_to",
              "dataset_path", "tokenizer_path", "random_seed", "batch_size", "gradient_accumulation_steps",
              "grad_clip", "dropout", "learning_rate", "weight_decay", "beta1", "beta2", "decay_lr", "warmup_iters",
              "lr_decay_iters", "min_lr", "eval_interval", "log_interval", "eval_iters", "backend", "device",
              "sdp_kernel", "dtype", "use_amp")
REQUIRED_MODEL_KEYS = ("block_size", "vocab_size", "n_layer", "n_embd", "n_head")
# Nano's LoRA adapts the four attention projections (wq, wk, wv, wo in its export.py).
NANO_LORA_TARGETS = "q,k,v,o"


@dataclasses.dataclass(frozen=True)
class NanoImport:
    """One Nano line file and the directory ``nanoq tokenize --format nano`` writes it to."""

    source: str
    output: str

    @property
    def token_files(self) -> str:
        """The glob of the imported token files (a file imported alone is all training split)."""
        return os.path.join(self.output, "train_*.bin")

    def command(self, vocab_size: int) -> str:
        return (f"nanoq tokenize --format nano {shlex.quote(self.source)} -o {shlex.quote(self.output)} "
                f"--vocab-size {vocab_size}")


@dataclasses.dataclass
class NanoConversion:
    """The result of ``convert_nano_config``.

    config: the nanoq TrainConfig. mapped: {"model.n_layer": what it became}
    for every Nano key that nanoq reproduces. unmapped: "train.dropout: why"
    for every key nanoq cannot reproduce (or only approximately). caveats:
    "model.dropout = 0.1: what differs" for mapped keys that still differ
    from Nano in a way the user should hear about. imports: the Nano data
    files to import, in curriculum order, each once.
    """

    config: TrainConfig
    mapped: Dict[str, str]
    unmapped: List[str]
    caveats: List[str]
    imports: List[NanoImport]


class _Fields:
    """Typed access to one Nano JSON object ("model" or "train")."""

    def __init__(self, values: Dict[str, Any], name: str, known: Sequence[str]):
        if not isinstance(values, dict):
            raise TypeError(f"the Nano {name} config must be a JSON object, got {type(values).__name__}")
        self.values, self.name, self.known = values, name, known

    def key(self, field: str) -> str:
        return f"{self.name}.{field}"

    def has(self, field: str) -> bool:
        return field in self.values

    def get(self, field: str, kind: str, default=None):
        """The value, checked: kind is "int" (integral floats such as 1e9 pass),
        "number", "bool" or "str"; ``default`` when absent."""
        if field not in self.values:
            return default
        value = self.values[field]
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind == "int" and isinstance(value, float) and value.is_integer():
            return int(value)
        if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if isinstance(value, float) or abs(value) < 2 ** 1000 else math.inf
            if math.isfinite(number):
                return number
        if (kind == "bool" and isinstance(value, bool)) or (kind == "str" and isinstance(value, str)):
            return value
        wanted = {"int": "an integer", "number": "a finite number", "bool": "true or false", "str": "a string"}
        raise ValueError(f"Nano {self.key(field)} must be {wanted[kind]}, got {value!r}")

    def unknown(self) -> List[str]:
        return [field for field in self.values if field not in self.known]


def count_lines(path: str) -> int:
    """Non-blank lines of a Nano line file: the samples it holds (one per line)."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def nano_learning_rate(step: int, lr: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> float:
    """Nano's decay_lr schedule: linear from 0 over warmup_iters, cosine down
    to min_lr at lr_decay_iters, then min_lr."""
    if step < warmup_iters:
        return lr * step / warmup_iters
    if step > lr_decay_iters:
        return min_lr
    ratio = (step - warmup_iters) / max(lr_decay_iters - warmup_iters, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def _dataset_pairs(train: _Fields) -> List[tuple]:
    if not train.has("dataset_path"):
        raise ValueError("the Nano train config has no dataset_path ([[train file, val file], ...])")
    pairs = train.values["dataset_path"]
    if not isinstance(pairs, list) or not pairs:
        raise ValueError(f"Nano train.dataset_path must be a non-empty list of [train file, val file] pairs, "
                         f"got {pairs!r}")
    for index, pair in enumerate(pairs):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) and p for p in pair)):
            raise ValueError(f"Nano train.dataset_path[{index}] must be [train file, val file] (two paths), "
                             f"got {pair!r}")
    return [tuple(pair) for pair in pairs]


def _imports(pairs: List[tuple], data_dir: str) -> Dict[str, NanoImport]:
    """{Nano file: NanoImport}, one directory per distinct file, named after it."""
    imports: Dict[str, NanoImport] = {}
    taken: Dict[str, str] = {}
    for source in (path for pair in pairs for path in pair):
        if source in imports:
            continue
        # Only plain characters: the name goes into a glob and into data.curriculum's syntax.
        name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.splitext(os.path.basename(source))[0]) or "data"
        if name in taken:
            raise ValueError(f"Nano data files {taken[name]} and {source} would both import to {data_dir}/{name}; "
                             f"rename one of them")
        taken[name] = source
        imports[source] = NanoImport(source=source, output=os.path.join(data_dir, name))
    return imports


class _Mapping:
    """What the conversion builds: the nanoq settings, and for each Nano key
    what it became (``mapped``) or why it could not (``unmapped``), and the
    differences a mapped key keeps (``caveats``)."""

    def __init__(self):
        self.values: Dict[str, Any] = {}
        self.mapped: Dict[str, str] = {}
        self.unmapped: List[str] = []
        self.caveats: List[str] = []

    def put(self, nano_key: str, why: str = "", **settings) -> None:
        """Nano's ``nano_key`` becomes these nanoq settings (``why``: a note on the choice)."""
        self.values.update(settings)
        self.mapped[nano_key] = ", ".join(f"{SECTION_OF[name]}.{name} = {value!r}" for name, value in settings.items())
        if why:
            self.mapped[nano_key] += f" ({why})"

    def same(self, nano_key: str, why: str) -> None:
        """Nano's ``nano_key`` needs no nanoq setting."""
        self.mapped[nano_key] = f"({why})"

    def report(self, entry: str) -> None:
        """A key nanoq cannot reproduce, or only approximately: "train.x = 1: why"."""
        self.unmapped.append(entry)

    def caveat(self, entry: str) -> None:
        """A mapped key that still differs from Nano: "model.x = 1: what differs"."""
        self.caveats.append(entry)

    def get(self, name: str):
        """A nanoq setting as converted so far, else its default."""
        return self.values.get(name, getattr(_DEFAULTS, name))


_DEFAULTS = TrainConfig()


def _map_architecture(model: _Fields, train: _Fields, out: _Mapping) -> None:
    missing = [field for field in REQUIRED_MODEL_KEYS if not model.has(field)]
    if missing:
        raise ValueError(f"the Nano model config lacks {', '.join(missing)}")
    # A Nano line is one window, of block_size + 1 tokens for a causal model
    # (2 * block_size for its non-causal seq2seq task): disjoint windows of
    # that many tokens keep the lines apart.
    block_size = model.get("block_size", "int")
    causal = model.get("is_causal", "bool", default=True)
    out.put("model.block_size", seq_len=block_size, window_step=block_size + 1 if causal else 2 * block_size)
    out.put("model.vocab_size", vocab_size=model.get("vocab_size", "int"))
    out.put("model.n_layer", num_hidden_layers=model.get("n_layer", "int"))
    out.put("model.n_embd", hidden_size=model.get("n_embd", "int"))
    out.put("model.n_head", num_attention_heads=model.get("n_head", "int"))
    out.values["tie_word_embeddings"] = True  # Nano shares the embedding and the output matrix
    if model.has("n_kv_head"):  # null: as many as n_head, which nanoq writes as 0
        kv_heads = None if model.values["n_kv_head"] is None else model.get("n_kv_head", "int")
        out.put("model.n_kv_head", num_key_value_heads=kv_heads or 0)
    if model.values.get("n_hidden") is not None:
        out.put("model.n_hidden", intermediate_size=model.get("n_hidden", "int"))
    else:
        where = "is null" if model.has("n_hidden") else "is not given"
        out.report(f"model.n_hidden: {where}, so Nano derives the SwiGLU width itself; model.intermediate_size "
                   f"stays at {_DEFAULTS.intermediate_size}: set it to your model's width")
    if model.has("norm_eps"):
        out.put("model.norm_eps", rms_norm_eps=model.get("norm_eps", "number"))
    _map_nano_options(model, train, out)


# Nano's model options, the nanoq setting each becomes, and that setting's
# value for Nano's non-default choice: use_rope false is a learned position
# table, bias true biases on every projection (q/k/v/o and gate/up/down),
# is_causal false bidirectional attention. Nano's defaults need no setting.
NANO_OPTIONS = (("use_rope", True, "position_embedding", "learned"),
                ("bias", False, "linear_bias", True),
                ("is_causal", True, "causal", False))


def _map_nano_options(model: _Fields, train: _Fields, out: _Mapping) -> None:
    for field, nano_default, setting, value in NANO_OPTIONS:
        if not model.has(field):
            continue
        if model.get(field, "bool") == nano_default:
            out.same(model.key(field), f"nanoq does the same: {field} = {str(nano_default).lower()}")
        elif field == "is_causal":
            # Nano trains a non-causal model on its seq2seq task (its denoiser
            # is a source edit, IS_DENOISE in train.py: train.objective denoise).
            out.put(model.key(field), causal=False, objective="seq2seq")
        else:
            out.put(model.key(field), **{setting: value})
    dropout = model.get("dropout", "number", default=0.0)
    if model.has("dropout") and dropout == 0:
        out.same(model.key("dropout"), "no dropout, as nanoq's default")
    elif model.has("dropout"):
        out.put(model.key("dropout"), dropout=dropout)
        out.caveat(f"{model.key('dropout')} = {dropout}: nanoq drops the embedding and the two block outputs, as "
                   f"Nano does; Nano's attention also drops attention probabilities, nanoq's does not")
    if train.has("dropout"):
        # Nano's train.py builds the model from the model config alone.
        ignored = train.get("dropout", "number")
        if ignored == dropout:
            out.same(train.key("dropout"), f"the model config's dropout ({dropout}) is the one Nano applies")
        else:
            out.report(f"{train.key('dropout')} = {ignored}: Nano's train.py builds the model from the model "
                       f"config, whose dropout ({dropout}) applies; nanoq's model.dropout follows it")


def nano_model_config(model_config: Dict[str, Any], *, intermediate_size: Optional[int] = None) -> ModelConfig:
    """The nanoq.ModelConfig of Nano's model config (the parsed JSON object)
    as Nano's train.py builds the model: tied embeddings, RMSNorm with
    norm_eps, n_kv_head key/value heads, n_hidden the SwiGLU width (or
    ``intermediate_size`` where Nano's is null), use_rope false a learned
    [block_size, n_embd] position table, bias true biases on q/k/v/o and
    gate/up/down, dropout the model dropout. is_causal false needs
    ModelConfig.causal (bidirectional attention). ValueError naming the Nano
    key for a missing or wrong value."""
    model = _Fields(model_config, "model", MODEL_KEYS)
    missing = [field for field in REQUIRED_MODEL_KEYS if not model.has(field)]
    if missing:
        raise ValueError(f"the Nano model config lacks {', '.join(missing)}")
    width = model.get("n_hidden", "int") if model.values.get("n_hidden") is not None else intermediate_size
    if width is None:
        raise ValueError("Nano model.n_hidden is not given: pass intermediate_size (the SwiGLU width)")
    bias = model.get("bias", "bool", default=False)
    values = dict(vocab_size=model.get("vocab_size", "int"), hidden_size=model.get("n_embd", "int"),
                  intermediate_size=width, num_hidden_layers=model.get("n_layer", "int"),
                  num_attention_heads=model.get("n_head", "int"),
                  num_key_value_heads=None if model.values.get("n_kv_head") is None else model.get("n_kv_head",
                                                                                                   "int"),
                  rms_norm_eps=model.get("norm_eps", "number", default=1e-5), tie_word_embeddings=True,
                  qkv_bias=bias, o_bias=bias, mlp_bias=bias, dropout=model.get("dropout", "number", default=0.0),
                  max_position_embeddings=model.get("block_size", "int"),
                  position_embedding="rope" if model.get("use_rope", "bool", default=True) else "learned")
    if not model.get("is_causal", "bool", default=True):
        values["causal"] = False
    try:
        return ModelConfig(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the Nano model config is not a valid nanoq model: {e}") from None


def _map_optimization(train: _Fields, out: _Mapping) -> None:
    for nano_key, nanoq_key, kind in (("learning_rate", "lr", "number"), ("weight_decay", "weight_decay", "number"),
                                      ("beta1", "beta1", "number"), ("beta2", "beta2", "number"),
                                      ("grad_clip", "grad_clip", "number"), ("random_seed", "seed", "int"),
                                      ("batch_size", "batch_size", "int"),
                                      ("gradient_accumulation_steps", "grad_accum", "int"),
                                      ("eval_iters", "eval_batches", "int"), ("log_interval", "log_every", "int")):
        if train.has(nano_key):
            out.put(train.key(nano_key), **{nanoq_key: train.get(nano_key, kind)})
    if train.has("eval_interval"):
        every = train.get("eval_interval", "int")
        out.put("train.eval_interval", eval_every=every, checkpoint_every=every)
    if out.get("lr") <= 0:
        raise ValueError(f"Nano train.learning_rate must be > 0, got {out.get('lr')}")


def _map_data(train: _Fields, out: _Mapping, data_dir: str, stage_steps: Optional[Sequence[int]]):
    """dataset_path: one pair trains on it, several become data.curriculum.
    Returns (the imports, the run's steps)."""
    pairs = _dataset_pairs(train)
    imports = _imports(pairs, data_dir)
    if stage_steps is None:
        # Non-positive sizes are refused by TrainConfig at the end, naming the setting.
        per_step = max(1, out.get("batch_size")) * max(1, out.get("grad_accum"))
        stage_steps = []
        for index, (source, _) in enumerate(pairs):
            try:
                lines = count_lines(source)
            except OSError as e:
                raise ValueError(f"Nano train.dataset_path[{index}][0] {source} cannot be read here ({e.strerror}), "
                                 f"so one pass over it has no known length: convert where the data is, or give "
                                 f"the steps of each stage") from None
            if lines < per_step:
                out.caveat(f"train.batch_size = {out.get('batch_size')}: {source} has {lines} "
                           f"line{'' if lines == 1 else 's'}, fewer than one optimizer step takes ({per_step}: "
                           f"batch_size x gradient_accumulation_steps), so its stage trains 1 step, which repeats "
                           f"lines; lower batch_size or give the steps of each stage")
            stage_steps.append(max(1, lines // per_step))
    stage_steps = list(stage_steps)
    if len(stage_steps) != len(pairs) or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0
                                                 for s in stage_steps):
        wanted = ("one positive integer (dataset_path has one pair)" if len(pairs) == 1 else
                  f"{len(pairs)} positive integers (one per dataset_path pair)")
        raise ValueError(f"stage steps must be {wanted}, got {stage_steps!r}")
    steps = sum(stage_steps)
    if len(pairs) == 1:
        out.put("train.dataset_path", train_data=imports[pairs[0][0]].token_files,
                eval_data=imports[pairs[0][1]].token_files, steps=steps)
    else:
        stages = [f"{imports[t].token_files}|{imports[v].token_files}@{n}" for (t, v), n in zip(pairs, stage_steps)]
        out.put("train.dataset_path", curriculum="; ".join(stages), steps=steps)
    return list(imports.values()), steps


def _map_schedule(train: _Fields, out: _Mapping, steps: int) -> None:
    decay = train.get("decay_lr", "bool")  # None when absent: nanoq's schedule stays
    if decay is False:
        out.put("train.decay_lr", schedule="constant", warmup_steps=0)
        for field in ("warmup_iters", "lr_decay_iters", "min_lr"):
            if train.has(field):
                train.get(field, "number")
                out.same(train.key(field), "unused: decay_lr is false, as in Nano")
        return
    if decay:
        out.put("train.decay_lr", schedule="cosine")
    if train.has("warmup_iters"):
        warmup = train.get("warmup_iters", "int")
        out.put("train.warmup_iters", warmup_steps=min(warmup, steps))
        if warmup > steps:
            out.mapped.pop("train.warmup_iters")
            out.report(f"train.warmup_iters = {warmup}: longer than the whole run ({steps} steps); "
                       f"train.warmup_steps = {steps}")
    if not (train.has("min_lr") or train.has("lr_decay_iters")):
        return
    lr = out.get("lr")
    min_lr = train.get("min_lr", "number", default=lr * _DEFAULTS.final_lr_fraction)
    decay_end = train.get("lr_decay_iters", "int", default=steps)
    if not 0 <= min_lr <= lr:
        raise ValueError(f"Nano train.min_lr ({min_lr}) must lie between 0 and learning_rate ({lr})")
    # nanoq's cosine ends one step past the last; end it where Nano's lr stands then.
    final = float(f"{nano_learning_rate(steps, lr, out.get('warmup_steps'), decay_end, min_lr) / lr:.6g}")
    out.values["final_lr_fraction"] = final
    if train.has("min_lr"):
        out.put("train.min_lr", final_lr_fraction=final)
    if train.has("lr_decay_iters") and decay_end == steps:
        out.same("train.lr_decay_iters", f"train.steps = {steps}: the cosine ends with the run, as in Nano")
    elif train.has("lr_decay_iters"):
        out.report(f"train.lr_decay_iters = {decay_end}: nanoq's cosine decays over the run's {steps} steps down "
                   f"to Nano's lr of step {steps} (final_lr_fraction {final}), while Nano's ends at step "
                   f"{decay_end}; stage steps adding up to {decay_end} match it exactly")


def _map_lora(train: _Fields, out: _Mapping) -> None:
    use_lora = train.get("use_lora", "bool", default=False)
    if use_lora:
        if not train.has("lora_rank"):
            raise ValueError("Nano train.use_lora is true but train.lora_rank is not given")
        out.put("train.use_lora", lora_targets=NANO_LORA_TARGETS)
    elif train.has("use_lora"):
        out.put("train.use_lora", lora_rank=0)
    for field, kind in (("lora_rank", "int"), ("lora_alpha", "number"), ("lora_dropout", "number")):
        if train.has(field):
            value = train.get(field, kind)
            if use_lora:
                out.put(train.key(field), **{field: value})
            else:
                out.same(train.key(field), "unused: use_lora is false, as in Nano")


def _map_run(train: _Fields, out: _Mapping, init_from: str) -> None:
    """Starting weights, where the run goes, the tokenizer and the hardware."""
    checkpoint = train.get("from_checkpoint", "str", default="")
    if init_from:
        out.values["init_from"] = init_from
    if checkpoint and init_from:
        out.mapped["train.from_checkpoint"] = f"model.init_from = {init_from!r} (given in place of {checkpoint!r})"
    elif checkpoint:
        out.report(f"train.from_checkpoint = {checkpoint!r}: a PyTorch pickle checkpoint, which nanoq does not "
                   f"read (loading a pickle can run code). To fine-tune, convert the base model to a Hugging Face "
                   f"directory and set model.init_from; to continue a nanoq run, use `nanoq train --resume`")
    elif train.has("from_checkpoint"):
        out.same("train.from_checkpoint", "empty: Nano starts from random weights")
    if train.has("save_checkpoint_to"):
        out.put("train.save_checkpoint_to", out_dir=train.get("save_checkpoint_to", "str") or "nanoq-out")
    if train.has("tokenizer_path"):
        out.report(f"train.tokenizer_path = {train.get('tokenizer_path', 'str')!r}: Nano's tokenizer has a format "
                   f"of its own, not a Hugging Face tokenizer.json; nanoq trains on the token ids as they are and "
                   f"the exported model has no tokenizer")
    # Nano's cuda and bfloat16 are what nanoq's "auto" picks on a GPU; "auto"
    # also lets the converted config run on a machine without one (a cpu run
    # computes in fp32 only). Only a choice "auto" would not make is written.
    device = train.get("device", "str", default=None)
    if device is not None and device.startswith("cuda:"):
        out.report(f"train.device = {device!r}: run.backend stays 'auto' (cuda where a GPU is usable), and nanoq "
                   f"uses the first run.devices GPUs it sees; pick GPU {device[5:]} with "
                   f"CUDA_VISIBLE_DEVICES={device[5:]}")
    elif device == "cuda":
        out.put("train.device", why="cuda where a GPU is usable, as Nano's cuda; cpu where none is", backend="auto")
    elif device == "cpu":
        out.put("train.device", backend="cpu")
    elif device is not None:
        out.report(f"train.device = {device!r}: nanoq runs on cpu or cuda; run.backend stays 'auto'")
    use_amp = train.get("use_amp", "bool", default=True)
    if train.has("dtype"):
        dtype = train.get("dtype", "str")
        if out.get("backend") == "cpu" or not use_amp:
            out.put("train.dtype", dtype="fp32")  # Nano computes in fp32 without autocast (off on the cpu)
        elif dtype == "bfloat16":
            out.put("train.dtype", why="bf16 on cuda, as Nano's bfloat16; fp32 on cpu, which computes in fp32 only",
                    dtype="auto")
        elif dtype == "float32":
            out.put("train.dtype", dtype="fp32")
        else:
            out.report(f"train.dtype = {dtype!r}: nanoq computes in bf16 or fp32; run.dtype stays 'auto' (bf16 on "
                       f"cuda, fp32 on cpu)")
    if train.has("use_amp"):
        out.same("train.use_amp", "nanoq's bf16 keeps fp32 master weights and fp32 accumulation, as AMP does"
                 if use_amp else "run.dtype = 'fp32': without AMP Nano computes in fp32")
    for field, why in (("backend", "nanoq picks its communicator: NCCL on cuda, shared memory on cpu"),
                       ("sdp_kernel", "nanoq has one attention kernel per backend")):
        if train.has(field):
            out.same(train.key(field), f"no setting: {why}; was {train.get(field, 'str')!r}")


def convert_nano_config(model_config: Dict[str, Any], train_config: Dict[str, Any], *, data_dir: str = "data",
                        stage_steps: Optional[Sequence[int]] = None, init_from: str = "") -> NanoConversion:
    """Maps Nano's model and train configs (the parsed JSON objects) to a nanoq TrainConfig.

    data_dir: where the Nano data files are imported (``data_dir/<file
    name>/``). stage_steps: optimizer steps per dataset_path pair; None counts
    the lines of each pair's train file (which must then be readable) and
    trains one pass over it. init_from: a Hugging Face model directory that
    stands in for Nano's from_checkpoint (model.init_from). Raises ValueError
    (TypeError for a non-object) naming the Nano key for a missing required
    key, a wrong type or a value nanoq rejects.
    """
    model = _Fields(model_config, "model", MODEL_KEYS)
    train = _Fields(train_config, "train", TRAIN_KEYS)
    out = _Mapping()
    _map_architecture(model, train, out)
    _map_optimization(train, out)
    imports, steps = _map_data(train, out, data_dir, stage_steps)
    _map_schedule(train, out, steps)
    _map_lora(train, out)
    _map_run(train, out, init_from)
    for fields in (model, train):
        for field in fields.unknown():
            out.report(f"{fields.key(field)}: not a key of Nano's {fields.name} config ({', '.join(fields.known)}); "
                       f"ignored")
    try:
        config = TrainConfig.from_dict(out.values)
    except ValueError as e:
        raise ValueError(f"the converted config is not valid: {e}") from None
    # The model's own checks (heads dividing the width, ...), which TrainConfig leaves to training.
    nano_model_config(model_config, intermediate_size=config.intermediate_size)
    return NanoConversion(config=config, mapped=out.mapped, unmapped=out.unmapped, caveats=out.caveats,
                          imports=imports)


def read_nano_configs(model_path: str | os.PathLike, train_path: str | os.PathLike) -> tuple:
    """(model config, train config): the two JSON objects, or ValueError /
    FileNotFoundError naming the file."""
    objects = []
    for path in (model_path, train_path):
        try:
            objects.append(read_json_object(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"Nano config {os.fspath(path)} does not exist") from None
    return tuple(objects)


def _printable(text: str) -> str:
    """``text`` with line breaks and other control characters escaped: keys and
    paths come from the JSON, and one of those would break a TOML comment."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def nano_toml(conversion: NanoConversion, sources: Sequence[str] = ()) -> str:
    """The converted config as TOML, headed by comments: where it came from,
    the data imports it expects, what could not be mapped and the caveats
    of what was."""
    vocab = conversion.config.vocab_size
    lines = ["nanoq config converted from Nano's " + (" and ".join(sources) if sources else "configs"), "",
             "Import Nano's data first:"]
    lines += [f"  {item.command(vocab)}" for item in conversion.imports]
    if conversion.unmapped:
        lines += ["", "Not mapped (or only approximately):"]
        lines += [f"  {entry}" for entry in conversion.unmapped]
    if conversion.caveats:
        lines += ["", "Mapped with a caveat:"]
        lines += [f"  {entry}" for entry in conversion.caveats]
    comments = [f"# {_printable(line)}".rstrip() for line in lines]
    return "\n".join(comments) + "\n\n" + conversion.config.to_toml()


def write_nano_toml(conversion: NanoConversion, path: str | os.PathLike, *, sources: Sequence[str] = (),
                    force: bool = False) -> str:
    """Writes ``nano_toml`` to ``path`` (whole or not at all); an existing file
    is a FileExistsError unless ``force``; a folder that is missing (or a
    file) is an OSError naming it. Returns the path."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(f"cannot write {path}: {folder} is not a folder; choose another output")
    if not os.path.exists(folder):
        raise FileNotFoundError(f"cannot write {path}: its folder {folder} does not exist; create it or choose "
                                f"another output")
    if os.path.exists(path) and not force:
        raise FileExistsError(f"{path} already exists; choose another output or pass --force to replace it")
    replace_text(path, nano_toml(conversion, sources))
    return path
