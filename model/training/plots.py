"""PNG plots of training and evaluation metrics (matplotlib, headless Agg backend).

Inputs are plain (step, value) series, e.g. ``stages.mechanism.tracking.metric_history`` of the
train
run, so the plots need neither MLflow nor a display. Each file is written atomically.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on compute nodes and CI
import matplotlib.pyplot as plt

from data_prep.atomic import atomic_path

Series = list[tuple[int, float]]

# Train-run metric key -> (file name, title, y label, log scale).
TRAIN_PLOTS = {
    "loss": ("loss.png", "Training loss", "cross-entropy (nats/token)", False),
    "lr": ("lr.png", "Learning rate", "learning rate", False),
    "tokens_per_s": ("tokens_per_s.png", "Training throughput", "tokens/s", False),
}


def save_png(fig, path: str | Path) -> Path:
    """Write a matplotlib figure to ``path`` as PNG, atomically, and close it."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=100, bbox_inches="tight", format="png")
    finally:
        plt.close(fig)
    return path


def plot_series(series: dict[str, Series], path: str | Path, title: str, ylabel: str,
                log_y: bool = False, xlabel: str = "step") -> Path:
    """One line per named series (sorted by step) into a PNG; ValueError if all are empty."""
    if not any(series.values()):
        raise ValueError(f"nothing to plot for {title!r}: every series is empty")
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, points in series.items():
        if points:
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, label=label, marker="." if len(xs) < 30 else None)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return save_png(fig, path)


def plot_training(histories: dict[str, Series], out_dir: str | Path) -> list[Path]:
    """loss.png, lr.png, tokens_per_s.png from the train run's histories (missing keys skipped)."""
    written = []
    for key, (name, title, ylabel, log_y) in TRAIN_PLOTS.items():
        if histories.get(key):
            path = Path(out_dir) / name
            written.append(plot_series({key: histories[key]}, path, title, ylabel, log_y))
    return written


def plot_perplexity(train_loss: Series, eval_perplexity: float, per_source: dict[str, float],
                    path: str | Path, eval_step: int | None = None) -> Path:
    """Training perplexity exp(loss) by step with the held-out perplexity marked, and a bar
    per source of held-out perplexity."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.0), gridspec_kw={"width_ratios": [2, 1]})
    if train_loss:
        xs, ys = zip(*sorted(train_loss))
        left.plot(xs, [math.exp(min(y, 50.0)) for y in ys], label="train exp(loss)")
        eval_step = xs[-1] if eval_step is None else eval_step
    left.scatter([eval_step or 0], [eval_perplexity], color="tab:red", zorder=3,
                 label=f"held-out {eval_perplexity:.2f}")
    left.set_yscale("log")
    left.set_xlabel("step")
    left.set_ylabel("perplexity")
    left.set_title("Perplexity")
    left.grid(alpha=0.3)
    left.legend()
    names = list(per_source)
    right.bar(names, [per_source[n] for n in names], color="tab:red")
    right.set_title("Held-out perplexity by source")
    right.set_ylabel("perplexity")
    return save_png(fig, path)
