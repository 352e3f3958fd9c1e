"""Pre-flight: the cheap input checks of every stage a run will compute, before any work.

Each stage's declaration may name a check (``StageDeclaration.check``). ``preflight`` calls it
for each stage this invocation will run or force, by the driver's own rule
(``stages.mechanism.selection.decide_stages``): a reused stage is not checked (its inputs may
be gone). Nothing is written and no worker is started, so a bad input costs a second, not a
Parsl start-up and a corpus load.
"""
from __future__ import annotations

from typing import Any

from stages.mechanism.declaration import StageDeclaration, StageList
from stages.mechanism.selection import StageDecision, reused_outputs


def stages_to_compute(pipeline: StageList, plans: list[StageDecision]) -> list[StageDeclaration]:
    """The stages the driver will run or force (not reuse or skip), in order."""
    return [pipeline.get(p.name) for p in plans if p.action in ("run", "force")]


def preflight(pipeline: StageList, cfg: Any, plans: list[StageDecision]) -> list[str]:
    """Run the check of every stage the driver's decisions (``plans``, from
    ``stages.mechanism.selection.decide_stages``) will compute; return their names. Each
    check sees the published outputs of the stages this invocation reuses. A failing check
    raises its ``ValueError`` (``ConfigError``, ``DataError``, ...), whose message names the
    setting and the fix.
    """
    reused = reused_outputs(plans)
    names = []
    for stage in stages_to_compute(pipeline, plans):
        if stage.check is not None:
            stage.check(cfg, reused)
        names.append(stage.name)
    return names
