"""Plan stage: choose the parallel layout (tp x pp x dp, micro-batch, schedule, sharding,
recompute) from the memory and time models, optionally refined by measuring the top plans.

Command line::

    python -m stages.plan --model CONFIG.yaml --cluster frontier --devices 3072 \\
        --global-batch 3072 [--seq-len 2048] [--json] [--rehearse]

CONFIG.yaml is a full pipeline preset or a bare mapping of model shapes (ModelConfig names
or common aliases such as num_layers / hidden_size / num_attention_heads).
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from data_prep.atomic import write_json_atomic
from model.config import ModelConfig, TrainConfig, vocab_fit_problem
from model.flops import flops_per_token
from model.planner.calibration import load_calibration, update_calibration
from model.planner.cluster import Cluster, rehearses
from model.planner.microbench import load_measured_cluster
from model.planner.plan import CONFIG_FIELDS, FIELD_TYPES, LAYOUT_FIELDS, Plan, PlanError
from model.planner.rank_counts import count_errors, rank_collective_bytes, rank_flops
from model.planner.run_cost import plan_run_cost
from model.planner.search import SearchResult, explain, predict_plan, search, validate_plan
from model.planner.shapes import Shapes
from model.training.files import SUMMARY_FILE
from stages.mechanism import launch
from stages.mechanism.launch import SPEC_FILE, RankSpec
from stages.mechanism.registry import TRAIN_WORKER  # measures with stages.train_worker (in the key)

MEASURE_STEPS = 4
MEASURE_DIR = "measure"
MEASURE_TIMEOUT_S = 900.0
"""A measurement that runs longer is killed (and recorded as failed)."""

ALIASES = {
    "n_layers": ("num_layers", "num_hidden_layers", "n_layer", "layers"),
    "d_model": ("hidden_size", "n_embd", "hidden", "dim"),
    "n_heads": ("num_attention_heads", "n_head", "heads"),
    "n_kv_heads": ("num_key_value_heads", "kv_heads"),
    "vocab_size": ("padded_vocab_size", "vocab"),
    "max_seq_len": ("seq_length", "max_position_embeddings", "n_positions", "seq_len"),
    "ffn_hidden": ("intermediate_size", "ffn_hidden_size"),
}


def model_from_mapping(raw: dict[str, Any], where: str) -> ModelConfig:
    """A ModelConfig from ModelConfig names or common aliases; unknown keys are an error."""
    out: dict[str, Any] = {}
    used = set()
    for name, aliases in ALIASES.items():
        for key in (name, *aliases):
            if key in raw:
                out[name] = raw[key]
                used.add(key)
                break
    for key in ("family", "parallel_residual", "rope_theta", "norm_eps", "init_std"):
        if key in raw:
            out[key] = raw[key]
            used.add(key)
    missing = [n for n in ("n_layers", "d_model", "n_heads", "vocab_size") if n not in out]
    if missing:
        raise PlanError(f"{where}: model shape lacks {missing} (accepted names: "
                        + "; ".join(f"{n} or {'/'.join(a)}" for n, a in ALIASES.items()) + ")")
    extra = sorted(set(raw) - used)
    if extra:
        raise PlanError(f"{where}: unknown model keys {extra}")
    try:
        return ModelConfig(**out)
    except (TypeError, ValueError) as exc:
        raise PlanError(f"{where}: {exc}") from exc


def load_model_file(path: str | Path) -> tuple[ModelConfig, TrainConfig | None, Any]:
    """(model, train or None, full PipelineConfig or None) from a preset or a bare model mapping."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PlanError(f"cannot read model config {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: expected a mapping")
    if "model" in raw and isinstance(raw["model"], dict):
        if {"train", "parallel", "data"} & set(raw):
            from stages.mechanism.config import load_config

            cfg = load_config(path)
            return cfg.model, cfg.train, cfg
        return model_from_mapping(raw["model"], str(path)), None, None
    return model_from_mapping(raw, str(path)), None, None


def fixed_fields(parallel: Any) -> dict[str, Any]:
    """The plan fields a ParallelConfig fixes (None means the planner chooses)."""
    names = [n for n in CONFIG_FIELDS if n != "sequence_parallel"]
    fixed = {n: getattr(parallel, n) for n in names if getattr(parallel, n, None) is not None}
    # sequence_parallel true allows the planner to use it (with tp > 1), false rules it out
    if not getattr(parallel, "sequence_parallel", False):
        fixed["sequence_parallel"] = False
    return fixed


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
    manual = hand_plan(fixed, train_cfg.global_batch, world)
    if manual is not None:
        checked = validate_plan(shapes, cluster, manual, model_cfg, train_cfg, world, calibration)
        return checked, None
    result = search(shapes, cluster, world, train_cfg.global_batch, fixed, top_k, calibration)
    for p in result.plans:
        p.check(model_cfg, train_cfg, world)  # the search and Plan.check agree; fail loudly if not
    return result.best, result


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
    raw["train"].update(checkpoint_every=0, checkpoint_minutes=None)
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


MEASURE_WORKER = "stages.measure_worker"


def measure_plans(cfg: Any, plans: list[Plan], out_dir: str | Path, steps: int, rounds: int,
                  timeout_s: float = MEASURE_TIMEOUT_S) -> dict[str, Any]:
    """Run every plan (one world size) for ``rounds`` rounds of ``steps`` steps of synthetic
    tokens, all in one launch of local ranks (``stages.measure_worker``: one start-up, every
    plan built once, the plans taking turns step by step).

    Returns {"step_times": per plan, per round, the seconds of each step (each build's warm-up
    step left out), "errors": per plan the refusal or None, "seconds": the launch's,
    "failed": the launch's own error or None}; what a launch that failed midway measured is
    kept."""
    from stages.measure_worker import MEASUREMENTS_FILE

    worlds = {p.world_size for p in plans}
    if len(worlds) != 1:
        raise ValueError(f"plans measured in one launch share a world size; got {sorted(worlds)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MEASUREMENTS_FILE).unlink(missing_ok=True)
    raw = cfg.to_dict()
    raw["parallel"].update(nproc=plans[0].world_size, nodes=1)
    raw["train"].update(checkpoint_every=0, checkpoint_minutes=None)
    spec = RankSpec(worker=MEASURE_WORKER, nproc=plans[0].world_size, nodes=1,
                    out_dir=str(out_dir.resolve()), config=raw, steps=steps, timeout_s=timeout_s,
                    extra={"plans": [p.to_dict() for p in plans], "rounds": rounds})
    path = spec.write(out_dir / SPEC_FILE)
    t0 = time.perf_counter()
    failed = None
    try:
        launch.run_local(path, out_dir / "worker.log", what="measurement", echo=False)
    except launch.RanksFailed as error:
        failed = str(error)[-1500:]
    times: list[list[list[float]]] = [[] for _ in plans]
    errors: list[str | None] = [None] * len(plans)
    records = out_dir / MEASUREMENTS_FILE
    for line in records.read_text().splitlines() if records.exists() else []:
        record = json.loads(line)
        if "error" in record:
            errors[record["index"]] = record["error"]
        else:
            times[record["index"]].append(record["step_times_s"])
    return {"step_times": times, "errors": errors, "seconds": time.perf_counter() - t0,
            "failed": failed}


def calibration_path(cfg: Any, cluster: Cluster) -> Path:
    """Where measured/predicted ratios for this cluster and rank count are kept."""
    return cfg.runs_dir / "plan_calibration" / f"{cluster.name}-{cfg.parallel.nproc}.json"


def measured_best(plans: list[Plan], records: list[dict[str, Any]],
                  log=print) -> Plan:
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


# --- rehearsal ---------------------------------------------------------------------------

def modeled_rank_memory(model_cfg: ModelConfig, train_cfg: TrainConfig, plan: Plan,
                        cluster: Cluster, world: int, stage: str,
                        calibration: dict[str, float] | None = None) -> tuple[float, float]:
    """(peak GB with the cluster's margins, tensor GB without) the memory model gives a rank
    of ``stage`` (first, middle or last; a middle stage is priced as the first)."""
    mem = explain(Shapes.from_configs(model_cfg, train_cfg, cluster), cluster, plan, world,
                  train_cfg.global_batch, calibration)["memory_gb"]
    modeled = "last" if stage == "last" else "first"  # the model bounds others by the first
    tensors = mem[f"states_{modeled}"] + mem[f"act_{modeled}"] + mem[f"transient_{modeled}"]
    return mem[modeled], tensors


def rehearsal_records(model_cfg: ModelConfig, train_cfg: TrainConfig, plan: Plan,
                      cluster: Cluster, world: int,
                      calibration: dict[str, float] | None = None,
                      ranks: list[int] | None = None) -> list[dict[str, Any]]:
    """Rehearse ``plan``'s first and last pipeline stage (``model.training.rehearse``; or the
    given ``ranks``) and set each rank's rehearsed figures beside the memory model's.

    Per rank (``stage`` first, middle or last; the model prices a middle stage as the
    first): ``peak_memory_gb`` (the model's, with the cluster's margins, as the search
    uses it), ``modeled_tensor_memory_gb`` (the model's states, activations and peak buffers, no
    margins),
    ``rehearsed_peak_memory_gb`` (tensor bytes at the rehearsed peak), the same with the
    cluster's margins and whether that fits the device, the rehearsed memory by category,
    FLOPs and collective bytes per step beside the planner's counts of them
    (``model.planner.rank_counts``: ``modeled_flops_per_step``,
    ``modeled_collective_bytes_by_dim``, their relative errors in ``count_errors``), and the
    model-FLOP count per device for scale.
    Raises RehearsalError (a RuntimeError) for a plan that cannot be rehearsed.
    """
    from model.training.rehearse import busiest_ranks, rehearse_isolated  # torch: when asked

    shapes = Shapes.from_configs(model_cfg, train_cfg, cluster)
    model_flops = (flops_per_token(model_cfg, train_cfg.seq_len) * train_cfg.global_batch
                   * train_cfg.seq_len / world)
    margin = 1 + cluster.fragmentation
    records = []
    for rank in ranks if ranks is not None else busiest_ranks(plan):
        pp_rank = rank // (plan.dp * plan.tp)
        stage = "first" if pp_rank == 0 else "last" if pp_rank == plan.pp - 1 else "middle"
        peak, tensors = modeled_rank_memory(model_cfg, train_cfg, plan, cluster, world, stage,
                                            calibration)
        result = rehearse_isolated(model_cfg, train_cfg, plan, rank,
                                   initializer=launch.die_with_parent)
        with_margins = result.peak_memory_gb * margin + cluster.reserved_gb
        flops = rank_flops(shapes, plan, pp_rank)
        comm = rank_collective_bytes(shapes, plan, pp_rank)
        records.append({
            "rank": rank, "stage": stage, "coords": result.coords,
            "peak_memory_gb": peak,
            "modeled_tensor_memory_gb": tensors,
            "rehearsed_peak_memory_gb": result.peak_memory_gb,
            "rehearsed_over_modeled": result.peak_memory_gb / tensors if tensors else None,
            "rehearsed_peak_memory_gb_with_margins": with_margins,
            "rehearsed_fits_device": with_margins <= cluster.memory_gb,
            "rehearsed_memory_gb_by_category": {
                k: v / 1e9 for k, v in result.peak_memory_by_category.items()},
            "rehearsed_flops_per_step": result.flops_per_step[-1],
            "model_flops_per_device_per_step": model_flops,
            "rehearsed_collective_bytes_per_step": result.collective_bytes_per_step[-1],
            "rehearsed_collective_bytes_by_dim": result.collective_bytes_by_dim,
            "modeled_flops_per_step": flops, "modeled_collective_bytes_by_dim": comm,
            "count_errors": count_errors(flops, comm, result.flops_per_step[-1],
                                         result.collective_bytes_by_dim),
            "rehearsal_seconds": result.seconds, "rehearsal_notes": result.notes,
        })
    return records


def rehearsal_text(plan: Plan, records: list[dict[str, Any]], device_gb: float) -> str:
    """The rehearsed ranks beside the memory model, as printable lines."""
    lines = [f"rehearsal of {plan.describe()} (fake tensors; one step measured after one "
             "warm-up step):",
             f"  {'rank':>6} {'stage':<6} {'modeled GB':>11} {'(tensors)':>10} "
             f"{'rehearsed GB':>13} {'ratio':>6} {'+margins':>9} {'device':>7}  FLOPs/step"]
    for r in records:
        ratio = r["rehearsed_over_modeled"]
        lines.append(
            f"  {r['rank']:>6} {r['stage']:<6} {r['peak_memory_gb']:>11.4g} "
            f"{r['modeled_tensor_memory_gb']:>10.4g} {r['rehearsed_peak_memory_gb']:>13.4g} "
            f"{ratio if ratio is not None else float('nan'):>6.2f} "
            f"{r['rehearsed_peak_memory_gb_with_margins']:>9.4g} {device_gb:>7g}  "
            f"{r['rehearsed_flops_per_step']:.3g}"
            + ("" if r["rehearsed_fits_device"] else "  (does not fit)"))
        cats = sorted(r["rehearsed_memory_gb_by_category"].items(), key=lambda kv: -kv[1])
        lines.append("         at the peak (GB): " + ", ".join(f"{k} {v:.4g}" for k, v in cats))
        comm = r["rehearsed_collective_bytes_per_step"]
        lines.append("         collectives per step (GB): "
                     + ", ".join(f"{k} {v / 1e9:.3g}" for k, v in sorted(comm.items())))
        errors = r.get("count_errors") or {}
        if errors:
            worst = max(errors, key=lambda k: abs(errors[k]))
            lines.append("         planner's counts vs rehearsed: FLOPs "
                         f"{100 * errors['flops']:+.2f} %, worst {worst} "
                         f"{100 * errors[worst]:+.2f} %")
    return "\n".join(lines)


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
    return load_measured_cluster(cfg.parallel.cluster, cfg.parallel.nproc,
                                 cache_dir=cfg.runs_dir / "cache" / "microbench")


def search_stage(cfg: Any, inputs: dict[str, dict], out_dir: Path, tracker: Any) -> Searched:
    """The search of the stage: check the store's vocabulary fits, choose among the plans
    for cfg.parallel.nproc ranks, print and log the table and the comparison PNG."""
    from stages import plan_report

    tok = (inputs or {}).get("tokenize") or {}
    vocab = vocab_fit_problem(tok.get("vocab_size"), cfg.model.vocab_size)
    if vocab:
        raise PlanError(vocab)
    cluster = _cluster(cfg)
    cal = load_calibration(calibration_path(cfg, cluster))
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
    from stages import plan_report

    out_dir = Path(out_dir)
    kept = json.loads((out_dir / CANDIDATES_FILE).read_text())
    plans = [Plan.from_dict(raw) for raw in kept["plans"]]
    cluster = _cluster(cfg)
    cal_path = calibration_path(cfg, cluster)
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
        others = [p for p in found.plans if p.key() != plan.key()]
        plan = rehearse_in_stage(cfg, [plan] + others[:REHEARSE_TRIES - 1], cluster,
                                 found.calibration, out_dir, tracker)
    plan_path = plan.to_json(out_dir / "plan.json")
    tracker.log_params({f"plan.{k}": v for k, v in plan.to_dict().items() if k != "predictions"}
                       | {"plan.cluster": cluster.name, "plan.world_size": cfg.parallel.nproc})
    tracker.log_metrics({f"predicted_{k}" if not k.startswith("measured") else k: float(v)
                         for k, v in plan.predictions.items()})
    out = {"plan": str(plan_path.resolve()),
           **{k: v for k, v in plan.to_dict().items() if k != "predictions"},
           "predictions": plan.predictions, "cluster": cluster.name,
           "host": socket.gethostname()}  # where the stage ran (a compute node when rehearsing)
    if rehearsing:
        out["rehearsal"] = str((out_dir / "rehearsal.json").resolve())
    return out


REHEARSE_TRIES = 5
"""Plans the stage rehearses, best first, before it gives up on finding one that fits."""


def rehearse_in_stage(cfg: Any, plans: list[Plan], cluster: Cluster,
                      calibration: dict[str, float] | None, out_dir: Path,
                      tracker: Any) -> Plan:
    """The stage's rehearsal (``parallel.rehearse``): rehearse ``plans`` in order and return
    the first whose rehearsed ranks fit the device with the cluster's margins, so the stage
    never keeps a plan its rehearsal says does not fit. Prints each, writes
    ``rehearsal.json`` (the kept plan's ``rehearsal_records``, or ``{"error": ...}`` for a
    plan that cannot be rehearsed: that plan stands) and, when plans gave way,
    ``rehearsal_rejected.json``; logs both and the kept plan's rehearsed peaks. Raises
    PlanError, with every plan's rehearsed peak and the fix, when none fits."""
    from model.training.rehearse import RehearsalError

    path = out_dir / "rehearsal.json"
    rejected: list[dict[str, Any]] = []
    for plan in plans:
        try:
            records = rehearsal_records(cfg.model, cfg.train, plan, cluster,
                                        cfg.parallel.nproc, calibration)
        except RehearsalError as exc:
            print(f"[plan] {plan.describe()} not rehearsed: {exc}", flush=True)
            path.write_text(json.dumps({"error": str(exc)}, indent=2))
            tracker.log_artifact(path)
            return plan
        print(rehearsal_text(plan, records, cluster.memory_gb), flush=True)
        if all(r["rehearsed_fits_device"] for r in records):
            break
        worst = max(r["rehearsed_peak_memory_gb_with_margins"] for r in records)
        print(f"[plan] {plan.describe()} needs {worst:.1f} GB per device by its rehearsal, "
              f"more than {cluster.memory_gb:g} GB: trying the next plan", flush=True)
        rejected.append({"plan": plan.describe(), "plan_fields": plan.to_dict(),
                         "rehearsed_peak_memory_gb_with_margins": worst, "ranks": records})
    else:
        sizes = "; ".join(f"{r['plan']}: {r['rehearsed_peak_memory_gb_with_margins']:.1f} GB"
                          for r in rejected)
        raise PlanError(
            f"no plan fits in {cluster.memory_gb:g} GB per device by its rehearsal ({sizes}, "
            "with the cluster's margins): fix recompute=full or a smaller micro_batch, or use "
            "more devices")
    if rejected:
        gave_way = out_dir / "rehearsal_rejected.json"
        gave_way.write_text(json.dumps(rejected, indent=2))
        tracker.log_artifact(gave_way)
    path.write_text(json.dumps(records, indent=2))
    tracker.log_artifact(path)
    tracker.log_metrics({f"rehearsed_peak_memory_gb_rank{r['rank']}":
                         r["rehearsed_peak_memory_gb"] for r in records})
    return plan


# --- command line ------------------------------------------------------------------------

FIX_TYPES = FIELD_TYPES


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


def explain_text(plan: Plan, ex: dict[str, Any]) -> str:
    """The step-time and memory breakdown of one plan as printable lines."""
    step = ex["step_time_s"]
    lines = [f"plan {plan.describe()}: {step:.4g} s per step", "step time (s per step):"]
    for k, v in ex["step"].items():
        lines.append(f"  {k:<26} {v:>11.4g}  {v / step:>6.1%}")
    lines.append(f"  {'sum':<26} {sum(ex['step'].values()):>11.4g}")
    lines.append("communication hidden under compute (not in the sum):")
    for k, v in ex["overlapped"].items():
        lines.append(f"  {k:<26} {v:>11.4g}")
    lines.append("memory (GB per device):")
    for k, v in ex["memory_gb"].items():
        lines.append(f"  {k:<26} {v:>11.4g}")
    for k, v in ex["parameters"].items():
        lines.append(f"  {k + ' (count)':<26} {v:>11.4g}")
    return "\n".join(lines)


def token_count(text: str) -> float:
    """``--tokens`` as a positive number of tokens (``20e12`` or ``20000000000000``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of tokens: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"the token budget must be positive, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Print the best plans for a model on a cluster (or one JSON object with --json).

    ``--fix NAME=VALUE`` fixes any plan field (a preset's ``parallel:`` fields are fixed too,
    the command line winning); with every field fixed the one plan is priced. ``--explain``
    adds the step-time and memory breakdown of the chosen plan. ``--tokens N`` prices a run
    of N tokens with the chosen plan (``model.planner.run_cost``); without it a preset's
    ``train.steps`` steps are priced (a bare model file prices nothing).
    """
    ap = argparse.ArgumentParser(
        description="Choose a parallel plan from the memory and time models."
    )
    ap.add_argument("--model", required=True, help="pipeline preset or model-shape YAML")
    ap.add_argument("--cluster", required=True, help="cluster name (configs/clusters) or YAML path")
    ap.add_argument("--devices", type=int, required=True, help="number of ranks (GPUs/GCDs)")
    ap.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    ap.add_argument("--top", type=int, default=10, help="plans to show")
    ap.add_argument("--calibration", default=None, help="calibration JSON from a refined plan run")
    ap.add_argument("--cache", default=None, help="microbenchmark cache file (measured clusters)")
    ap.add_argument("--fix", action="append", default=[], metavar="NAME=VALUE",
                    help=f"fix a plan field ({', '.join(FIX_TYPES)}); repeatable")
    ap.add_argument("--explain", action="store_true",
                    help="print the step-time and memory breakdown of the chosen plan")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tokens", type=token_count, default=None, metavar="N",
                    help="price a whole run of N tokens (e.g. 20e12) with the chosen plan; "
                         "default: the preset's train.steps steps")
    ap.add_argument("--rehearse", action="store_true",
                    help="rehearse the chosen plan's first and last stage ranks on fake tensors "
                         "(two training steps each; minutes at Frontier sizes) and report "
                         "their peak memory, FLOPs and collective bytes beside the model's")
    args = ap.parse_args(argv)
    try:
        model_cfg, train_cfg, full = load_model_file(args.model)
        cluster = load_measured_cluster(args.cluster, args.devices, cache_path=args.cache)
        seq = args.seq_len or (train_cfg.seq_len if train_cfg else model_cfg.max_seq_len)
        model_cfg.max_seq_len = max(model_cfg.max_seq_len, seq)
        dtype = args.dtype or (train_cfg.dtype if train_cfg else
                               ("float32" if cluster.measured else "bfloat16"))
        train = TrainConfig(global_batch=args.global_batch, seq_len=seq, dtype=dtype)
        cal = load_calibration(args.calibration)
        fixed = fixed_fields(full.parallel) if full is not None else {}
        fixed.update(parse_fix(args.fix))
        plan, result = choose(model_cfg, train, cluster, args.devices, fixed, cal, top_k=args.top)
        ex = explain(Shapes.from_configs(model_cfg, train, cluster), cluster, plan, args.devices,
                     args.global_batch, cal) if args.explain or args.json else None
        cost = None
        if args.tokens is not None or train_cfg is not None:
            cost = plan_run_cost(plan.predictions, model_cfg, args.global_batch, seq, cluster,
                                 args.devices, tokens=args.tokens,
                                 steps=None if args.tokens is not None else train_cfg.steps,
                                 checkpoint_every=train_cfg.checkpoint_every if train_cfg else 0)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rehearsed: list[dict[str, Any]] = []
    if args.rehearse:
        from model.training.rehearse import RehearsalError

        try:
            rehearsed = rehearsal_records(model_cfg, train, plan, cluster, args.devices, cal)
        except RehearsalError as exc:
            print(f"error: cannot rehearse: {exc}", file=sys.stderr)
            return 2
    if args.json:
        out = {k: getattr(plan, k) for k in LAYOUT_FIELDS}
        out.update({k: plan.predictions[k] for k in ("step_time_s", "tokens_per_s",
                                                     "tflops_per_device", "mfu",
                                                     "memory_gb_per_device")})
        out["search_seconds"] = result.seconds if result else 0.0
        out["breakdown"] = {**ex["step"], **ex["overlapped"]}
        out["memory_breakdown"] = {**ex["memory_gb"], **ex["parameters"]}
        if args.rehearse:
            out["rehearsal"] = rehearsed
        out["run_cost"] = cost.to_dict() if cost is not None else None
        print(json.dumps(out))
        return 0
    if result is not None:
        print(result.table(args.top))
    else:
        pr = plan.predictions
        print(f"priced plan {plan.describe()}: {pr['step_time_s']:.4g} s/step, "
              f"{pr['tokens_per_s']:.5g} tokens/s, {pr['tflops_per_device']:.3g} TFLOPS per "
              f"device, MFU {pr['mfu']:.1%}, {pr['memory_gb_per_device']:.2f} GB per device")
    if args.explain:
        print(explain_text(plan, ex))
    if cost is not None:
        print("\n".join(cost.lines()))
    if args.rehearse:
        print(rehearsal_text(plan, rehearsed, cluster.memory_gb))
    return 0


__all__ = ["choose", "main", "measure_plans", "predict_plan", "run"]

if __name__ == "__main__":
    sys.exit(main())
