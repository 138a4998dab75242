"""The ``nanoq`` command line: train, tokenize, export, generate, eval, plot, info, convert.

The options of ``nanoq train`` are generated from the settings table in
``nanoq.training.settings``, so the TOML schema, the flags and the docs cannot
drift apart.
"""
from __future__ import annotations

import functools
import math
import os
import sys
import warnings

import click

from nanoq import options as option_schema
from nanoq_cli import inference
from nanoq_cli.numbers import Boolean, FiniteFloat, Integer
from nanoq.tokenization.pipeline import SPECIAL_TEXT
from nanoq.tokenization.tokenizer import MIN_TRAINED_VOCAB
from nanoq.training.settings import settings


_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE_LIMIT = 2**63 - 1


def _parse_size(text: str, allow_zero: bool = False) -> int:
    """Bytes of "5GB" (10**9), "2GiB" (2**30), "500MB", "1048576"; ValueError otherwise."""
    stripped = text.strip().upper()
    digits = stripped.rstrip("KMGTIB").strip()
    unit = stripped[len(digits):].strip() or "B"
    try:
        number = float(digits) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"{text!r} is not a size such as 5GB, 2GiB, 500MB or 1048576") from None
    if not math.isfinite(number) or number > _SIZE_LIMIT:
        raise ValueError(f"{text!r} is not a finite size of at most {_SIZE_LIMIT} bytes")
    size = int(number)
    if size < 0 or (size == 0 and not allow_zero):
        raise ValueError(f"{text!r}: the size must be {'zero or more' if allow_zero else 'positive'}")
    return size


class Size(click.ParamType):
    """Bytes given as "5GB" (10**9), "2GiB" (2**30), "500MB" or "1048576"."""

    name = "size"

    def __init__(self, allow_zero: bool = False):
        self.allow_zero = allow_zero

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return _parse_size(value, self.allow_zero)
        except ValueError as e:
            self.fail(str(e), param, ctx)


_CLICK_TYPES = {int: Integer(), float: FiniteFloat(), str: click.STRING, bool: Boolean()}


def _fail(error: Exception) -> click.ClickException:
    return click.ClickException(str(error))


@click.group(context_settings=dict(help_option_names=["-h", "--help"]))
@click.version_option(package_name="nanoq", prog_name="nanoq")
def cli():
    """Train Llama-family language models. `nanoq train` alone trains a small
    demo model on a bundled Shakespeare corpus."""
    warnings.showwarning = _warning_line


def _warning_line(message, category, filename, lineno, file=None, line=None):
    """A Python warning as one "warning: ..." line on stderr: the file and
    source line Python shows mean nothing to someone running a command."""
    click.echo(f"warning: {message}", err=True)


def _setting_options(command, memory_only: bool = False):
    """Adds ``--name VALUE`` (also ``--name-with-dashes``) for every setting
    (memory_only: for `nanoq memory`, those of Setting.memory_command_flag)."""
    for item in reversed(settings()):
        if memory_only and not item.memory_command_flag:
            continue
        flags = [f"--{item.name}"] + ([f"--{item.name.replace('_', '-')}"] if "_" in item.name else [])
        if item.type is list:  # repeated: --name A --name B; not given: None, like the other flags
            command = click.option(*flags, item.name, type=click.STRING, multiple=True, metavar="TEXT",
                                   callback=lambda ctx, param, value: list(value) if value else None,
                                   help=f"[{item.section}] {item.help} (repeat for several; default "
                                        f"{item.default!r})")(command)
            continue
        kind = click.Choice(item.choices) if item.choices else _CLICK_TYPES[item.type]
        default = str(item.default).lower() if item.type is bool else repr(item.default) \
            if item.type is str else item.default
        metavar = f"[{'|'.join(item.choices)}]" if item.choices else item.type.__name__.upper()
        command = click.option(*flags, item.name, type=kind, default=None, metavar=metavar,
                               help=f"[{item.section}] {item.help} (default {default})")(command)
    return command


def _rules_epilog() -> str:
    """The core's rules between settings, one paragraph each (nanoq.options)."""
    return "\n\n".join(["Rules between settings, checked before training starts:"] +
                       [f"- {rule['message']}" for rule in option_schema.rules()])


def _run_config_file(resume: str):
    """The config.toml of the run that ``--resume DIR`` names (a run
    directory, its checkpoints/ or a step directory), or None."""
    from nanoq_cli.inference import RUN_CHECKPOINTS

    path = os.path.abspath(resume)
    if os.path.basename(os.path.dirname(path)) == RUN_CHECKPOINTS:  # a step directory
        path = os.path.dirname(path)
    if os.path.basename(path) == RUN_CHECKPOINTS:
        path = os.path.dirname(path)
    candidate = os.path.join(path, "config.toml")
    return candidate if os.path.isfile(candidate) else None


def _auto_resume(overrides: dict) -> str:
    """The run directory that ``--resume auto`` continues, found with the
    flags' out_dir and run_name (else the defaults'), or "auto" when
    there is none (``train`` then says so and starts a fresh run)."""
    from nanoq.training import RunInUse, load_config
    from nanoq.training.resume import find_run

    # Only where runs are (the other flags apply to the run's own settings, read after).
    where = {name: overrides[name] for name in ("out_dir", "run_name") if name in overrides}
    try:
        run = find_run(load_config(None, where), "auto", say=lambda line: None)
    except (ValueError, OSError, RunInUse) as e:
        raise _fail(e) from None
    return "auto" if run is None else run.run_dir


@cli.command(context_settings=dict(max_content_width=110), epilog=_rules_epilog())
@click.argument("config_file", metavar="[CONFIG.toml]", required=False, type=click.Path(dir_okay=False))
@click.option("--print-config", is_flag=True, help="Print the merged configuration as TOML and exit.")
@click.option("--resume", is_flag=False, flag_value="auto", default=None, metavar="[auto|DIR]",
              help="Continue from a checkpoint. DIR: a run directory, its checkpoints/ or a step directory. "
              "auto (also --resume alone): <out_dir>/<run_name>, or without run_name the run in out_dir with "
              "the newest checkpoint; a fresh run if there is none. Model and data settings must match the "
              "checkpoint's; other changes (steps, lr, ...) are applied and reported. Without CONFIG.toml "
              "the settings of a run resumed start from its own config.toml (the flags still apply).")
@_setting_options
def train(config_file, print_config, resume, **flags):
    """Train a model. Settings come from the defaults (the demo), then
    CONFIG.toml, then the flags; see configs/example.toml. Under a launcher
    (mpiexec -n P, srun) the P processes train one world of P x devices;
    the first writes the run and prints."""
    from nanoq.training import load_config
    from nanoq.training import train as run_training

    overrides = {name: value for name, value in flags.items() if value is not None}
    if config_file is None and resume == "auto":  # the run that auto finds, taken as --resume DIR
        resume = _auto_resume(overrides)
    if config_file is None and resume not in (None, "auto"):
        config_file = _run_config_file(resume)
        if config_file is not None:
            # (on stderr: --print-config's TOML goes to stdout)
            click.echo(f"settings: {config_file} (the run's own; flags change them)", err=True)
    try:
        config = load_config(config_file, overrides)
    except (ValueError, FileNotFoundError) as e:
        raise _fail(e) from None
    if print_config:
        click.echo(config.to_toml(), nl=False)
        return
    if resume is not None and resume.endswith(".toml") and os.path.isfile(resume):
        raise click.UsageError(f"--resume took {resume!r} as its DIR; put CONFIG.toml first "
                               f"(nanoq train {resume} --resume) or write --resume auto")
    import nanoq

    from nanoq.training import RunInUse, TrainingHalted

    try:
        run_training(config, resume=resume)
    except (ValueError, TypeError, OSError, ImportError, nanoq.NanoqError, TrainingHalted, RunInUse) as e:
        raise _fail(e) from None  # (ImportError: an optional package a setting needs, say run.tracker's)
    except KeyboardInterrupt as interrupt:
        from nanoq.checkpoint import list_checkpoints
        from nanoq.training.resume import CHECKPOINTS

        run_dir = getattr(interrupt, "run_dir", None)
        if run_dir and list_checkpoints(os.path.join(run_dir, CHECKPOINTS)):
            click.echo(f"interrupted: no final model written; the log and checkpoints so far are in {run_dir} "
                       f"(the same command with --resume continues from the last checkpoint)", err=True)
        else:  # during a new run's set-up (which removes its directory) or before its first checkpoint
            click.echo("interrupted before the run's first checkpoint: nothing to resume"
                       + (f" (the log so far is in {run_dir})" if run_dir and os.path.isdir(run_dir) else ""),
                       err=True)
        sys.exit(130)


@cli.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="New (or empty) directory for train_*.bin, eval_*.bin, tokenizer.json and tokenize.json.")
@click.option("--format", "fmt", type=click.Choice(["auto", "text", "jsonl", "sft", "nano"]), default="auto",
              show_default=True, help="auto: .jsonl/.json files are jsonl, others text. sft: prompt/response "
              "or messages lines, trained on responses only (the template goes into tokenizer_config.json as "
              "its chat_template). nano: base64-pickled token lines.")
@click.option("--text-field", default="text", show_default=True, help="jsonl: the field holding the text.")
@click.option("--split", type=click.Choice(["file", "paragraph", "line"]), default="file", show_default=True,
              help="text: what one document is.")
@click.option("--tokenizer", type=click.Path(exists=True),
              help="A Hugging Face tokenizer.json, or a model directory holding one.")
@click.option("--train-tokenizer", is_flag=True, help="Train a byte-level BPE on the training documents.")
@click.option("--vocab-size", type=Integer(1), metavar="N",
              help=f"Vocabulary of --train-tokenizer (at least {MIN_TRAINED_VOCAB}: the 256 bytes and the special "
              f"tokens); nano: the model's vocabulary.")
@click.option("--eos-token", help="--tokenizer's end-of-sequence token, written between documents (default: "
              "detected). A --train-tokenizer's is always <|endoftext|>.")
@click.option("--eos-id", type=Integer(), help="nano: a token id appended after every line (default: none).")
@click.option("--eval-fraction", type=FiniteFloat(0.0, 1.0, max_open=True), default=0.0, show_default=True,
              help="Share of documents held out as eval_*.bin.")
@click.option("--seed", type=Integer(0), default=0, show_default=True, help="Seed of the eval split.")
@click.option("--workers", type=Integer(1), default=1, show_default=True, help="Encoding processes.")
@click.option("--shard-tokens", type=Integer(1), default=100_000_000, show_default=True,
              help="Most tokens per .bin shard; shards end between documents (only a longer document is "
              "split). Training windows do not span shards: keep shards far longer than a window.")
@click.option("--packing", type=click.Choice(["stream", "pack"]),
              help="How training serves the files (recorded in tokenize.json): pack = whole documents per "
              "window, attending only to themselves; stream = windows of the document stream. Default: pack "
              "for --format sft, else stream.")
@click.option("--special-text", type=click.Choice(SPECIAL_TEXT), default="tokens", show_default=True,
              help="What text that spells a special token of the tokenizer (<|endoftext|> in a web page, a chat "
              "marker in a message) becomes: tokens = that token (as a Hugging Face tokenizer call does), "
              "text = ordinary text (as tiktoken's encode_ordinary does). The EOS between documents and the SFT "
              "template's markers are tokens either way; the documents holding such text are counted.")
def tokenize(inputs, output, fmt, text_field, split, tokenizer, train_tokenizer, vocab_size, eos_token, eos_id,
             eval_fraction, seed, workers, shard_tokens, packing, special_text):
    """Tokenize text, JSONL, SFT JSONL or Nano line files into token files.

    Every document ends with the EOS token, and the files record where
    each starts; the train/eval split is by document. The output directory
    appears only once it is complete.
    """
    from click.core import ParameterSource

    from nanoq.tokenization import InputError, import_nano, tokenize_files
    from nanoq.tokenization.sources import detect_format

    given = {name for name in ("text_field", "split")
             if click.get_current_context().get_parameter_source(name) != ParameterSource.DEFAULT}
    formats = {fmt} if fmt != "auto" else {detect_format(os.fspath(path)) for path in inputs}
    if "text_field" in given and "jsonl" not in formats:
        raise click.UsageError(f"--text-field is for JSONL inputs (--format jsonl, or .jsonl/.json files); these "
                               f"are read as {', '.join(sorted(formats))}")
    if "split" in given and "text" not in formats:
        raise click.UsageError(f"--split is for text inputs (--format text, or files other than .jsonl/.json); "
                               f"these are read as {', '.join(sorted(formats))}")
    from nanoq.backends import usable_cores

    cores, source = usable_cores()
    if workers > cores:
        click.echo(f"note: --workers {workers} is more than the {cores} cores this process may use ({source}): "
                   f"slower than --workers {cores}", err=True)
    seen = {}
    for path in inputs:
        first = seen.get(os.path.realpath(path))
        if first is not None:
            raise click.UsageError(f"input {path} is given twice{f' (as {first})' if first != path else ''}: its "
                                   f"documents would be tokenized twice")
        seen[os.path.realpath(path)] = path
    try:
        if fmt == "nano":
            if vocab_size is None:
                raise click.UsageError("--format nano needs --vocab-size (the model's vocabulary)")
            if packing is not None:
                raise click.UsageError("--packing is for documents closed by EOS, not --format nano's lines")
            if special_text != "tokens":
                raise click.UsageError("--special-text is for text; --format nano's lines are token ids already")
            result = import_nano(inputs, output, vocab_size=vocab_size, eos_id=eos_id,
                                 eval_fraction=eval_fraction, seed=seed, shard_tokens=shard_tokens)
        else:
            if train_tokenizer == (tokenizer is not None):
                raise click.UsageError("give --tokenizer PATH or --train-tokenizer --vocab-size N (one of them)")
            if train_tokenizer and vocab_size is None:
                raise click.UsageError("--train-tokenizer needs --vocab-size N")
            if vocab_size is not None and not train_tokenizer:
                raise click.UsageError("--vocab-size goes with --train-tokenizer or --format nano")
            if eos_id is not None:
                raise click.UsageError("--eos-id is for --format nano; use --eos-token")
            extra = {} if packing is None else {"packing": packing}
            result = tokenize_files(inputs, output, fmt=fmt, text_field=text_field, split=split,
                                    tokenizer=tokenizer, train_tokenizer_vocab=vocab_size or 0,
                                    eos_token=eos_token, eval_fraction=eval_fraction, seed=seed,
                                    workers=workers, shard_tokens=shard_tokens, special_text=special_text,
                                    **extra)
    except (InputError, ValueError, OSError) as e:  # (OSError: a write that failed, say a full disk)
        raise _fail(e) from None
    files = len(result.train_files) + len(result.eval_files)
    click.echo(f"wrote {result.output}: {result.documents} documents ({result.eval_documents} held out), "
               f"{result.train_tokens:,} train + {result.eval_tokens:,} eval tokens in {files} file(s), "
               f"vocab {result.vocab_size}, EOS id {result.eos_id}"
               f"{f', each document opening with BOS id(s) {result.bos_ids}' if result.bos_ids else ''} "
               f"({result.seconds:.1f}s)")
    if result.special_text_documents:
        became = ("those tokens; --special-text text encodes such text as ordinary text" if special_text == "tokens"
                  else "ordinary text (--special-text text)")
        spelled = ", ".join(f"{token} ({count})" for token, count in list(result.special_text_tokens.items())[:5])
        more = len(result.special_text_tokens) - 5
        click.echo(f"note: {result.special_text_documents} document(s) spell special tokens of the tokenizer in "
                   f"their text (documents per token: {spelled}{f' and {more} more' if more > 0 else ''}); "
                   f"that text became {became}", err=True)
    if result.untrained_documents:
        click.echo(f"note: {result.untrained_documents} document(s) hold nothing to train on (SFT conversations "
                   f"without an assistant turn): they only take room in the windows", err=True)
    if train_tokenizer and result.vocab_size < vocab_size:
        click.echo(f"note: the trained tokenizer has {result.vocab_size} tokens, fewer than --vocab-size "
                   f"{vocab_size}: the corpus had no more merges to learn", err=True)


@cli.command()
@click.argument("log", type=click.Path(exists=True))
@click.option("-o", "--output", default="loss.png", show_default=True, type=click.Path(dir_okay=False),
              help="Image to write (png, svg, pdf).")
def plot(log, output):
    """Plot train and eval loss of a run (its log.jsonl or run directory)."""
    from nanoq.plot import plot_losses

    path = os.path.join(log, "log.jsonl") if os.path.isdir(log) else log
    if os.path.isdir(log) and not os.path.isfile(path):
        raise click.ClickException(f"{log} holds no log.jsonl: give a run directory (<out_dir>/<run_name>) or "
                                   f"its log.jsonl")
    try:
        plot_losses(path, output)
    except (ImportError, ValueError, OSError) as e:
        raise _fail(e) from None
    click.echo(f"wrote {output}")


def _memory_model(config, model_path, datasets):
    """The ModelConfig to estimate: ``--model``'s config.json, else the one
    training builds: model.init_from's, or the settings' [model] with
    vocab_size 0 meaning the token files' (read as training reads them),
    or on the demo corpus its tokenizer's. ``datasets``: the token files
    opened (loop.config_datasets)."""
    from nanoq import ModelConfig
    from nanoq.training.loop import data_model_config, model_config

    if model_path is not None:
        return ModelConfig.from_pretrained(model_path)
    if config.train_data or config.curriculum:
        return data_model_config(config, datasets)
    if config.init_from or config.vocab_size:
        return model_config(config, 0)
    from nanoq.demo import DEMO_DIR
    from nanoq.tokenization.tokenizer import load_tokenizer, tokenizer_vocab_size

    return model_config(config, tokenizer_vocab_size(load_tokenizer(DEMO_DIR)))


@cli.command(context_settings=dict(max_content_width=110))
@click.argument("config_file", metavar="[CONFIG.toml]", required=False, type=click.Path(dir_okay=False))
@click.option("--model", "model_path", type=click.Path(exists=True), metavar="HF_DIR_OR_CONFIG_JSON",
              help="Estimate this Hugging Face model (a directory or its config.json) instead of [model].")
@click.option("--device-memory", type=Size(), metavar="SIZE",
              help="Memory of one device to check the fit against (80GB = 80*10^9 bytes, 80GiB = 80*2^30; "
              "what the GPU reports is best: an H100 80GB has 81559MiB, an H200 143771MiB), "
              "and on cuda to size the classifier's logits chunk as on such a GPU; default: the smallest GPU "
              "that nvidia-ml-py sees, on the cuda backend; on cpu, each device's share of the host memory "
              "available here.")
@click.option("--reserve", type=Size(allow_zero=True), metavar="SIZE",
              help="Device memory taken outside nanoq's allocator (CUDA context, cuBLASLt, NCCL), added when "
              "judging the fit; default 1GiB on cuda, 0 on cpu.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Also draw the contexts per device as stacked bars (png, svg, pdf; needs matplotlib).")
@click.option("--processes", type=Integer(1), metavar="P",
              help="Processes of the run (mpiexec -n P), each driving --devices devices of one world; default: "
              "the launcher's under a launcher, else 1.")
@functools.partial(_setting_options, memory_only=True)
def memory(config_file, model_path, device_memory, reserve, plot_path, processes, **flags):
    """Estimate the memory per device of a run, without allocating.

    The run is read as `nanoq train` reads it (defaults, CONFIG.toml, flags;
    the flags are the settings that change memory, and grad_accum;
    CONFIG.toml may hold any),
    the vocab size from the token files too; --model replaces its [model].
    Prints the bytes per context (the generation KV cache counted when
    train.sample_every > 0 samples during training), whether they fit the
    device and, when they do not, what would. --backend auto counts
    as cuda only when a GPU is usable here; give --backend cuda to estimate
    a GPU run anywhere. With --processes P the world is P x devices
    devices (as under mpiexec -n P).
    """
    from nanoq.memory import estimate_memory, human_bytes, planned_processes, visible_gpu_memory
    from nanoq.training import load_config
    from nanoq.training.loop import config_datasets, data_packing
    from nanoq.training.samples import samples_off
    from nanoq.training.settings import train_options

    if plot_path:  # before the estimate: a path that cannot be written fails at once
        from nanoq.plot import check_image_path

        try:
            check_image_path(plot_path, "nanoq memory --plot")
        except (ImportError, ValueError, OSError) as e:
            raise _fail(e) from None
    overrides = {name: value for name, value in flags.items() if value is not None}
    if model_path is not None and overrides.get("init_from"):  # (--model would win silently)
        raise click.UsageError("give the model once: --model or --init-from, not both")
    device_bytes, reserve_bytes = device_memory, reserve
    try:
        config = load_config(config_file, overrides)
        datasets = config_datasets(config)  # opened once: packed files are scanned for their documents
        model = _memory_model(config, model_path, datasets)
        # Samples during training generate: the KV cache is then part of the run.
        # A given device size also sizes the cuda classifier chunk as on that GPU.
        # Packed windows (data.packing pack, or auto on SFT files; training's or eval's) add cuda's
        # attention mask.
        options = train_options(config, data_packing(config, datasets))
        processes = planned_processes(processes, options)
        samples = config.sample_every > 0 and \
            samples_off(model.causal, processes == 1, processes, processes * options.devices) is None
        estimate = estimate_memory(model, options, reserve_bytes=reserve_bytes, processes=processes,
                                   generates=samples, device_memory=device_bytes)
    except (ValueError, FileNotFoundError) as e:
        raise _fail(e) from None
    from nanoq.distributed import launcher_world

    world = launcher_world()
    if world is not None and world[0] != 0:  # under mpiexec every process estimates; the first one says it
        return
    from_nvml = device_bytes is None and estimate.options.backend == "cuda"
    from_host = device_bytes is None and estimate.options.backend == "cpu"
    if from_nvml:
        device_bytes = visible_gpu_memory()
    host_note = None
    if from_host:
        from nanoq._core import cpu_host_memory

        # The cpu backend's devices are threads sharing the host's memory (and the processes of a
        # launcher, taken to run on this machine): each its share.
        host_bytes, source = cpu_host_memory()
        if host_bytes:
            devices = estimate.world_devices
            device_bytes = host_bytes // devices
            host_note = (f"(the device memory is this machine's available host memory, {human_bytes(host_bytes)}"
                         + (f", shared by the {devices} cpu devices" if devices > 1 else "") + f": {source})")
    click.echo(estimate.table(device_bytes))
    if device_bytes is not None:
        if from_nvml:
            click.echo("(the device memory is that of the smallest GPU nvidia-ml-py sees here)")
        if host_note:
            click.echo(host_note)
        # Shares of one host memory: offloading to it or more devices (smaller shares) would not help.
        for line in estimate.suggestions(device_bytes, shared_host=host_note is not None):
            click.echo(f"  suggestion: {line}")
    elif from_nvml:
        click.echo("(no GPU that nvidia-ml-py sees here to check the fit against: give --device-memory SIZE, "
                   "e.g. 81559MiB for an H100 80GB, for a verdict and suggestions)")
    if plot_path:
        from nanoq.plot import plot_memory

        try:
            plot_memory(estimate, plot_path, device_bytes)
        except (ImportError, ValueError, OSError) as e:
            raise _fail(e) from None
        click.echo(f"wrote {plot_path}")


@cli.command("export")
@click.argument("checkpoint", type=click.Path())
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="New directory for the Hugging Face model (must not exist).")
@click.option("--max-shard-size", type=Size(), default="5GiB", show_default=True,
              help="Largest safetensors file; bigger models are sharded with an index (5GB = 5*10^9 bytes, "
              "5GiB = 5*2^30).")
@click.option("--tokenizer", type=click.Path(exists=True, file_okay=False),
              help="Directory whose tokenizer files to include (default: the checkpoint's tokenizer).")
@click.option("--max-position-embeddings", type=Integer(1),
              help="Context length written to config.json (default: the checkpoint's).")
@click.option("--merge", is_flag=True,
              help="LoRA checkpoints: merge the adapters into the base model and write the full model "
              "(default: write the adapters as a PEFT adapter directory).")
@click.option("--base-model", type=click.Path(exists=True),
              help="LoRA checkpoints: the base model the adapters were trained on, if it has moved (default: "
              "the one the checkpoint recorded); another architecture or other weights are refused.")
@click.option("--allow-non-finite", is_flag=True,
              help="Write the weights even if some are NaN or infinite (refused by default).")
def export(checkpoint, output, max_shard_size, tokenizer, max_position_embeddings, merge, base_model,
           allow_non_finite):
    """Write a checkpoint's weights as a Hugging Face model directory.

    CHECKPOINT is a step directory, a checkpoint root or a run directory
    (its checkpoints/): of a root, the newest valid step, named in the
    output with any newer step directory that was passed over.
    transformers loads the result with AutoModelForCausalLM. A LoRA
    checkpoint holds only adapters: it is written as a PEFT adapter
    (adapter_config.json + adapter_model.safetensors, for
    peft.PeftModel.from_pretrained), or with --merge as a full model.
    """
    from nanoq.checkpoint import STATE_FILE, list_checkpoints, list_step_dirs, read_state, step_dir_name
    from nanoq.hf_export import export_checkpoint
    from nanoq_cli.inference import checkpoint_root

    max_shard_bytes = max_shard_size
    if not os.path.exists(checkpoint):
        raise click.ClickException(f"no checkpoint at {checkpoint}: give a step directory, a checkpoint root or a "
                                   f"run directory")
    checkpoint = checkpoint_root(checkpoint)  # a run directory: its checkpoints
    try:
        # A root: its newest valid step (by number, as --resume takes it, whatever `latest` says),
        # named, with the newer step directories it passed over.
        complete = [] if os.path.isfile(os.path.join(checkpoint, STATE_FILE)) else list_checkpoints(checkpoint)
        if complete:
            newer = [step_dir_name(n) for n in list_step_dirs(checkpoint) if n > complete[-1]]
            checkpoint = os.path.join(os.path.abspath(checkpoint), step_dir_name(complete[-1]))
            click.echo(f"exporting {checkpoint}, the newest valid checkpoint of {os.path.dirname(checkpoint)}"
                       + (f" (passed over, not valid: {', '.join(newer)})" if newer else ""))
        if merge and not read_state(checkpoint).get("lora"):
            raise click.UsageError("--merge is for LoRA checkpoints; this one holds full weights (export it "
                                   "without --merge)")
        directory = export_checkpoint(checkpoint, output, max_position_embeddings=max_position_embeddings,
                                      tokenizer_dir=tokenizer, max_shard_bytes=max_shard_bytes,
                                      merge_adapters=merge, base_model=base_model,
                                      allow_non_finite=allow_non_finite)
    except (ValueError, TypeError, OSError) as e:
        raise click.ClickException(f"cannot export {checkpoint}: {e}") from None
    click.echo(f"wrote {directory}")


@cli.command()
def info():
    """Version, backends built into this install and the devices they see."""
    import platform

    import nanoq

    click.echo(f"nanoq {nanoq.__version__} (Python {platform.python_version()}, {platform.machine()})")
    click.echo(f"package: {os.path.dirname(nanoq.__file__)}")
    for entry in nanoq.backends():
        if entry["built"]:
            detail = f" - {entry['detail']}" if entry["detail"] else ""
            click.echo(f"backend {entry['name']}: {entry['devices']} device(s){detail}")
        else:
            click.echo(f"backend {entry['name']}: {entry['detail'] or 'not built'}")


@cli.group()
def convert():
    """Convert another trainer's configs to a nanoq config."""


def _stage_steps(ctx, param, text):
    """--stage-steps "N[,N...]" as a list of integers (None when not given)."""
    if text is None:
        return None
    try:
        return [Integer().convert(part, param, ctx) for part in text.split(",")]
    except click.BadParameter:
        raise click.BadParameter(f"expected comma-separated integers (each within 64 bits), got {text!r}") from None


@convert.command("nano-config")
@click.argument("model_config", type=click.Path(dir_okay=False))
@click.argument("train_config", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The nanoq TOML to write.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--data-dir", default="data", show_default=True,
              help="Where Nano's data files are imported, one directory each (relative to the working directory; "
              "the config names the files by their absolute paths).")
@click.option("--stage-steps", metavar="N[,N...]", callback=_stage_steps,
              help="Optimizer steps of each dataset_path pair (default: one pass over each train file's lines).")
@click.option("--init-from", type=click.Path(file_okay=False),
              help="A Hugging Face model directory to start from, in place of Nano's from_checkpoint "
              "(model.init_from; e.g. the model/ of a nanoq pretraining run).")
@click.option("--import-data", is_flag=True,
              help="Also import the Nano data files into --data-dir (nanoq tokenize --format nano); files "
              "imported before are kept.")
def nano_config(model_config, train_config, output, force, data_dir, stage_steps, init_from, import_data):
    """Write a nanoq config from Nano's model and train configs.

    MODEL_CONFIG and TRAIN_CONFIG are the JSON files Nano's train.py takes
    with -m and -t. Every Nano key is mapped or named on stderr with the
    reason it is not, and a mapping that still differs from Nano is named
    with its caveat (both also as comments in OUTPUT); see
    docs/nano-migration.md.
    """
    from nanoq.nano_config import convert_nano_config, read_nano_configs, write_nano_toml

    try:
        model_values, train_values = read_nano_configs(model_config, train_config)
        # Absolute: the imports run here, and a TOML's paths are relative to its own folder.
        conversion = convert_nano_config(model_values, train_values, data_dir=os.path.abspath(data_dir),
                                         stage_steps=stage_steps,
                                         init_from=os.path.abspath(init_from) if init_from else "")
        write_nano_toml(conversion, output, sources=(model_config, train_config), force=force)
    except (ValueError, TypeError, OSError) as e:
        raise _fail(e) from None
    for entry in conversion.unmapped:
        click.echo(f"warning: not mapped: {entry}", err=True)
    for entry in conversion.caveats:
        click.echo(f"warning: mapped with a caveat: {entry}", err=True)
    click.echo(f"wrote {output}: {len(conversion.mapped)} Nano keys mapped ({len(conversion.caveats)} with a "
               f"caveat), {len(conversion.unmapped)} not (see the warnings above and the comments in {output})")
    vocab = conversion.config.vocab_size
    if import_data:
        from nanoq.tokenization import import_nano

        for item in conversion.imports:
            if os.path.exists(os.path.join(item.output, "tokenize.json")):
                click.echo(f"{item.output} is already imported; kept")
                continue
            try:
                result = import_nano([item.source], item.output, vocab_size=vocab)
            except (ValueError, OSError) as e:  # InputError is a ValueError
                raise click.ClickException(f"cannot import {item.source}: {e}") from None
            click.echo(f"imported {item.source}: {result.documents:,} lines, {result.train_tokens:,} tokens "
                       f"-> {item.output}")
    else:
        click.echo("import the data with:")
        for item in conversion.imports:
            click.echo(f"  {item.command(vocab)}")
    click.echo(f"then train: nanoq train {output}")


cli.add_command(inference.generate)
cli.add_command(inference.eval_command)


def main():
    """The `nanoq` command: under a launcher, an error that ends one process
    (click's usage errors and `Error:` exits included) ends every process of
    the run, so that none waits for a process that is gone. SIGTERM (a
    scheduler cancelling the job) unwinds as Ctrl-C does, so that what a
    command was writing is removed rather than left half made (the training
    loop stops at a step's end with a checkpoint instead, and a second
    signal ends the process at once, see nanoq.training.stop)."""
    import signal

    from nanoq.distributed import abort_on_failure
    from nanoq.training.stop import end_process_on_second_signal

    signal.signal(signal.SIGTERM, _terminated)
    end_process_on_second_signal()
    return abort_on_failure(cli)


def _terminated(number, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
