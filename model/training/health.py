"""Step health: skip bad steps, roll back after a loss spike, name slow ranks.

The rules (one home for them; the trainer only asks and acts):

- **Bad step.** A step whose loss or global gradient norm is not finite on any rank is
  skipped: no optimizer update, while the step count, the learning-rate schedule and the
  data stream advance (the lr stays a function of the step, and the batch is not retried).
  The ranks agree before the optimizer step, so no rank updates when another saw a NaN:
  one all-reduce of the loss and a count of bad ranks (``StepHealth.judge``), which is the
  dp mean of the loss the trainer takes anyway.
- **Spike.** After ``train.spike_window`` good steps, a step's loss ``L`` is a spike when
  ``L - m > max(k * 1.4826 * MAD, train.spike_min_rise * m)``, where ``m`` is the median of
  the last ``spike_window`` good losses, MAD their median absolute deviation (1.4826 * MAD
  estimates a standard deviation robustly) and ``k`` is ``train.spike_deviations``. The
  relative floor keeps a flat, quiet curve (a tiny MAD) from calling a wobble a spike.
- **Rollback.** A spike, or ``train.max_bad_steps`` bad steps in a row, restores the newest
  complete checkpoint (weights, optimizer, schedule, random state, loss history) while the
  data stream stays where it is: the batches drawn since that checkpoint, those that led to
  the spike included, are skipped, as PaLM did. The spike rule then waits for
  ``spike_window`` new good steps before it judges again. Without a checkpoint to go back
  to, the step is skipped instead. A checkpoint written inside a run of bad steps (an
  out-of-time or final save; scheduled saves wait for the run to end) holds the weights that
  led to it and is never a rollback's target: the newest one taken before the run began is.
  A rollback called for with no such checkpoint counts as one too. More than
  ``train.max_rollbacks`` of them end the training with ``TrainingDiverged`` (it diverges
  whatever data it sees): one named line, like a hung collective's.
- **Slow ranks.** Every ``train.slow_rank_every`` steps each rank's busy seconds per step
  (``busy_seconds``: time the rank's thread ran or was ready to run, not time blocked in a
  collective waiting for the others) are gathered (one all-gather of a float); the slowest
  over the (lower) median is a metric, and a rank above ``train.slow_rank_ratio`` is named
  with its host on the console.

Fault injection, for tests and drills only: the environment variable ``FAULTS_VAR`` holds a
JSON object (``Faults``) that poisons given batches with NaN, multiplies their loss (a
spike), drops batches before training on them, or makes one rank burn CPU each step. It is
read once per rank; unset, nothing is injected.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from model.config import TrainConfig

FAULTS_VAR = "FRONTIER_LLM_TRAIN_FAULTS"
"""Fault injection (tests and drills only): a JSON object with the fields of ``Faults``."""

MAD_SIGMA = 1.4826  # MAD x this estimates the standard deviation of normal noise


class TrainingDiverged(ValueError):
    """More than ``train.max_rollbacks`` rollbacks: the training diverges whatever data it sees.
    A ``ValueError`` so that the stage fails with this one message and no retry
    (``stages.mechanism.launch.rank_main``'s ``rank-error.json``), as a hung collective does."""


def written_in_bad_streak(extra: dict[str, Any]) -> bool:
    """Whether a checkpoint's extra state (``extra.pt``) says it was saved inside a run of bad
    steps: its weights are those that led to the run, so a rollback must go further back."""
    return bool((extra.get("health") or {}).get("bad_streak", 0))


# ---------------------------------------------------------------- the rules
def is_spike(loss: float, good: Iterable[float], deviations: float, min_rise: float) -> bool:
    """Whether ``loss`` is a spike above the ``good`` losses (the module's rule)."""
    good = list(good)
    median = statistics.median(good)
    mad = statistics.median(abs(x - median) for x in good)
    return loss - median > max(deviations * MAD_SIGMA * mad, min_rise * abs(median))


@dataclass
class Verdict:
    """What a step's collective check decided (every rank gets the same one)."""

    bad: bool = False
    """Some rank's loss or gradient norm was not finite."""
    spike: bool = False
    """The loss was a spike."""
    rollback: bool = False
    """Go back to the newest checkpoint (a spike, or too many bad steps in a row)."""

    @property
    def update(self) -> bool:
        """Whether the optimizer may apply this step."""
        return not (self.bad or self.spike)


class StepHealth:
    """The per-rank state of the bad-step and spike rules.

    Every rank holds one; ranks without the loss (earlier pipeline stages) judge only the
    gradient norm. ``state_dict`` goes into checkpoints (the window of good losses, so a
    resumed run decides as the uninterrupted one would; the counters and records, so they
    survive a restart); a rollback restores none of it.
    """

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.good: deque[float] = deque(maxlen=cfg.spike_window)
        self.bad_streak = 0
        self.batches_drawn = 0  # global batches drawn from the stream, skipped ones included
        self.skipped: list[dict[str, Any]] = []  # one record per skipped step
        self.rollbacks: list[dict[str, Any]] = []  # one record per rollback
        self.since_checkpoint: list[int] = []  # batches drawn since the newest checkpoint
        self.last_good_step = 0  # the newest step whose update was applied (0: none yet)

    def judge(self, loss: torch.Tensor | None, norm: torch.Tensor, counts: bool,
              dp: int) -> tuple[torch.Tensor, Verdict]:
        """This step's dp-mean loss and verdict, the same on every rank (collective).

        One all-reduce (SUM over all ranks) carries both the loss and a count of the ranks
        whose loss or gradient norm is not finite, so the check replaces the dp mean of the
        loss the trainer takes anyway instead of adding a collective. ``loss``: this rank's
        mean over its own rows (None before the last pipeline stage); ``counts``: whether this
        rank adds it (one rank per dp index). Every rank then judges the spike rule on the same
        mean, so the window of good losses is the same everywhere."""
        bad = (~torch.isfinite(norm)).float()
        if loss is not None:
            bad = bad + (~torch.isfinite(loss.detach())).float()
        part = (loss.detach().float() if counts and loss is not None
                else torch.zeros((), dtype=torch.float32, device=bad.device))
        packed = torch.stack([part, bad.to(part.device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed)
        mean = packed[0] / dp
        value, flagged = float(mean), bool(packed[1] > 0)
        bad_step = flagged or not math.isfinite(value)
        k = self.cfg.spike_deviations
        spike = (not bad_step and k is not None and len(self.good) == self.good.maxlen
                 and is_spike(value, self.good, k, self.cfg.spike_min_rise))
        if bad_step:
            self.bad_streak += 1
        else:
            self.bad_streak = 0
            if not spike:
                self.good.append(value)
        return mean, Verdict(bad=bad_step, spike=spike,
                             rollback=spike or self.bad_streak >= self.cfg.max_bad_steps)

    def drew(self) -> int:
        """Count one batch drawn from the stream; return its index (0-based)."""
        index = self.batches_drawn
        self.batches_drawn += 1
        self.since_checkpoint.append(index)
        return index

    def window(self, batch: int) -> dict[str, int]:
        """The data window of global batch ``batch``: its index and its sequences (positions
        ``[first, last]`` in the loader's global order)."""
        size = self.cfg.global_batch
        return {"batch": batch, "first_sequence": batch * size,
                "last_sequence": (batch + 1) * size - 1}

    def record_skip(self, step: int, batch: int, loss: float | None, norm: float) -> dict:
        """Record a skipped step; return the record."""
        record = {"step": step, **self.window(batch), "loss": _plain(loss),
                  "grad_norm": _plain(norm)}
        self.skipped.append(record)
        return record

    def record_rollback(self, step: int, to_step: int | None, reason: str,
                        checkpoint: str | None, batches: list[int]) -> dict:
        """Record a rollback from ``step`` to ``to_step``; ``batches`` (those drawn since that
        checkpoint) are the skipped windows. ``to_step`` None: one was called for but no
        checkpoint before the trouble exists (the step is only skipped); it counts all the
        same. Raises ``TrainingDiverged`` past train.max_rollbacks."""
        record = {"step": step, "to_step": to_step, "reason": reason, "checkpoint": checkpoint,
                  "batches": batches,
                  "first_sequence": batches[0] * self.cfg.global_batch if batches else None,
                  "last_sequence": ((batches[-1] + 1) * self.cfg.global_batch - 1
                                    if batches else None)}
        self.rollbacks.append(record)
        if to_step is not None:
            self.since_checkpoint, self.bad_streak = [], 0
        # else the run of bad steps goes on, and each further bad step calls again
        if len(self.rollbacks) > self.cfg.max_rollbacks:
            raise TrainingDiverged(self.diverged_message())
        return record

    def diverged_message(self) -> str:
        """What ``TrainingDiverged`` says: the rollbacks' steps, the last good step, the fix."""
        cfg, steps = self.cfg, [r["step"] for r in self.rollbacks]
        last = self.rollbacks[-1]
        nowhere = sum(r["to_step"] is None for r in self.rollbacks)
        without = ("" if not nowhere else ", none of them with" if nowhere == len(steps)
                   else f", {nowhere} of them without")
        without += " a checkpoint before the trouble to go back to" if nowhere else ""
        return (f"training diverged: {len(steps)} rollbacks called for (train.max_rollbacks="
                f"{cfg.max_rollbacks}) at steps {', '.join(map(str, steps))}{without}; the last "
                f"at step {last['step']} ({last['reason']}); the last good step was "
                f"{self.last_good_step}. Try a lower train.lr (now {cfg.lr:g}), a longer "
                f"train.warmup_steps (now {cfg.warmup_steps}) or a smaller train.grad_clip (now "
                f"{cfg.grad_clip:g}), or check the data near the skipped batches")

    def saved(self) -> None:
        """A checkpoint of the current state was written: later rollbacks start from it."""
        self.since_checkpoint = []

    def state_dict(self) -> dict[str, Any]:
        """Plain state for the checkpoint's extra."""
        return {"good": list(self.good), "bad_streak": self.bad_streak,
                "batches_drawn": self.batches_drawn, "skipped": list(self.skipped),
                "rollbacks": list(self.rollbacks), "last_good_step": self.last_good_step}

    def load_state_dict(self, state: dict[str, Any] | None, rollback: bool = False) -> None:
        """Restore from a checkpoint (a resume). A ``rollback`` restores nothing: the stream
        position, counters and records go on, and the window of good losses starts empty, so
        the spike rule waits for ``spike_window`` new good steps (the data after the skipped
        batches may be legitimately harder than the checkpoint's window remembers; judging
        it against that window would roll back again and again)."""
        state = state or {}
        self.good.clear()
        self.bad_streak, self.since_checkpoint = 0, []
        if not rollback:
            self.good.extend(state.get("good", []))
            self.batches_drawn = int(state.get("batches_drawn", 0))
            self.skipped = list(state.get("skipped", []))
            self.rollbacks = list(state.get("rollbacks", []))
            self.last_good_step = int(state.get("last_good_step", 0))

    def summary(self) -> dict[str, Any]:
        """The training summary's ``health`` entry."""
        return {"skipped_steps": self.skipped, "rollbacks": self.rollbacks,
                "batches_drawn": self.batches_drawn, "last_good_step": self.last_good_step}


def _plain(value: float | None) -> float | str | None:
    """A JSON-safe number: non-finite values as their names ("nan", "inf")."""
    if value is None:
        return None
    return value if math.isfinite(value) else str(value)


# ---------------------------------------------------------------- slow ranks
def busy_seconds() -> float:
    """Seconds this thread has run or waited to run on a CPU (Linux schedstat: run time +
    run-queue delay); time blocked in a collective waiting for other ranks is not counted.
    Elsewhere, this thread's CPU time."""
    try:
        with open("/proc/thread-self/schedstat") as handle:
            run_ns, wait_ns = handle.read().split()[:2]
        return (int(run_ns) + int(wait_ns)) / 1e9
    except (OSError, ValueError):
        return time.thread_time()


@dataclass
class SlowRankReport:
    """One gathering of per-rank busy seconds per step."""

    step: int
    seconds: list[float]
    """Busy seconds per step of each rank (by global rank) over the last interval."""
    ratio: float
    """Slowest over the lower median."""
    slow: list[int] = field(default_factory=list)
    """Ranks above train.slow_rank_ratio x the lower median."""
    first: bool = False
    """The first step's gathering (start-up included: a metric, never a console warning)."""


class SlowRanks:
    """Gathers each rank's busy seconds per step every ``train.slow_rank_every`` steps."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.every, self.limit, self.device = cfg.slow_rank_every, cfg.slow_rank_ratio, device
        self._since, self._steps = busy_seconds(), 0
        self._first = True  # the first step counted gathers too: the chart starts at step 1
        self.hosts: list[str] | None = None

    def restart(self) -> None:
        """Start a fresh interval (after a pause that is not training: a rollback, a save)."""
        self._since, self._steps = busy_seconds(), 0

    def after_step(self, step: int) -> SlowRankReport | None:
        """Count a step; on the first one and every ``every``-th, gather (collective) and return
        the report (``first`` set on the first: its busy time includes the start-up)."""
        self._steps += 1
        first, self._first = self._first, False
        if not self.every or (step % self.every and not first) or not dist.is_initialized():
            return None
        now = busy_seconds()
        mine = torch.tensor([(now - self._since) / max(1, self._steps)], dtype=torch.float64,
                            device=self.device)
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        seconds = [float(t) for t in gathered]
        self._since, self._steps = busy_seconds(), 0
        median = statistics.median_low(seconds)
        ratio = max(seconds) / median if median > 0 else 1.0
        slow = [r for r, s in enumerate(seconds) if median > 0 and s / median > self.limit]
        if slow and self.hosts is None:  # every rank saw the same numbers: all gather names
            import socket

            hosts: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(hosts, socket.gethostname())
            self.hosts = [str(h) for h in hosts]
        return SlowRankReport(step, seconds, ratio, slow, first)

    def describe(self, report: SlowRankReport) -> str:
        """The console line naming the slow ranks and their hosts."""
        median = statistics.median_low(report.seconds)
        named = ", ".join(
            f"rank {r} on {self.hosts[r] if self.hosts else '?'} "
            f"({report.seconds[r]:.3f} s/step, {report.seconds[r] / median:.1f}x)"
            for r in report.slow)
        return (f"[train] slow ranks at step {report.step}: {named}; the median rank is busy "
                f"{median:.3f} s/step (train.slow_rank_ratio={self.limit})")


# ---------------------------------------------------------------- fault injection
@dataclass(frozen=True)
class Faults:
    """Injected faults (``FAULTS_VAR``), for tests and drills only. Batches are global batch
    indices (0-based, counting every batch drawn, skipped ones included)."""

    nan_batches: frozenset[int] = frozenset()
    """Batches whose gradients (and loss, with ``nan_loss``) become NaN, after the gradients
    were averaged: on ``nan_rank`` only (the others see finite numbers), or every rank."""
    nan_rank: int | None = None
    nan_loss: bool = True
    spike_batches: frozenset[int] = frozenset()
    """Batches whose loss is multiplied by ``spike_factor`` (after the backward pass)."""
    spike_factor: float = 10.0
    drop_batches: frozenset[int] = frozenset()
    """Batches drawn and thrown away before training on them (a run that never saw them)."""
    slow_rank: int | None = None
    """This rank burns ``slow_seconds`` of CPU before each step."""
    slow_seconds: float = 0.0

    @classmethod
    def from_environ(cls) -> Faults | None:
        """The faults ``FAULTS_VAR`` asks for, or None when it is unset or empty."""
        text = os.environ.get(FAULTS_VAR, "").strip()
        if not text:
            return None
        try:
            raw = json.loads(text)
            sets = {k: frozenset(int(b) for b in raw.pop(k, ()))
                    for k in ("nan_batches", "spike_batches", "drop_batches")}
            return cls(**sets, **raw)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{FAULTS_VAR} must be a JSON object with the fields of "
                             f"model.training.health.Faults: {error}") from None

    def poison(self, batch: int, loss: torch.Tensor | None,
               params: list[torch.Tensor]) -> torch.Tensor | None:
        """After the backward pass of ``batch``: the loss (and gradients) it should have."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        if batch in self.nan_batches and self.nan_rank in (None, rank):
            for p in params:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
            if loss is not None and self.nan_loss:
                loss = loss * float("nan")
        if batch in self.spike_batches and loss is not None:
            loss = loss * self.spike_factor
        return loss

    def stall(self) -> None:
        """Burn ``slow_seconds`` of CPU on ``slow_rank`` (a slow device or host)."""
        if self.slow_rank is None or not dist.is_initialized() or dist.get_rank() != self.slow_rank:
            return
        end = time.perf_counter() + self.slow_seconds
        while time.perf_counter() < end:
            pass
