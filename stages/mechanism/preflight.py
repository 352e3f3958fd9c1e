"""Pre-flight: the cheap input checks of every stage a run will compute, before any work.

Each stage's declaration may name a check (``stages.mechanism.checks``). ``preflight`` calls it for
each stage this invocation will run or force, by the driver's own rule
(``stages.mechanism.selection.decide_stages``): a reused stage is not checked (its inputs may be
gone).
Nothing is written and no worker is started, so a bad input costs a second, not a Parsl
start-up and a corpus load.
"""
from __future__ import annotations

from stages.mechanism.config import ConfigError, PipelineConfig
from stages.mechanism.registry import StageDeclaration, declaration
from stages.mechanism.selection import StageDecision, reused_outputs


def stages_to_compute(plans: list[StageDecision]) -> list[StageDeclaration]:
    """The stages the driver will run or force (not reuse or skip), in order."""
    return [declaration(p.name) for p in plans if p.action in ("run", "force")]


def check_layout(cfg: PipelineConfig) -> None:
    """The ``parallel.*`` fields the config fixes can form a plan for this model, batch and
    ``parallel.nproc`` (``model.training.validate.layout_problem``: the plan stage's own
    rules); ConfigError with the plan stage's message otherwise, whatever the stages."""
    from model.planner.choose import fixed_fields, hand_plan
    from model.training.validate import layout_problem

    nproc, fixed = cfg.parallel.nproc, fixed_fields(cfg.parallel)
    problem = layout_problem(cfg.model, cfg.train, nproc, fixed,
                             hand_plan(fixed, cfg.train.global_batch, nproc))
    if problem:
        raise ConfigError(f"parallel.* on parallel.nproc={cfg.parallel.nproc} ranks: {problem}")


def preflight(cfg: PipelineConfig, plans: list[StageDecision]) -> list[str]:
    """Run the check of every stage the driver's decisions (``plans``, from
    ``stages.mechanism.selection.decide_stages``) will compute; return their names. Each
    check sees the published outputs of the stages this invocation reuses.

    Then the config's fixed parallel layout (``check_layout``; after the stages' checks,
    which name a more direct cause, e.g. more ranks than this machine runs). A failing check
    raises its ``ValueError`` (``ConfigError``, ``DataError``, ...), whose
    message names the setting and the fix.
    """
    reused = reused_outputs(plans)
    names = []
    for stage in stages_to_compute(plans):
        if stage.check is not None:
            stage.check(cfg, reused)
        names.append(stage.name)
    check_layout(cfg)
    return names
