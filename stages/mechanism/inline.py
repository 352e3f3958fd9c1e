"""Run a stage in this process, walking its shape the way the Parsl apps do.

``run_stage`` is the inline executor: ``begin`` (reuse or open an attempt), then by the
stage's shape ``run``; or ``prepare``, every ``part`` in turn, ``finalize``; or ``prepare``,
the ranks on this machine (``stages.mechanism.launch.run_local``), ``finalize``; then
``finish``, or ``fail`` with the error. The pipeline runs the same steps as Parsl apps
(``workflows.apps``); tests and notebooks run stages with this, without Parsl.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from stages.mechanism import launch
from stages.mechanism.attempt import PipelineContext, begin, fail, finish
from stages.mechanism.config import PipelineConfig
from stages.mechanism.outputs import StageResult
from stages.mechanism.registry import StageDeclaration
from stages.mechanism.shape import FAN_OUT, SINGLE


def run_work(stage: StageDeclaration, cfg: PipelineConfig, inputs: dict[str, dict],
             out_dir: Path, tracker: Any, work: Any = None) -> dict[str, Any]:
    """The stage's work on ``out_dir`` by its shape, in this process, without the attempt
    around it (no key, lock or publish); its outputs. ``work``: the work module (default
    ``stage.work()``)."""
    work = work or stage.work()
    out_dir = Path(out_dir)
    shape = stage.shape(cfg)
    if shape.kind == SINGLE:
        return work.run(cfg, inputs, out_dir, tracker)
    prepared = work.prepare(cfg, inputs, out_dir, tracker)
    if shape.kind == FAN_OUT:
        if prepared != shape.parts:  # the Parsl apps submit shape.parts parts: both must agree
            raise RuntimeError(f"{stage.name}: prepare made {prepared} parts, its shape "
                               f"declares {shape.parts}")
        parts = [work.part(cfg, out_dir, index) for index in range(shape.parts)]
        return work.finalize(cfg, out_dir, parts, tracker)
    launch.run_local(prepared, out_dir / stage.ranks_log, what=stage.activity or stage.name)
    return work.finalize(cfg, out_dir, [], tracker)


def run_stage(ctx: PipelineContext, stage: StageDeclaration, cfg: PipelineConfig,
              inputs: dict[str, StageResult], force: bool = False,
              work: ModuleType | None = None) -> StageResult:
    """Reuse or compute ``stage`` here; its result. ``work``: the work module (default
    ``stage.work()``)."""
    attempt = begin(ctx, stage, cfg, inputs, force)
    if attempt.reused is not None:
        return attempt.reused
    tracker = attempt.tracker(ctx)
    try:
        outputs = run_work(stage, cfg, attempt.inputs, Path(attempt.work_dir), tracker, work)
        tracker.flush()
    except BaseException as error:
        fail(ctx, attempt, error)
        raise
    return finish(ctx, attempt, outputs)
