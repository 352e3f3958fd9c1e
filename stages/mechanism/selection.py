"""Which output each stage takes: reuse one, continue one, or compute a new one.

The one home of the rule that the driver (``workflows.pipeline``), each attempt
(``stages.mechanism.attempt.begin``), the pre-flight checks and the readiness report share:

- a stage's key hashes its ingredients (``stages.mechanism.keys``), among them the digests
  of its upstream stages' outputs; a stage whose key already succeeded is reused;
- with ``--rerun-triggers`` naming fewer than all triggers, an output whose ingredients
  agree on the named ones is kept too (say, one made by other code), and says so;
- a stage that can be extended continues an earlier output (its declaration's
  ``continuation`` hook);
- ``--only``/``--from``/``--force`` recompute the selected stages.

The driver decides once per invocation (``decide_stages``) and hands the decisions on. A
stage whose upstream will run has no key yet: its key hashes what the upstream will
produce, so it is decided again when its attempt begins, and reused then if the upstream's
output came out the same (early cutoff).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.mechanism import keys, outputs
from stages.mechanism.declaration import Continuation, StageDeclaration, StageList, json_digest
from stages.mechanism.errors import ConfigError
from stages.mechanism.outputs import StageResult

ACTIONS = ("run", "force", "reuse", "skip")


@dataclass
class Resolution:
    """A stage's key for given inputs and what already exists for it.

    ``found``: a published output to reuse (damaged ones are never found); ``kept``: the
    ingredients in which ``found`` differs, when it was kept because ``--rerun-triggers``
    leaves them out ("" for an exact match); ``continues``: where a new attempt would start
    from; ``damage``: what is wrong with the exact key's published output, if anything."""

    ingredients: dict[str, Any]
    key: str
    found: StageResult | None = None
    kept: str = ""
    continues: Continuation | None = None
    damage: str | None = None


@dataclass
class StageDecision:
    """What the driver will do with one stage. ``key`` is None while it hashes the output
    of an upstream stage that runs first."""

    name: str
    key: str | None
    action: str  # "run", "force", "reuse", "skip" (after the stage given to --only)
    existing: StageResult | None
    reason: str = ""  # for "run": why an older output of this stage is not reused
    resolution: Resolution | None = None


def digest_of(result: StageResult, pipeline: StageList) -> str:
    """The digest downstream keys hash of a stage's result (computed from its outputs when
    its status predates digests; a stage outside ``pipeline`` hashes its outputs)."""
    if result.digest:
        return result.digest
    stage = pipeline.find(result.name)
    return stage.output_digest(result.outputs) if stage else json_digest(result.outputs)


def resolve(runs_dir: str | Path, stage: StageDeclaration, cfg: Any,
            input_digests: dict[str, str], code: str,
            triggers: tuple[str, ...] = keys.TRIGGERS) -> Resolution:
    """The key of ``stage`` on these inputs and the output it would take (module docstring).

    Order: the exact key's intact output; else, with ``triggers`` narrowed, the newest
    output that agrees on them; else a continuation; else nothing (compute afresh)."""
    ingredients = keys.key_ingredients(stage, cfg, input_digests, code)
    key = keys.key_of(ingredients)
    found = outputs.find_succeeded(runs_dir, stage.name, key)
    damage = stage.output_problem(found.outputs) if found is not None else None
    if found is not None and not damage:
        return Resolution(ingredients, key, found)
    if set(triggers) != set(keys.TRIGGERS):
        for old_key, directory, status in outputs.stage_outputs(runs_dir, stage.name):
            old = status.get("ingredients") or {}
            if old and keys.same_except(old, ingredients, triggers):
                kept = outputs.find_succeeded(runs_dir, stage.name, old_key)
                if kept is not None and not stage.output_problem(kept.outputs):
                    return Resolution(ingredients, key, kept,
                                      kept=", ".join(keys.differences(old, ingredients)))
    continues = (stage.continuation.find(runs_dir, stage, cfg, ingredients)
                 if stage.continuation is not None else None)
    if continues is not None:
        ingredients = {**ingredients, "continues": continues.ingredient()}
        key = keys.key_of(ingredients)
        found = outputs.find_succeeded(runs_dir, stage.name, key)
        damage = stage.output_problem(found.outputs) if found is not None else None
        if found is not None and not damage:
            return Resolution(ingredients, key, found, continues=continues)
    return Resolution(ingredients, key, None, continues=continues, damage=damage)


def decide_stages(
    pipeline: StageList, cfg: Any, only: str | None, start: str | None, force: bool,
    code: dict[str, str] | str | None = None, triggers: tuple[str, ...] = keys.TRIGGERS,
) -> list[StageDecision]:
    """Decide run / force / reuse / skip per stage; refuse selections whose upstream is missing.

    ``--only STAGE`` recomputes that stage, reuses the stages before it (they must exist)
    and skips the stages after it; ``--from STAGE`` recomputes it and every later stage.

    ``code`` is the per-stage code hash (``stages.mechanism.keys.code_hashes()`` when not
    given; the driver computes it once and passes the same to its PipelineContext)."""
    code = keys.code_hashes(pipeline) if code is None else code
    runs_dir = cfg.runs_dir
    order = pipeline.order
    if only:
        selected = {only}
    elif start:
        selected = set(order[order.index(start):])
    else:
        selected = set(order)
    decided: dict[str, StageDecision] = {}
    for stage in pipeline:
        name = stage.name
        ups = [decided[u] for u in stage.upstream]
        pending = [u.name for u in ups if u.existing is None or u.action in ("run", "force")]
        resolution = None
        if not pending:
            digests = {u.name: digest_of(u.existing, pipeline) for u in ups}
            resolution = resolve(runs_dir, stage, cfg, digests, keys.code_for(code, name),
                                 triggers)
        existing = resolution.found if resolution else None
        key = existing.key if existing else (resolution.key if resolution else None)
        damage = resolution.damage if resolution else None
        if only and order.index(name) > order.index(only):
            decided[name] = StageDecision(name, key, "skip", existing, resolution=resolution)
            continue
        if name not in selected:
            if existing is None:
                flag = f"--only {only}" if only else f"--from {start}"
                what = f"it is damaged ({damage})" if damage else "there is none"
                raise ConfigError(
                    f"{flag} needs the '{name}' stage's output for the current config "
                    f"(key {key}), and {what}: run the pipeline without {flag.split()[0]} first")
            action = "reuse"
        elif force or only or start:
            action = "force"
        else:
            action = "reuse" if existing is not None else "run"
        decided[name] = StageDecision(name, key, action, existing,
                                      _reason(runs_dir, action, resolution, pending),
                                      resolution)
    return list(decided.values())


def _reason(runs_dir: Path, action: str, resolution: Resolution | None,
            pending: list[str]) -> str:
    """The dry run's "why" line for one decision ("" when there is nothing to say)."""
    if resolution is None:
        if action in ("run", "force"):
            return (f"its key hashes what {' and '.join(pending)} will make: decided once "
                    "that is made, and reused then if it comes out the same")
        return ""
    parts = []
    if action == "reuse" and resolution.kept:
        parts.append(f"kept although {resolution.kept} changed (--rerun-triggers leaves "
                     "them out)")
    if action in ("run", "force"):
        if resolution.damage:
            parts.append(f"its output is damaged: {resolution.damage}")
        elif action == "run":
            reason = keys.rerun_reason(runs_dir, resolution.ingredients)
            if reason:
                parts.append(reason)
        if resolution.continues is not None:
            parts.append(resolution.continues.why)
            if resolution.continues.warning:
                parts.append(f"warning: {resolution.continues.warning}")
    return "; ".join(parts)


def reused_outputs(plans: list[StageDecision]) -> dict[str, dict[str, Any]]:
    """Name -> published outputs of the stages these decisions reuse (what the pre-flight
    checks and the readiness report may read)."""
    return {p.name: p.existing.outputs for p in plans
            if p.action == "reuse" and p.existing is not None}


def stage_keys(pipeline: StageList, cfg: Any,
               code: dict[str, str] | str | None = None) -> dict[str, Any]:
    """Every stage's key as the driver would decide it now (None while pending)."""
    return {p.name: p.key for p in decide_stages(pipeline, cfg, None, None, False, code)}
