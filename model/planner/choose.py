"""Choosing a plan: the fields a config or the command line fixes, the search or the hand
plan, the figures it is priced with, and the measured best among refined plans.

The plan stage (``stages.plan``), the planner's command line (``workflows.plan``), the
scaling study and the readiness report all choose through here, so they choose alike.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from model.config import ModelConfig, TrainConfig
from model.parallel.layout import (
    CHOICES,
    CONFIG_FIELDS,
    FIELD_TYPES,
    Plan,
    PlanError,
    check_choice,
)
from model.planner.cluster import Cluster
from model.planner.search import SearchResult, search, validate_plan
from model.planner.shapes import Shapes

RUNS_DIR_FIGURES = Path("cache") / "microbench"
"""A runs dir's own copy of this machine's microbenchmark, read before the per-user cache
(``planning_cluster``); the stage never writes it."""

FIX_TYPES = FIELD_TYPES
"""Plan fields ``--fix NAME=VALUE`` takes, with their types."""


def planning_cluster(name_or_path: str | Path, nproc: int, runs_dir: str | Path) -> Cluster:
    """The cluster a plan for ``nproc`` ranks is priced on. A measured one gets this
    machine's cached figures (``model.planner.microbench_cache``): from ``runs_dir``'s own
    copy when it holds a trusted one, else from the per-user cache, measured only when
    neither does. So every runs dir on a machine plans with the same figures."""
    from model.planner.microbench import load_measured_cluster

    return load_measured_cluster(name_or_path, nproc,
                                 read_first=Path(runs_dir) / RUNS_DIR_FIGURES)


def figures_record(cluster: Cluster) -> dict[str, str]:
    """Where a cluster's figures came from, for plan.json: ``{"cluster", "figures"
    (file, cached or measured), "source" (the cluster or cache file)}``."""
    return {"cluster": cluster.name, "figures": cluster.figures, "source": cluster.source}


def calibration_file(runs_dir: str | Path, cluster_name: str, nproc: int) -> Path:
    """Where measured/predicted ratios for this cluster and rank count are kept."""
    return Path(runs_dir) / "plan_calibration" / f"{cluster_name}-{nproc}.json"


def fixed_fields(parallel: Any) -> dict[str, Any]:
    """The plan fields a ParallelConfig fixes (None means the planner chooses)."""
    names = [n for n in CONFIG_FIELDS if n != "sequence_parallel"]
    fixed = {n: getattr(parallel, n) for n in names if getattr(parallel, n, None) is not None}
    # sequence_parallel true allows the planner to use it (with tp > 1), false rules it out
    if not getattr(parallel, "sequence_parallel", False):
        fixed["sequence_parallel"] = False
    return fixed


def parse_fix(items: list[str]) -> dict[str, Any]:
    """``--fix NAME=VALUE`` arguments as plan fields; an unknown name or bad value is an error."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in FIX_TYPES:
            raise PlanError(f"--fix {item!r}: use NAME=VALUE with NAME one of {list(FIX_TYPES)}")
        kind = FIX_TYPES[name]
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise PlanError(f"--fix {item!r}: {name} takes true or false")
            out[name] = value.lower() in ("true", "1", "yes")
        elif kind is int:
            try:
                out[name] = int(value)
            except ValueError:
                raise PlanError(f"--fix {item!r}: {name} takes an integer") from None
        else:
            out[name] = value
    return out


def hand_plan(fixed: dict[str, Any], global_batch: int, world: int) -> Plan | None:
    """A complete plan when the config fixes every layout field, else None."""
    core = ("tp", "pp", "micro_batch", "schedule", "sharding", "recompute")
    if not all(fixed.get(k) is not None for k in core):
        return None
    dp = fixed.get("dp") or max(1, world // (fixed["tp"] * fixed["pp"]))
    # a batch that does not split leaves grad_accum wrong on purpose: Plan.check names it
    ga = max(1, global_batch // (fixed["micro_batch"] * dp))
    return Plan(tp=fixed["tp"], pp=fixed["pp"], dp=dp, micro_batch=fixed["micro_batch"],
                grad_accum=ga,
                schedule=fixed["schedule"], virtual_stages=fixed.get("virtual_stages") or 1,
                sharding=fixed["sharding"], recompute=fixed["recompute"],
                recompute_layers=fixed.get("recompute_layers") or 0,
                sequence_parallel=bool(fixed.get("sequence_parallel", False)))


def choose(model_cfg: ModelConfig, train_cfg: TrainConfig, cluster: Cluster, world: int,
           fixed: dict[str, Any] | None = None, calibration: dict[str, float] | None = None,
           top_k: int = 10) -> tuple[Plan, SearchResult | None]:
    """The best plan (validated, with predictions) and the search that found it (None: by hand)."""
    shapes = Shapes.from_configs(model_cfg, train_cfg, cluster)
    fixed = fixed or {}
    for name in CHOICES.keys() & fixed.keys():
        check_choice(name, fixed[name])
    manual = hand_plan(fixed, train_cfg.global_batch, world)
    if manual is not None:
        checked = validate_plan(shapes, cluster, manual, model_cfg, train_cfg, world, calibration)
        return checked, None
    result = search(shapes, cluster, world, train_cfg.global_batch, fixed, top_k, calibration)
    for p in result.plans:
        p.check(model_cfg, train_cfg, world)  # the search and Plan.check agree; fail loudly if not
    return result.best, result


def measured_best(plans: list[Plan], records: list[dict[str, Any]], log=print) -> Plan:
    """The plan of the highest measured tokens/s, with its measured figures in its
    predictions; each record gets the plan's predictions beside it. PlanError when no
    measurement succeeded."""
    for i, (plan, m) in enumerate(zip(plans, records, strict=True)):
        m["predicted_step_time_s"] = plan.predictions["step_time_s"]
        m["predicted_memory_gb"] = plan.predictions["memory_gb_per_device"]
        m["compute_s"], m["comm_s"] = plan.predictions["compute_s"], plan.predictions["comm_s"]
        log(f"measured {i + 1}/{len(plans)} {plan.describe()}: "
            + (f"{m['step_time_s']:.4f} s/step (predicted {m['predicted_step_time_s']:.4f})"
               if m["ok"] else f"failed ({m['error'][:200]})"))
    ok = [(r, p) for r, p in zip(records, plans, strict=True) if r["ok"]]
    if not ok:
        raise PlanError("measured refinement failed for every plan: "
                        + "; ".join(r.get("error", "")[:300] for r in records))
    best_rec, best = max(ok, key=lambda rp: rp[0]["tokens_per_s"])
    best.predictions["measured_step_time_s"] = best_rec["step_time_s"]
    best.predictions["measured_tokens_per_s"] = best_rec["tokens_per_s"]
    return best


def layout_problem(model_cfg: ModelConfig, train_cfg: TrainConfig, nproc: int,
                   fixed: dict[str, Any], hand: Plan | None = None) -> str | None:
    """Why no parallel plan can be formed at all on ``nproc`` ranks for this model and batch
    with the ``fixed`` plan fields (``stages.plan.fixed_fields`` of ``parallel.*``), or None.

    The plan stage's own rules, asked before any work: a plan fixed whole by hand (``hand``,
    ``stages.plan.hand_plan``) by ``Plan.problems``, as the plan stage validates it; else
    the search's structural pass (``model.planner.search.enumerate_plans``: tp divides the
    heads, key/value heads, vocabulary and MLP; tp*pp*dp is the rank count; dp and the
    micro-batch divide the global batch; ...) and its message when nothing passes. No
    cluster and no memory model: whether a formable plan fits the devices stays the plan
    stage's question.
    """
    from model.planner.search import _no_candidates_message, enumerate_plans

    if hand is not None:
        broken = hand.problems(model_cfg, train_cfg, nproc)
        return f"plan {hand.describe()} is invalid: " + "; ".join(broken) if broken else None
    shapes = Shapes.from_configs(model_cfg, train_cfg)
    try:
        found, rejected = enumerate_plans(shapes, nproc, train_cfg.global_batch, fixed)
    except PlanError as error:
        return str(error)
    if len(found["tp"]):
        return None
    return _no_candidates_message(shapes, nproc, train_cfg.global_batch, fixed, rejected)
