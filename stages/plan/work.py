"""Plan stage: choose the parallel layout (tp x pp x dp, micro-batch, schedule, sharding,
recompute) for ``parallel.nproc`` ranks on ``parallel.cluster`` and write plan.json.

The choosing is the planner's (``model.planner``: ``choose`` searches, ``rehearsal`` gives
way to a plan that fits); this module does the stage's part: read its inputs, call the
planner, launch the measured refinement's ranks, write plan.json and the reports, log to
MLflow. The planner's command line is ``python -m workflows.plan``.
"""
from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_prep.atomic import write_json_atomic
from model.config import vocab_fit_problem
from model.parallel.layout import Plan, PlanError
from model.planner.calibration import load_calibration, update_calibration
from model.planner.choose import (
    calibration_file,
    choose,
    figures_record,
    fixed_fields,
    measured_best,
    planning_cluster,
)
from model.planner.cluster import Cluster, rehearses
from model.rehearsal.plans import rehearse_until_one_fits
from model.training.files import SUMMARY_FILE
from stages.mechanism import launch
from stages.mechanism.launch import SPEC_FILE, RankSpec
from stages.plan import TRAIN_WORKER  # measures with stages.train.worker (in the key)

MEASURE_STEPS = 4
MEASURE_DIR = "measure"
MEASURE_TIMEOUT_S = 900.0
"""A measurement that runs longer is killed (and recorded as failed)."""


# --- measured refinement -----------------------------------------------------------------

def measurement_spec(cfg: Any, plan: Plan, out_dir: str | Path, steps: int = MEASURE_STEPS,
                     peak_tflops: float | None = None, nodes: int = 1,
                     timeout_s: float | None = MEASURE_TIMEOUT_S) -> Path:
    """Write the rank spec that runs ``plan`` for ``steps`` steps of synthetic tokens on
    ``nodes`` nodes, into ``out_dir``, keeping no checkpoint (no periodic or final save);
    return its path. ``read_measurement`` reads what the ranks leave."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SUMMARY_FILE).unlink(missing_ok=True)  # a result must come from this launch
    raw = cfg.to_dict()
    raw["parallel"].update(nproc=plan.world_size, nodes=nodes)
    # a measurement times steps: no checkpoint, no validation (train.eval_every)
    raw["train"].update(checkpoint_every=0, checkpoint_minutes=None, eval_every=0)
    spec = RankSpec(worker=TRAIN_WORKER, nproc=plan.world_size, nodes=nodes,
                    out_dir=str(out_dir.resolve()), config=raw, plan=plan.to_dict(), steps=steps,
                    peak_tflops=peak_tflops, timeout_s=timeout_s, extra={"save_final": False})
    return spec.write(out_dir / SPEC_FILE)


def read_measurement(out_dir: str | Path, plan: Plan, error: str | None = None) -> dict[str, Any]:
    """What a measurement of ``plan`` left in ``out_dir``: {"plan", "ok", "step_time_s",
    "tokens_per_s", "peak_memory_gb"}, or {"plan", "ok": False, "error"} (``error``, else a
    rank's own message, else the missing summary)."""
    out_dir = Path(out_dir)
    result: dict[str, Any] = {"plan": plan.to_dict(), "ok": False}
    summary = out_dir / SUMMARY_FILE
    if not summary.exists():
        result["error"] = (error or launch.read_rank_error(out_dir)
                           or f"{summary} is missing after the ranks exited")
        return result
    data = json.loads(summary.read_text())
    result.update(ok=True, step_time_s=data["step_time_s"], tokens_per_s=data["tokens_per_s"],
                  peak_memory_gb=data.get("peak_memory_gb"))
    return result


# --- the stage ---------------------------------------------------------------------------

@dataclass
class Searched:
    """What the search found: the cluster it priced, the calibration it used, the chosen
    plan and the ranked plans (empty when every layout field was fixed by hand)."""

    cluster: Cluster
    calibration: dict[str, float] | None
    plan: Plan
    plans: list[Plan]


def _cluster(cfg: Any) -> Cluster:
    return planning_cluster(cfg.parallel.cluster, cfg.parallel.nproc, cfg.runs_dir)


def _calibration_path(cfg: Any, cluster: Cluster) -> Path:
    return calibration_file(cfg.runs_dir, cluster.name, cfg.parallel.nproc)


def search_stage(cfg: Any, inputs: dict[str, dict], out_dir: Path, tracker: Any) -> Searched:
    """The search of the stage: check the store's vocabulary fits, choose among the plans
    for cfg.parallel.nproc ranks, print and log the table and the comparison PNG."""
    from stages.plan import report as plan_report

    tok = (inputs or {}).get("tokenize") or {}
    vocab = vocab_fit_problem(tok.get("vocab_size"), cfg.model.vocab_size)
    if vocab:
        raise PlanError(vocab)
    cluster = _cluster(cfg)
    cal = load_calibration(_calibration_path(cfg, cluster))
    top = max(10, cfg.parallel.refine_top_k)
    plan, result = choose(cfg.model, cfg.train, cluster, cfg.parallel.nproc,
                          fixed_fields(cfg.parallel), cal, top_k=top)
    if result is not None:
        print(result.table(), flush=True)
        (out_dir / "plan_table.txt").write_text(result.table(top) + "\n")
        tracker.log_artifact(out_dir / "plan_table.txt")
        png = plan_report.comparison_png(result.plans[:top], out_dir / "plan_comparison.png")
        tracker.log_artifact(png)
    return Searched(cluster, cal, plan, result.plans if result is not None else [])


def run(cfg: Any, inputs: dict[str, dict], out_dir: Path, tracker: Any) -> dict[str, Any]:
    """Choose the plan for cfg.parallel.nproc ranks on cfg.parallel.cluster (and rehearse it
    when ``parallel.rehearse`` says so); write plan.json. With ``parallel.refine_top_k`` the
    stage runs as ranks instead: ``prepare``, the measurements, ``finalize``."""
    out_dir = Path(out_dir)
    found = search_stage(cfg, inputs, out_dir, tracker)
    return publish(cfg, found, found.plan, out_dir, tracker)


CANDIDATES_FILE = "candidates.json"
"""The search's ranked plans and its choice, kept by ``prepare`` for ``finalize``."""


def prepare(cfg: Any, inputs: dict[str, dict], out_dir: Path, tracker: Any) -> str:
    """Measured refinement, first step (``parallel.refine_top_k`` > 0): the search, then a
    rank spec for each of its top ``refine_top_k`` plans, each on the plan's
    ``parallel.nproc`` ranks over ``parallel.nodes`` nodes, and the series spec that runs
    them one after another in the stage's allocation (``stages.mechanism.launch.RankSpec.series``);
    returns the series spec's path. Only this search runs where the stage's apps run (the
    login node under Slurm unless the stage rehearses); the measurements are ranks."""
    out_dir = Path(out_dir)
    found = search_stage(cfg, inputs, out_dir, tracker)
    tried = found.plans[:cfg.parallel.refine_top_k]
    write_json_atomic(out_dir / CANDIDATES_FILE, {
        "chosen": found.plan.to_dict(), "plans": [p.to_dict() for p in found.plans]})
    peak = found.cluster.peak_for(cfg.train.dtype) / 1e12
    paths = [str(measurement_spec(cfg, plan, out_dir / MEASURE_DIR / f"plan{i}",
                                  peak_tflops=peak, nodes=cfg.parallel.nodes))
             for i, plan in enumerate(tried)]
    series = RankSpec(worker=TRAIN_WORKER, nproc=cfg.parallel.nproc, nodes=cfg.parallel.nodes,
                      out_dir=str(out_dir.resolve()), config=cfg.to_dict(), series=paths)
    print(f"measuring the top {len(tried)} plans for {MEASURE_STEPS} steps each on "
          f"{cfg.parallel.nproc} ranks over {cfg.parallel.nodes} node(s), one after another",
          flush=True)
    return str(series.write(out_dir / SPEC_FILE))


def finalize(cfg: Any, out_dir: Path, parts: list[Any], tracker: Any) -> dict[str, Any]:
    """Measured refinement, last step: read each measurement, keep the measured best (its
    measured figures in its predictions), update the cluster's calibration, log the
    predicted-vs-measured report; then as ``run`` (rehearsal, plan.json)."""
    from stages.plan import report as plan_report

    out_dir = Path(out_dir)
    kept = json.loads((out_dir / CANDIDATES_FILE).read_text())
    plans = [Plan.from_dict(raw) for raw in kept["plans"]]
    cluster = _cluster(cfg)
    cal_path = _calibration_path(cfg, cluster)
    found = Searched(cluster, load_calibration(cal_path), Plan.from_dict(kept["chosen"]), plans)
    tried = plans[:cfg.parallel.refine_top_k]
    if not tried:  # every layout field fixed by hand: nothing to compare
        return publish(cfg, found, found.plan, out_dir, tracker)
    records = [read_measurement(out_dir / MEASURE_DIR / f"plan{i}", plan)
               for i, plan in enumerate(tried)]
    plan = measured_best(tried, records)
    points = [{"plan": r["plan"], "compute_s": r["compute_s"], "comm_s": r["comm_s"],
               "measured_s": r["step_time_s"]} for r in records if r["ok"]]
    found.calibration = update_calibration(cal_path, points)
    (out_dir / "calibration.json").write_text(json.dumps(found.calibration, indent=2))
    tracker.log_artifact(out_dir / "calibration.json")
    for art in plan_report.measured_report(records, out_dir):
        tracker.log_artifact(art)
    return {**publish(cfg, found, plan, out_dir, tracker),
            "measured": str((out_dir / "measured.json").resolve())}


def publish(cfg: Any, found: Searched, plan: Plan, out_dir: Path,
            tracker: Any) -> dict[str, Any]:
    """Rehearse ``plan`` when ``parallel.rehearse`` says so (the next plans standing in for
    one that does not fit), write plan.json, log its fields and predictions; the outputs."""
    cluster = found.cluster
    rehearsing = rehearses(cfg.parallel.rehearse, cluster.measured)
    if rehearsing:
        plan = rehearse_in_stage(cfg, plan, found.plans, cluster, found.calibration, out_dir,
                                 tracker)
    plan_path = plan.to_json(out_dir / "plan.json", figures=figures_record(cluster))
    tracker.log_params({f"plan.{k}": v for k, v in plan.to_dict().items() if k != "predictions"}
                       | {"plan.cluster": cluster.name, "plan.world_size": cfg.parallel.nproc})
    tracker.log_metrics({f"predicted_{k}" if not k.startswith("measured") else k: float(v)
                         for k, v in plan.predictions.items()})
    out = {"plan": str(plan_path.resolve()),
           **{k: v for k, v in plan.to_dict().items() if k != "predictions"},
           "predictions": plan.predictions, "cluster": cluster.name,
           "figures": figures_record(cluster),
           "host": socket.gethostname()}  # where the stage ran (a compute node when rehearsing)
    if rehearsing:
        out["rehearsal"] = str((out_dir / "rehearsal.json").resolve())
    return out


def rehearse_in_stage(cfg: Any, plan: Plan, ranked: list[Plan], cluster: Cluster,
                      calibration: dict[str, float] | None, out_dir: Path,
                      tracker: Any) -> Plan:
    """The stage's rehearsal (``parallel.rehearse``): the planner's give-way rule over
    ``plan`` and the search's next best (``model.rehearsal.plans.rehearse_until_one_fits``),
    each rank in a process that dies with the stage. Writes ``rehearsal.json`` (the kept
    plan's ``rehearsal_records``, or ``{"error": ...}`` for a plan that cannot be
    rehearsed) and, when plans gave way, ``rehearsal_rejected.json``; logs both and the kept
    plan's rehearsed peaks. PlanError, with every plan's rehearsed peak and the fix, when
    none fits; PlanError naming both ways out when the plan cannot be rehearsed at all (a
    plan that was never rehearsed must not reach the queue as if it had been)."""
    kept = rehearse_until_one_fits(cfg.model, cfg.train, cluster, cfg.parallel.nproc, plan,
                                   ranked, calibration, log=lambda s: print(s, flush=True))
    if kept.rejected:
        gave_way = out_dir / "rehearsal_rejected.json"
        gave_way.write_text(json.dumps(kept.rejected, indent=2))
        tracker.log_artifact(gave_way)
    path = out_dir / "rehearsal.json"
    path.write_text(json.dumps(kept.records if kept.error is None else {"error": kept.error},
                               indent=2))
    tracker.log_artifact(path)
    if kept.error is not None:
        raise PlanError(
            f"the plan {kept.plan.describe()} cannot be rehearsed ({kept.error}); the rehearsal "
            "is how the plan stage knows a GPU plan fits: set FRONTIER_LLM_REHEARSAL_PYTHON to "
            "an interpreter with the torch it was checked on (docs/frontier.md, the "
            "rehearsal's own environment), or opt out with --set parallel.rehearse=false")
    if kept.records:
        tracker.log_metrics({f"rehearsed_peak_memory_gb_rank{r['rank']}":
                             r["rehearsed_peak_memory_gb"] for r in kept.records})
    return kept.plan


__all__ = ["finalize", "prepare", "run"]
