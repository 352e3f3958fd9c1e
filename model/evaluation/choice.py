"""Which checkpoint of a training the evaluation and its export read.

The train stage names its last checkpoint (``checkpoints/step-N``). When that one fails
``model.training.checkpoint.checkpoint_problem`` (a truncated, missing or damaged file, no
manifest), ``usable_checkpoint`` takes the newest intact ``step-M`` (M < N) beside it, as a
resumed training does (``latest_checkpoint``), and says in one line what it skipped and
why. When none is intact it raises ``NoIntactCheckpoint``, one line naming each problem;
the caller adds what to do (the evaluate stage: retrain).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model.training.checkpoint import (
    CHECKSUM_LIMIT_BYTES,
    CheckpointError,
    checkpoint_problem,
    checkpoint_step,
    newest_intact,
)


class NoIntactCheckpoint(CheckpointError):
    """Neither the named checkpoint nor an older one beside it can be read."""


@dataclass(frozen=True)
class CheckpointChoice:
    """The checkpoint to read (``path``, its ``step``) and those skipped on the way, newest
    first, each with its problem (empty when the named one is intact)."""

    path: Path
    step: int | None
    skipped: tuple[tuple[Path, str], ...] = ()

    def note(self, what: str = "using") -> str | None:
        """One line naming each skipped checkpoint, why, and the step used instead; None
        when nothing was skipped. ``what``: the verb for the step used ("evaluating")."""
        if not self.skipped:
            return None
        why = "; ".join(f"{path} ({problem})" for path, problem in self.skipped)
        return f"skipping damaged checkpoint {why}: {what} step {self.step} ({self.path}) instead"

    def skipped_records(self) -> list[dict[str, str]]:
        """The skipped checkpoints as JSON records ({"checkpoint", "problem"})."""
        return [{"checkpoint": str(path), "problem": problem} for path, problem in self.skipped]


def usable_checkpoint(named: str | Path,
                      checksum_limit: int = CHECKSUM_LIMIT_BYTES) -> CheckpointChoice:
    """``named`` when it passes ``checkpoint_problem``, else the newest intact ``step-M``
    with M below its step in the same directory.

    Raises NoIntactCheckpoint (one line, each problem named) when there is none: also for a
    damaged checkpoint not named ``step-N``, which has no older siblings to fall back to.
    """
    named = Path(named)
    problem = checkpoint_problem(named, checksum_limit)
    if problem is None:
        return CheckpointChoice(named, checkpoint_step(named))
    step = checkpoint_step(named)
    chosen, older = (None, []) if step is None else newest_intact(named.parent, step,
                                                                  checksum_limit)
    skipped = ((named, problem), *older)
    if chosen is None:
        if step is None:
            raise NoIntactCheckpoint(f"checkpoint {named} cannot be read: {problem}")
        why = "; ".join(f"{path.name}: {issue}" for path, issue in skipped)
        raise NoIntactCheckpoint(f"no intact checkpoint is left in {named.parent} ({why})")
    return CheckpointChoice(chosen, checkpoint_step(chosen), skipped)
