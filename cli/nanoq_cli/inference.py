"""`nanoq generate` and `nanoq eval`: a trained model's text and loss.

MODEL is a Hugging Face model folder (config.json + safetensors), a nanoq
run folder or a checkpoint (a step directory or a checkpoint root). A run
folder means the model of its newest step: the model its last finish
exported (model/, or model-step<N>/ after a resumed run's finish) unless a
checkpoint is newer, then that checkpoint. A LoRA checkpoint runs its
adapters unmerged on the base model it recorded.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import click

from nanoq.data.objectives import OBJECTIVES
from nanoq_cli.numbers import FiniteFloat, Integer

BACKENDS = ("auto", "cpu", "cuda", "cuda_emulated")
DEFAULT_NEW_TOKENS = 64  # nanoq generate's --max-new-tokens
RUN_MODEL = "model"          # the final model a finished run exports
RUN_CHECKPOINTS = "checkpoints"
RUN_LOG = "log.jsonl"


@dataclass
class ModelSource:
    """Where a model's weights, architecture and tokenizer come from."""
    kind: str                   # "hf" or "checkpoint"
    path: str                   # the HF folder, or the checkpoint's step directory
    config: object              # nanoq.ModelConfig
    tokenizer_dir: Optional[str]
    max_positions: Optional[int]
    trained_seq_len: Optional[int] = None
    lora: object = None         # nanoq.lora.LoraConfig of a LoRA checkpoint
    base_model: Optional[str] = None
    note: Optional[str] = None  # which of a run folder's models this is, when it held several


def checkpoint_root(path: str) -> str:
    """A run directory's checkpoints/ folder; any other path as it is."""
    return os.path.join(path, RUN_CHECKPOINTS) if os.path.isdir(os.path.join(path, RUN_CHECKPOINTS)) else path


def _last_finish(run: str) -> Optional[tuple]:
    """(step, model folder) of the last finish of the run folder `run`, from
    its log.jsonl's last "end" record: None without one, or when the model
    of that finish is not there any more. The folder (an export, or for a
    model transformers cannot load the final checkpoint) is looked up in
    `run` by name: the record holds the path the run had then."""
    from nanoq.checkpoint import STATE_FILE

    try:
        with open(os.path.join(run, RUN_LOG), encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"end"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or record.get("type") != "end":
            continue
        step, model_dir = record.get("step"), record.get("model_dir")
        if not isinstance(step, int) or not isinstance(model_dir, str) or not model_dir:
            return None
        parent, name = os.path.split(os.path.normpath(model_dir))
        if os.path.basename(parent) == RUN_CHECKPOINTS:
            folder, marker = os.path.join(run, RUN_CHECKPOINTS, name), STATE_FILE
        else:
            folder, marker = os.path.join(run, name), "config.json"
        return (step, folder) if os.path.isfile(os.path.join(folder, marker)) else None
    return None


def _exports(run: str) -> list:
    """The run folder's exported models, oldest first: model/, then the
    model-step<N>[-k]/ of later finishes (by N, then k)."""
    found = []
    for name in os.listdir(run):
        match = re.fullmatch(rf"{RUN_MODEL}(?:-step(\d+)(?:-(\d+))?)?", name)
        if match and os.path.isfile(os.path.join(run, name, "config.json")):
            found.append(((int(match[1] or -1), int(match[2] or 1)), name))
    return [os.path.join(run, name) for _, name in sorted(found)]


def _run_model(run: str) -> Optional[tuple]:
    """(path, note) of the model a run folder means (see the module
    docstring), note None when the folder held no other; None when it holds
    neither an exported model nor checkpoints."""
    from nanoq.checkpoint import CheckpointError, read_state

    exports = _exports(run)
    try:
        newest = read_state(checkpoint_root(run)) if os.path.isdir(os.path.join(run, RUN_CHECKPOINTS)) else None
    except CheckpointError:
        newest = None
    finish = _last_finish(run)
    if newest is not None and (finish is None and not exports or finish is not None and newest["step"] > finish[0]):
        note = (f"{newest['path']}, the newest checkpoint (step {newest['step']}), newer than the run's last "
                f"exported model" if finish is not None or exports else None)
        return newest["path"], note
    if finish is not None:  # the newest step's model (a checkpoint of its step holds the same)
        path, what, others = finish[1], f"the model of the run's last finish (step {finish[0]})", len(exports) - 1
    elif exports:  # no log to date them by: the last export, which a checkpoint may postdate
        path, what, others = exports[-1], "the run's latest exported model", len(exports) - 1 + (newest is not None)
    else:
        return None
    return path, (f"{path}, {what}" if others > 0 else None)


def find_model(path: str) -> ModelSource:
    """The ModelSource of MODEL (see the module docstring); ValueError when
    `path` is none of those."""
    from nanoq import ModelConfig
    from nanoq.checkpoint import CheckpointError, read_state, recorded_tokenizer_dir
    from nanoq.lora import LoraConfig

    if os.path.isfile(os.path.join(path, "config.json")):
        config = ModelConfig.from_pretrained(path)
        tokenizer = path if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
        return ModelSource("hf", path, config, tokenizer, config.max_position_embeddings)
    run = _run_model(path) if os.path.isdir(path) else None
    if run is not None:
        source = find_model(run[0])
        source.note = run[1]
        return source
    root = checkpoint_root(path)
    try:
        state = read_state(root)
    except CheckpointError as e:
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ValueError(f"{path} is a PEFT adapter (adapter_config.json), not a model: give the run or "
                             f"checkpoint it came from (its adapters run on the base it recorded), or a model "
                             f"exported with them merged (nanoq export CHECKPOINT --merge)") from None
        raise ValueError(f"{path} is not a Hugging Face model folder (no config.json), a run folder or a "
                         f"checkpoint: {e}") from None
    lora = LoraConfig(**state["lora"]) if state.get("lora") else None
    return ModelSource("checkpoint", state["path"], ModelConfig(**state["model_config"]),
                       recorded_tokenizer_dir(state), state.get("max_position_embeddings"),
                       trained_seq_len=state["options"].get("seq_len"), lora=lora, base_model=state.get("base_model"))


def say_which(source: ModelSource) -> None:
    """Names, on stderr, which of a run folder's models `source` is, when it held several."""
    if source.note:
        click.echo(f"model: {source.note}", err=True)


def open_trainer(source: ModelSource, backend: str, seq_len: int, batch_size: int = 1):
    """A Trainer of `source`'s model with its weights (one device), for
    forward passes only: TrainOptions.inference (no gradients or optimizer
    state, and none of the activations a backward would read)."""
    import nanoq
    from nanoq.checkpoint import read_weights

    options = nanoq.TrainOptions(backend=backend, batch_size=batch_size, seq_len=seq_len, lora=source.lora,
                                 inference=True)
    trainer = nanoq.Trainer(source.config, options)
    try:
        if source.kind == "hf":
            trainer.import_weights(source.path)
        else:
            if source.lora is not None:
                if not source.base_model or not os.path.exists(source.base_model):
                    raise ValueError(f"{source.path}: the LoRA checkpoint's base model {source.base_model!r} is "
                                     f"not there any more; export it with nanoq export --merge --base-model")
                trainer.import_weights(source.base_model)
            trainer.set_weights(read_weights(source.path), trainable_only=True)
    except BaseException:
        trainer.close()
        raise
    return trainer


def _load_tokenizer(source: ModelSource, what: str):
    from nanoq.tokenization.tokenizer import load_tokenizer

    if source.tokenizer_dir is None:
        raise ValueError(f"{source.path} has no tokenizer (tokenizer.json) for {what}: pass --tokenizer FOLDER, "
                         f"or give a model folder that holds one, or a checkpoint whose run recorded one")
    return load_tokenizer(source.tokenizer_dir)


@click.command("generate")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", help="The text to continue (encoded with the model's tokenizer).")
@click.option("--prompt-ids", metavar="IDS",
              help="Instead of --prompt: the token ids to continue, separated by spaces or commas (e.g. \"5 17 "
              "3\"), for a model without a tokenizer.json (a Nano import's); prints the completion's ids.")
@click.option("--max-new-tokens", type=Integer(0),
              help=f"Most tokens to generate (fewer when the tokenizer's end-of-sequence token comes first); "
              f"default {DEFAULT_NEW_TOKENS}, or fewer where the model's positions leave less after the prompt.")
@click.option("--temperature", type=FiniteFloat(0.0), default=1.0, show_default=True,
              help="Softmax temperature; 0 is greedy (the most likely token each time).")
@click.option("--top-k", type=Integer(0), default=0, show_default=True,
              help="Sample among the K most likely tokens only (0: all).")
@click.option("--top-p", type=FiniteFloat(0.0, 1.0, min_open=True), default=1.0, show_default=True,
              help="Sample among the most likely tokens whose probability reaches P (1: all).")
@click.option("--seed", type=Integer(0), default=0, show_default=True, help="Seed of the sampling.")
@click.option("--steps", type=Integer(1),
              help="Bidirectional (denoising) models only: unmasking passes over the whole sequence, at most "
              "--max-new-tokens (default: --max-new-tokens, one position per pass).")
@click.option("--mask-token", metavar="ID|TEXT",
              help="Bidirectional models only: the mask token, an id or the token's text (default: the run's "
              "data.mask_token for a run's checkpoint, else the tokenizer's: its tokenizer_config.json "
              "mask_token, else <mask>, [MASK] or <|mask|>).")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(exists=True, file_okay=False),
              help="A folder holding the tokenizer.json to use (default: the model's: a Hugging Face folder's "
              "own, or the one a checkpoint's run recorded).")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True)
@click.option("--json", "as_json", is_flag=True,
              help="Print an object {prompt, completion, prompt_ids, completion_ids} instead of the text (with "
              "--prompt-ids, the texts only where the model has a tokenizer).")
def generate(model, prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, steps, mask_token,
             tokenizer_dir, backend, as_json):
    """Continue PROMPT with MODEL (a Hugging Face model folder with its
    tokenizer, a run folder or a checkpoint) and print the continuation.
    A bidirectional model (model.causal false) fills --max-new-tokens
    masked positions after the prompt in --steps passes, the most confident
    first (Trainer.denoise)."""
    from nanoq.tokenization.tokenizer import eos_id_or_none

    try:
        if (prompt is None) == (prompt_ids is None):
            raise ValueError("give the prompt as --prompt TEXT or as --prompt-ids IDS (one of them)")
        prompt_ids_given = prompt_ids is not None
        source = find_model(model)
        say_which(source)
        if tokenizer_dir is not None:
            if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
                raise ValueError(f"--tokenizer {tokenizer_dir} holds no tokenizer.json")
            source.tokenizer_dir = tokenizer_dir
        tokenizer = eos = None
        if prompt is not None or source.tokenizer_dir is not None:
            tokenizer = _load_tokenizer(source, "--prompt (give --prompt-ids to continue token ids)")
            eos = eos_id_or_none(tokenizer, os.path.join(source.tokenizer_dir, "tokenizer.json"))
        if prompt is not None:
            prompt_ids = tokenizer.encode(prompt).ids
        else:
            prompt_ids = _token_ids(prompt_ids, source.config.vocab_size)
            prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False) if tokenizer is not None else None
        causal = source.config.causal
        if causal and not prompt_ids:
            raise ValueError("--prompt encodes to no tokens: give some text")
        if causal and (steps is not None or mask_token is not None):
            raise ValueError(f"--steps and --mask-token are for bidirectional (denoising) models; {model} is "
                             f"causal")
        max_new_tokens_given = max_new_tokens is not None
        if max_new_tokens is None:  # the default, within what the model's positions leave
            positions = source.max_positions if causal else (source.trained_seq_len or source.max_positions)
            max_new_tokens = DEFAULT_NEW_TOKENS
            if positions and len(prompt_ids) < positions:
                max_new_tokens = min(DEFAULT_NEW_TOKENS, positions - len(prompt_ids))
        seq_len = len(prompt_ids) + max_new_tokens
        if source.max_positions and seq_len > source.max_positions:
            asked = f" and --max-new-tokens ({max_new_tokens}) exceed" if max_new_tokens_given else " exceeds"
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens){asked} the model's {source.max_positions} "
                             f"positions")
        if not causal:
            run_config = _run_config(source)
            if run_config is not None and run_config.objective == "seq2seq":
                raise ValueError(f"{model} was trained for train.objective seq2seq; nanoq generate fills masked "
                                 f"positions as a denoise-trained model learned to, which this one never saw "
                                 f"(nanoq eval scores it on its objective)")
            if mask_token is None and run_config is not None:
                mask_token = run_config.mask_token or None
            mask_id = _mask_id(mask_token, source.tokenizer_dir, source.config.vocab_size, "generate")
            if steps is not None and steps > max_new_tokens:
                raise ValueError(f"--steps {steps} is more than --max-new-tokens {max_new_tokens}: each pass fills "
                                 f"at least one position")
        if not causal:
            # Denoising fills a block of the window it was trained on (see Trainer.denoise).
            window = source.trained_seq_len or source.max_positions or seq_len
            if window < seq_len:
                raise ValueError(f"the prompt ({len(prompt_ids)} tokens) and --max-new-tokens ({max_new_tokens}) "
                                 f"exceed the {window} positions the model was trained on")
            seq_len = window
        with open_trainer(source, backend, max(seq_len, 1)) as trainer:
            if causal:
                completion_ids = trainer.generate(prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                                                  top_p=top_p, seed=seed, stop=_stop_ids(source, eos))
            else:
                completion_ids = trainer.denoise(prompt_ids, max_new_tokens, steps or max_new_tokens, mask_id,
                                                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
                if eos in completion_ids:  # as a causal model's generation stops there
                    completion_ids = completion_ids[:completion_ids.index(eos) + 1]
    except (ValueError, TypeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    completion = tokenizer.decode(completion_ids, skip_special_tokens=True) if tokenizer is not None else None
    if as_json:
        texts = dict(prompt=prompt, completion=completion) if tokenizer is not None else {}
        click.echo(json.dumps(dict(**texts, prompt_ids=prompt_ids, completion_ids=completion_ids)))
    elif prompt_ids_given:
        click.echo(" ".join(map(str, completion_ids)))
    else:
        click.echo(completion)


def _token_ids(text: str, vocab_size: int) -> list:
    """The ids of --prompt-ids (separated by spaces or commas), each below ``vocab_size``."""
    words = text.replace(",", " ").split()
    if not words:
        raise ValueError("--prompt-ids holds no token ids: give some, e.g. \"5 17 3\"")
    bad = [word for word in words if not word.isdigit()]
    if bad:
        raise ValueError(f"--prompt-ids must be token ids (non-negative integers) separated by spaces or commas; "
                         f"got {bad[0]!r}")
    ids = [int(word) for word in words]
    if max(ids) >= vocab_size:
        raise ValueError(f"--prompt-ids: token id {max(ids)} is not below the model's vocab size {vocab_size}")
    return ids


def _stop_ids(source: ModelSource, eos: Optional[int]) -> list:
    """Where a causal generation stops, as transformers' generate() would:
    the tokenizer's EOS and the eos_token_id (an id or a list, e.g. an
    instruct model's end-of-turn ids) of the model's config.json and
    generation_config.json (a Hugging Face folder's own; a checkpoint's
    tokenizer folder's, which is its base model's when it was imported)."""
    from nanoq.durable import read_json_object

    stop = [] if eos is None else [eos]
    folders = [source.path] if source.kind == "hf" else []
    if source.tokenizer_dir and source.tokenizer_dir not in folders:
        folders.append(source.tokenizer_dir)
    for folder in folders:
        for name in ("config.json", "generation_config.json"):
            try:
                ids = read_json_object(os.path.join(folder, name)).get("eos_token_id")
            except (OSError, ValueError):
                continue  # absent or not a config: the tokenizer's EOS stands
            for token in ids if isinstance(ids, list) else [ids]:
                if isinstance(token, int) and not isinstance(token, bool) \
                        and 0 <= token < source.config.vocab_size and token not in stop:
                    stop.append(token)
    return stop


def _run_config(source: ModelSource):
    """The TrainConfig of the run `source` belongs to (its config.toml: two
    folders above a checkpoint's step directory; beside an exported model,
    in a folder that also holds the run's log), or None."""
    path = os.path.abspath(source.path)
    run = os.path.dirname(os.path.dirname(path) if source.kind == "checkpoint" else path)
    if not os.path.isfile(os.path.join(run, "config.toml")) or \
            source.kind == "hf" and not os.path.isfile(os.path.join(run, RUN_LOG)):
        return None
    from nanoq.training import load_config

    return load_config(os.path.join(run, "config.toml"))


def _eval_objective(source: ModelSource, objective: Optional[str], model: str) -> str:
    """The objective nanoq eval scores `source` by: --objective, else its
    run's train.objective, else causal for a causal model; ValueError for a
    bidirectional model without either, and for one that does not fit."""
    if objective is None and source.config.causal:
        objective = "causal"  # the only objective a causal model trains for
    elif objective is None:
        config = _run_config(source)
        objective = config.objective if config is not None else None
    if objective is None:
        raise ValueError(f"{model} is a bidirectional (denoising) model from no nanoq run: give --objective "
                         f"seq2seq or denoise, what it was trained for")
    if (objective == "causal") != source.config.causal:
        raise ValueError(f"--objective {objective} does not fit {model}, a "
                         f"{'causal' if source.config.causal else 'bidirectional'} model (causal is for causal "
                         f"models; seq2seq and denoise for bidirectional ones)")
    return objective


def _mask_id(mask_token: Optional[str], tokenizer_dir: str, vocab_size: int, command: str) -> int:
    """The id --mask-token names (digits: an id; else a token's text), or the tokenizer's mask token;
    a ValueError names nanoq ``command``'s option."""
    from nanoq.tokenization.tokenizer import find_mask_id

    try:
        return find_mask_id(tokenizer_dir, mask_token or "", vocab_size)
    except ValueError as e:
        raise ValueError(f"{str(e).removesuffix(' (data.mask_token)')}; for nanoq {command}: pass --mask-token "
                         f"ID|TEXT") from None


def evaluate(trainer, dataset, max_batches: int = 0, seed: int = 0) -> dict:
    """Mean loss (over every counted target token) and perplexity of
    `trainer` on the windows of `dataset` (nanoq.data.Dataset), in batches of
    the trainer's rows; at most `max_batches` batches (0: all). seed: the
    denoise objective's draws (nanoq.data.EvalLoader)."""
    from nanoq.data import EvalLoader

    loader = EvalLoader(dataset, batch_rows=trainer.options.devices * trainer.options.batch_size, seed=seed)
    loss_sum, tokens, batches = 0.0, 0, 0
    for batch in loader:  # (inputs, targets), and positions when the dataset packs documents
        if max_batches and batches == max_batches:
            break
        stats = trainer.validate(*batch)
        loss_sum += stats.loss * stats.tokens
        tokens += stats.tokens
        batches += 1
    if tokens == 0:
        raise ValueError("the evaluated windows hold no counted target tokens (every target is masked)")
    loss = loss_sum / tokens
    return dict(loss=loss, perplexity=math.exp(loss) if loss < 700 else math.inf, tokens=tokens,
                batches=batches, windows=min(dataset.num_windows, batches * loader.batch_rows))


@click.command("eval")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option("--data", required=True, metavar="GLOB", help='Token files (.bin) to evaluate on, e.g. "eval_*.bin".')
@click.option("--seq-len", type=Integer(1),
              help="Window length (default: a checkpoint's training seq_len, else the model's positions, at "
              "most 1024).")
@click.option("--batches", type=Integer(0), default=0, show_default=True,
              help="Evaluate at most this many batches (0: every window).")
@click.option("--batch-size", type=Integer(1), default=4, show_default=True, help="Windows per batch.")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True)
@click.option("--window-step", type=Integer(1), metavar="N",
              help="Tokens from one window's start to the next: seq_len (windows sharing a token) or seq_len + 1 "
              "(disjoint) for the causal objective (default: the model's run's data.window_step when it "
              "evaluates at the run's seq_len, as the run's evaluations did, else seq_len).")
@click.option("--packing", type=click.Choice(["stream", "pack", "auto"]),
              help="stream: windows of the token stream; pack: whole documents per window, each attending "
              "only to itself (nanoq.data.loader); auto: what the files' tokenize.json says (pack for "
              "nanoq tokenize --format sft). Default: the model's run's data.packing, else auto.")
@click.option("--objective", type=click.Choice(OBJECTIVES),
              help="What the targets are (nanoq.data.objectives): causal = the next token; seq2seq and denoise "
              "for bidirectional models (default: the model's run's train.objective, else causal).")
@click.option("--mask-token", metavar="ID|TEXT",
              help="--objective denoise: the mask token, an id or the token's text (default: the run's "
              "data.mask_token, else the tokenizer's).")
@click.option("--seed", type=Integer(0),
              help="--objective denoise: the seed of the masks drawn per window (default: the run's "
              "train.seed, as its evaluations drew them, else 0).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def eval_command(model, data, seq_len, batches, batch_size, backend, window_step, packing, objective, mask_token, seed,
                 as_json):
    """Mean loss and perplexity of MODEL (a Hugging Face model folder, a run
    folder or a checkpoint) on the windows of token files, as training
    evaluates them: seq_len + 1 tokens per window for the causal objective,
    and the windows of a bidirectional model's objective; the windows' step,
    packing and objective are its run's unless the options say."""
    from nanoq.data import Dataset

    try:
        source = find_model(model)
        say_which(source)
        if seq_len is None:
            seq_len = source.trained_seq_len or min(source.max_positions or 1024, 1024)
        if source.max_positions and seq_len > source.max_positions:
            raise ValueError(f"--seq-len {seq_len} exceeds the model's {source.max_positions} positions")
        objective = _eval_objective(source, objective, model)
        try:
            run_config, unreadable = _run_config(source), None
        except ValueError as e:  # a config.toml of another nanoq version, say
            run_config, unreadable = None, e
        mask_id = None
        if objective == "denoise":
            if unreadable is not None:  # its masks are the run's: no defaults stand in for them
                raise unreadable
            run_mask = run_config.mask_token or None if run_config is not None else None
            mask_id = _mask_id(mask_token if mask_token is not None else run_mask, source.tokenizer_dir,
                               source.config.vocab_size, "eval")
            if seed is None:
                seed = run_config.seed if run_config is not None else 0
        elif mask_token is not None or seed is not None:
            raise ValueError("--mask-token and --seed are for --objective denoise")
        if unreadable is not None:  # the windows' defaults stand
            click.echo(f"warning: the windows are cut by the options and defaults, not by the model's run: "
                       f"{unreadable}", err=True)
        if run_config is not None and run_config.seq_len == seq_len and run_config.objective == objective:
            # The windows the run's own evaluations had (a Nano import's one window per line, say).
            window_step = window_step or run_config.window_step or None
            packing = packing or run_config.packing
        packing = packing or "auto"  # (for seq2seq and denoise: the stream, whatever the files were tokenized for)
        dataset = Dataset(data, seq_len, window_step=window_step, packing=packing, objective=objective,
                          mask_token=mask_id)
        if dataset.vocab_size > source.config.vocab_size:
            raise ValueError(f"the token files have vocab size {dataset.vocab_size}, more than the model's "
                             f"{source.config.vocab_size}: they were tokenized for another model")
        # (ids may pass the header's vocab: llm.q's added EOS)
        dataset.check_vocab(source.config.vocab_size, f"the model {model}", trained=False)
        with open_trainer(source, backend, seq_len, batch_size) as trainer:
            result = evaluate(trainer, dataset, batches, seed or 0)
    except (ValueError, TypeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    result = dict(model=model, data=data, seq_len=seq_len, window_step=dataset.window_step, **result)
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(f"loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}  ({result['tokens']:,} tokens "
                   f"in {result['windows']} windows of {seq_len}, {result['batches']} batches)")
