"""Per-step measurements: memory, throughput summary and the loss-curve plot."""
from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory, or this process's peak resident set size on CPU, in GB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    try:
        import resource

        # ru_maxrss is in KiB on Linux: the true peak, not the current RSS.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    except ImportError:  # pragma: no cover - non-POSIX
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss / 1e9


def median_step_time(step_times: list[float]) -> float:
    """Median step time, leaving out the first (warm-up) step when there are others."""
    times = step_times[1:] if len(step_times) > 1 else step_times
    return statistics.median(times) if times else float("nan")


def plot_losses(losses: list[float], first_step: int, path: str | Path) -> Path:
    """Write the loss curve as a PNG (matplotlib Agg) atomically; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(first_step + 1, first_step + 1 + len(losses)), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path
