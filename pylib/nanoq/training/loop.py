"""The training loop: data, schedule, evaluation, checkpoints, logs and the final Hugging Face model.

A run lives in its own directory ``<out_dir>/<run_name>``:

    config.toml     the merged configuration (``nanoq train config.toml --run_name NEW`` repeats the run)
    run.lock        while a trainer runs here: its lock and process id (see nanoq.training.run_lock)
    log.jsonl       one JSON object per line (see nanoq.training.log)
    data/           the tokenized demo corpus (demo runs only)
    checkpoints/    step_XXXXXXXX/ every checkpoint_every steps and after the last (see nanoq.checkpoint)
    tensorboard/    with run.tracker = "tensorboard": its event files (see nanoq.training.tracking)
    wandb/          with run.tracker = "wandb": the W&B run files, and wandb_run_id the run's id
    model/          the final weights, a Hugging Face model directory (see nanoq.hf_export);
                    with LoRA the adapters merged in, and model/adapter/ the adapters unmerged
                    (a PEFT adapter directory, see nanoq.lora)

``model.init_from`` starts from a Hugging Face model (its weights and
architecture); with ``lora.lora_rank`` > 0 those weights stay frozen and only
low-rank adapters train, and checkpoints hold just the adapters (resuming
imports init_from again first).

Resuming (``train(config, resume="auto" | path)``) loads the newest checkpoint
of a run and continues in that run's directory, appending to its log (see
nanoq.training.resume for what may change on resume).

Under a launcher (``mpiexec -n P``, ``srun``; see nanoq.distributed) every
process runs ``train`` with the same config and drives ``run.devices``
devices of one world of P x devices. The processes first check that they
agree (nanoq version, every setting, the data files: ValueError on every
process naming what differs); the root process (rank 0) chooses and creates
the run directory, prepares the demo corpus and writes config.toml,
log.jsonl, the final model and the console lines, while each process reads
only its rows of every global batch (the data's ``part``). A failure in
these steps on one process fails them on every process (nanoq.agreement).
A stop signal on any process stops every process after the
same step.
"""
from __future__ import annotations

import dataclasses
import glob
import math
import os
import shutil
import sys
import time
import warnings
from typing import Callable, List, Optional, TypeVar

from nanoq import OutOfMemoryError, __version__, distributed
from nanoq.agreement import agree, on_root
from nanoq.checkpoint import DiskSpaceWarning, newest_finite
from nanoq.durable import make_dirs, replace_text
from nanoq.backends import (CUDA_BACKENDS, OversubscriptionWarning, cpu_oversubscription, idle_gpus_warning,
                            resolve_backend)
from nanoq.trainer_config import ModelConfig, head_shape
from nanoq.hf_export import NotExportable, architecture, export_adapter
from nanoq.data import Curriculum, DataLoader, Dataset, EvalLoader
from nanoq.telemetry import GpuTelemetry
from nanoq.trainer import Trainer
from nanoq.training.settings import TrainConfig, parse_curriculum, settings, train_options
from nanoq.training.resume import CHECKPOINTS, Progress, Resume, extra_state, find_run, prepare_resume, restore
from nanoq.training.run_lock import lock_run, require_not_in_use
from nanoq.training.samples import Samples, prepare_samples, sampling_note
from nanoq.training.tracking import check_tracker, open_tracker
from nanoq.training.log import JsonlLog, eval_line, format_duration, gpu_summary, memory_lines, train_line
from nanoq.training.lr_schedule import cooldown_note, learning_rate
from nanoq.training.stop import StopRequest, TrainingHalted, ask_to_stop


@dataclasses.dataclass
class TrainResult:
    """The outcome of ``train``: where things are and how the losses went.

    evals: [(step, mean eval loss)] in order (a resumed run's include those
    before its checkpoint); final_eval_loss is the last one (None without
    eval data). parameters: number of model parameters. resumed_from: the
    checkpoint this call continued from, or None.
    """

    run_dir: str
    model_dir: str
    log_path: str
    steps: int
    parameters: int
    final_train_loss: float
    final_eval_loss: Optional[float]
    evals: List[tuple]
    seconds: float
    resumed_from: Optional[str] = None
    # "SIGINT"/"SIGTERM" when a signal stopped the run early, "SIGPIPE" when its console's reader went
    # away (model_dir is then "")
    stopped_by: Optional[str] = None


def _print(line: str) -> None:
    try:
        print(line, flush=True)
    except BrokenPipeError:
        # Whoever read the console went away (`nanoq train | head`): later lines go nowhere, and the run
        # stops after its step with a checkpoint, as on a signal (SIGPIPE, which Python turns into this).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        if not ask_to_stop("SIGPIPE"):
            raise


def _silent(line: str) -> None:
    """The console of a process other than the root: it prints only errors."""


T = TypeVar("T")


def _on_every_process(group: distributed.ProcessGroup, work: Callable[[], T], action: str) -> T:
    """``work()`` run by every process; a failure on any process fails it on
    every one (nanoq.agreement.agree), so none goes on to a collective that
    a failed one will never reach."""
    result, error = None, None
    try:
        result = work()
    except Exception as e:  # noqa: BLE001 - raised by agree, after every process heard of it
        error = e
    try:
        agree(group, error, action=action)
    finally:
        error = None  # (no cycle: see nanoq.agreement)
    return result


class _NoLog:
    """The log of a process other than the root, which writes no run files."""

    def write(self, **record) -> None:
        pass

    def __enter__(self) -> "_NoLog":
        return self

    def __exit__(self, *exc) -> None:
        pass


def _make_run_dir(path: str) -> None:
    """os.makedirs(path); an OSError other than FileExistsError (a read-only out_dir) says what to do."""
    try:
        make_dirs(path)
    except FileExistsError:
        raise
    except OSError as e:
        raise OSError(e.errno, f"cannot create the run directory {path} ({e.strerror or e}): make run.out_dir "
                               f"writable or choose another") from None


def new_run_dir(config: TrainConfig) -> str:
    """Creates and returns ``<out_dir>/<run_name>``. A named run that exists
    is an error; an unnamed run gets a timestamp, suffixed if it is taken."""
    if config.run_name:
        path = os.path.join(config.out_dir, config.run_name)
        try:
            _make_run_dir(path)
        except FileExistsError:
            require_not_in_use(path)  # busy, not merely taken: say by whom
            raise FileExistsError(f"run directory {path} already exists: to continue that run, resume it "
                                  f"(nanoq train --resume, or train(config, resume=\"auto\")); else choose another "
                                  f"run_name or remove it") from None
        return path
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for suffix in range(1000):
        path = os.path.join(config.out_dir, stamp + (f"-{suffix}" if suffix else ""))
        try:
            _make_run_dir(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot find a free run directory for {stamp} in {config.out_dir}")


def _data_paths(config: TrainConfig, run_dir: str, say: Callable[[str], None]):
    """(train spec, eval spec or None, tokenizer directory or None)."""
    if not config.train_data:
        if config.eval_data:
            raise ValueError("data.eval_data is set but data.train_data is not; give both, or neither for "
                             "the demo corpus")
        from nanoq import demo

        directory = os.path.join(run_dir, "data")
        if os.path.isfile(os.path.join(directory, "tokenize.json")):  # a resumed demo run: written complete
            say(f"demo corpus: {directory}")
            return os.path.join(directory, "train_*.bin"), os.path.join(directory, "eval_*.bin"), directory
        result = demo.prepare(directory)
        say(f"demo corpus: {result.documents} Shakespeare plays, {result.train_tokens:,} train and "
            f"{result.eval_tokens:,} eval tokens (vocab {result.vocab_size})")
        return (os.path.join(result.output, "train_*.bin"), os.path.join(result.output, "eval_*.bin"),
                result.output)
    return config.train_data, (config.eval_data or None), _tokenizer_dir(config.train_data)


def _check_init_from_tokenizer(init_from: str, tokenizer_dir: Optional[str]) -> None:
    """ValueError when the training data's tokenizer (``tokenizer_dir``, the
    one beside the train files or the demo's) is not model.init_from's own:
    its token ids would stand for other text in that model, and the final
    model would be exported with the data's tokenizer instead of its own."""
    theirs = os.path.join(init_from, "tokenizer.json")
    if tokenizer_dir is None or not os.path.isfile(theirs):
        return
    from nanoq.tokenization.tokenizer import load_tokenizer

    data, model = load_tokenizer(tokenizer_dir), load_tokenizer(init_from)
    if data.get_vocab(with_added_tokens=True) != model.get_vocab(with_added_tokens=True):
        raise ValueError(f"the training data was tokenized with {os.path.join(tokenizer_dir, 'tokenizer.json')} "
                         f"({data.get_vocab_size(with_added_tokens=True)} tokens), not with model.init_from "
                         f"{init_from}'s tokenizer ({model.get_vocab_size(with_added_tokens=True)} tokens): its "
                         f"ids would stand for other text in that model. Tokenize the data with it: nanoq tokenize "
                         f"... --tokenizer {init_from}")


def _check_one_tokenizer(datasets: List[tuple]) -> None:
    """ValueError when two of the run's file sets ([(role, Dataset)]: train,
    eval, curriculum stages) have tokenizer.json files beside them whose
    vocabularies differ: the same ids would stand for other text in them
    (a vocab size that happens to be equal hides it), and the model would be
    exported with the first one's tokenizer. Sets without a tokenizer.json
    are not compared."""
    import filecmp

    from nanoq.tokenization.tokenizer import load_tokenizer

    reference = None  # (role, tokenizer file, vocabulary)
    for role, dataset in datasets:
        file = os.path.join(os.path.dirname(os.path.abspath(dataset.files[0].path)), "tokenizer.json")
        if not os.path.isfile(file):
            continue
        if reference is None:
            reference = (role, file, load_tokenizer(file).get_vocab(with_added_tokens=True))
            continue
        if file == reference[1] or filecmp.cmp(file, reference[1], shallow=False):
            continue
        if load_tokenizer(file).get_vocab(with_added_tokens=True) != reference[2]:
            raise ValueError(f"{role} was tokenized with {file}, {reference[0]} with {reference[1]}, and their "
                             f"vocabularies differ: the same ids stand for other text in them. Tokenize every "
                             f"file set with one tokenizer: nanoq tokenize ... --tokenizer "
                             f"{os.path.dirname(reference[1])}")


def _tokenizer_dir(train_spec: str) -> Optional[str]:
    """The directory of the first training file when it holds a tokenizer.json, else None."""
    first = sorted(glob.glob(train_spec)) or [train_spec]
    directory = os.path.dirname(os.path.abspath(first[0]))
    return directory if os.path.isfile(os.path.join(directory, "tokenizer.json")) else None


class _CurrentStageEval:
    """Iterates the eval loader of the curriculum's current stage: after a
    stage's last step that is still the stage's own (see Curriculum)."""

    def __init__(self, curriculum: Curriculum):
        self.curriculum = curriculum

    def __iter__(self):
        return iter(self.curriculum.eval_loader())


def _curriculum(config: TrainConfig, world: "_World", say: Callable[[str], None]):
    """The data of ``data.curriculum``: (Curriculum, eval loader of the current
    stage or None, tokenizer dir of the first stage's files or None,
    [(role, Dataset)] of every file set, [(train role, train Dataset, eval
    role, eval Dataset)] of the stages with eval data)."""
    parsed = parse_curriculum(config.curriculum)
    stages, datasets, evaluated = [], [], []
    for number, stage in enumerate(parsed, 1):
        train_set, eval_set = _stage_datasets(config, number, stage)
        datasets.append((f"data.curriculum stage {number} train_data", train_set))
        if eval_set:
            datasets.append((f"data.curriculum stage {number} eval_data", eval_set))
            evaluated.append(datasets[-2] + datasets[-1])
        stages.append((world.train_loader(train_set, config),
                       world.eval_loader(eval_set, config) if eval_set else None, stage.steps))
        evaluation = f", eval {stage.eval_data} ({eval_set.num_windows:,})" if eval_set else ""
        say(f"curriculum stage {number}: {stage.steps} steps on {stage.train_data} ({train_set.num_windows:,} "
            f"windows){evaluation}")
    curriculum = Curriculum(stages, batches_per_step=config.grad_accum)
    evaluation = _CurrentStageEval(curriculum) if stages[0][1] is not None else None
    return curriculum, evaluation, _tokenizer_dir(parsed[0].train_data), datasets, evaluated


def _dataset(config: TrainConfig, spec: str) -> Dataset:
    from nanoq.tokenization.tokenizer import find_mask_id

    mask = find_mask_id(_tokenizer_dir(spec), config.mask_token) if config.objective == "denoise" else None
    return Dataset(spec, config.seq_len, window_step=config.window_step or None, packing=config.packing,
                   objective=config.objective, mask_token=mask)


def _stage_datasets(config: TrainConfig, number: int, stage) -> tuple:
    """(train Dataset, eval Dataset or None) of curriculum stage ``number``;
    errors name the stage."""
    try:
        return (_dataset(config, stage.train_data),
                _dataset(config, stage.eval_data) if stage.eval_data else None)
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(f"data.curriculum stage {number}: {e}") from None


def config_datasets(config: TrainConfig) -> List[Dataset]:
    """The Datasets of ``config``'s token files as ``train`` opens them
    (data.train_data and data.eval_data, or data.curriculum's); [] for the
    demo corpus (not made here). Opening reads the files (packed ones are
    scanned for their documents): open them once for data_model_config and
    data_packing."""
    if config.curriculum:
        return [dataset for number, stage in enumerate(parse_curriculum(config.curriculum), 1)
                for dataset in _stage_datasets(config, number, stage) if dataset is not None]
    if config.train_data:
        return [_dataset(config, config.train_data)] + ([_dataset(config, config.eval_data)] if config.eval_data
                                                        else [])
    return []


def data_model_config(config: TrainConfig, datasets: Optional[List[Dataset]] = None) -> ModelConfig:
    """The ModelConfig that ``train`` builds for ``config``'s token files
    (data.train_data and data.eval_data, or data.curriculum's): their vocab
    sizes and largest token ids decide [model] vocab_size 0, as in training
    (see ``model_config``). The files are read (or ``datasets``, their
    config_datasets), the demo corpus is not made: without train data this
    is a ValueError."""
    datasets = config_datasets(config) if datasets is None else datasets
    if not datasets:
        raise ValueError("no token files to read the vocab size from (data.train_data and data.curriculum are \"\")")
    return _model_for_data(config, datasets)


def run_packing(datasets) -> str:
    """data.packing of a run over ``datasets`` (training and eval, every
    stage's): "pack" when any of them packs (its windows come with
    positions, so the run sets TrainOptions.packed_documents), else "stream"."""
    return "pack" if any(dataset.packing == "pack" for dataset in datasets) else "stream"


def data_packing(config: TrainConfig, datasets: Optional[List[Dataset]] = None) -> str:
    """data.packing as ``train`` resolves it for ``config`` (``run_packing``
    over the files it opens, or ``datasets``, their config_datasets; "auto"
    read from their tokenization; the demo corpus streams unless
    data.packing is "pack")."""
    datasets = config_datasets(config) if datasets is None else datasets
    if datasets:
        return run_packing(datasets)
    return "pack" if config.packing == "pack" else "stream"


# model.vocab_size 0 takes the largest token id + 1 where that passes the
# files' header vocab (llm.q writes an added EOS as id = header vocab), but
# not beyond this many times the header's: an id that far out is a corrupt
# file, not a vocabulary (one stray id of 10**9 became a 238 GiB embedding).
DERIVED_VOCAB_LIMIT = 2


def _model_for_data(config: TrainConfig, datasets) -> ModelConfig:
    """model_config of the largest vocab size and token id of ``datasets``.
    ValueError naming the file and index of a token id beyond
    DERIVED_VOCAB_LIMIT times the header vocab when model.vocab_size is 0."""
    header_vocab = max(dataset.vocab_size for dataset in datasets)
    if not config.vocab_size and config.init_from == "":
        limit = DERIVED_VOCAB_LIMIT * header_vocab
        for token_file in (f for dataset in datasets for f in dataset.files):
            index = token_file.first_id_from(limit)
            if index is not None:
                raise ValueError(
                    f"token file {token_file.path!r}: token id {int(token_file.tokens[index])} at index {index} "
                    f"is far past the token files' vocab size {header_vocab} (their headers'): model.vocab_size 0 "
                    f"takes the largest id + 1 only below {limit} ({DERIVED_VOCAB_LIMIT}x). A corrupt file? Give "
                    f"model.vocab_size to train on such ids anyway")
    return model_config(config, header_vocab, max(dataset.max_token for dataset in datasets) + 1)


def epochs_in_words(windows: int, dataset: Dataset) -> str:
    """How much of ``dataset`` a run of ``windows`` training windows reads:
    "2.5 epochs", or "3.2% of an epoch" below one."""
    epochs = windows / dataset.num_windows
    return f"{epochs:.1f} epochs" if epochs >= 1 else f"{100 * epochs:.2g}% of an epoch"


def small_data_warnings(datasets, rows_per_step: int) -> List[str]:
    """A warning for each training Dataset (role ending in train_data) with
    fewer windows than the ``rows_per_step`` sequences of one optimizer step,
    saying how many times each step repeats its data, and for each of
    several files whose tails, which no window holds, are over 1% of its
    tokens (fewer, longer files would lose less)."""
    out = []
    for role, dataset in datasets:
        tokens = sum(len(file) for file in dataset.files)
        if role.endswith("train_data") and len(dataset.files) > 1 and dataset.tail_tokens > tokens / 100:
            out.append(f"{dataset.tail_tokens:,} of {role}'s {tokens:,} tokens "
                       f"({100 * dataset.tail_tokens / tokens:.0f}%) are never trained: windows do not span its "
                       f"{len(dataset.files)} files, and each file's tokens after its last whole window of seq_len "
                       f"{dataset.seq_len} are in none (tokenize into fewer, longer files: nanoq tokenize "
                       f"--shard-tokens)")
        if role.endswith("train_data") and dataset.num_windows < rows_per_step:
            out.append(f"{role} has {dataset.num_windows} window(s) of seq_len {dataset.seq_len}, fewer "
                       f"than the {rows_per_step} sequences of one step: each step repeats that data "
                       f"{rows_per_step / dataset.num_windows:.1f} times (use more data, a smaller "
                       f"train.batch_size or train.grad_accum, or a shorter data.seq_len)")
    return out


def check_data_vocab(config: TrainConfig, model: ModelConfig, datasets, evaluated) -> None:
    """Refuses data the model cannot read (ValueError naming the files and
    both vocabularies): every token id must be < the model's vocab_size, and
    every eval file set (``evaluated``: [(train role, train Dataset, eval
    role, eval Dataset)]) must have its train files' header vocab, or with
    model.init_from the model's: eval data from another tokenizer would
    measure nothing. So must the files of one set, and every training set
    (a curriculum's stages) the first's: mixed, the same ids would stand for
    other text."""
    for role, dataset in datasets:
        sizes = {}  # header vocab -> the first file with it
        for file in dataset.files:
            sizes.setdefault(file.vocab_size, file.path)
        if len(sizes) > 1:
            named = ", ".join(f"{size} ({path})" for size, path in sizes.items())
            raise ValueError(f"the files of {role} give different vocab sizes in their headers: {named}; they "
                             f"come from different tokenizers: tokenize them all with one")
    trains = [(role, dataset) for role, dataset in datasets if role.endswith("train_data")]
    first_role, first = trains[0] if trains else (None, None)
    for role, dataset in trains[1:]:
        if dataset.vocab_size not in {first.vocab_size} | ({model.vocab_size} if config.init_from else set()):
            model_part = f" nor model.init_from's ({model.vocab_size})" if config.init_from else ""
            raise ValueError(f"{role} has vocab size {dataset.vocab_size} but {first_role} has {first.vocab_size}"
                             f"{model_part}: the stages' files come from different tokenizers; tokenize them "
                             f"with one")
    for train_role, train_set, eval_role, eval_set in evaluated:
        allowed = {train_set.vocab_size} | ({model.vocab_size} if config.init_from else set())
        if eval_set.vocab_size not in allowed:
            model_part = f" nor model.init_from's ({model.vocab_size})" if config.init_from else ""
            raise ValueError(f"{eval_role} has vocab size {eval_set.vocab_size} but {train_role} has "
                             f"{train_set.vocab_size}{model_part}: the eval files come from another tokenizer; "
                             f"tokenize them with the train files' tokenizer")
    what = f"model.init_from {config.init_from}" if config.init_from else "the model"
    for role, dataset in datasets:
        dataset.check_vocab(model.vocab_size, what)
        if dataset.mask_token is not None and dataset.mask_token >= model.vocab_size:
            raise ValueError(f"the mask token of {role} (id {dataset.mask_token}, data.mask_token) is outside "
                             f"{what}'s vocabulary [0, {model.vocab_size})")


def model_config(config: TrainConfig, data_vocab_size: int, token_vocab_size: int = 0) -> ModelConfig:
    """The ModelConfig of a TrainConfig: that of the model.init_from
    directory, else built from the [model] sizes. data_vocab_size: the token
    files' (largest header) vocab size, which the model's must reach;
    token_vocab_size: their largest token id + 1, which may pass it (llm.q
    writes an added EOS token as id = header vocab). [model] vocab_size 0
    takes the larger of the two."""
    if config.init_from:
        if not os.path.exists(config.init_from):
            raise FileNotFoundError(f"model.init_from {config.init_from} does not exist (give a Hugging Face model "
                                    f"folder: config.json and safetensors weights)")
        try:
            model = ModelConfig.from_pretrained(config.init_from)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"model.init_from: {e}") from None
        if model.vocab_size < data_vocab_size:
            raise ValueError(f"model.init_from {config.init_from} has a vocabulary of {model.vocab_size}, smaller "
                             f"than the token files' vocab size {data_vocab_size}: tokenize with its tokenizer")
        # The directory's config.json sets the architecture ([model] sizes are ignored); a [model]
        # setting that asks for another kind of model is refused rather than dropped (it would train
        # something else than asked for, say a causal model for objective seq2seq), and model.dropout,
        # a training setting, applies.
        asked = [(f"model.causal = {str(config.causal).lower()}", not config.causal and model.causal),
                 (f"model.position_embedding = {config.position_embedding!r}",
                  config.position_embedding != model.position_embedding and config.position_embedding != "rope"),
                 ("model.linear_bias = true",
                  config.linear_bias and not (model.qkv_bias and model.o_bias and model.mlp_bias))]
        conflicts = [setting for setting, conflicting in asked if conflicting]
        if conflicts:
            raise ValueError(f"{', '.join(conflicts)} cannot apply to model.init_from {config.init_from}: its "
                             f"config.json sets the architecture (causal {str(model.causal).lower()}, positions "
                             f"{model.position_embedding!r}, biases q/k/v {str(model.qkv_bias).lower()}, o "
                             f"{str(model.o_bias).lower()}, MLP {str(model.mlp_bias).lower()}); leave them out")
        return dataclasses.replace(model, dropout=config.dropout) if config.dropout else model
    vocab = config.vocab_size or max(data_vocab_size, token_vocab_size)
    if vocab < data_vocab_size:
        raise ValueError(f"model.vocab_size {vocab} is smaller than the token files' vocab size "
                         f"{data_vocab_size}")
    head_shape(config.hidden_size, config.num_attention_heads, config.num_key_value_heads or
               config.num_attention_heads, prefix="model.")  # (errors in [model]'s names)
    return ModelConfig(vocab_size=vocab, hidden_size=config.hidden_size,
                       intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                       num_attention_heads=config.num_attention_heads,
                       num_key_value_heads=config.num_key_value_heads or None, rope_theta=config.rope_theta,
                       rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
                       position_embedding=config.position_embedding,
                       max_position_embeddings=config.seq_len if config.position_embedding == "learned" else None,
                       qkv_bias=config.linear_bias, o_bias=config.linear_bias, mlp_bias=config.linear_bias,
                       dropout=config.dropout, causal=config.causal)


def _eval_data_at(config: TrainConfig, step: int) -> str:
    """The eval files of the evaluation after ``step``: data.eval_data, or
    with data.curriculum the eval files of the stage ``step`` is in (a
    stage's last step still its own; step 0 the first stage's)."""
    if not config.curriculum:
        return config.eval_data
    end = 0
    for stage in parse_curriculum(config.curriculum):
        end += stage.steps
        if step <= end:
            return stage.eval_data
    return stage.eval_data


# The [model] settings that model.init_from's config.json replaces (model_config).
_INIT_FROM_SETS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "rope_theta", "rms_norm_eps", "tie_word_embeddings")


def ignored_model_settings(config: TrainConfig, model: ModelConfig) -> List[str]:
    """The [model] sizes ``config`` sets (to other than their defaults)
    that model.init_from's config.json, which ``model`` is, sets otherwise:
    "model.hidden_size = 128 (its 64)", for a warning."""
    defaults = {item.name: item.default for item in settings()}
    ignored = []
    for name in _INIT_FROM_SETS:
        value, theirs = getattr(config, name), getattr(model, name)
        if name == "num_key_value_heads":
            theirs = theirs or model.num_attention_heads
        if value != defaults[name] and value != theirs:
            ignored.append(f"model.{name} = {value!r} (its {theirs!r})")
    return ignored


def warmup_steps(config: TrainConfig, resumed: Optional[Resume] = None) -> int:
    """The warmup the schedule uses: train.warmup_steps, clamped to the
    run's train.steps (``train`` warns when it clamps). A resumed run whose
    checkpoint had finished a warmup clamped shorter by the train.steps of
    its time keeps that warmup when train.warmup_steps is unchanged: a
    longer one would drop the rate back below the peak it had reached and
    warm up again."""
    warmup = min(config.warmup_steps, config.steps)
    if resumed is not None:
        saved = resumed.state["extra_state"]["config"].get("train", {})
        if saved.get("warmup_steps") == config.warmup_steps and isinstance(saved.get("steps"), int):
            earlier = min(config.warmup_steps, saved["steps"])
            if earlier < warmup and resumed.state["extra_state"]["step"] >= earlier:
                return earlier
    return warmup


def _warmup_note(config: TrainConfig, resumed: Optional[Resume], say: Callable[[str], None]) -> None:
    """Says when the warmup is not train.warmup_steps (see warmup_steps), and
    when the wsd schedule's decay is not its cooldown_fraction's."""
    warmup = warmup_steps(config, resumed)
    if config.schedule == "wsd":
        note = cooldown_note(config.steps, warmup, config.cooldown_fraction)
        if note:
            say(f"warning: {note}")
    if warmup < min(config.warmup_steps, config.steps):
        say(f"train.warmup_steps ({config.warmup_steps}) was cut to the run's first {warmup} steps, and that warmup "
            f"is done: the resumed run keeps it (a longer one would lower the rate again; start a new run to warm "
            f"up otherwise)")
    elif config.warmup_steps > config.steps:
        say(f"warning: train.warmup_steps ({config.warmup_steps}) is longer than the run's train.steps "
            f"({config.steps}): warming up over all {config.steps} steps (set --warmup_steps N, N <= "
            f"{config.steps}, to choose)")


def evaluate(trainer: Trainer, loader: EvalLoader, max_batches: int = 0) -> tuple:
    """(mean loss over the counted tokens, counted tokens) of the first
    ``max_batches`` batches of ``loader`` (0: all of them)."""
    total_loss = 0.0
    total_tokens = 0
    for index, batch in enumerate(loader):  # (inputs, targets), and positions when packed
        if max_batches and index >= max_batches:
            break
        stats = trainer.validate(*batch)
        total_loss += stats.loss * stats.tokens
        total_tokens += stats.tokens
    return (total_loss / total_tokens if total_tokens else math.nan), total_tokens


class _World:
    """This process's place in the run: its ProcessGroup, and the loaders of
    its part of every global batch (of processes x devices x batch_size rows)."""

    def __init__(self, group: distributed.ProcessGroup, config: TrainConfig):
        self.group = group
        self.devices = group.size * config.devices  # the world's
        self.rows = self.devices * config.batch_size

    @property
    def part(self) -> tuple:
        return self.group.rank, self.group.size

    def train_loader(self, dataset: Dataset, config: TrainConfig) -> DataLoader:
        return DataLoader(dataset, batch_rows=self.rows, seed=config.seed, devices=self.devices, part=self.part)

    def eval_loader(self, dataset: Dataset, config: TrainConfig) -> EvalLoader:
        return EvalLoader(dataset, batch_rows=self.rows, part=self.part, seed=config.seed)


def _agreed_settings(group: distributed.ProcessGroup, config: TrainConfig) -> None:
    """Every process runs the same nanoq version, settings and backend (ValueError on every process if not).

    Path settings are left out: each process resolves them in its own
    working directory (nodes may mount the data in different places), and
    what they name is compared instead (``_agreed_data``; the core compares
    the models an init_from gives)."""
    try:
        backend = resolve_backend(config.backend)
    except Exception as e:  # noqa: BLE001 - compared, so every process learns of it
        backend = f"unavailable here ({e})"
    values = {"nanoq version": __version__, "run.backend (resolved)": backend}
    paths = {item.name for item in settings() if item.path}
    for section, entries in config.sections().items():
        values.update({f"{section}.{name}": value for name, value in entries.items() if name not in paths})
    distributed.check_agreement(group, values, "the nanoq version and settings")


def _agreed_data(group: distributed.ProcessGroup, datasets) -> None:
    """Every process sees the same data files (names and sizes, as
    Dataset.fingerprint): ValueError on every process naming the file if not."""
    values = {}
    for role, dataset in datasets:
        for name, size in dataset.file_sizes():
            key = f"{role} file {name}"
            while key in values:  # files of the same name in different directories
                key += "'"
            values[key] = f"{size:,} bytes"
    distributed.check_agreement(group, values, "the data files")


def _setup(config: TrainConfig, run_dir: str, say: Callable[[str], None], group: distributed.ProcessGroup):
    """Opens the data (the root process prepares the demo corpus, the others
    then read it) and checks it against the model and the other processes:
    (ModelConfig, TrainOptions, DataLoader or Curriculum, eval loader or None,
    tokenizer dir or None)."""
    world = _World(group, config)

    def open_data():
        if config.curriculum:
            return _curriculum(config, world, say)
        train_spec, eval_spec, tokenizer_dir = paths
        train_set = _dataset(config, train_spec)
        eval_set = _dataset(config, eval_spec) if eval_spec else None
        datasets = [("data.train_data", train_set)] + ([("data.eval_data", eval_set)] if eval_set else [])
        return (world.train_loader(train_set, config), world.eval_loader(eval_set, config) if eval_set else None,
                tokenizer_dir, datasets, [datasets[0] + datasets[1]] if eval_set else [])

    # The root prepares the demo corpus; given files are each process's own
    # (its paths resolved in its own working directory, see load_config).
    if config.curriculum:
        paths = None
    elif config.train_data:
        paths = _data_paths(config, run_dir, say)
    else:
        paths = on_root(group, lambda: _data_paths(config, run_dir, say), action="preparing the data")
    loader, eval_loader, tokenizer_dir, datasets, evaluated = _on_every_process(group, open_data,
                                                                                 "opening the data")
    _agreed_data(group, datasets)
    for warning in small_data_warnings(datasets, world.rows * config.grad_accum):
        say(f"warning: {warning}")

    def checked_model() -> ModelConfig:
        _check_one_tokenizer(datasets)
        model = _model_for_data(config, [dataset for _, dataset in datasets])
        check_data_vocab(config, model, datasets, evaluated)
        return model

    model = _on_every_process(group, checked_model, "reading the model config")
    if config.init_from:
        _check_init_from_tokenizer(config.init_from, tokenizer_dir)
        if model.max_position_embeddings and config.seq_len > model.max_position_embeddings:
            say(f"warning: data.seq_len {config.seq_len} passes model.init_from's max_position_embeddings "
                f"{model.max_position_embeddings}: the model was not trained on positions that far")
        ignored = ignored_model_settings(config, model)
        if ignored:
            say(f"warning: {', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} not what trains: "
                f"model.init_from {config.init_from}'s config.json sets the architecture; leave "
                f"{'it' if len(ignored) == 1 else 'them'} out of [model]")
    # Packed windows (data.packing as the files resolved it) come with positions.
    options = train_options(config, run_packing(dataset for _, dataset in datasets))
    return model, options, loader, eval_loader, tokenizer_dir


def _sample_dataset(loader, eval_loader) -> Dataset:
    """The Dataset whose first document is the default sample prompt: the
    eval data's (the first curriculum stage's), else the train data's."""
    if isinstance(eval_loader, _CurrentStageEval):
        return eval_loader.curriculum.stages[0][1].dataset
    if eval_loader is not None:
        return eval_loader.dataset
    return loader.stages[0][0].dataset if isinstance(loader, Curriculum) else loader.dataset


def _samples(config: TrainConfig, trainer: Trainer, loader, eval_loader, tokenizer_dir: Optional[str],
             first_step: int, say: Callable[[str], None]) -> Optional[Samples]:
    """The run's Samples (None when no step after ``first_step`` is due for
    samples, or when the trainer cannot generate: then a console line says why).
    Every run with train.sample_every > 0 and steps left samples at least
    once, after its last step (as `nanoq memory` plans its KV cache)."""
    if not config.sample_every or first_step >= config.steps:
        return None
    note = sampling_note(trainer)
    if note:
        say(note)
        return None
    return prepare_samples(config.sample_every, config.sample_prompts, config.sample_tokens, config.seq_len,
                           _sample_dataset(loader, eval_loader), tokenizer_dir, last=config.steps)


def _final_model_dir(run_dir: str, step: int, say: Callable[[str], None]) -> str:
    """``run/model``, or where an earlier finish of this run wrote that,
    ``run/model-step<step>`` (then -2, -3, ...): an export never replaces another."""
    path = os.path.join(run_dir, "model")
    if not os.path.lexists(path):
        return path
    candidate, number = f"{path}-step{step}", 1
    while os.path.lexists(candidate):
        number += 1
        candidate = f"{path}-step{step}-{number}"
    say(f"{path} holds an earlier finish of this run; the final model goes to {candidate}")
    return candidate


def _telemetry(config: TrainConfig, trainer: Trainer) -> GpuTelemetry:
    """NVML telemetry of the trainer's GPUs when the run asks for it and runs
    on cuda; otherwise one of no GPUs (off, with no ``reason``)."""
    wanted = config.telemetry_every and trainer.backend == "cuda"
    return GpuTelemetry(devices=trainer.world_size if wanted else 0)


def _world_memory(trainer: Trainer) -> List[dict]:
    """Trainer.memory_summary() of every device of the world, numbered by
    global rank (collective: every process sends its own devices')."""
    first = trainer.topology[1]
    own = [dict(entry, device=first + entry["device"]) for entry in trainer.memory_summary()]
    return [entry for part in trainer.processes.allgather(own) for entry in part]


def _export_final_model(trainer: Trainer, directory: str, tokenizer_dir: Optional[str], lora: bool,
                        say: Callable[[str], None]) -> str:
    """Writes the final model (and with LoRA the PEFT adapter) into
    ``directory``; returns its path on every process. Collective under a
    launcher: every process calls Trainer.export_model and export_adapter,
    which gather the weights from every process (at any ZeRO stage) and
    have the root write them (a failure there fails it on every process)."""
    model_dir = trainer.export_model(directory, tokenizer_dir=tokenizer_dir)
    if lora:  # also unmerged, for peft
        say(f"adapter (PEFT): {export_adapter(trainer, os.path.join(model_dir, 'adapter'))}")
    return model_dir


def _halt_message(skipped: int, step: int, path: str, good: Optional[str]) -> str:
    """What a run stopped by ``skipped`` non-finite updates in a row tells
    the user: the checkpoint it just wrote (``path``) and the newest one
    whose state is finite (``good``, None when there is none)."""
    message = f"{skipped} updates in a row had a non-finite loss or gradient; stopped at step {step}. "
    if good == path:
        return message + (f"The weights and optimizer state are those of the last good update, saved in {path} "
                          f"(lower train.lr or raise train.grad_clip, then resume)")
    if good is None:
        return message + (f"The state saved in {path} is not finite, and no checkpoint of this run is: start the "
                          f"run again (lower train.lr or raise train.grad_clip)")
    return message + (f"The state saved in {path} is not finite; the last good checkpoint is {good}: move the "
                      f"later step directories away and resume from it (lower train.lr or raise "
                      f"train.grad_clip)")


# -- the loop -----------------------------------------------------------------------

def _check_train_arguments(config, resume, say, progress, processes) -> None:
    """TypeError, naming the argument and the type it must have, for an
    argument of ``train`` of another type."""
    if not isinstance(config, TrainConfig):
        hint = (": nanoq.training.TrainConfig(**settings) makes one from flat settings such as {'steps': 3}, "
                "nanoq.training.load_config(path, overrides=settings) from a TOML file"
                if isinstance(config, dict) else
                " (nanoq.training.load_config(path) reads one from a TOML file)")
        raise TypeError(f"config must be a nanoq.training.TrainConfig, got {type(config).__name__}{hint}")
    if resume is not None and not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"resume must be None, \"auto\" or the path of a run directory to continue, "
                        f"got {type(resume).__name__}")
    if not callable(say):
        raise TypeError(f"say must be a callable that receives each console line (a str), got {type(say).__name__}")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or None (a bar only on a terminal), "
                        f"got {type(progress).__name__}")
    if processes is not None and not isinstance(processes, distributed.ProcessGroup):
        raise TypeError(f"processes must be a nanoq.distributed.ProcessGroup, got {type(processes).__name__}")


def train(config: TrainConfig, *, resume: Optional[str | os.PathLike] = None, say: Callable[[str], None] = _print,
          progress: Optional[bool] = None, processes: Optional[distributed.ProcessGroup] = None) -> TrainResult:
    """Trains a model as ``config`` says and writes the run directory (see the
    module docstring).

    resume: None starts a new run. A path (a run directory, its checkpoints/
    or a step directory) continues that run from its newest checkpoint, in
    its directory. "auto" continues ``<out_dir>/<run_name>`` or, without a
    run_name, the run in out_dir with the newest checkpoint; with none, it
    starts a fresh run. say: receives the console lines (on the root
    process only). progress: a tqdm bar on stderr (None: only when stderr
    is a terminal; never on other processes than the root). processes: the
    ProcessGroup of the run (default nanoq.distributed.processes(): the
    launcher's processes, or this one alone); every member calls ``train``.

    Raises TypeError, naming the argument, for an argument of another type
    than these (a dict of settings for ``config``, say) before anything
    else; ValueError for inconsistent settings and data, for processes
    that disagree on them, and for a resume whose config changes a setting
    in FIXED_ON_RESUME, before any step; RunInUse when another trainer is
    running in the run directory (the run holds a lock on it until it
    returns, see nanoq.training.run_lock).
    """
    _check_train_arguments(config, resume, say, progress, processes)
    group = distributed.processes() if processes is None else processes
    if not group.is_root:
        say, progress = _silent, False
    start = time.time()
    _agreed_settings(group, config)
    on_root(group, lambda: check_tracker(config.tracker), action="checking run.tracker", fallback=ImportError)
    run = None if resume is None else _on_every_process(group, lambda: find_run(config, resume, say),
                                                        "finding the run to resume")
    if resume is not None and group.size > 1:
        # Each process looked from its own working directory: all must have found a run, or none, and
        # all continue the root's (the collectives below differ between the two).
        runs = group.allgather(run)
        found = [each is not None for each in runs]
        if len(set(found)) > 1:
            with_run = ", ".join(str(rank) for rank, found_one in enumerate(found) if found_one)
            without = ", ".join(str(rank) for rank, found_one in enumerate(found) if not found_one)
            raise ValueError(f"resume {resume!r}: processes {with_run} found a run to resume and processes "
                             f"{without} found none (each looks from its own working directory and "
                             f"run.out_dir): give every process the same run")
        run = runs[0]
    run_dir = on_root(group, lambda: new_run_dir(config), action="making the run directory") if run is None \
        else run.run_dir
    lock = lock_run(run_dir, group)  # before anything in the run directory changes
    try:
        resumed = None
        if run is not None:  # the root verifies the checkpoints and sets damaged ones aside
            resumed = on_root(group, lambda: prepare_resume(config, run, say),
                              action="finding the checkpoint to resume", fallback=ValueError)
            config = resumed.config
            if resumed.finished is not None:
                return _finished(run_dir, config, resumed, start, say)
        return _train_in(run_dir, config, resumed, start, say, progress, group)
    except KeyboardInterrupt as interrupt:  # (a second Ctrl-C; the first stops at a step's end)
        interrupt.run_dir = os.path.abspath(run_dir)  # for the caller to say what is there to resume
        raise
    finally:
        if lock is not None:
            lock.release()


def _finished(run_dir: str, config: TrainConfig, resumed: Resume, start: float,
              say: Callable[[str], None]) -> TrainResult:
    """The result of resuming a run that finished at train.steps already
    (``resumed.finished``): it trains, evaluates and writes nothing."""
    finished = resumed.finished
    say(f"{os.path.abspath(run_dir)} finished at step {config.steps} already: nothing to train (give train.steps "
        f"above {config.steps}, --steps N, to train on)")
    say(f"model: {finished['model_dir']}")
    evals = finished["evals"]
    return TrainResult(run_dir=os.path.abspath(run_dir), model_dir=finished["model_dir"],
                       log_path=os.path.abspath(os.path.join(run_dir, "log.jsonl")), steps=config.steps,
                       parameters=finished["parameters"], final_train_loss=finished["train_loss"],
                       final_eval_loss=evals[-1][1] if evals else None, evals=evals,
                       seconds=time.time() - start, resumed_from=resumed.state["path"])


def _train_in(run_dir: str, config: TrainConfig, resumed: Optional[Resume], start: float,
              say: Callable[[str], None], progress: Optional[bool], group: distributed.ProcessGroup) -> TrainResult:
    """The run of ``train`` in ``run_dir``, which its root process has locked."""
    trainer = None
    try:
        model, options, loader, eval_loader, tokenizer_dir = _setup(config, run_dir, say, group)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OversubscriptionWarning)  # (said below in run.* words)
            trainer = Trainer(model, options, processes=group)
        if trainer.backend == "cpu":
            for warning in (idle_gpus_warning(config.backend, trainer.backend),
                            cpu_oversubscription(options.devices, options.threads, group.node_local()[1])):
                if warning:
                    say(f"warning: {warning}")
        if config.init_from:
            say(f"weights: {config.init_from}" + (" (frozen; LoRA adapters train)" if options.lora else ""))
            trainer.import_weights(config.init_from)
        elif options.lora:
            say("warning: LoRA on randomly initialised weights (set model.init_from to adapt a trained model)")
        done = Progress() if resumed is None else restore(trainer, loader, resumed)
        samples = _samples(config, trainer, loader, eval_loader, tokenizer_dir, done.step, say)
        resume_step = None if resumed is None else done.step
        tracker = _on_every_process(group, lambda: open_tracker(config.tracker, run_dir, resume_step)
                                    if group.is_root else None, "opening run.tracker")
    except BaseException:
        if trainer is not None:
            trainer.close()
        if resumed is None and group.is_root:
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing ran: leave no half-made run behind
        raise
    # Named once the run is set up: a setup that fails removes a new run's directory.
    say(f"run directory: {os.path.abspath(run_dir)}")
    if group.is_root:  # (out_dir absolute: `nanoq train RUN/config.toml --run_name NEW` goes beside this run)
        replace_text(os.path.join(run_dir, "config.toml"),
                     dataclasses.replace(config, out_dir=os.path.abspath(config.out_dir)).to_toml())
    tokens_per_step = loader.batch_rows * config.seq_len * config.grad_accum  # the global batch
    world_devices = trainer.topology[0]
    log_file = JsonlLog(os.path.join(run_dir, "log.jsonl"), tracker=tracker) if group.is_root else _NoLog()
    # Under a launcher the root samples its own GPUs, which it logs.
    sampler = _telemetry(config, trainer) if group.is_root else GpuTelemetry(devices=0)

    with trainer, log_file as log, sampler as telemetry, StopRequest(say=group.is_root) as stop:
        shapes = trainer.parameter_shapes
        parameters = sum(math.prod(shape) for shape in shapes.values())
        placement = f" ({group.size} processes x {trainer.world_size})" if group.size > 1 else ""
        layers = model.num_hidden_layers
        say(f"model: {parameters / 1e6:.2f}M parameters ({layers} layer{'s' * (layers != 1)}, hidden "
            f"{model.hidden_size}, vocab {model.vocab_size}) on {trainer.backend} x{world_devices}{placement} "
            f"({trainer.dtype}); {config.steps} step{'s' * (config.steps != 1)} of {tokens_per_step:,} tokens"
            + (f" ({epochs_in_words(config.steps * loader.batch_rows * config.grad_accum, loader.dataset)})"
               if isinstance(loader, DataLoader) else ""))
        if trainer.backend in CUDA_BACKENDS:
            info = trainer.get_attention_info(0)
            packed = f"; packed documents: {info['documents']}" if options.packed_documents else ""
            say(f"attention: {info['implementation']} (attention = {options.attention!r}){packed}")
        if options.lora:
            trainable = sum(math.prod(shapes[name]) for name in trainer.trainable_names)
            say(f"lora: rank {options.lora.rank}, alpha {options.lora.alpha:g}, dropout {options.lora.dropout:g} on "
                f"{','.join(options.lora.targets)}: {trainable / 1e6:.3f}M trainable parameters "
                f"({100 * trainable / parameters:.2f}%)")
        memory = _world_memory(trainer)
        for line in memory_lines(memory):
            say(line)
        if telemetry.reason:
            say(f"gpu telemetry off: {telemetry.reason}")
        about = dict(parameters=parameters, backend=trainer.backend, devices=world_devices, processes=group.size,
                     run_dir=os.path.abspath(run_dir), config=config.sections(), memory=memory)
        if resumed is not None:
            say(f"resuming from {resumed.state['path']} at step {done.step}")
            for key, (old, new) in resumed.changes.items():
                say(f"  changed since the checkpoint: {key} {old!r} -> {new!r}")
        _warmup_note(config, resumed, say)  # (once the run is set up: not before a refusal of something else)
        if resumed is None:
            log.write(type="start", time=0.0, **about)
        else:
            log.write(type="resume", step=done.step, time=done.time, checkpoint=resumed.state["path"],
                      changes=resumed.changes, **about)
        train_start = time.time() - done.time

        def run_eval(step: int) -> None:
            if eval_loader is None:
                return
            began = time.time()
            loss, tokens = evaluate(trainer, eval_loader, config.eval_batches)
            done.evals.append((step, loss))
            log.write(type="eval", step=step, loss=loss, tokens=tokens, time=time.time() - train_start)
            say(eval_line(step, loss, tokens, time.time() - began))

        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=done.step, unit="step", leave=False, file=sys.stderr,
                   disable=None if progress is None else not progress)

        def emit(line: str) -> None:
            if bar.disable:
                say(line)
            else:
                bar.write(line)

        saved = {}  # step -> path of the checkpoints this call wrote

        def save_checkpoint() -> str:
            began = time.time()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", DiskSpaceWarning)
                path = trainer.save_checkpoint(os.path.join(run_dir, CHECKPOINTS), done.step,
                                               extra_state(done, loader, config), keep_last=config.keep_last,
                                               keep_every=config.keep_every, tokenizer_dir=tokenizer_dir)
            for warning in caught:  # a checkpoint deleted early for room goes where the run's news goes
                if issubclass(warning.category, DiskSpaceWarning):
                    emit(f"warning: {warning.message}")
                    log.write(type="warning", step=done.step, message=str(warning.message),
                              time=time.time() - train_start)
                else:
                    warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
            log.write(type="checkpoint", step=done.step, path=path, time=time.time() - train_start)
            emit(f"checkpoint @ step {done.step}: {path} ({time.time() - began:.1f}s)")
            saved[done.step] = path
            return path

        def this_steps_checkpoint() -> str:
            """The checkpoint of done.step: the one this call or the resumed run saved, else a new one
            (a step's directory is saved once)."""
            if done.step in saved:
                return saved[done.step]
            if resumed is not None and resumed.state["step"] == done.step:
                return resumed.state["path"]
            return save_checkpoint()

        def stop_here(signal_name: str) -> None:
            path = this_steps_checkpoint()
            log.write(type="stopped", step=done.step, signal=signal_name, checkpoint=path,
                      time=time.time() - train_start)
            emit(f"{signal_name}: stopped after step {done.step}; checkpoint {path} (the same command "
                 f"with --resume continues)")

        skipped_in_a_row = 0
        stopped_by = None
        first_step, step_seconds = done.step, 0.0  # this call's steps and their time (for the ETA: no evals)
        try:
            warmup = warmup_steps(config, resumed)
            for step in range(done.step, config.steps):
                # (A checkpoint saved by a stop during step's evaluation holds it: not evaluated again.)
                if config.eval_every and step % config.eval_every == 0 and \
                        not (done.evals and done.evals[-1][0] == step):
                    run_eval(step)
                    stopped_by = stop.agreed(group)  # a signal during the evaluation stops before the step
                    if stopped_by:
                        stop_here(stopped_by)
                        break
                lr = learning_rate(step, kind=config.schedule, peak=config.lr, total_steps=config.steps,
                                   warmup_steps=warmup, final_lr_fraction=config.final_lr_fraction,
                                   cooldown_fraction=config.cooldown_fraction)
                began = time.time()
                for _ in range(config.grad_accum):
                    trainer.step(*loader.next_batch())
                stats = trainer.update(lr=lr, beta1=config.beta1, beta2=config.beta2,
                                       weight_decay=config.weight_decay, grad_clip=config.grad_clip)
                now = time.time()
                done.step, done.tokens, done.train_loss = step + 1, done.tokens + tokens_per_step, stats.loss
                done.time = now - train_start
                step_seconds += now - began
                tokens_per_s = tokens_per_step / max(now - began, 1e-9)
                trained_per_s = stats.tokens / max(now - began, 1e-9)
                extra = dict(z_loss=stats.z_loss) if config.z_loss else {}  # (in the gradient, not in loss)
                log.write(type="train", step=step + 1, loss=stats.loss, lr=lr, grad_norm=stats.grad_norm,
                          tokens=done.tokens, trained_tokens=stats.tokens, tokens_per_s=tokens_per_s,
                          time=done.time, **extra)
                bar.update(1)
                gpus = []
                if telemetry.available and (step + 1) % config.telemetry_every == 0:
                    gpus = telemetry.sample()
                    log.write(type="telemetry", step=step + 1, time=done.time, gpus=gpus)
                if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
                    eta = step_seconds / (step + 1 - first_step) * (config.steps - step - 1)
                    line = train_line(step + 1, config.steps, stats.loss, stats.grad_norm, lr, tokens_per_s,
                                      trained_per_s, done.time, eta)
                    emit(f"{line} | {gpu_summary(gpus)}" if gpus else line)
                if stats.skipped and stats.tokens == 0:  # every target -100: nothing to learn, nothing wrong
                    log.write(type="skipped", step=step + 1, loss=stats.loss, grad_norm=stats.grad_norm,
                              reason="no counted tokens", time=done.time)
                    emit(f"step {step + 1}: no counted tokens (every target is -100), update skipped")
                skipped_in_a_row = skipped_in_a_row + 1 if stats.skipped and stats.tokens else 0
                if stats.skipped and stats.tokens:
                    log.write(type="skipped", step=step + 1, loss=stats.loss, grad_norm=stats.grad_norm,
                              reason="non-finite loss or gradient", in_a_row=skipped_in_a_row, time=done.time)
                    emit(f"step {step + 1}: non-finite loss or gradient, update skipped ({skipped_in_a_row} in a "
                         f"row, at most {config.max_skipped_steps})")
                    if skipped_in_a_row >= config.max_skipped_steps:
                        path = save_checkpoint()
                        good = newest_finite(os.path.join(run_dir, CHECKPOINTS))
                        log.write(type="halted", step=done.step, checkpoint=path, last_good_checkpoint=good,
                                  time=time.time() - train_start)
                        raise TrainingHalted(_halt_message(skipped_in_a_row, done.step, path, good))
                stopped_by = stop.agreed(group)
                if stopped_by:
                    stop_here(stopped_by)
                    break
                if config.checkpoint_every and ((step + 1) % config.checkpoint_every == 0
                                                or step + 1 == config.steps):
                    save_checkpoint()
                # After the checkpoint: generating allocates the KV cache, which may not fit.
                if samples is not None and samples.due(step + 1):
                    try:
                        samples.write(trainer, step + 1, log, emit, time.time() - train_start)
                    except OutOfMemoryError as e:  # (the trainer trains on: only the cache was refused)
                        samples = None
                        message = (f"samples off for the rest of the run: generation's KV cache does not fit "
                                   f"beside training ({str(e).splitlines()[0]}); nanoq memory counts it, and "
                                   f"train.sample_every 0 leaves samples out")
                        log.write(type="warning", step=step + 1, message=message, time=time.time() - train_start)
                        emit(f"warning: {message}")
        finally:
            bar.close()
        if stopped_by:
            return TrainResult(run_dir=os.path.abspath(run_dir), model_dir="",
                               log_path=os.path.abspath(os.path.join(run_dir, "log.jsonl")), steps=done.step,
                               parameters=parameters, final_train_loss=done.train_loss,
                               final_eval_loss=done.evals[-1][1] if done.evals else None, evals=done.evals,
                               seconds=time.time() - start,
                               resumed_from=None if resumed is None else resumed.state["path"],
                               stopped_by=stopped_by)
        run_eval(config.steps)

        # The tokenizer's eos id goes into config.json (see nanoq.hf_export.write_model).
        try:
            architecture(trainer.config)
        except NotExportable as unexportable:
            # A model transformers cannot compute (learned positions,
            # bidirectional attention): the final checkpoint is the model.
            # A resumed run that trained no further has it already (saving it again would fail).
            model_dir = this_steps_checkpoint()
            say(f"no Hugging Face export: {unexportable}")
            say("the final checkpoint holds the model: nanoq generate, nanoq eval and --resume take it")
        else:
            model_dir = on_root(group, lambda: _final_model_dir(run_dir, config.steps, say),
                                action="choosing the model directory")
            model_dir = _export_final_model(trainer, model_dir, tokenizer_dir, bool(options.lora), say)
        seconds = time.time() - start
        log.write(type="end", step=config.steps, time=time.time() - train_start, model_dir=model_dir)
    evals = done.evals
    final_eval = evals[-1][1] if evals else None
    summary = f"done in {format_duration(seconds)}: train loss {done.train_loss:.4f}"
    if evals:
        # From the first evaluation on the final one's eval data (a curriculum's stages have their own).
        final_data = _eval_data_at(config, evals[-1][0])
        first = next((step, loss) for step, loss in evals if _eval_data_at(config, step) == final_data)
        summary += f", eval loss {first[1]:.4f} (step {first[0]}) -> {final_eval:.4f} (step {evals[-1][0]})" \
            if first[0] != evals[-1][0] else f", eval loss {final_eval:.4f}"
    say(summary)
    say(f"model: {model_dir}")
    return TrainResult(run_dir=os.path.abspath(run_dir), model_dir=model_dir,
                       log_path=os.path.abspath(os.path.join(run_dir, "log.jsonl")), steps=config.steps,
                       parameters=parameters, final_train_loss=done.train_loss, final_eval_loss=final_eval,
                       evals=evals, seconds=seconds,
                       resumed_from=None if resumed is None else resumed.state["path"])
