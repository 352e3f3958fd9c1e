"""The stage walk: the one order in which a stage's steps run, by its shape.

- one app (``SINGLE``): ``begin`` (reuse or open an attempt), the work's ``run``, publish;
- a fan-out (``FAN_OUT``): ``begin`` and the work's ``prepare`` (the part count), every
  ``part`` (anywhere, in any order), then ``finalize`` and publish;
- ranks (``RANKS``): ``begin`` and ``prepare`` (the rank spec), the ranks, ``finalize`` and
  publish.

The steps (``begin_step``, ``part_step``, ``finish_step``, ``single_step``) are plain
functions; ``walk`` composes them through a ``Steps`` object that says how a step is run.
``InlineSteps`` calls them in this process (``run_stage``: tests, notebooks); the workflow's
Parsl apps are thin adapters that call the same steps in worker processes
(``workflows.apps``), so both paths share every check, such as the part count of a fan-out.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, Protocol, TypeVar

from stages.mechanism import launch
from stages.mechanism.attempt import Attempt, PipelineContext, begin, fail, finish
from stages.mechanism.declaration import StageDeclaration
from stages.mechanism.outputs import StageResult
from stages.mechanism.shape import FAN_OUT, SINGLE, StageShape

Handle = TypeVar("Handle")


def _work(stage: StageDeclaration, work: ModuleType | None) -> Any:
    return work or stage.work()


def single_step(ctx: PipelineContext, stage: StageDeclaration, cfg: Any,
                inputs: dict[str, StageResult], force: bool = False,
                work: ModuleType | None = None) -> StageResult:
    """A one-app stage, whole: reuse its output, or ``run`` it and publish."""
    attempt = begin(ctx, stage, cfg, inputs, force)
    if attempt.reused is not None:
        return attempt.reused
    tracker = attempt.tracker(ctx)
    try:
        outputs = _work(stage, work).run(cfg, attempt.inputs, Path(attempt.work_dir), tracker)
        tracker.flush()
    except BaseException as error:
        fail(ctx, attempt, error)
        raise
    return finish(ctx, attempt, outputs)


def begin_step(ctx: PipelineContext, stage: StageDeclaration, cfg: Any,
               inputs: dict[str, StageResult], force: bool = False,
               work: ModuleType | None = None) -> Attempt:
    """Open a multi-part stage and run its ``prepare``: the attempt (``reused`` set when the
    output is reused, else ``prepared`` holds the part count or the rank spec's path)."""
    attempt = begin(ctx, stage, cfg, inputs, force)
    if attempt.reused is not None:
        return attempt
    tracker = attempt.tracker(ctx)
    try:
        attempt.prepared = _work(stage, work).prepare(cfg, attempt.inputs,
                                                      Path(attempt.work_dir), tracker)
        tracker.flush()
    except BaseException as error:
        fail(ctx, attempt, error)
        raise
    return attempt


def part_step(stage: StageDeclaration, cfg: Any, attempt: Attempt, index: int,
              work: ModuleType | None = None) -> dict[str, Any] | None:
    """One part of a fan-out stage (one input shard of tokenize); None when reused."""
    if attempt.reused is not None:
        return None
    return _work(stage, work).part(cfg, Path(attempt.work_dir), index)


def check_part_count(stage: StageDeclaration, cfg: Any, prepared: Any, parts: list[Any]) -> None:
    """A fan-out's ``prepare`` made as many parts as its shape declares, which is how many
    were submitted; RuntimeError otherwise."""
    shape = stage.shape(cfg)
    if shape.kind == FAN_OUT and prepared != len(parts):
        raise RuntimeError(f"{stage.name}: prepare made {prepared} parts, its shape declares "
                           f"{shape.parts} and {len(parts)} ran")


def finish_step(ctx: PipelineContext, stage: StageDeclaration, cfg: Any, attempt: Attempt,
                parts: list[Any], work: ModuleType | None = None) -> StageResult:
    """A multi-part stage's ``finalize`` over its parts' results, then publish (the reused
    result when reused). A fan-out's ``prepare`` must have made as many parts as its shape
    declares, which is how many were submitted."""
    if attempt.reused is not None:
        return attempt.reused
    try:
        check_part_count(stage, cfg, attempt.prepared, parts)
        tracker = attempt.tracker(ctx)
        outputs = _work(stage, work).finalize(cfg, Path(attempt.work_dir), list(parts), tracker)
        tracker.flush()
    except BaseException as error:
        fail(ctx, attempt, error)
        raise
    return finish(ctx, attempt, outputs)


class Steps(Protocol, Generic[Handle]):
    """How ``walk`` runs each step: at once (``InlineSteps``) or as a Parsl app whose handle
    is a future (``workflows.session``)."""

    def single(self) -> Handle: ...

    def begin(self) -> Handle: ...

    def part(self, begun: Handle, index: int) -> Handle: ...

    def ranks(self, begun: Handle) -> Handle: ...

    def finish(self, begun: Handle, parts: list[Handle], after: Handle | None) -> Handle: ...


def walk(shape: StageShape, steps: Steps[Handle]) -> list[Handle]:
    """Run a stage's steps in the order its shape gives; every step's handle, the stage's
    result last."""
    if shape.kind == SINGLE:
        return [steps.single()]
    begun = steps.begin()
    if shape.kind == FAN_OUT:
        parts = [steps.part(begun, index) for index in range(shape.parts)]
        return [begun, *parts, steps.finish(begun, parts, None)]
    ranks = steps.ranks(begun)
    return [begun, ranks, steps.finish(begun, [], ranks)]


@dataclass
class InlineSteps:
    """The steps run one after another in this process; ranks on this machine
    (``stages.mechanism.launch.run_local``)."""

    ctx: PipelineContext
    stage: StageDeclaration
    cfg: Any
    inputs: dict[str, StageResult]
    force: bool = False
    work: ModuleType | None = None

    def single(self) -> StageResult:
        return single_step(self.ctx, self.stage, self.cfg, self.inputs, self.force, self.work)

    def begin(self) -> Attempt:
        return begin_step(self.ctx, self.stage, self.cfg, self.inputs, self.force, self.work)

    def part(self, begun: Attempt, index: int) -> dict[str, Any] | None:
        return part_step(self.stage, self.cfg, begun, index, self.work)

    def ranks(self, begun: Attempt) -> None:
        if begun.reused is None:
            try:
                launch.run_local(begun.prepared, Path(begun.work_dir) / self.stage.ranks_log,
                                 what=self.stage.activity or self.stage.name)
            except BaseException as error:
                fail(self.ctx, begun, error)
                raise

    def finish(self, begun: Attempt, parts: list[Any], after: Any) -> StageResult:
        return finish_step(self.ctx, self.stage, self.cfg, begun, parts, self.work)


def run_stage(ctx: PipelineContext, stage: StageDeclaration, cfg: Any,
              inputs: dict[str, StageResult], force: bool = False,
              work: ModuleType | None = None) -> StageResult:
    """Reuse or compute ``stage`` in this process; its result. ``work``: the work module
    (default ``stage.work()``)."""
    return walk(stage.shape(cfg), InlineSteps(ctx, stage, cfg, inputs, force, work))[-1]


@dataclass
class _WorkOnly:
    """The steps of a stage's work alone, on a given directory: no key, lock or publish."""

    stage: StageDeclaration
    work: Any
    cfg: Any
    inputs: dict[str, dict]
    out_dir: Path
    tracker: Any

    def single(self) -> dict[str, Any]:
        return self.work.run(self.cfg, self.inputs, self.out_dir, self.tracker)

    def begin(self) -> Any:
        return self.work.prepare(self.cfg, self.inputs, self.out_dir, self.tracker)

    def part(self, prepared: Any, index: int) -> dict[str, Any]:
        return self.work.part(self.cfg, self.out_dir, index)

    def ranks(self, prepared: Any) -> None:
        launch.run_local(prepared, self.out_dir / self.stage.ranks_log,
                         what=self.stage.activity or self.stage.name)

    def finish(self, prepared: Any, parts: list[Any], after: Any) -> dict[str, Any]:
        check_part_count(self.stage, self.cfg, prepared, parts)
        return self.work.finalize(self.cfg, self.out_dir, list(parts), self.tracker)


def run_work(stage: StageDeclaration, cfg: Any, inputs: dict[str, dict], out_dir: Path,
             tracker: Any, work: ModuleType | None = None) -> dict[str, Any]:
    """The stage's work on ``out_dir`` by its shape, in this process, without the attempt
    around it (no key, lock or publish); its outputs."""
    steps = _WorkOnly(stage, _work(stage, work), cfg, inputs, Path(out_dir), tracker)
    return walk(stage.shape(cfg), steps)[-1]
