"""Figures: loss curves of a run log (``nanoq plot LOG -o loss.png``) and
memory per device by context (``nanoq memory --plot mem.png``).

Needs matplotlib, the ``plot`` extra: ``pip install "nanoq[plot]"``.
"""
from __future__ import annotations

import os

from nanoq.training.log import read_log


def _pyplot(command: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(f'{command} needs matplotlib: pip install "nanoq[plot]" (or pip install matplotlib)') \
            from None
    return plt


def plot_losses(log_path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Draws the train loss (per step) and eval loss (per evaluation) of a
    log.jsonl against the optimizer step and saves the figure to ``output``."""
    plt = _pyplot("nanoq plot")
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


def plot_memory(estimate, output: str | os.PathLike, device_memory_bytes=None) -> None:
    """Draws a nanoq.memory.MemoryEstimate as one stacked bar per device
    (GiB by context, the reserve on top) with the device size as a line
    when given, and saves the figure to ``output``."""
    from nanoq.memory import CONTEXTS, parameter_count_text

    plt = _pyplot("nanoq memory --plot")
    devices = list(range(estimate.options.devices))
    gib = float(1 << 30)
    figure, axes = plt.subplots(figsize=(max(5.0, 1.0 + 0.8 * len(devices)), 5))
    bottom = [0.0] * len(devices)
    layers = [(name, estimate.contexts[name]) for name in CONTEXTS]
    layers.append(("reserve (not nanoq's)", estimate.reserve_bytes))
    colors = plt.get_cmap("tab10").colors
    for index, (name, value) in enumerate(layers):
        if not value:
            continue
        heights = [value / gib] * len(devices)
        axes.bar(devices, heights, bottom=bottom, label=name, color=colors[index % len(colors)],
                 hatch="//" if name.startswith("reserve") else None, alpha=0.9)
        bottom = [b + h for b, h in zip(bottom, heights)]
    if device_memory_bytes:
        axes.axhline(device_memory_bytes / gib, color="black", linestyle="--", linewidth=1,
                     label=f"device memory ({device_memory_bytes / gib:.1f} GiB)")
    axes.set_xticks(devices)
    axes.set_xticklabels([f"{estimate.options.backend}:{d}" for d in devices])
    axes.set_xlabel("device")
    axes.set_ylabel("GiB")
    o = estimate.options
    axes.set_title(f"{parameter_count_text(estimate.parameters)} parameters, batch {o.batch_size} x seq {o.seq_len}, "
                   f"{o.dtype}", fontsize=10)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(os.fspath(output), dpi=120)
    plt.close(figure)
