"""The training configuration: one table of settings, used for TOML files,
command-line flags, ``--print-config`` and the documentation.

Each TrainConfig field is a setting: a TOML section, a type (int, float,
str, bool), a default and a help line (``settings()`` lists them). A TOML
file puts each key in its section::

    [model]
    hidden_size = 256
    [train]
    lr = 3e-3

Flags use the bare key (``--hidden_size 256`` or ``--hidden-size 256``) and
override the file. The defaults are the bundled demo: ``nanoq train`` alone
trains a 4-layer model on a few Shakespeare plays.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import tomllib
from typing import Any, Dict, List, NamedTuple, Optional

import numpy as np

from nanoq import options as option_schema
from nanoq.trainer_config import BACKENDS, DTYPES, POSITION_EMBEDDINGS, STATE_DTYPES, TrainOptions
from nanoq.lora import LoraConfig, parse_targets
from nanoq.data.loader import PACKINGS
from nanoq.data.objectives import OBJECTIVES, window_steps
from nanoq.training.tracking import TRACKER_PACKAGES

SECTIONS = ("model", "data", "train", "lora", "checkpoint", "run")
SCHEDULES = ("cosine", "linear", "wsd", "constant")
TRACKERS = ("",) + tuple(TRACKER_PACKAGES)
LORA_TARGETS = option_schema.choices("lora_targets")


def setting(section: str, default, help: str, choices=(), minimum=None, maximum=None, above=None, below=None,
            memory=False, path=False, report=False):
    """A TrainConfig field: its section, default, help and allowed values
    (``choices``, or a range: ``minimum``/``maximum`` inclusive, ``above``/``below`` exclusive).
    memory: the setting changes the memory a run takes (``nanoq memory`` takes
    these flags, and those marked report). report: the setting leaves the
    memory alone but changes what ``nanoq memory`` says (grad_accum: the
    tokens per step its suggestions keep). path: the value is made of file
    paths, which a TOML file gives relative to its own folder (see
    ``load_config``).
    A list default (a list-of-strings setting) is copied for each TrainConfig."""
    initial = dict(default_factory=lambda: list(default)) if isinstance(default, list) else dict(default=default)
    return dataclasses.field(**initial, metadata=dict(section=section, help=help, choices=tuple(choices),
                                                            minimum=minimum, maximum=maximum, above=above,
                                                            below=below, memory=memory, path=path,
                                                            report=report))


def core_help(name: str, more: str = "", list_choices: bool = False) -> str:
    """The help of core option ``name`` (nanoq.options), so that a setting's
    meaning is written once, in the core; with ``list_choices`` each choice
    follows with the core's help of it; ``more`` adds what only the setting
    has (its "auto", its comma-separated form, what "" means)."""
    spec = option_schema.option(name)
    text = spec["help"]
    if list_choices:
        text += ": " + "; ".join(f"{choice['name']} = {choice['help']}" for choice in spec["choices"])
    return text + (f"; {more}" if more else "")


def core_limits(name: str) -> dict:
    """The range of core option ``name`` (nanoq.options) as ``setting``'s
    keyword arguments, so that a setting cannot drift from the core."""
    low, high = option_schema.limits(name)
    out = {}
    if low:
        out["minimum" if low["inclusive"] else "above"] = _plain(low["value"])
    if high:
        out["maximum" if high["inclusive"] else "below"] = _plain(high["value"])
    return out


def _plain(value: float):
    """3.0 -> 3 (limits of integer settings read as integers)."""
    return int(value) if float(value).is_integer() else value


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the schema (see ``settings()``)."""

    section: str
    name: str
    type: type
    default: Any
    help: str
    choices: tuple
    minimum: Optional[float]
    maximum: Optional[float]
    above: Optional[float]
    below: Optional[float]
    memory: bool = False
    path: bool = False
    report: bool = False

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def memory_command_flag(self) -> bool:
        """Whether ``nanoq memory`` takes this setting's flag (memory or report)."""
        return self.memory or self.report


@dataclasses.dataclass
class TrainConfig:
    """Everything ``nanoq train`` needs; see ``settings()`` for the help of each field."""

    # -- model: a Llama-style decoder -------------------------------------------
    vocab_size: int = setting("model", 0, "vocabulary size; 0 = the token files' vocab size (or their "
                                         "largest token id + 1 when that is larger: llm.q writes an added EOS as "
                                         "id = header vocab)", minimum=0, memory=True)
    hidden_size: int = setting("model", 256, "model width", minimum=1, memory=True)
    intermediate_size: int = setting("model", 704, "SwiGLU MLP width", minimum=1, memory=True)
    num_hidden_layers: int = setting("model", 4, "transformer blocks", minimum=1, memory=True)
    num_attention_heads: int = setting("model", 4, "query heads", minimum=1, memory=True)
    num_key_value_heads: int = setting("model", 0, "key/value heads (GQA); 0 = num_attention_heads", minimum=0,
                                     memory=True)
    rope_theta: float = setting("model", 10000.0, "RoPE base", above=0)
    rms_norm_eps: float = setting("model", 1e-5, "RMSNorm epsilon", above=0)
    tie_word_embeddings: bool = setting("model", True, "share the embedding and output matrices", memory=True)
    position_embedding: str = setting("model", "rope", "positions: \"rope\" (rotary, Llama's) or \"learned\" (a "
                                                       "trained [seq_len, hidden] table added to the token embedding, "
                                                       "Nano's use_rope = false; not exportable to transformers)",
                                      choices=POSITION_EMBEDDINGS, memory=True)
    linear_bias: bool = setting("model", False, "biases on the q/k/v/o and gate/up/down projections (Nano's "
                                                "bias = true)", memory=True)
    dropout: float = setting("model", 0.0, "dropout on the embedding, each attention output and each MLP output "
                                           "while training (Nano's dropout); off in evaluation and generation",
                             minimum=0.0, below=1.0, memory=True)
    causal: bool = setting("model", True, "causal attention (each token sees the ones before it); false = "
                                          "bidirectional (Nano's is_causal = false), for train.objective seq2seq "
                                          "or denoise; not exportable to transformers")
    init_from: str = setting("model", "", "a Hugging Face model directory to start from (its config.json sets the "
                                          "architecture and the [model] sizes are ignored, with a warning naming those "
                                          "set otherwise; model.dropout applies, "
                                          "and model.causal, position_embedding and linear_bias may not ask for "
                                          "another architecture); \"\" = random weights",
                            memory=True, path=True)

    # -- data ------------------------------------------------------------------
    train_data: str = setting("data", "", "training token files (.bin path or glob); \"\" = the bundled demo corpus",
                              memory=True, path=True)
    eval_data: str = setting("data", "", "eval token files (path or glob), with the train files' vocab "
                                         "size (or model.init_from's); \"\" = none (the demo's own with the demo)",
                             memory=True, path=True)
    curriculum: str = setting("data", "", "stages trained in order, replacing train_data/eval_data: "
                                          "\"TRAIN[|EVAL]@STEPS; ...\" (token-file paths or globs; the STEPS add "
                                          "up to train.steps); \"\" = none", memory=True, path=True)
    seq_len: int = setting("data", 128, core_help("seq_len", "windows of seq_len + 1 tokens step by seq_len, so "
                                                          "every token is a target once per epoch (windows do not "
                                                          "span token files: a file's tokens after its last whole "
                                                          "window are not trained)"),
                           **core_limits("seq_len"), memory=True)
    window_step: int = setting("data", 0, "tokens from one window's start to the next: 0 = seq_len (consecutive "
                                          "windows share a token, as in llm.q); seq_len + 1 = disjoint windows "
                                          "(one per Nano line); train.objective seq2seq and denoise take only 0 "
                                          "(their disjoint windows of 2 * seq_len and seq_len tokens) or that "
                                          "size", minimum=0)
    packing: str = setting("data", "auto", "\"stream\": windows cut from the concatenated documents; \"pack\": "
                                           "whole documents packed into windows, attention and positions restarting "
                                           "at each (SFT); \"auto\" = what the files' tokenization chose (pack for "
                                           "nanoq tokenize --format sft)", choices=PACKINGS + ("auto",),
                           memory=True)
    mask_token: str = setting("data", "", "train.objective denoise: the mask token, an id or the token's text; "
                                          "\"\" = the tokenizer's mask token")
    eval_batches: int = setting("data", 16, "batches per evaluation; 0 = the whole eval set", minimum=0)

    # -- train: optimisation and schedule --------------------------------------
    objective: str = setting("train", "causal", "causal: predict the next token; seq2seq: predict tokens "
                                                "[T, 2T) of each 2T-token window from its first T (Nano's "
                                                "non-causal task); denoise: restore windows whose tokens were "
                                                "replaced by data.mask_token with a ratio drawn per window (Nano's "
                                                "denoiser); seq2seq and denoise need model.causal = false",
                             choices=OBJECTIVES)
    steps: int = setting("train", 240, "optimizer steps", minimum=1)
    batch_size: int = setting("train", 16, core_help("batch_size"), **core_limits("batch_size"),
                              memory=True)
    grad_accum: int = setting("train", 1, core_help("grad_accum"), **core_limits("grad_accum"), report=True)
    lr: float = setting("train", 2e-3, "peak learning rate", above=0)
    schedule: str = setting("train", "cosine", "learning-rate schedule after warmup", choices=SCHEDULES)
    warmup_steps: int = setting("train", 20, "steps of linear warmup up to lr: update s (from 0) takes "
                                                  "lr*(s+1)/warmup_steps (a warmup longer than train.steps is cut "
                                                  "to the run, with a warning)", minimum=0)
    final_lr_fraction: float = setting("train", 0.1, "final lr as a fraction of lr", minimum=0, maximum=1)
    cooldown_fraction: float = setting("train", 0.2, "wsd only: share of all steps spent decaying at the end",
                                       minimum=0, maximum=1)
    weight_decay: float = setting("train", 0.1, "AdamW decoupled weight decay (matrices only)", minimum=0)
    beta1: float = setting("train", 0.9, "AdamW beta1", minimum=0, maximum=0.999999)
    beta2: float = setting("train", 0.95, "AdamW beta2", minimum=0, maximum=0.999999)
    grad_clip: float = setting("train", 1.0, "clip the global gradient norm to this; 0 = off", minimum=0)
    z_loss: float = setting("train", 0.0, core_help("z_loss", "adds z_loss * lse^2 per token to the gradient, not "
                                                              "to the logged loss; log.jsonl's train records hold "
                                                              "its mean as z_loss"), **core_limits("z_loss"))
    eval_every: int = setting("train", 40, "evaluate every N steps (and at step 0 and the end); 0 = only at "
                                           "the end", minimum=0)
    max_skipped_steps: int = setting("train", 5, "stop (with a checkpoint of the last good state) after this "
                                                 "many updates in a row with a non-finite loss or gradient",
                                     minimum=1)
    seed: int = setting("train", 0, "seed of the weights and the data order", minimum=0, maximum=2**64 - 1)
    sample_every: int = setting("train", 60, "generate greedy samples from train.sample_prompts every N steps "
                                             "(and after the last step), printed and logged; 0 = off", minimum=0,
                                memory=True)
    sample_prompts: List[str] = setting("train", [], "prompts of the samples (needs the data's tokenizer.json); "
                                                     "[] = the start of the first eval document (of the train data "
                                                     "without eval data)")
    sample_tokens: int = setting("train", 32, "most new tokens per sample (fewer when the end-of-sequence token "
                                              "comes first, or where prompt and sample would pass data.seq_len)",
                                 minimum=1)

    # -- lora: low-rank adapters on a frozen base (usually model.init_from) ----
    lora_rank: int = setting("lora", 0, core_help("lora_rank"),
                             **core_limits("lora_rank"), memory=True)
    lora_alpha: float = setting("lora", 16.0, core_help("lora_alpha"),
                                **core_limits("lora_alpha"))
    lora_dropout: float = setting("lora", 0.0, core_help("lora_dropout"),
                                  **core_limits("lora_dropout"), memory=True)
    lora_targets: str = setting("lora", "q,k,v,o",
                                core_help("lora_targets", f"comma-separated: {', '.join(LORA_TARGETS)} (or all)"),
                                memory=True)

    # -- checkpoint: <run>/checkpoints/step_XXXXXXXX, for --resume and nanoq export --
    checkpoint_every: int = setting("checkpoint", 100, "save a checkpoint every N steps and after the last "
                                                       "step; 0 = none of those (a run still saves one when a "
                                                       "signal or train.max_skipped_steps stops it, and at the end "
                                                       "when its model cannot be exported)", minimum=0)
    keep_last: int = setting("checkpoint", 2, "checkpoints kept: the newest N (older ones are deleted)",
                             minimum=1)
    keep_every: int = setting("checkpoint", 0, "also keep every checkpoint whose step is divisible by N; "
                                               "0 = none", minimum=0)

    # -- run: where and how ----------------------------------------------------
    backend: str = setting("run", "auto", core_help("backend", "auto = cuda if a GPU is usable, else cpu",
                                                      list_choices=True),
                           choices=BACKENDS, memory=True)
    devices: int = setting("run", 1, core_help("devices"), **core_limits("devices"), memory=True)
    threads: int = setting("run", 0, core_help("threads"), **core_limits("threads"),
                           memory=True)
    dtype: str = setting("run", "auto", core_help("dtype", "auto = bf16 on cuda, fp32 on cpu"),
                         choices=DTYPES, memory=True)
    master_dtype: str = setting("run", "fp32", core_help("master_dtype"),
                                choices=STATE_DTYPES, memory=True)
    optimizer_dtype: str = setting("run", "fp32", core_help("optimizer_dtype"),
                                   choices=STATE_DTYPES, memory=True)
    recompute: str = setting("run", "", core_help("recompute", "comma-separated; \"\" = keep all", list_choices=True),
                        memory=True)
    offload: str = setting("run", "", core_help("offload", "comma-separated (gradients: zero_stage >= 2); \"\" = none",
                                                  list_choices=True), memory=True)
    zero_stage: int = setting("run", 1, core_help("zero_stage"),
                              **core_limits("zero_stage"), memory=True)
    attention: str = setting("run", "auto", core_help("attention", list_choices=True),
                             choices=option_schema.choices("attention"), memory=True)
    attention_deterministic: bool = setting("run", True, core_help("attention_deterministic"),
                                            memory=True)
    cuda_graphs: bool = setting("run", True, core_help("cuda_graphs"))
    matmul_dtype: str = setting("run", "auto", core_help("matmul_dtype", list_choices=True),
                                choices=option_schema.choices("matmul_dtype"), memory=True)
    out_dir: str = setting("run", "nanoq-out", "runs go to <out_dir>/<run_name>")
    run_name: str = setting("run", "", "name of this run's directory in out_dir (a folder name, no path); \"\" = a "
                                       "timestamp (an existing run is never overwritten)")
    log_every: int = setting("run", 1, "print a console line every N steps", minimum=1)
    tracker: str = setting("run", "", "also log the run's figures and samples to TensorBoard (<run>/tensorboard; "
                                      "extra nanoq[tensorboard]) or Weights & Biases (<run>/wandb, offline with "
                                      "WANDB_MODE=offline; extra nanoq[wandb]); \"\" = log.jsonl only",
                           choices=TRACKERS)
    telemetry_every: int = setting("run", 10, "cuda: log GPU utilisation, power, clocks and temperature "
                                              "(NVML) every N steps; 0 = off", minimum=0)

    def __post_init__(self):
        for item in settings():
            setattr(self, item.name, _checked(item, getattr(self, item.name)))
        if self.run_name in (".", "..") or any(sep and sep in self.run_name for sep in (os.sep, os.altsep, "/")):
            raise ValueError(f"run.run_name must be a folder name, the run's directory in run.out_dir, not a path; "
                             f"got {self.run_name!r} (put the folder it goes in into run.out_dir)")
        try:  # names checked without lora_rank too: the value goes into config.toml, which a resume matches
            if self.lora_targets.strip():
                parse_targets(self.lora_targets)
        except ValueError as e:
            raise ValueError(f"lora.lora_targets: {e}") from None
        if self.objective != "causal" and self.causal:
            raise ValueError(f"train.objective {self.objective} trains a bidirectional model: set model.causal = "
                             f"false")
        if self.objective == "causal" and not self.causal:
            raise ValueError("model.causal = false with train.objective causal would let each position see the "
                             "token it predicts: choose train.objective seq2seq or denoise, or keep model.causal")
        if self.mask_token and self.objective != "denoise":
            raise ValueError(f"data.mask_token is for train.objective denoise (this run's is {self.objective}); "
                             f"leave it \"\"")
        if self.objective != "causal" and self.packing == "pack":
            raise ValueError(f"data.packing pack is for causal models; train.objective {self.objective} reads "
                             f"windows of the stream (data.packing stream or auto)")
        steps = window_steps(self.objective, self.seq_len)
        if self.window_step not in (0, *steps):
            if self.objective == "causal":
                raise ValueError(f"data.window_step must be 0 or data.seq_len ({self.seq_len}: windows sharing a "
                                 f"token) or data.seq_len + 1 ({self.seq_len + 1}: disjoint windows); got "
                                 f"{self.window_step}")
            raise ValueError(f"data.window_step must be 0 or {steps[0]} (the disjoint windows of train.objective "
                             f"{self.objective}); got {self.window_step}")
        if self.curriculum:
            stages = parse_curriculum(self.curriculum)
            if self.train_data or self.eval_data:
                raise ValueError("data.curriculum replaces data.train_data and data.eval_data; leave those \"\"")
            total = sum(stage.steps for stage in stages)
            if total != self.steps:
                raise ValueError(f"train.steps ({self.steps}) must equal the steps of the data.curriculum stages "
                                 f"added up ({total}); set train.steps = {total}")
        train_options(self)  # the core's names and rules (nanoq.options), before any run directory exists

    @classmethod
    def from_dict(cls, values: Dict[str, Any]) -> "TrainConfig":
        """From flat ``{name: value}``; unknown names are a ValueError naming them."""
        known = {item.name for item in settings()}
        unknown = [name for name in values if name not in known]
        if unknown:
            raise ValueError(f"unknown setting {unknown[0]!r}{_suggest(unknown[0], known)}")
        return cls(**values)

    def sections(self) -> Dict[str, Dict[str, Any]]:
        """``{section: {name: value}}`` in schema order (the TOML layout)."""
        out: Dict[str, Dict[str, Any]] = {section: {} for section in SECTIONS}
        for item in settings():
            out[item.section][item.name] = getattr(self, item.name)
        return out

    def to_toml(self) -> str:
        """The config as a TOML document that ``load_config`` reads back unchanged."""
        lines = []
        for section, values in self.sections().items():
            lines.append(f"[{section}]")
            lines += [f"{name} = {_toml_value(value)}" for name, value in values.items()]
            lines.append("")
        return "\n".join(lines)


class CurriculumStage(NamedTuple):
    """One stage of ``data.curriculum``: training token files (a path or glob),
    eval token files ("" = none) and the optimizer steps the stage lasts."""

    train_data: str
    eval_data: str
    steps: int


def parse_curriculum(text: str) -> List[CurriculumStage]:
    """The stages of a ``data.curriculum`` string, in training order.

    Syntax: stages separated by ``;`` (one trailing ``;`` allowed), each
    ``TRAIN@STEPS`` or ``TRAIN|EVAL@STEPS``: TRAIN and EVAL are token-file
    paths or globs as in data.train_data, STEPS a positive integer, e.g.
    ``"web/train_*.bin|web/eval_*.bin@400; sft/train_*.bin|sft/eval_*.bin@100"``.
    Either every stage names eval files or none does. A ValueError names the
    stage (counted from 1) and what is wrong with it.
    """
    parts = text.split(";")
    if len(parts) > 1 and not parts[-1].strip():
        parts.pop()
    stages = []
    for number, part in enumerate(parts, 1):
        stage = part.strip()
        if not stage:
            raise ValueError(f"data.curriculum stage {number} is empty; write stages as TRAIN[|EVAL]@STEPS "
                             f"separated by ';'")
        where = f"data.curriculum stage {number} ({stage!r})"
        files, at, steps = stage.rpartition("@")
        if not at:
            raise ValueError(f"{where} has no '@STEPS'; write e.g. '{stage}@100'")
        steps = steps.strip()
        if not re.fullmatch(r"[0-9]+", steps) or int(steps) == 0:
            raise ValueError(f"{where}: the steps after '@' must be a positive integer, got {steps!r}")
        train, bar, evaluation = (piece.strip() for piece in files.partition("|"))
        if not train:
            raise ValueError(f"{where} names no training files before '|' or '@'")
        if bar and not evaluation:
            raise ValueError(f"{where} has '|' but no eval files after it")
        if "|" in evaluation:
            raise ValueError(f"{where} has more than one '|'; a stage is TRAIN|EVAL@STEPS")
        stages.append(CurriculumStage(train, evaluation, int(steps)))
    with_eval = [bool(stage.eval_data) for stage in stages]
    if any(with_eval) and not all(with_eval):
        raise ValueError(f"data.curriculum stage {with_eval.index(False) + 1} has no eval files but other stages "
                         f"have: give every stage '|EVAL' files, or none")
    return stages


def settings() -> List[Setting]:
    """The schema: one Setting per TrainConfig field, in declaration order."""
    return [Setting(section=f.metadata["section"], name=f.name, type=_TYPES[f.type],
                    default=f.default_factory() if f.default is dataclasses.MISSING else f.default,
                    help=f.metadata["help"], choices=f.metadata["choices"], minimum=f.metadata["minimum"],
                    maximum=f.metadata["maximum"], above=f.metadata["above"],
                    below=f.metadata["below"], memory=f.metadata["memory"], path=f.metadata["path"],
                    report=f.metadata["report"])
            for f in dataclasses.fields(TrainConfig)]


_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "List[str]": list, int: int, float: float, str: str,
          bool: bool}
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               list: "a list of strings"}


# The widest numbers a setting may hold: an integer without a maximum of its
# own is at most a signed 64-bit one where it lands (numpy, the core), and
# floats reach the core as float32, where a larger magnitude would be inf.
INT_LIMIT = 2**63 - 1
FLOAT_LIMIT = float(np.finfo(np.float32).max)


def _checked(item: Setting, value):
    """``value`` converted to the setting's type (int -> float only), or a
    ValueError that names the setting."""
    ok = isinstance(value, item.type) and not (item.type is int and isinstance(value, bool))
    if item.type is list and ok:
        ok = all(isinstance(entry, str) for entry in value)
        value = list(value)
    if item.type is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value, ok = float(value), True
        except OverflowError:
            raise ValueError(f"{item.key} must be finite, got {value!r}") from None
    if not ok:
        raise ValueError(f"{item.key} must be {_TYPE_NAMES[item.type]}, got {value!r}")
    if item.type is float and not math.isfinite(value):
        raise ValueError(f"{item.key} must be finite, got {value!r}")
    if item.type is float and abs(value) > FLOAT_LIMIT:
        raise ValueError(f"{item.key} must be at most {FLOAT_LIMIT:.7g} in magnitude (the float32 range the "
                         f"core computes in), got {value!r}")
    if item.type is int and item.maximum is None and item.below is None and abs(value) > INT_LIMIT:
        raise ValueError(f"{item.key} must be at most {INT_LIMIT} (a signed 64-bit integer), got {value!r}")
    if item.choices and value not in item.choices:
        raise ValueError(f"{item.key} must be one of {', '.join(map(_choice_text, item.choices))}, got {value!r}")
    if item.minimum is not None and value < item.minimum:
        raise ValueError(f"{item.key} must be >= {item.minimum}, got {value!r}")
    if item.maximum is not None and value > item.maximum:
        raise ValueError(f"{item.key} must be <= {item.maximum}, got {value!r}")
    if item.above is not None and value <= item.above:
        raise ValueError(f"{item.key} must be > {item.above}, got {value!r}")
    if item.below is not None and value >= item.below:
        raise ValueError(f"{item.key} must be < {item.below}, got {value!r}")
    return value


def _choice_text(choice: str) -> str:
    """A choice as the docs and errors show it ("" quoted, so it can be seen)."""
    return choice if choice else '""'


def _suggest(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # a TOML basic string: JSON's escapes are TOML's, and DEL must be escaped too
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(entry) for entry in value) + "]"
    return repr(value)


def read_toml(path: str | os.PathLike) -> Dict[str, Any]:
    """Flat ``{name: value}`` of a config file, checked against the schema:
    sections and keys must exist and each key must sit in its own section.
    Errors name the file and the key (values are type-checked by TrainConfig)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:
        raise ValueError(f"{path}: not valid TOML: nested too deeply") from None
    schema = {item.name: item for item in settings()}
    flat: Dict[str, Any] = {}
    for section, table in document.items():
        if section not in SECTIONS or not isinstance(table, dict):
            raise ValueError(f"{path}: unknown section or top-level key {section!r}; sections are "
                             f"{', '.join(f'[{s}]' for s in SECTIONS)}")
        for name, value in table.items():
            item = schema.get(name)
            if item is None:
                raise ValueError(f"{path}: unknown key '{section}.{name}'{_suggest(name, schema)}")
            if item.section != section:
                raise ValueError(f"{path}: key {name!r} belongs in [{item.section}], not [{section}]")
            flat[name] = value
    return flat


def load_config(path: Optional[str | os.PathLike] = None, overrides: Optional[Dict[str, Any]] = None) -> TrainConfig:
    """The defaults, updated by the TOML file at ``path`` (if any), then by
    ``overrides`` (flat ``{name: value}``). ValueError names the bad key.

    Relative file paths in the TOML file (the settings marked ``path``:
    data.train_data, data.eval_data, the files of data.curriculum,
    model.init_from) are relative to the file's folder and become absolute
    here, so that a config means the same from any working directory (and a
    missing file's error names the folder searched). Paths in ``overrides``
    (the command line's) are relative to the working directory and become
    absolute too, so that the config.toml a run writes into its directory
    names the same files when it is read again (``nanoq train
    RUN/config.toml --resume RUN``). run.out_dir stays as given.
    """
    values = {}
    if path is not None:
        values = resolve_paths(read_toml(path), os.path.dirname(os.path.abspath(path)))
    try:
        # Checked as a whole: a file may be valid only with the overrides (offload with the zero_stage
        # a flag gives).
        return TrainConfig.from_dict({**values, **resolve_paths(overrides or {}, os.getcwd())})
    except ValueError:
        if path is not None:
            try:  # where the file is at fault on its own, the error names it
                TrainConfig.from_dict(values)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
        raise


def resolve_paths(values: Dict[str, Any], folder: str) -> Dict[str, Any]:
    """``values`` (flat, as read_toml returns them) with the relative paths
    of the settings marked ``path`` joined to ``folder``; "" stays "" and a
    value that is not a string is left for TrainConfig to refuse."""
    def absolute(text: str) -> str:
        return os.path.normpath(os.path.join(folder, os.path.expanduser(text))) if text else text

    out = dict(values)
    for item in settings():
        value = out.get(item.name)
        if not item.path or not isinstance(value, str) or not value:
            continue
        if item.name == "curriculum":
            try:
                stages = parse_curriculum(value)
            except ValueError:
                continue  # TrainConfig reports it
            out[item.name] = "; ".join(absolute(stage.train_data) + (f"|{absolute(stage.eval_data)}"
                                                                     if stage.eval_data else "") + f"@{stage.steps}"
                                       for stage in stages)
        else:
            out[item.name] = absolute(value)
    return out


def train_options(config: TrainConfig, packing: Optional[str] = None) -> TrainOptions:
    """The TrainOptions of a TrainConfig (ValueError for options the core's
    schema refuses: unknown names, broken rules between settings).
    ``packing`` is data.packing as the data resolved it ("pack" or
    "stream"; None: the setting itself, "auto" counting as stream): "pack"
    sets packed_documents."""
    packing = config.packing if packing is None else packing
    return TrainOptions(backend=config.backend, devices=config.devices, batch_size=config.batch_size,
                        seq_len=config.seq_len, grad_accum=config.grad_accum, seed=config.seed, z_loss=config.z_loss,
                        threads=config.threads, dtype=config.dtype, master_dtype=config.master_dtype,
                        optimizer_dtype=config.optimizer_dtype, recompute=config.recompute,
                        offload=config.offload, zero_stage=config.zero_stage, lora=lora_config(config),
                        attention=config.attention, attention_deterministic=config.attention_deterministic,
                        cuda_graphs=config.cuda_graphs,
                        matmul_dtype=config.matmul_dtype, packed_documents=packing == "pack")


def lora_config(config: TrainConfig) -> Optional[LoraConfig]:
    """The LoRA setting of a TrainConfig (None when lora_rank is 0)."""
    if not config.lora_rank:
        return None
    return LoraConfig(rank=config.lora_rank, alpha=config.lora_alpha, dropout=config.lora_dropout,
                      targets=config.lora_targets)


def schema_markdown() -> str:
    """The schema as a Markdown table (the README's is generated from this)."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for item in settings():
        meaning = (item.help + (f" ({' / '.join(map(_choice_text, item.choices))})" if item.choices else "")
                   ).replace("|", "\\|")
        rows.append(f"| `{item.key}` | {item.type.__name__} | `{_toml_value(item.default)}` | {meaning} |")
    return "\n".join(rows)
