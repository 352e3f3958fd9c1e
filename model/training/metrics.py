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


class BackgroundSink:
    """Forwards log_metrics/log_artifact/flush to ``sink`` from one background thread, in order.

    A tracker write (an MLflow batch to SQLite or a server) can take tens of milliseconds;
    doing it off the training thread keeps per-step logging well under 5% of a step.
    ``flush`` waits until everything queued has been sent (the one worker thread runs the
    writes in order, so the sink's own flush runs after all of them); the trainer calls it
    after every checkpoint, so a rank killed later has delivered every metric up to that
    checkpoint. Errors resurface on ``flush``.
    """

    def __init__(self, sink) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.sink = sink
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics")
        self._pending: list = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Queue one step's metrics."""
        self._pending.append(self._pool.submit(self.sink.log_metrics, dict(metrics), step))
        self._pending = [f for f in self._pending if not f.done() or f.exception()]

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Queue an artifact upload."""
        self._pending.append(self._pool.submit(self.sink.log_artifact, path, artifact_path))

    def flush(self) -> None:
        """Send everything queued, then flush the wrapped sink (raises a queued error)."""
        self._pool.submit(self.sink.flush).result()
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Flush and stop the thread."""
        self.flush()
        self._pool.shutdown()
