"""Training objectives: how a window of tokens becomes (inputs, targets).

One definition for the three objectives Nano's ``train.py`` trains, used by
the datasets (training and evaluation alike):

- ``causal``: next-token prediction. A window holds seq_len + 1 tokens w;
  inputs are w[:T] and targets w[1:].
- ``seq2seq``: Nano's same-length sequence-to-sequence task for a
  bidirectional model (``is_causal = false``), as its toy tasks (sorting,
  palindromes) use: a window holds 2 * seq_len tokens; inputs are w[:T] and
  targets w[T:2T], target t being predicted from all of the inputs.
- ``denoise``: Nano's masked-token denoiser for a bidirectional model: a
  window holds seq_len tokens; the targets are the window itself and the
  inputs the window with each token replaced by the mask token with
  probability p, p drawn uniformly from [0, 1) once per window.

SFT masks (False = not trained on) apply to the target token they belong to:
a target whose own token is masked is ignored (-100). Nano's seq2seq branch
takes the mask of the input half instead and its loss weighting does not
apply the mask at all; nanoq aligns the mask with what is predicted in every
objective, so a mask means the same thing whatever the objective.

Denoising draws are a pure function of (seed, epoch, window index): the
same window in the same epoch is corrupted the same way whatever the number
of processes or devices, and a resumed run (whose loader resumes at the same
epoch and position) sees exactly the draws it would have seen. Evaluation
windows use epoch 0 and the run's seed, so every evaluation of a run scores
the same corrupted inputs.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

IGNORE_INDEX = -100
OBJECTIVES = ("causal", "seq2seq", "denoise")
# The stream name that keeps denoising draws apart from every other use of
# the seed (the loaders' permutations use [seed, epoch]).
_DENOISE_STREAM = 0x64656E6F  # "deno"


def check_objective(objective) -> str:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(map(repr, OBJECTIVES))}; got {objective!r}")
    return objective


def window_tokens(objective: str, seq_len: int) -> int:
    """Tokens one window of ``objective`` reads from a token file."""
    check_objective(objective)
    return {"causal": seq_len + 1, "seq2seq": 2 * seq_len, "denoise": seq_len}[objective]


def window_steps(objective: str, seq_len: int) -> tuple:
    """The window steps ``objective`` allows, the default first: causal
    windows may share their last token with the next window's first (step
    seq_len, the default) or be disjoint (seq_len + 1); seq2seq and denoise
    windows are disjoint."""
    length = window_tokens(objective, seq_len)
    return (seq_len, seq_len + 1) if objective == "causal" else (length,)


def split_window(objective: str, window: np.ndarray, mask: Optional[np.ndarray], inputs: np.ndarray,
                 targets: np.ndarray) -> None:
    """Fills ``inputs`` and ``targets`` ([seq_len] each) from one window of
    ``window_tokens(objective, seq_len)`` tokens and its SFT mask (or None).
    The denoise corruption is applied separately (``corrupt``)."""
    seq_len = inputs.shape[0]
    if objective == "causal":
        inputs[:] = window[:-1]
        targets[:] = window[1:]
        target_mask = None if mask is None else mask[1:]
    elif objective == "seq2seq":
        inputs[:] = window[:seq_len]
        targets[:] = window[seq_len:]
        target_mask = None if mask is None else mask[seq_len:]
    else:
        inputs[:] = window
        targets[:] = window
        target_mask = mask
    if target_mask is not None:
        targets[~target_mask] = IGNORE_INDEX


def corrupt(inputs: np.ndarray, window_indices, mask_token: int, seed: int, epoch) -> np.ndarray:
    """Denoising: replaces tokens of ``inputs`` ([rows, seq_len], in place)
    by ``mask_token``. Row r, window ``window_indices[r]`` of epoch
    ``epoch`` (one for every row, or one per row), draws p ~ U[0, 1) and
    masks each token with probability p, from a generator seeded with (seed,
    epoch, window index). Returns the bool mask of replaced tokens."""
    indices = np.asarray(window_indices, dtype=np.int64).reshape(-1)
    if indices.size != inputs.shape[0]:
        raise ValueError(f"{indices.size} window indices for {inputs.shape[0]} rows")
    epochs = np.broadcast_to(np.asarray(epoch, dtype=np.int64), indices.shape)
    replaced = np.zeros(inputs.shape, dtype=bool)
    for row, (index, row_epoch) in enumerate(zip(indices.tolist(), epochs.tolist())):
        rng = np.random.default_rng([int(seed), _DENOISE_STREAM, int(row_epoch), int(index)])
        p = rng.random()
        replaced[row] = rng.random(inputs.shape[1]) < p
    inputs[replaced] = mask_token
    return replaced
