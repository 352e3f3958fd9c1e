"""Per-step measurements: memory, throughput summary, the loss-curve plot, and the sink that
sends metrics to the tracking store off the training thread (spooling them locally while the
store is away)."""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data_prep.atomic import write_text_atomic

if TYPE_CHECKING:
    import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory, or this process's peak resident set size on CPU, in GB."""
    import torch

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
    from model.training.plots import save_png

    return save_png(fig, path)


SPOOL_FILE = "metrics_spool.jsonl"  # in the training stage's directory
MAX_BATCH_VALUES = 1000  # values in one MLflow log_batch request (the server's limit)
IMPORT_COMMAND = "python -m workflows.import_metrics"


def spool_lines(path: str | Path) -> list[str]:
    """The complete records (JSON lines) of a metrics spool, in order, without newlines.

    A torn last line (the writer was killed in the middle of an append) is left out; so is
    an unreadable line, with one warning naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    lines, bad = [], 0
    for line in text.split("\n"):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except ValueError:
            bad += 1
            continue
        lines.append(line)
    if bad:
        print(f"[metrics] {path}: skipped {bad} torn or unreadable line(s)", file=sys.stderr,
              flush=True)
    return lines


def append_spool(path: str | Path, records: list[dict[str, Any]], fsync: bool = True) -> None:
    """Append ``records`` to the spool at ``path`` as JSON lines (fsync'ed unless told not to).

    A torn last line left by a killed writer is closed with a newline first, so it cannot
    swallow the next record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        if handle.tell() > 0:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                handle.write(b"\n")
        handle.write("".join(json.dumps(r) + "\n" for r in records).encode("utf-8"))
        handle.flush()
        if fsync:
            os.fsync(handle.fileno())


def metric_batches(records: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Consecutive records of one run, grouped so a group holds at most MAX_BATCH_VALUES
    values (one request each); order is kept."""
    batch: list[dict[str, Any]] = []
    values = 0
    for record in records:
        size = len(record["metrics"])
        if batch and (values + size > MAX_BATCH_VALUES or record["run_id"] != batch[0]["run_id"]):
            yield batch
            batch, values = [], 0
        batch.append(record)
        values += size
    if batch:
        yield batch


def deliver_spool(
    path: str | Path, send: Callable[[str, list[dict[str, Any]]], None],
    done_path: str | Path | None = None,
) -> int:
    """Send the spool's records in order with ``send(run_id, records)``; return how many.

    When all are sent the spool is renamed to ``done_path`` (removed without one). If a send
    fails, the spool is rewritten (atomically) with the records not yet sent and the error
    propagates: delivering again neither loses nor repeats a record."""
    path = Path(path)
    lines = spool_lines(path)
    sent = 0
    try:
        for batch in metric_batches([json.loads(line) for line in lines]):
            send(batch[0]["run_id"], batch)
            sent += len(batch)
    finally:
        if sent < len(lines):
            if sent:
                write_text_atomic(path, "".join(line + "\n" for line in lines[sent:]))
        elif done_path is not None:
            os.replace(path, done_path)
        else:
            path.unlink(missing_ok=True)
    return sent


def short_reason(error: BaseException) -> str:
    """The gist of a tracking error (``[Errno 111] Connection refused``, ``error code 503``)
    rather than MLflow's whole wrapped message."""
    text = str(error).strip()
    for pattern in (r"\[Errno -?\d+\] [^'\")]+", r"too many \d+ error responses",
                    r"error code \d+", r"[Rr]ead timed out", r"timed out"):
        match = re.search(pattern, text)
        if match:
            return match.group(0)
    return (text.splitlines() or [type(error).__name__])[0][:160]


class BackgroundSink:
    """Sends per-step metrics to a tracker from one background thread, in order; while the
    tracking store is away it keeps them in a local spool and training goes on.

    ``sink`` is a ``stages.mechanism.tracking.Tracker`` (``uri``, ``run_id``, ``send_metrics``,
    ``log_artifact``, ``flush``). Metrics are sent in batches every ``send_every_s``
    (default: the tracker's ``flush_seconds``) or every 500 values; a write (an MLflow batch
    to SQLite or a server) takes tens of milliseconds and never runs on the training thread.
    ``flush`` sends everything queued and returns when it is in the store (or, while the
    store is away, appended and fsync'ed to the spool); the trainer calls it after every
    checkpoint, so a rank killed later has kept every metric up to that checkpoint.

    With a ``spool`` path, a failed write (connection error, HTTP 5xx, any tracking error)
    does not stop training: the records are kept in memory, go to the spool at the next
    flush, and one line says so. Delivery is tried again every ``retry_every_s`` and at each
    flush; when the store answers, the spool is sent in order, then removed, and one line
    says so. A spool left after training is sent by ``python -m workflows.import_metrics
    SPOOL``. A spool left by an earlier attempt is sent first. Without a
    spool, a failed write is raised by the next ``flush`` (as are failed artifact uploads).

    ``logged_through``, when given, returns the last step whose metrics the run already
    holds (an earlier try logged them before it was stopped, and a resumed training
    recomputes those steps bitwise); records of that step and before are dropped. It runs
    first on the worker thread, as does the tracker's first write, so that neither opening
    the store nor asking it delays the training's start.
    """

    SPILL_RECORDS = 10_000  # records kept in memory while the store is away, then spooled

    def __init__(self, sink, spool: str | Path | None = None,
                 send_every_s: float | None = None, retry_every_s: float = 30.0,
                 logged_through: Callable[[], int] | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.sink = sink
        self.spool = Path(spool) if spool is not None else None
        self.send_every_s = (send_every_s if send_every_s is not None
                             else float(getattr(sink, "flush_seconds", 2.0)))
        self.retry_every_s = retry_every_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics")
        # Touched only by the worker thread:
        self._unsent: list[dict[str, Any]] = []
        self._values = 0
        self._spooled = self.spool is not None and bool(spool_lines(self.spool))
        self._down = False
        self._last_try = time.monotonic()
        self._error: BaseException | None = None  # raised by flush (no spool)
        self._logged_through: int | None = None  # records of this step and before are dropped
        if logged_through is not None:
            self._pool.submit(self._learn_logged_through, logged_through)

    # -- training thread -------------------------------------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Queue one step's metrics (stamped now)."""
        record = {"run_id": self.sink.run_id, "step": step or 0,
                  "timestamp": int(time.time() * 1000),
                  "metrics": {k: float(v) for k, v in metrics.items()}}
        self._pool.submit(self._add, record)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Queue an artifact upload."""
        self._pool.submit(self._upload, path, artifact_path)

    def flush(self) -> None:
        """Send everything queued (or spool it while the store is away); raise a kept error
        when there is no spool."""
        self._pool.submit(self._flush).result()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Flush and stop the thread."""
        try:
            self.flush()
        finally:
            self._pool.shutdown()

    # -- worker thread ---------------------------------------------------------------
    def _learn_logged_through(self, logged_through: Callable[[], int]) -> None:
        try:
            self._logged_through = logged_through()
        except Exception as error:  # noqa: BLE001 - metrics must not stop training
            print(f"[metrics] could not tell which steps the run already holds "
                  f"({short_reason(error)}); every step is sent", flush=True)

    def _add(self, record: dict[str, Any]) -> None:
        if self._logged_through is not None and record["step"] <= self._logged_through:
            return
        self._unsent.append(record)
        self._values += len(record["metrics"])
        wait = self.retry_every_s if self._down else self.send_every_s
        if (not self._down and self._values >= 500) or time.monotonic() - self._last_try >= wait:
            self._send_all()
        if self._down and len(self._unsent) >= self.SPILL_RECORDS:
            self._spill(fsync=False)

    def _flush(self) -> None:
        self._send_all()
        if self._down:
            self._spill(fsync=True)
        try:
            self.sink.flush()
        except Exception as error:  # noqa: BLE001 - any tracking failure: keep training
            self._failed(error)

    def _send_all(self) -> None:
        """Send the spool, then the records in memory, in order; on failure keep what is left."""
        self._last_try = time.monotonic()
        if self._error is not None or (not self._unsent and not self._spooled):
            return
        was_down, kept = self._down, 0
        try:
            if self._spooled:
                kept = deliver_spool(self.spool, self.sink.send_metrics)
                self._spooled = False
            while self._unsent:
                batch = next(metric_batches(self._unsent))
                self.sink.send_metrics(batch[0]["run_id"], batch)
                del self._unsent[:len(batch)]
                self._values -= sum(len(r["metrics"]) for r in batch)
                kept += len(batch) if was_down else 0
        except Exception as error:  # noqa: BLE001 - connection, HTTP 5xx, any tracking error
            self._failed(error)
            return
        self._down = False
        if was_down or kept:
            where = f"; {self.spool} emptied" if self.spool is not None else ""
            print(f"[metrics] MLflow at {self.sink.uri} answers again: sent {kept} record(s) "
                  f"kept while it was away{where}", flush=True)

    def _failed(self, error: BaseException) -> None:
        if self.spool is None:
            self._error = self._error or error
            return
        if not self._down:
            print(f"[metrics] MLflow at {self.sink.uri} is unreachable ({short_reason(error)}); "
                  f"training goes on and metrics are kept in {self.spool}, sent when it answers "
                  f"(or later: {IMPORT_COMMAND} {self.spool})", flush=True)
        self._down = True

    def _spill(self, fsync: bool) -> None:
        if self._unsent and self.spool is not None:
            append_spool(self.spool, self._unsent, fsync=fsync)
            self._unsent, self._values, self._spooled = [], 0, True

    def _upload(self, path: str | Path, artifact_path: str | None) -> None:
        try:
            self.sink.log_artifact(path, artifact_path)
        except Exception as error:  # noqa: BLE001 - any tracking failure: keep training
            if self.spool is None:
                self._error = self._error or error
                return
            print(f"[metrics] artifact {path} was not sent to MLflow at {self.sink.uri} "
                  f"({type(error).__name__}); it stays in {Path(path).parent}", flush=True)


# ------------------------------------------------ step health (model.training.health)
def skip_metrics(record: dict[str, Any], total: int) -> dict[str, float]:
    """The metrics of a skipped step (its record from ``StepHealth.record_skip``)."""
    return {"skipped_step": 1.0, "skipped_batch": float(record["batch"]),
            "skipped_steps_total": float(total)}


def rollback_metrics(record: dict[str, Any], total: int) -> dict[str, float]:
    """The metrics of a rollback (its record from ``StepHealth.record_rollback``), logged at
    the step that caused it."""
    return {"rollback": 1.0, "rollback_to_step": float(record["to_step"]),
            "rollback_skipped_batches": float(len(record["batches"])),
            "rollbacks_total": float(total)}


def slow_rank_metrics(ratio: float, seconds: list[float]) -> dict[str, float]:
    """The slowest rank's busy seconds per step over the median rank's, and which rank."""
    return {"slow_rank_ratio": ratio,
            "slowest_rank": float(max(range(len(seconds)), key=seconds.__getitem__))}


# ------------------------------------------------ throughput labels (docs/training.md#metrics)
MEDIAN_SUFFIX = "_median"
"""Suffix of a figure at the median step time of the attempt so far (first step left out):
``tokens_per_s_median``, ``tflops_per_device_median``, ``mfu_median``. Unsuffixed, a figure is
one step's own, on the console and in MLflow alike."""


def throughput(tokens: int, seconds: float, flops_per_token: float, devices: int,
               peak_tflops: float, suffix: str = "") -> dict[str, float]:
    """``tokens_per_s``, ``tflops_per_device`` and ``mfu`` (each name + ``suffix``) of
    ``tokens`` trained in ``seconds`` on ``devices`` devices of ``peak_tflops`` each."""
    tokens_per_s = tokens / seconds if seconds > 0 else 0.0
    tflops = flops_per_token * tokens_per_s / devices / 1e12
    return {f"tokens_per_s{suffix}": tokens_per_s, f"tflops_per_device{suffix}": tflops,
            f"mfu{suffix}": tflops / peak_tflops}


def progress_line(step: int, steps: int, loss: float, last: dict[str, float],
                  median: dict[str, float], median_s: float) -> str:
    """The console's progress line, its figures under their MLflow names: this step's
    ``tokens_per_s`` (``last``), then the ``_median`` ones (``median``, from ``throughput``
    with ``MEDIAN_SUFFIX``) at ``median_s`` seconds a step, and the time left at that pace."""
    m = MEDIAN_SUFFIX
    return (f"[train] step {step}/{steps} loss {loss:.4f} tokens_per_s {last['tokens_per_s']:,.0f} "
            f"tokens_per_s{m} {median[f'tokens_per_s{m}']:,.0f} mfu{m} {median[f'mfu{m}']:.3f} "
            f"({median_s:.3f} s/step) ETA {median_s * (steps - step):.0f} s")
