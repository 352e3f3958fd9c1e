"""The pipeline's stages, in order: the one list the engine (``stages.mechanism``) takes.

Adding a stage is adding a folder ``stages/<name>/`` (its declaration ``STAGE`` in
``__init__.py``, its work module, its rank worker if it has ranks) and a line here.
"""
from __future__ import annotations

from stages import curate, evaluate, plan, tokenize, train
from stages.mechanism.declaration import StageDeclaration, StageList

PIPELINE = StageList((
    curate.STAGE,
    tokenize.STAGE,
    plan.STAGE,
    train.STAGE,
    evaluate.STAGE,
))

STAGE_ORDER: tuple[str, ...] = PIPELINE.order


def declaration(name: str) -> StageDeclaration:
    """The declaration of stage ``name``."""
    return PIPELINE.get(name)


def upstream(name: str) -> tuple[str, ...]:
    """The stages whose outputs (and keys) stage ``name`` consumes."""
    return declaration(name).upstream
