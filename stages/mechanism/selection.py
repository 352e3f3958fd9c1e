"""Which stages an invocation runs, reuses, forces or skips, from the config alone.

The one home of the rule the driver (``workflows.pipeline``), the pre-flight checks
(``stages.mechanism.preflight``) and the scaling studies share: a stage whose key already succeeded
is reused; ``--only``/``--from``/``--force`` recompute the selected stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.mechanism import keys, outputs
from stages.mechanism.config import ConfigError, PipelineConfig
from stages.mechanism.outputs import StageResult
from stages.mechanism.registry import STAGE_ORDER, declaration


@dataclass
class StageDecision:
    """What the driver will do with one stage."""

    name: str
    key: str
    action: str  # "run", "force", "reuse", "skip" (after the stage given to --only)
    existing: StageResult | None
    reason: str = ""  # for "run": why an older output of this stage is not reused


def stage_ingredients(
    cfg: PipelineConfig, code: dict[str, str] | str
) -> dict[str, dict[str, Any]]:
    """Every stage's key ingredients (``stages.mechanism.keys.key_ingredients``), from the config
    and
    the code hashes alone (no work done)."""
    made: dict[str, str] = {}
    found: dict[str, dict[str, Any]] = {}
    for name in STAGE_ORDER:
        stage = declaration(name)
        inputs = {u: made[u] for u in stage.upstream}
        found[name] = keys.key_ingredients(name, cfg, stage.sections, inputs,
                                           keys.code_for(code, name))
        made[name] = keys.key_of(found[name])
    return found


def stage_keys(cfg: PipelineConfig, code: dict[str, str] | str | None = None) -> dict[str, str]:
    """Every stage's key (``code``: ``stages.mechanism.keys.code_hashes()`` when not given)."""
    code = keys.code_hashes() if code is None else code
    return {n: keys.key_of(i) for n, i in stage_ingredients(cfg, code).items()}


def decide_stages(
    cfg: PipelineConfig, only: str | None, start: str | None, force: bool,
    code: dict[str, str] | str | None = None,
) -> list[StageDecision]:
    """Decide run / force / reuse / skip per stage; refuse selections whose upstream is missing.

    ``--only STAGE`` recomputes that stage, reuses the stages before it (they must exist)
    and skips the stages after it; ``--from STAGE`` recomputes it and every later stage.

    ``code`` is the per-stage code hash the keys use (``stages.mechanism.keys.code_hashes()`` when
    not
    given; the driver computes it once and passes the same to its PipelineContext)."""
    ingredients = stage_ingredients(cfg, keys.code_hashes() if code is None else code)
    stage_keys = {n: keys.key_of(i) for n, i in ingredients.items()}
    runs_dir = cfg.runs_dir
    if only:
        selected = {only}
    elif start:
        selected = set(STAGE_ORDER[STAGE_ORDER.index(start) :])
    else:
        selected = set(STAGE_ORDER)
    plans = []
    for name in STAGE_ORDER:
        existing = outputs.find_succeeded(runs_dir, name, stage_keys[name])
        damage = declaration(name).output_problem(existing.outputs) if existing else None
        # Damaged: run again, a resumable stage from what is whole (attempt.begin).
        if damage:
            existing = None
        if only and STAGE_ORDER.index(name) > STAGE_ORDER.index(only):
            plans.append(StageDecision(name, stage_keys[name], "skip", existing))
            continue
        if name not in selected:
            if existing is None:
                flag = f"--only {only}" if only else f"--from {start}"
                what = f"it is damaged ({damage})" if damage else "there is none"
                raise ConfigError(
                    f"{flag} needs the '{name}' stage's output for the current config "
                    f"(key {stage_keys[name]}), and {what}: "
                    f"run the pipeline without {flag.split()[0]} first"
                )
            action = "reuse"
        elif force or only or start:
            action = "force"
        else:
            action = "reuse" if existing is not None else "run"
        reason = keys.rerun_reason(runs_dir, ingredients[name]) if action == "run" else ""
        if damage and action == "run":
            reason = f"its output is damaged: {damage}"
        plans.append(StageDecision(name, stage_keys[name], action, existing, reason))
    return plans
