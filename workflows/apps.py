"""Parsl apps: thin wrappers that run stage functions on executors.

Light stages and the driver-side parts of multi-part stages run on the "cpu" executor; the
ranks of train and evaluate each run as one bash app on the "train" executor (torchrun
locally, ``$PARSL_MPI_PREFIX`` under Slurm). Every python app
sends its prints to a log file that the driver tails, since worker output is otherwise
only in Parsl's worker logs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from parsl import bash_app, python_app


@contextlib.contextmanager
def _logged(log_path: str) -> Iterator[None]:
    """Send this app's stdout/stderr to ``log_path`` (line buffered, appended)."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with (
        open(log_path, "a", buffering=1) as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        yield


@python_app(executors=["cpu"])
def stage_app(ctx, name: str, cfg, force: bool, log_path: str, **upstream):
    """Run a whole one-function stage (plan; evaluate on one rank) under the stage mechanism."""
    from stages import stage
    from stages.registry import stage_module

    with _logged(log_path):
        return stage.run_stage(ctx, stage_module(name), cfg, upstream, force)


@python_app(executors=["cpu"])
def begin_app(ctx, name: str, cfg, force: bool, log_path: str, **upstream):
    """Open a multi-part stage (tokenize, train, evaluate) and run its ``prepare`` step.

    Returns the stage's StageResult when it is reused, else (attempt, prepared).
    """
    from stages import stage
    from stages.registry import stage_module

    module = stage_module(name)
    with _logged(log_path):
        attempt = stage.begin(
            ctx, name, module.SECTIONS, cfg, upstream, force, getattr(module, "RESUMABLE", False)
        )
        if isinstance(attempt, stage.StageResult):
            return attempt
        tracker = attempt.tracker(ctx)
        try:
            prepared = module.prepare(cfg, attempt.inputs, Path(attempt.work_dir), tracker)
            tracker.flush()
        except BaseException as error:
            stage.fail(ctx, attempt, error)
            raise
        return attempt, prepared


@python_app(executors=["cpu"])
def shard_app(cfg, opened, shard_index: int, log_path: str) -> dict[str, Any] | None:
    """Tokenize one input shard into its own part of the store (no-op when reused)."""
    from stages import stage, tokenize

    if isinstance(opened, stage.StageResult):
        return None
    attempt, _ = opened
    with _logged(log_path):
        return tokenize.part(cfg, Path(attempt.work_dir), shard_index)


@python_app(executors=["cpu"])
def finish_app(ctx, name: str, cfg, opened, log_path: str, *parts):
    """Run a multi-part stage's ``finalize`` and publish it (pass-through when reused)."""
    from stages import stage
    from stages.registry import stage_module

    if isinstance(opened, stage.StageResult):
        return opened
    attempt, _ = opened
    module = stage_module(name)
    with _logged(log_path):
        try:
            work_dir = Path(attempt.work_dir)
            tracker = attempt.tracker(ctx)
            if name == "tokenize":
                outputs = module.finalize(cfg, work_dir, list(parts), tracker)
            else:
                outputs = module.finalize(cfg, work_dir, tracker)
            tracker.flush()
        except BaseException as error:
            stage.fail(ctx, attempt, error)
            raise
        return stage.finish(ctx, attempt, outputs)


@bash_app(executors=["train"])
def ranks_app(name: str, cfg, opened, stdout=None, stderr=None, parsl_resource_specification=None):
    """The shell command that starts every rank of stage ``name`` (train, evaluate) from the
    spec its ``prepare`` wrote (``true`` when the stage is reused)."""
    from stages import stage
    from workflows import sites

    if isinstance(opened, stage.StageResult):
        return "true"
    _, prepared = opened
    return sites.ranks_command(name, cfg, prepared["spec"], prepared)
