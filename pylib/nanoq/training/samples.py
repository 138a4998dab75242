"""Samples during training: greedy continuations of a few prompts every ``train.sample_every`` steps
and after the run's last step.

The training trainer generates them itself (Trainer.generate, greedy, no
second model); the root prints each one and writes it to log.jsonl as

    {"type": "sample", "step": 60, "index": 0, "prompt": "...", "completion": "...", "time": ...}

(``index``: the prompt's place in train.sample_prompts). Generation reads
the weights and fills only the KV cache, so a run with samples trains
bitwise as one without.

Prompts: ``train.sample_prompts``, encoded with the data's tokenizer (the
tokenizer.json beside the train files, or the demo's); by default the start
of the first document of the eval data (of the train data without eval data):
its first DEFAULT_PROMPT_TOKENS tokens (at most half of data.seq_len), after
any leading end-of-sequence tokens and before the next one, shown decoded,
or as token ids when the data has no tokenizer. In data with a mask (SFT)
the prompt also stops before the document's first trained token, so it is
the document's prompt without its reply and the sample is the model's
reply (a document whose first token is trained gives its start, as without
a mask). A sample has at most ``train.sample_tokens`` new tokens, fewer
when the end-of-sequence token comes first or the prompt and sample would
pass data.seq_len.
"""
from __future__ import annotations

import os
from typing import Callable, List, NamedTuple, Optional

import numpy as np

DEFAULT_PROMPT_TOKENS = 16


class Prompt(NamedTuple):
    """One sample prompt: as shown (``text``) and as the model reads it (``ids``)."""

    text: str
    ids: List[int]


class Samples:
    """The prompts of a run and how to continue and show them: samples after
    every ``every`` steps and after step ``last`` (the run's last; 0: none),
    of at most ``max_new_tokens`` new tokens within ``seq_len`` positions
    (the trainer's), decoded with ``tokenizer`` (a tokenizers.Tokenizer;
    None: shown as ids) and ending after the token ``stop`` (the
    end-of-sequence id; None: none)."""

    def __init__(self, every: int, prompts: List[Prompt], max_new_tokens: int, seq_len: int, tokenizer=None,
                 stop: Optional[int] = None, last: int = 0):
        self.every = every
        self.last = last
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.seq_len = seq_len
        self.tokenizer = tokenizer
        self.stop = stop

    def due(self, step: int) -> bool:
        """Whether samples are written after ``step`` updates: every
        ``every`` steps and after the run's last step (``last``)."""
        return bool(self.every) and step > 0 and (step % self.every == 0 or step == self.last)

    def decode(self, ids: List[int]) -> str:
        """Text of ``ids``: decoded with the tokenizer, else the ids separated by spaces."""
        if self.tokenizer is None:
            return " ".join(str(token) for token in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def write(self, trainer, step: int, log, emit: Callable[[str], None], elapsed: float) -> None:
        """Generates every prompt's sample with ``trainer``, logs it as a
        ``sample`` record at ``step`` and prints it with ``emit``."""
        for index, prompt in enumerate(self.prompts):
            budget = min(self.max_new_tokens, self.seq_len - len(prompt.ids))
            completion_ids = trainer.generate(prompt.ids, budget, temperature=0.0,
                                              stop=() if self.stop is None else (self.stop,))
            completion = self.decode(completion_ids)
            log.write(type="sample", step=step, index=index, prompt=prompt.text, completion=completion,
                      time=elapsed)
            emit(f"sample @ step {step}: {prompt.text!r} -> {completion!r}")


def document_start(tokens: np.ndarray, eos: Optional[int], limit: int,
                   mask: Optional[np.ndarray] = None) -> List[int]:
    """The first ``limit`` tokens of the first document of ``tokens``: after
    any leading ``eos`` tokens, up to (not including) the next one.

    ``mask``: None, or bool [len(tokens)], True = trained on (an SFT mask).
    With it the tokens also stop before the document's first trained token,
    so an SFT document gives its prompt without the reply; when the
    document's first token is already trained (no prompt part), or none is,
    the mask changes nothing."""
    tokens = np.asarray(tokens)
    begin = 0
    if eos is not None:
        others = np.flatnonzero(tokens != eos)
        begin = int(others[0]) if others.size else tokens.size
        tokens = tokens[begin:]
        ends = np.flatnonzero(tokens[:limit] == eos)
        tokens = tokens[:ends[0]] if ends.size else tokens
    tokens = tokens[:limit]
    if mask is not None:
        trained = np.flatnonzero(np.asarray(mask, dtype=bool)[begin:begin + tokens.size])
        if trained.size and trained[0] > 0:
            tokens = tokens[:trained[0]]
    return [int(token) for token in tokens]


def _leading(tokens: np.ndarray, eos: Optional[int], chunk: int = 4096) -> int:
    """How many ``eos`` tokens start ``tokens`` (a memory-mapped file's:
    read a chunk at a time, so that a long file is not read whole)."""
    if eos is None:
        return 0
    for start in range(0, len(tokens), chunk):
        others = np.flatnonzero(np.asarray(tokens[start:start + chunk]) != eos)
        if others.size:
            return start + int(others[0])
    return len(tokens)


def prepare_samples(every: int, prompts: List[str], max_new_tokens: int, seq_len: int, dataset,
                    tokenizer_dir: Optional[str], last: int = 0) -> Optional[Samples]:
    """The Samples of a run (None when ``every`` is 0): ``last`` is its last
    step (train.steps), ``prompts`` are train.sample_prompts, ``dataset`` the nanoq.data.Dataset whose first
    document is the default prompt (with a mask, its untrained start: see
    document_start), ``tokenizer_dir`` the directory of the data's
    tokenizer.json (None: none). ValueError, naming the setting, for
    prompts without a tokenizer, prompts that encode to nothing and prompts
    that leave no room in data.seq_len."""
    if not every:
        return None
    tokenizer = eos = None
    if tokenizer_dir is not None:
        from nanoq.tokenization.tokenizer import eos_id_or_none, load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir)
        eos = eos_id_or_none(tokenizer, os.path.join(tokenizer_dir, "tokenizer.json"))
    samples = Samples(every, [], max_new_tokens, seq_len, tokenizer, eos, last)
    if not prompts:
        first = dataset.files[0]
        limit = min(DEFAULT_PROMPT_TOKENS, max(seq_len // 2, 1))
        begin = _leading(first.tokens, eos)  # reads the file's start only, not the whole file
        window = np.asarray(first.tokens[begin:begin + limit])
        mask = first.mask_range(begin, begin + window.size) if first.has_mask else None
        ids = document_start(window, eos, limit, mask)
        if not ids:
            raise ValueError(f"{first.path} starts with no document to take a sample prompt from; "
                             f"give train.sample_prompts or set train.sample_every = 0")
        samples.prompts.append(Prompt(samples.decode(ids), ids))
        return samples
    if tokenizer is None:
        raise ValueError("train.sample_prompts needs the data's tokenizer (a tokenizer.json beside the train "
                         "files) to encode the prompts; leave sample_prompts [] to continue the start of an eval "
                         "document (shown as token ids), or set train.sample_every = 0")
    for number, text in enumerate(prompts):
        ids = tokenizer.encode(text).ids
        if not ids:
            raise ValueError(f"train.sample_prompts[{number}] ({text!r}) encodes to no tokens: give some text")
        if len(ids) >= seq_len:
            raise ValueError(f"train.sample_prompts[{number}] is {len(ids)} tokens, which leaves no room for a "
                             f"sample in data.seq_len {seq_len}; shorten it")
        samples.prompts.append(Prompt(text, ids))
    return samples


def sampling_note(trainer) -> Optional[str]:
    """Why ``trainer`` cannot write samples (None: it can)."""
    return samples_off(trainer.config.causal, trainer.holds_whole_world, trainer.processes.size,
                       trainer.topology[0])


def samples_off(causal: bool, whole_world: bool, processes: int, devices: int) -> Optional[str]:
    """Why a run cannot write samples (None: it can): generation needs a
    causal model, in a trainer that holds its whole world (see
    Trainer.generate); ``devices`` of the world in all. The run's rule, and
    ``nanoq memory``'s for counting the KV cache."""
    if not causal:
        return "samples off: the model is bidirectional (model.causal = false); nanoq generate --steps N samples it"
    if not whole_world:
        return (f"samples off: generation needs a single-process run, and this one spans "
                f"{processes} processes ({devices} devices)")
    return None
