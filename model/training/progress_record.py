"""What each rank was last doing, so that a collective that times out names who did not arrive.

Every training rank keeps one small file, ``<out_dir>/progress/rank-NNNNN.json``, rewritten in
place (one ``pwrite`` of a fixed-size JSON line, no fsync: a few microseconds) at a few points
of each step (``mark``, called by the trainer): entering the ``forward/backward`` of step N
(the batch, every micro-batch's forward and backward, the gradient all-reduce that overlaps
them, the whole schedule under pipelining), the ``loss/norm all-reduce`` (the step checks'
all-reduce and the gradient norm's), the ``step end`` (rollback, slow-rank gather, the
checkpoint vote) and a ``checkpoint save``. Entering a phase completes the one before, so a
record says where the rank is, since when, and its last completed operation. Each record
carries a sequence number: the ranks pass the same marks in the same order, so a rank whose
number is below another's has not yet reached the point the other waits at.

When a collective times out (``train.collective_timeout_s``, the process group's timeout),
the rank that waited reads every record and its error (``explain_timeout``) names the ranks
that did not arrive, the phase each was in and for how long, and its own last completed
operation; ``CollectiveTimeout`` is a ``ValueError`` so that the rank's own message becomes the
stage's (``stages.mechanism.launch.rank_main``'s ``rank-error.json``). A record from an
earlier launch in the same directory (another ``dist_env.launch_id``) counts as none.

Fault injection, for tests and drills only: ``STALL_VAR`` makes one rank hang at the end of a
phase of a step (its record still says it is in that phase), until its time is up or the rank
is asked to stop (the launcher's SIGTERM once another rank failed: it then raises, and the
launch ends without waiting for the launcher's SIGKILL).
"""
from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROGRESS_DIR = "progress"
"""Under a training's output directory: one record per rank (and NCCL's flight-recorder dumps)."""
STALL_VAR = "FRONTIER_LLM_STALL"
"""Fault injection (tests and drills only): a JSON object with the fields of ``Stall``."""
RECORD_BYTES = 512  # each write covers the whole record: no truncate, no stale tail
SETTLE_S = 1.0  # how long a timed-out rank waits for its peers to record their own timeouts
NAMED_RANKS = 8  # the message names at most this many ranks that did not arrive
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


class CollectiveTimeout(ValueError):
    """A collective did not finish within ``train.collective_timeout_s``; the message names
    the ranks that did not arrive. A ``ValueError`` so that the stage fails with this message
    (``stages.mechanism.launch``); a rerun resumes from the newest checkpoint."""


@dataclass(frozen=True)
class Stall:
    """Rank ``rank`` hangs for ``seconds`` at the end of ``phase`` of step ``step`` (1-based)."""

    rank: int
    step: int
    phase: str = "forward/backward"
    seconds: float = 3600.0

    @classmethod
    def from_environ(cls) -> Stall | None:
        """The stall ``STALL_VAR`` asks for, or None when it is unset or empty."""
        text = os.environ.get(STALL_VAR, "").strip()
        if not text:
            return None
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError) as error:
            raise ValueError(f"{STALL_VAR} must be a JSON object with the fields of "
                             f"model.training.progress_record.Stall: {error}") from None


def label(phase: str, step: int) -> str:
    """``phase`` of step ``step`` as the messages say it (step 0: before the first step)."""
    return f"{phase} of step {step}" if step else phase


class ProgressRecord:
    """This rank's record of where it is (``mark``) and, on a timeout, who it waited for."""

    def __init__(self, directory: str | Path, rank: int, world_size: int, launch: str,
                 timeout_s: float, stop: Callable[[], bool] | None = None) -> None:
        self.directory, self.rank, self.world_size = Path(directory), rank, world_size
        self.launch, self.timeout_s, self._stop = launch, timeout_s, stop
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path(rank), os.O_WRONLY | os.O_CREAT, 0o644)
        self.seq, self.phase, self.step, self.since = 0, "start-up", 0, time.time()
        self.done: str | None = None
        self.stall = Stall.from_environ()
        self._write()

    def path(self, rank: int) -> Path:
        """Where rank ``rank`` keeps its record."""
        return self.directory / f"rank-{rank:05d}.json"

    def mark(self, phase: str, step: int) -> None:
        """Entering ``phase`` of step ``step``: the phase before it is done."""
        if self.stall is not None and (self.rank, self.step, self.phase) == (
                self.stall.rank, self.stall.step, self.stall.phase):
            self._hang()
        self.done = label(self.phase, self.step)
        self.seq, self.phase, self.step, self.since = self.seq + 1, phase, step, time.time()
        self._write()

    def _hang(self) -> None:
        """The injected stall (``STALL_VAR``): sleep until its time is up, or raise once the
        rank is asked to stop."""
        end = time.monotonic() + self.stall.seconds
        stopped = False
        while time.monotonic() < end and not stopped:
            time.sleep(0.05)
            stopped = self._stop is not None and self._stop()
        if stopped:
            raise RuntimeError(f"rank {self.rank} hung by {STALL_VAR} in "
                               f"{label(self.phase, self.step)} was asked to stop")

    def _write(self, timed_out: bool = False) -> None:
        record = {"rank": self.rank, "launch": self.launch, "seq": self.seq,
                  "phase": self.phase, "step": self.step, "since": self.since,
                  "done": self.done, "timed_out": timed_out}
        os.pwrite(self._fd, json.dumps(record).encode().ljust(RECORD_BYTES - 1) + b"\n", 0)

    def read(self, rank: int) -> dict[str, Any] | None:
        """Rank ``rank``'s record of this launch, or None (none yet, an earlier launch's, or
        caught mid-write)."""
        try:
            record = json.loads(self.path(rank).read_bytes())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("launch") == self.launch else None

    def explain(self, settle_s: float = SETTLE_S) -> str:
        """Why this rank's collective timed out: the ranks that did not arrive (a lower
        sequence number than this rank's; failing any, after ``settle_s``, the ranks at this
        rank's point that did not time out themselves: stuck inside the phase), what each
        was doing and this rank's last completed operation."""
        self._write(timed_out=True)
        others = [r for r in range(self.world_size) if r != self.rank]
        records = {r: self.read(r) for r in others}
        missing = [r for r in others if records[r] is None or records[r]["seq"] < self.seq]
        if not missing:
            deadline = time.monotonic() + settle_s
            while True:
                records = {r: self.read(r) for r in others}
                missing = [r for r in others if records[r] is not None
                           and records[r]["seq"] == self.seq and not records[r]["timed_out"]]
                if not missing or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        head = (f"a collective did not finish within train.collective_timeout_s="
                f"{self.timeout_s:g} s: rank {self.rank} waited in the "
                f"{label(self.phase, self.step)} (its last completed operation: "
                f"{self.done or 'none'})")
        if not missing:
            return (f"{head}; every rank reached it, so the collective itself stalled (the "
                    f"network or a device); each rank's record: {self.directory}")
        now = time.time()
        named = [self._describe(r, records[r], now) for r in missing[:NAMED_RANKS]]
        more = f", and {len(missing) - NAMED_RANKS} more" if len(missing) > NAMED_RANKS else ""
        return (f"{head}; did not arrive: {', '.join(named)}{more}; each rank's record: "
                f"{self.directory}")

    @staticmethod
    def _describe(rank: int, record: dict[str, Any] | None, now: float) -> str:
        if record is None:
            return f"rank {rank} (no record from this launch: it never reached training)"
        return (f"rank {rank} (in the {label(record['phase'], record['step'])} for "
                f"{max(0.0, now - record['since']):.1f} s; last completed: "
                f"{record['done'] or 'none'})")

    def close(self) -> None:
        """Stop recording (the file stays: the last record of the rank)."""
        os.close(self._fd)


_record: ProgressRecord | None = None  # this process's rank, once its worker opened it


def open_record(out_dir: str | Path, rank: int, world_size: int, launch: str, timeout_s: float,
                stop: Callable[[], bool] | None = None) -> ProgressRecord:
    """Start this rank's record under ``out_dir/PROGRESS_DIR``; ``mark`` writes to it."""
    global _record
    _record = ProgressRecord(Path(out_dir) / PROGRESS_DIR, rank, world_size, launch, timeout_s,
                             stop)
    return _record


def close_record() -> None:
    """Stop this rank's record; ``mark`` does nothing again."""
    global _record
    if _record is not None:
        _record.close()
        _record = None


def mark(phase: str, step: int) -> None:
    """Record that this rank enters ``phase`` of step ``step`` (nothing when no record is
    open: the rehearsal, the plan's measurement, a trainer in a test process)."""
    if _record is not None:
        _record.mark(phase, step)


def explain_timeout(error: BaseException) -> CollectiveTimeout | None:
    """``error`` as a ``CollectiveTimeout`` naming who did not arrive, when it is a timed-out
    collective of a rank that keeps a record; else None."""
    if _record is None or not _TIMEOUT.search(str(error)):
        return None
    return CollectiveTimeout(_record.explain())
