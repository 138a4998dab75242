"""Learning-rate schedules: pure functions of the step.

Step s (0-based) is the s-th optimizer update of ``total_steps``. Every kind
first warms up linearly, lr(s) = peak * (s + 1) / warmup_steps for
s < warmup_steps, so the first update already moves and step warmup_steps - 1
reaches the peak. After warmup, with final = peak * final_lr_fraction:

- cosine:   from peak at s = warmup_steps down to final at s = total_steps
            along half a cosine;
- linear:   the same endpoints along a straight line;
- wsd:      warmup-stable-decay: peak until the last
            cooldown_fraction * total_steps steps, then linear down to final
            at s = total_steps;
- constant: peak.

The schedule reaches ``final`` at s = total_steps, one past the last update.
"""
from __future__ import annotations

import math

KINDS = ("cosine", "linear", "wsd", "constant")


def learning_rate(step: int, *, kind: str, peak: float, total_steps: int, warmup_steps: int = 0,
                  final_lr_fraction: float = 0.1, cooldown_fraction: float = 0.2) -> float:
    """The learning rate of update ``step`` (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"schedule must be one of {', '.join(KINDS)}, got {kind!r}")
    if total_steps <= 0 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"need 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps}) "
                         f"and total_steps > 0")
    if not 0 <= final_lr_fraction <= 1 or not 0 <= cooldown_fraction <= 1:
        raise ValueError("final_lr_fraction and cooldown_fraction must be in [0, 1]")
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    final = peak * final_lr_fraction
    if kind == "constant":
        return peak
    if kind == "wsd":
        decay_start = _wsd_decay_start(total_steps, warmup_steps, cooldown_fraction)
        if step < decay_start:
            return peak
        progress = (step - decay_start) / max(total_steps - decay_start, 1e-12)
        return peak + (final - peak) * min(progress, 1.0)
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    if kind == "linear":
        return peak + (final - peak) * progress
    return final + (peak - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _wsd_decay_start(total_steps: int, warmup_steps: int, cooldown_fraction: float) -> float:
    """The step from which wsd decays: the last cooldown_fraction of the steps, after the warmup."""
    return max(warmup_steps, total_steps - cooldown_fraction * total_steps)


def cooldown_note(total_steps: int, warmup_steps: int, cooldown_fraction: float) -> str | None:
    """A warning, in words, when the wsd schedule's decay is not the last
    ``cooldown_fraction`` of the steps: the warmup overlaps it (the decay
    then starts after the warmup), or it is shorter than one step (then no
    update decays). None when it is as asked."""
    asked = cooldown_fraction * total_steps
    decaying = total_steps - math.ceil(_wsd_decay_start(total_steps, warmup_steps, cooldown_fraction))
    if asked and decaying == 0:
        return (f"train.cooldown_fraction {cooldown_fraction:g} of {total_steps} steps is less than one step: no "
                f"update decays and train.final_lr_fraction is never reached (raise it, or use more steps)")
    if warmup_steps > total_steps - asked:
        return (f"the wsd decay runs over the last {total_steps - warmup_steps} steps, not the {asked:g} that "
                f"train.cooldown_fraction {cooldown_fraction:g} asks for: the warmup takes the first {warmup_steps}")
    return None

