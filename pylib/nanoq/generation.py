"""Text generation on a Trainer: the KV-cache decode loop, iterative
unmasking for bidirectional models, and host-side sampling.

The core runs the model (``CoreTrainer.forward_cached``): for a causal model
the prompt in one pass that fills the KV cache, then one token at a time
attending to it; this module checks the arguments, picks each next token
from the last position's logits (greedy, temperature, top-k, top-p, with a
seeded generator) and stops at ``max_new_tokens`` or a stop token. For a
bidirectional (denoising) model, ``denoise`` starts from mask tokens after
the prompt and fills the most confident ones over a few whole-sequence
passes. One sequence at a time.
"""
from __future__ import annotations

import numbers

import numpy as np


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def token_ids(name: str, ids, vocab_size: int) -> np.ndarray:
    """`ids` (a sequence of ints or a 1-D integer array) as int32, each in [0, vocab_size)."""
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"{name} must be token ids (ints), not text: tokenize it first")
    array = np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must hold ints, got dtype {array.dtype}")
    bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    if bad.size:
        raise ValueError(f"token id {int(array[bad[0]])} at {name}[{int(bad[0])}] is outside the vocabulary "
                         f"[0, {vocab_size})")
    return np.ascontiguousarray(array, dtype=np.int32)


class Sampler:
    """Chooses the next token from a row of logits.

    temperature 0 (or top_k 1) is greedy: the highest logit, the lowest id
    among equals. Otherwise the logits are divided by ``temperature``,
    restricted to the ``top_k`` highest (0: all), then to the smallest set of
    highest-probability tokens whose probability reaches ``top_p`` (1: all),
    and one token is drawn with numpy's PCG64 generator seeded by ``seed``.
    Calling it gives the token; ``choose`` also gives the token's probability
    (the confidence ``denoise`` ranks masked positions by).
    """

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0):
        self.temperature = _real("temperature", temperature)
        self.top_k = _int("top_k", top_k)
        self.top_p = _real("top_p", top_p)
        seed = _int("seed", seed)
        if not self.temperature >= 0.0 or not np.isfinite(self.temperature):
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.greedy = self.temperature == 0.0 or self.top_k == 1
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def __call__(self, logits: np.ndarray) -> int:
        return self.choose(logits)[0]

    def choose(self, logits: np.ndarray) -> tuple[int, float]:
        """The next token of a row of logits and its probability under
        softmax(logits / temperature) (temperature 1 when it is 0), before the
        top-k / top-p restriction: the model's confidence in that token."""
        if self.greedy:
            token = int(np.argmax(logits))
            return token, _probability(logits, token, self.temperature or 1.0)
        scaled = _scaled(logits, self.temperature)
        order = np.argsort(-scaled, kind="stable")  # highest first, lower ids first among equals
        if self.top_k:
            order = order[:self.top_k]
        chosen = scaled[order]
        probs = np.exp(chosen - chosen[0])
        probs /= probs.sum()
        if self.top_p < 1.0:
            # Keep the tokens before the cumulative probability reaches top_p, and the one that reaches it.
            keep = int(np.searchsorted(np.cumsum(probs), self.top_p)) + 1
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        token = int(order[self._rng.choice(len(order), p=probs)])
        return token, _probability(logits, token, self.temperature)


def _scaled(logits: np.ndarray, temperature: float) -> np.ndarray:
    """(logits - their maximum) / temperature in float64: at most 0, so a
    tiny temperature gives -inf (probability 0), never inf - inf = NaN."""
    shifted = logits.astype(np.float64)
    shifted -= shifted.max()
    with np.errstate(over="ignore"):
        return shifted / temperature


def _probability(logits: np.ndarray, token: int, temperature: float) -> float:
    """softmax(logits / temperature)[token], in float64."""
    scaled = _scaled(logits, temperature)
    return float(np.exp(scaled[token]) / np.exp(scaled).sum())


def generate(core, prompt_ids, max_new_tokens: int, sampler: Sampler, stop=(),
             max_positions: int | None = None) -> list[int]:
    """The decode loop over ``core`` (a CoreTrainer); see Trainer.generate.
    max_positions: the model's max_position_embeddings (None: unknown)."""
    vocab, capacity = core.vocab_size, core.seq_len
    prompt = token_ids("prompt_ids", prompt_ids, vocab)
    max_new_tokens = _int("max_new_tokens", max_new_tokens)
    if not prompt.size:
        raise ValueError("prompt_ids is empty: generation needs at least one token to continue")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if stop is None:
        stop = ()
    elif isinstance(stop, numbers.Integral):
        stop = (stop,)
    stop_ids = set(int(t) for t in token_ids("stop", list(stop), vocab))
    if prompt.size + max_new_tokens > capacity:
        raise ValueError(f"the prompt ({prompt.size} tokens) and max_new_tokens ({max_new_tokens}) make "
                         f"{prompt.size + max_new_tokens} positions, more than seq_len {capacity} (the "
                         f"trainer's longest sequence): shorten them or make the Trainer with a larger seq_len")
    if max_positions and prompt.size + max_new_tokens > max_positions:
        raise ValueError(f"the prompt ({prompt.size} tokens) and max_new_tokens ({max_new_tokens}) make "
                         f"{prompt.size + max_new_tokens} positions, more than the model's "
                         f"max_position_embeddings {max_positions}")
    new: list[int] = []
    if max_new_tokens == 0:
        return new
    logits = np.empty(vocab, np.float32)
    core.forward_cached(prompt, 0, False, logits)
    position = prompt.size
    while True:
        token = sampler(logits)
        new.append(token)
        if token in stop_ids or len(new) == max_new_tokens:
            return new
        core.forward_cached(np.array([token], np.int32), position, False, logits)
        position += 1


def denoise(core, prompt_ids, max_new_tokens: int, steps: int, mask_token: int, sampler: Sampler,
            max_positions: int | None = None) -> list[int]:
    """Iterative unmasking over ``core`` (a CoreTrainer of a bidirectional
    model); see Trainer.denoise. max_positions: the model's
    max_position_embeddings (None: unknown)."""
    vocab, capacity = core.vocab_size, core.seq_len
    prompt = token_ids("prompt_ids", prompt_ids, vocab)
    max_new_tokens = _int("max_new_tokens", max_new_tokens)
    steps = _int("steps", steps)
    mask_token = _int("mask_token", mask_token)
    if not 0 <= mask_token < vocab:
        raise ValueError(f"mask_token {mask_token} is outside the vocabulary [0, {vocab})")
    if vocab < 2:
        raise ValueError("the vocabulary holds only the mask token: there is no token to fill the masks with")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (the masked positions to fill), got {max_new_tokens}")
    if not 1 <= steps <= max_new_tokens:
        raise ValueError(f"steps must be in [1, max_new_tokens {max_new_tokens}] (each step fills at least one "
                         f"masked position), got {steps}")
    length = prompt.size + max_new_tokens
    if length > capacity:
        raise ValueError(f"the prompt ({prompt.size} tokens) and max_new_tokens ({max_new_tokens}) make {length} "
                         f"positions, more than seq_len {capacity} (the trainer's longest sequence; denoising "
                         f"fills one block): shorten them or make the Trainer with a larger seq_len")
    if max_positions and length > max_positions:
        raise ValueError(f"the prompt ({prompt.size} tokens) and max_new_tokens ({max_new_tokens}) make {length} "
                         f"positions, more than the model's max_position_embeddings {max_positions}")
    # The block is the model's whole window, as in training (every window a
    # denoiser learns from is seq_len tokens, masks included, and Nano's
    # denoise_generate fills a block_size block): the positions after the
    # new tokens stay mask tokens and are not filled.
    block = min(capacity, max_positions) if max_positions else capacity
    sequence = np.full(block, mask_token, np.int32)
    sequence[:prompt.size] = prompt
    masked = np.zeros(block, bool)
    masked[prompt.size:length] = True
    for step in range(steps):
        row = logits(core, sequence[None])[0]
        row[:, mask_token] = -np.inf  # a filled position never holds the mask token
        candidates = np.flatnonzero(masked)  # in position order: the sampler's draws are too
        chosen = [sampler.choose(row[position]) for position in candidates]
        confidence = np.array([probability for _, probability in chosen])
        # Fill so that every mask is gone after the last step; the most confident first, the
        # earlier position first among equals.
        count = -(-candidates.size // (steps - step))
        for index in np.argsort(-confidence, kind="stable")[:count]:
            sequence[candidates[index]] = chosen[index][0]
            masked[candidates[index]] = False
    return sequence[prompt.size:length].tolist()


def logits(core, inputs, positions=None) -> np.ndarray:
    """The logits of each row of ``inputs``; see Trainer.logits. With
    ``positions`` (checked by the caller), each document of a row runs as
    its own sequence."""
    array = np.asarray(inputs)
    if array.ndim != 2:
        raise ValueError(f"inputs must be a 2-D array [rows, time] of token ids, got shape {array.shape}")
    rows, time = array.shape
    if rows < 1 or time < 1:
        raise ValueError(f"inputs must have at least one row and one position, got shape {array.shape}")
    if time > core.seq_len:
        raise ValueError(f"inputs has {time} positions, more than seq_len {core.seq_len} (the trainer's longest "
                         f"sequence)")
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"inputs must hold int token ids, got dtype {array.dtype}")
    out = np.empty((rows, time, core.vocab_size), np.float32)
    for r in range(rows):
        row = token_ids(f"inputs[{r}]", array[r], core.vocab_size)
        starts = [0] if positions is None else list(np.flatnonzero(positions[r] == 0))
        for first, end in zip(starts, starts[1:] + [time]):
            core.forward_cached(np.ascontiguousarray(row[first:end]), 0, True, out[r, first:end].reshape(-1))
    return out
