"""Figures: loss and learning-rate curves of a run log, with its resume points
(``nanoq plot LOG -o loss.png``), and
memory per device by context (``nanoq memory --plot mem.png``).

Needs matplotlib, the ``plot`` extra: ``pip install "nanoq[plot]"``, or from a
source folder ``pip install ".[plot]"`` (the error says which, see nanoq.install).
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
        from nanoq.install import extra_install_command

        raise ImportError(f"{command} needs matplotlib: {extra_install_command('plot')} (or pip install "
                          f"matplotlib)") from None
    return plt


def check_image_path(output: str | os.PathLike, command: str) -> None:
    """Refuses, before anything is drawn, an image path that cannot be
    written: FileNotFoundError when its folder does not exist, ValueError
    when its suffix is not an image format matplotlib writes (it would
    otherwise write a .png beside a name without one)."""
    _pyplot(command)  # (matplotlib, or the ImportError saying how to get it)
    from matplotlib.backend_bases import FigureCanvasBase

    path = os.fspath(output)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: the folder {folder} does not exist")
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise ValueError(f"cannot write {path}: name an image file ending in one of "
                         f"{', '.join('.' + name for name in sorted(formats))}")


def _by_step(records, kind: str, field: str) -> list:
    """[(step, value)] of the ``kind`` records' ``field``, sorted by step; a
    step logged twice (a resumed run repeats the steps after its checkpoint)
    keeps its later value, the one the run continued from."""
    values = {r["step"]: r[field] for r in records if r.get("type") == kind and r.get(field) is not None}
    return sorted(values.items())


def loss_figure(records: list, title: str = "loss"):
    """The matplotlib Figure of a run's log records: the train loss (per
    step) and eval loss (per evaluation) on top, the learning rate below,
    against the optimizer step; a dashed vertical line on both marks each
    step a run was resumed from. ValueError when there are no losses."""
    plt = _pyplot("nanoq plot")
    train = _by_step(records, "train", "loss")
    evals = _by_step(records, "eval", "loss")
    rates = _by_step(records, "train", "lr")
    resumes = sorted({r["step"] for r in records if r.get("type") == "resume" and r.get("step") is not None})
    if not train and not evals:
        raise ValueError("no train or eval losses to plot")
    figure, (losses, lr) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                       gridspec_kw=dict(height_ratios=(3, 1)))
    if train:
        losses.plot(*zip(*train), label="train", linewidth=1, alpha=0.8)
    if evals:
        losses.plot(*zip(*evals), label="eval", marker="o", linewidth=1.5)
    if rates:
        lr.plot(*zip(*rates), label="lr", color="tab:green", linewidth=1)
    for number, step in enumerate(resumes):
        for axes in (losses, lr):
            axes.axvline(step, color="gray", linestyle="--", linewidth=1,
                         label="resumed" if number == 0 and axes is losses else None)
    losses.set_ylabel("loss")
    losses.set_title(title)
    losses.grid(alpha=0.3)
    losses.legend()
    lr.set_xlabel("step")
    lr.set_ylabel("lr")
    lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    lr.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def plot_losses(log_path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Draws ``loss_figure`` of a log.jsonl (titled by its run directory)
    and saves it to ``output``."""
    plt = _pyplot("nanoq plot")
    check_image_path(output, "nanoq plot")
    title = os.path.basename(os.path.dirname(os.path.abspath(log_path))) or "loss"
    try:
        figure = loss_figure(read_log(log_path), title)
    except ValueError as e:
        message = str(e)  # read_log names the file (and line) itself
        raise ValueError(message if message.startswith(os.fspath(log_path)) else f"{log_path}: {message}") from None
    figure.savefig(os.fspath(output), dpi=120)
    plt.close(figure)


def plot_memory(estimate, output: str | os.PathLike, device_memory_bytes=None) -> None:
    """Draws a nanoq.memory.MemoryEstimate as one stacked bar per device
    (GiB by context, the reserve on top) with the device size as a line
    when given, and saves the figure to ``output``."""
    from nanoq.memory import CONTEXTS, parameter_count_text

    plt = _pyplot("nanoq memory --plot")
    check_image_path(output, "nanoq memory --plot")
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
