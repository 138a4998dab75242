"""Loss curves of a run log: ``nanoq plot LOG -o loss.png``.

Needs matplotlib, the ``plot`` extra: ``pip install "nanoq[plot]"``.
"""
from __future__ import annotations

import os

from nanoq.training.log import read_log


def plot_losses(log_path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Draws the train loss (per step) and eval loss (per evaluation) of a
    log.jsonl against the optimizer step and saves the figure to ``output``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError('nanoq plot needs matplotlib: pip install "nanoq[plot]" (or pip install matplotlib)') \
            from None
    records = read_log(log_path)
    train = [(r["step"], r["loss"]) for r in records if r.get("type") == "train" and r.get("loss") is not None]
    evals = [(r["step"], r["loss"]) for r in records if r.get("type") == "eval" and r.get("loss") is not None]
    if not train and not evals:
        raise ValueError(f"{log_path}: no train or eval losses to plot")
    figure, axes = plt.subplots(figsize=(7, 4.5))
    if train:
        axes.plot(*zip(*train), label="train", linewidth=1, alpha=0.8)
    if evals:
        axes.plot(*zip(*evals), label="eval", marker="o", linewidth=1.5)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(os.path.basename(os.path.dirname(os.path.abspath(log_path))) or "loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(os.fspath(output), dpi=120)
    plt.close(figure)
