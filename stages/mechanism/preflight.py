"""Pre-flight: the cheap input checks of every stage a run will compute, before any work.

Each stage's declaration may name a check (``stages.mechanism.checks``). ``preflight`` calls it for
each stage this invocation will run or force, by the driver's own rule
(``stages.mechanism.selection.decide_stages``): a reused stage is not checked (its inputs may be
gone).
Nothing is written and no worker is started, so a bad input costs a second, not a Parsl
start-up and a corpus load.
"""
from __future__ import annotations

from stages.mechanism.config import PipelineConfig
from stages.mechanism.registry import StageDeclaration, declaration
from stages.mechanism.selection import decide_stages


def stages_to_compute(cfg: PipelineConfig, only: str | None = None, start: str | None = None,
                      force: bool = False) -> list[StageDeclaration]:
    """The stages the driver will run or force (not reuse or skip), in order
    (``stages.mechanism.selection.decide_stages`` decides)."""
    return [declaration(p.name) for p in decide_stages(cfg, only, start, force)
            if p.action in ("run", "force")]


def preflight(cfg: PipelineConfig, only: str | None = None, start: str | None = None,
              force: bool = False) -> list[str]:
    """Run the check of every stage that will be computed; return their names.

    A failing check raises its ``ValueError`` (``ConfigError``, ``DataError``, ...), whose
    message names the setting and the fix.
    """
    names = []
    for stage in stages_to_compute(cfg, only, start, force):
        if stage.check is not None:
            stage.check(cfg)
        names.append(stage.name)
    return names
