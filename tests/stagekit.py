"""Stages outside the pipeline for tests of the stage mechanism: a declaration whose work
the test passes to ``stages.mechanism.walk.run_stage``."""
from __future__ import annotations

from stages.config import PipelineConfig
from stages.mechanism.shape import SINGLE, StageShape
from stages.registry import StageDeclaration


def _single(cfg: PipelineConfig) -> StageShape:
    return StageShape(SINGLE)


def declare(name: str, sections: tuple[str, ...] = ("train",),
            resumable: bool = False) -> StageDeclaration:
    """A one-app stage named ``name`` that reads ``sections``; no upstream."""
    return StageDeclaration(name, sections=sections, upstream=(), shape=_single,
                            module="tests.stagekit", resumable=resumable)
