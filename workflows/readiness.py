"""The readiness report: a Slurm run checked against the site's limits before the first
allocation, as one table (``--dry-run`` prints it on slurm and frontier sites).

One row per check: the jobs (nodes x walltime, and on Frontier the job-size bin and its
walltime limit), the plan (its predicted step time and device memory: rehearsed where the
plan stage has rehearsed it, else modeled), whether the plan stage can rehearse with the torch
installed here, when the first checkpoint lands, the
interruptions the training should expect and the checkpoint interval that loses least work
to them (``model.planner.failures``) beside the configured one, host memory of the
evaluation, the Hugging Face export, the corpus, the runs dir's file system, and the whole
run's time, jobs and node-hours. A row is ``ok``, ``warning`` (it cannot be checked
from here: said why) or ``error`` (a run would be refused, or fail, or waste its
allocation: said how to fix it). Nothing is submitted, and nothing heavy is imported: the
plan comes from the plan stage's output when it exists, else from the planner's search (a
few seconds on the login node, as the plan stage's own search).
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.config import TrainConfig
from model.parallel.layout import Plan
from model.planner.failures import Interruptions, auto_checkpoint_minutes, config_interruptions
from model.planner.scaling import FRONTIER_NODES
from stages.config import PipelineConfig, walltime_seconds
from stages.evaluate.checks import (
    EVAL_BYTES_PER_PARAM,
    evaluation_host_gb,
    evaluation_memory_problem,
)
from stages.mechanism.selection import StageDecision, decide_stages, reused_outputs
from stages.registry import PIPELINE, declaration
from stages.tokenize.checks import hub_budget_problem
from stages.train.checks import checkpoint_cadence_problem, predicted_step_time
from workflows.frontier import (
    FRONTIER_NODE_MEMORY_GB,
    NODE_LOCAL_ENV_NODES,
    hub_fetch_problem,
    hub_sources,
    largest_job_nodes,
    node_local_env_problem,
    proxy_configured,
    runs_dir_problem,
    walltime_bin,
)


@dataclass(frozen=True)
class Finding:
    """One row of the report."""

    check: str
    value: str
    verdict: str = "ok"  # "ok", "warning" or "error"
    fix: str = ""


def _node_hours(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.3g} h" if seconds >= 3600 else f"{seconds / 60:.3g} min"


def job_finding(what: str, cfg: PipelineConfig, nodes: int, walltime: str,
                setting: str = "site.walltime") -> Finding:
    """A block's nodes x walltime; on Frontier its job-size bin, an error beyond its limit
    (``setting`` names the walltime's field in the fix)."""
    wall = walltime_seconds(walltime)
    value = f"{nodes} node(s) x {walltime}"
    if cfg.site.name != "frontier":
        return Finding(what, value, "warning", "the site's job limits are not known here")
    if nodes > FRONTIER_NODES:
        return Finding(what, value, "error", f"Frontier jobs take at most {FRONTIER_NODES} "
                       "nodes: lower parallel.nproc")
    number, _, limit_h = walltime_bin(nodes)
    value += f" (bin {number}: up to {limit_h:g} h)"
    if wall > limit_h * 3600:
        return Finding(what, value, "error", f"set {setting} <= {int(limit_h):02d}:00:00, "
                       f"the limit of bin {number} at {nodes} node(s)")
    return Finding(what, value)


def _rehearsed(found: dict[str, Any] | None) -> bool:
    """Whether a reused plan output holds rehearsal records (not a rehearsal's error)."""
    rehearsal = (found or {}).get("rehearsal")
    return bool(rehearsal) and isinstance(json.loads(Path(rehearsal).read_text()), list)


def _plan_of(cfg: PipelineConfig, found: dict[str, Any] | None
             ) -> tuple[Plan, list[dict[str, Any]] | None, float | None, str]:
    """(the plan, its rehearsal records or None, the device's GB or None, where it came
    from): the plan stage's published output this invocation reuses (``found``: its
    outputs), else the planner's search."""
    if found is not None:
        rehearsal = found.get("rehearsal")
        records = json.loads(Path(rehearsal).read_text()) if rehearsal else None
        return Plan.from_json(found["plan"]), records, None, "the plan stage's output"
    from model.planner.choose import choose, fixed_fields
    from model.planner.cluster import load_cluster

    cluster = load_cluster(cfg.parallel.cluster)  # a cluster measured at plan time refuses
    plan, _ = choose(cfg.model, cfg.train, cluster, cfg.parallel.nproc,
                     fixed_fields(cfg.parallel))
    return plan, None, cluster.memory_gb, "the planner's search (not yet rehearsed)"


def plan_findings(cfg: PipelineConfig, found_plan: dict[str, Any] | None = None
                  ) -> tuple[list[Finding], float | None]:
    """The plan's rows (its layout and step time, its device memory) and its step time."""
    from model.planner.cluster import ClusterError

    try:
        plan, records, device, source = _plan_of(cfg, found_plan)
    except ClusterError:  # measured by a microbenchmark when the plan stage runs
        return [Finding("plan", f"parallel.cluster={cfg.parallel.cluster}", "warning",
                        "this cluster is measured where the plan stage runs: run it "
                        "(--only plan) to see the plan")], None
    except ValueError as error:  # no plan fits, or a bad plan setting: the plan stage says so
        return [Finding("plan", "none", "error", str(error))], None
    predictions = plan.predictions
    step = predicted_step_time(predictions)
    layout = plan.describe()
    rows = [Finding("plan", f"{layout}: {step:.4g} s/step, MFU {predictions.get('mfu', 0):.0%} "
                    f"(from {source})" if step else f"{layout} (from {source})")]
    modeled = predictions.get("memory_gb_per_device")
    if isinstance(records, dict):  # rehearsal.json's {"error": ...}: the plan stood unrehearsed
        rows.append(Finding(
            "device memory", f"{modeled or 0:.3g} GB modeled, not rehearsed", "error",
            f"the plan stage could not rehearse its plan ({records.get('error', records)}): "
            f"{REHEARSAL_FIX}"))
    elif records:
        worst = max(records, key=lambda r: r["rehearsed_peak_memory_gb_with_margins"])
        fits = all(r["rehearsed_fits_device"] for r in records)
        rows.append(Finding(
            "device memory", f"{worst['rehearsed_peak_memory_gb_with_margins']:.3g} GB rehearsed "
            f"(rank {worst['rank']}, with margins), modeled {worst['peak_memory_gb']:.3g} GB",
            "ok" if fits else "error",
            "" if fits else "the rehearsed rank does not fit: rerun the plan stage "
            "(it plans only what fits) or fix fewer plan fields (parallel.*)"))
    elif modeled is not None:
        over = device is not None and modeled > device
        rows.append(Finding(
            "device memory", f"{modeled:.3g} GB modeled" + (f" of {device:g} GB" if device else ""),
            "error" if over else "warning",
            "the plan does not fit: fix fewer plan fields (parallel.*)" if over else
            "modeled only: the plan stage rehearses the rank on fake tensors (parallel.rehearse)"))
    return rows, step


REHEARSAL_FIX = ("give the rehearsal an interpreter with the torch it was checked on "
                 "(export FRONTIER_LLM_REHEARSAL_PYTHON=<its python>: docs/frontier.md, "
                 "'The rehearsal's own environment'), or opt out of the rehearsal by name "
                 "with --set parallel.rehearse=false (the memory model alone decides)")


def rehearsal_finding(cfg: PipelineConfig, rehearsed: bool = False) -> Finding | None:
    """Whether the plan stage can rehearse its plan: with the torch of the interpreter that
    rehearses (``$FRONTIER_LLM_REHEARSAL_PYTHON``, else this one: the environment the plan
    stage runs in). An error when the rehearsal would refuse that torch
    (``model.rehearsal.torch_pin``), since the plan would then stand on the memory model
    alone; ok when the plan output this run reuses is already rehearsed (``rehearsed``); a
    warning when ``parallel.rehearse=false`` opts out; None where the stage does not
    rehearse by default (a measured cluster)."""
    from model.planner.cluster import is_measured, rehearses
    from model.rehearsal import torch_pin

    setting = cfg.parallel.rehearse
    if not rehearses(setting, is_measured(cfg.parallel.cluster)):
        if setting is False:
            return Finding("rehearsal", "off (parallel.rehearse=false)", "warning",
                           "the plan's device memory is the memory model's alone")
        return None
    if rehearsed:
        return Finding("rehearsal", "the reused plan output is rehearsed")
    checked = ".".join(map(str, torch_pin.CHECKED_TORCH))
    python = torch_pin.rehearsal_python()
    where = "here" if python == sys.executable else f"in {python}"
    version = torch_pin.torch_of(python)
    if version is None or torch_pin.torch_release(version) != torch_pin.CHECKED_TORCH:
        return Finding("rehearsal", f"torch {version or 'not installed'} {where}; the "
                       f"rehearsal runs on torch {checked} only", "error",
                       f"the plan stage would keep its plan unrehearsed: {REHEARSAL_FIX}")
    return Finding("rehearsal", f"torch {version} {where}: the plan stage rehearses its plan")


def _resolved_train(cfg: PipelineConfig, figures: Interruptions) -> TrainConfig:
    """``cfg.train`` with ``checkpoint_minutes: auto`` resolved as the train stage resolves
    it; left ``auto`` when the save time is unknown (the interval row says so)."""
    if cfg.train.checkpoint_minutes != "auto" or figures.best_interval_s is None:
        return cfg.train
    return dataclasses.replace(cfg.train, checkpoint_minutes=auto_checkpoint_minutes(figures))


def checkpoint_interval_s(cfg: PipelineConfig, train: TrainConfig, step: float) -> float:
    """Seconds of training between checkpoints as configured: the first of
    ``train.checkpoint_every`` steps (0: only at the end), ``train.checkpoint_minutes``
    (resolved) and the save before the walltime (when the signal leaves a step for it)."""
    by_steps = min(train.checkpoint_every or train.steps, train.steps) * step
    minutes = train.checkpoint_minutes
    by_clock = minutes * 60 if isinstance(minutes, (int, float)) else math.inf
    save = cfg.site.save_before_end()
    before_end = walltime_seconds(cfg.site.walltime) - save if save > step else math.inf
    return min(by_steps, by_clock, before_end)


def checkpoint_finding(cfg: PipelineConfig, step: float | None,
                       figures: Interruptions | None = None) -> Finding:
    """When the first checkpoint lands, and an error when none can land within one job."""
    if step is None:
        return Finding("first checkpoint", "unknown", "warning", "no predicted step time")
    train = _resolved_train(cfg, figures or config_interruptions(cfg))
    first = checkpoint_interval_s(cfg, train, step)
    problem = checkpoint_cadence_problem(train, cfg.site, step)
    value = f"after {_hours(first)} of training" + _checkpoint_write(cfg)
    return Finding("first checkpoint", value, "error" if problem else "ok", problem or "")


WASTEFUL_INTERVAL = 1.5
"""The configured interval is a warning when it loses this many times Young/Daly's work."""


def failure_findings(cfg: PipelineConfig, step: float | None,
                     figures: Interruptions | None = None) -> list[Finding]:
    """The interruptions the whole training should expect, and the checkpoint interval that
    loses least work to them (Young/Daly) beside the configured one, each with the
    node-hours it loses (``model.planner.failures``)."""
    figures = figures or config_interruptions(cfg)
    if step is None:
        return [Finding("interruptions", "unknown", "warning", "no predicted step time")]
    run = cfg.train.steps * step
    nodes = cfg.parallel.nodes
    configured = checkpoint_interval_s(cfg, _resolved_train(cfg, figures), step)
    mine = figures.lost(configured, run)
    rows = [Finding("interruptions", f"{mine.failures:.3g} expected in {_hours(run)} of "
                    f"training: {figures.rate_per_node_hour:.3g} per node-hour x {nodes} "
                    f"node(s), one every {_hours(figures.mtbf_s)} ({figures.rate_source})")]
    best = figures.best_interval_s
    if best is None:
        auto = cfg.train.checkpoint_minutes == "auto"
        value = (f"configured {_hours(configured)}: {_node_hours(mine.node_hours)} node-hours "
                 "lost to failures, plus saves of unknown cost")
        fix = (f"{figures.unknown_save}: set node_write_gbps in the cluster file to price a "
               "save" + (", which train.checkpoint_minutes=auto needs (or give it minutes)"
                         if auto else ""))
        rows.append(Finding("checkpoint interval", value, "error" if auto else "warning", fix))
        return rows
    ideal = figures.lost(best, run)
    value = (f"Young/Daly {_hours(best)} (save {figures.save_s:.3g} s): "
             f"{_node_hours(ideal.node_hours)} node-hours lost; configured "
             f"{_hours(configured)}: {_node_hours(mine.node_hours)} node-hours lost")
    if mine.node_hours > WASTEFUL_INTERVAL * ideal.node_hours:
        saved = _node_hours(mine.node_hours - ideal.node_hours)
        fix = (f"train.checkpoint_minutes=auto ({best / 60:.3g} min) loses {saved} fewer "
               "node-hours")
        if cfg.train.checkpoint_minutes == "auto":  # checkpoint_every saves sooner than auto
            fix = (f"train.checkpoint_every saves more often than auto's {best / 60:.3g} min: "
                   f"set train.checkpoint_every=0 to lose {saved} fewer node-hours")
        return [*rows, Finding("checkpoint interval", value, "warning", fix)]
    return [*rows, Finding("checkpoint interval", value)]


def _checkpoint_write(cfg: PipelineConfig) -> str:
    """``; each written in ...`` from the cluster file's write bandwidth, or nothing."""
    from model.flops import GPTParams
    from model.planner.cluster import ClusterError, load_cluster
    from model.planner.run_cost import CHECKPOINT_BYTES_PER_PARAM, checkpoint_seconds

    try:
        cluster = load_cluster(cfg.parallel.cluster)
    except ClusterError:  # measured where the plan stage runs: no file-system figures
        return ""
    params = GPTParams.from_config(cfg.model).total()
    seconds = checkpoint_seconds(params, cfg.parallel.nodes, cluster)
    if seconds is None:
        return ""
    return (f"; each {CHECKPOINT_BYTES_PER_PARAM * params / 1e12:.3g} TB, written in "
            f"{seconds:.3g} s")


def evaluation_findings(cfg: PipelineConfig) -> list[Finding]:
    """Host memory of the evaluation (the whole model in float32 per process with
    ``eval.layout=replicas``) against a node's, and the streamed Hugging Face export."""
    node_gb = FRONTIER_NODE_MEMORY_GB if cfg.site.name == "frontier" else None
    rows = []
    if cfg.eval.layout == "training":
        rows.append(Finding("evaluation", f"{cfg.eval.ranks} ranks in the training layout: no "
                            "process holds the whole model"))
    else:
        value = (f"{cfg.eval.ranks} process(es) x {evaluation_host_gb(cfg):.3g} GB (the whole "
                 "model in float32)")
        problem = evaluation_memory_problem(cfg, node_gb) if node_gb else None
        if node_gb is None:
            rows.append(Finding("evaluation", value, "warning", "the node's memory is not known"))
        elif problem:
            rows.append(Finding("evaluation", f"{value} > {node_gb} GB of a node", "error",
                                problem))
        else:
            rows.append(Finding("evaluation", f"{value} of {node_gb} GB of a node"))
    largest = cfg.model.vocab_size * cfg.model.d_model * EVAL_BYTES_PER_PARAM / 1e9
    rows.append(Finding("export", f"streamed from the checkpoint's shards: peak about the "
                        f"largest tensor, {largest:.3g} GB"))
    return rows


def corpus_finding(cfg: PipelineConfig) -> Finding:
    """The corpus: its size on disk, or for a hub source the budget that bounds it."""
    data = cfg.data
    need = cfg.train.steps * cfg.train.global_batch * cfg.train.seq_len
    value = f"training reads {need:.3g} tokens"
    sources = [data.source] if data.source else list(data.sources.values())
    hub = [s for s in sources if s.startswith("hf:")]
    if hub:
        problem = hub_budget_problem(cfg)
        if problem:
            return Finding("corpus", f"{', '.join(hub)} streamed whole; {value}", "error",
                           problem)
        budget = f"data.max_documents={data.max_documents:,}"
        return Finding("corpus", f"{', '.join(hub)} streamed within {budget}; {value}",
                       "warning", "the hub's size is not checked from here")
    sizes = []
    for source in sources or ["stdlib"]:
        if source == "stdlib":  # the built-in corpus: this interpreter's standard library
            continue
        path = Path(source)
        if not path.exists():
            return Finding("corpus", f"{source} is not here; {value}", "warning",
                           "not visible from this machine: checked when tokenize starts")
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        sizes.append(sum(p.stat().st_size for p in files))
    return Finding("corpus", f"{sum(sizes) / 1e9:.3g} GB on disk; {value}")


def environment_finding(cfg: PipelineConfig) -> Finding:
    """Where the ranks import Python from: node-local NVMe (site.node_local_env) or the shared
    file system, an error on Frontier above ``NODE_LOCAL_ENV_NODES`` nodes in one job."""
    site = cfg.site
    nodes = largest_job_nodes(cfg)
    if site.node_local_env:
        return Finding("environment", f"{site.node_local_env} copied to each node's NVMe "
                       f"(largest job {nodes} node(s))")
    value = (f"site.conda_env={site.conda_env}" if site.conda_env else "the submitting "
             "interpreter") + f" over the shared file system, largest job {nodes} node(s)"
    problem = node_local_env_problem(cfg)
    if problem:
        return Finding("environment", value, "error", problem)
    if site.name == "frontier":
        return Finding("environment", f"{value} (up to {NODE_LOCAL_ENV_NODES} on Frontier)")
    return Finding("environment", value, "warning", "the site's file systems are not known here")


def corpus_fetch_finding(cfg: PipelineConfig, plans: list[StageDecision]) -> Finding | None:
    """Where a hub corpus (``hf:``) is fetched: on a compute node, which on Frontier needs
    OLCF's proxy (an error without one); None without a hub source."""
    hub = hub_sources(cfg)
    if not hub:
        return None
    tokenize = next((p for p in plans if p.name == "tokenize"), None)
    if tokenize is not None and tokenize.action not in ("run", "force"):
        how = "reused" if tokenize.action == "reuse" else "not run"
        return Finding("corpus fetch", f"{', '.join(hub)}: tokenize is {how}, nothing is "
                       "fetched")
    where = f"{', '.join(hub)} streamed by tokenize on a compute node"
    problem = hub_fetch_problem(cfg)
    if problem:
        return Finding("corpus fetch", where, "error", problem)
    if proxy_configured(cfg):
        return Finding("corpus fetch", f"{where} through the proxy site.worker_init exports")
    return Finding("corpus fetch", where, "warning",
                   "that the compute nodes reach the internet is not checked from here")


def runs_dir_finding(cfg: PipelineConfig) -> Finding:
    """Where outputs, checkpoints and the MLflow store go: on Frontier, Lustre."""
    problem = runs_dir_problem(cfg) if cfg.site.name == "frontier" else None
    if problem:
        return Finding("runs dir", str(cfg.tracking.runs_dir), "error", problem)
    if cfg.site.name == "frontier":
        return Finding("runs dir", f"{cfg.runs_dir} (Lustre)")
    return Finding("runs dir", str(cfg.runs_dir), "warning",
                   "that the compute nodes share it is not checked from here")


def whole_run_finding(cfg: PipelineConfig, step: float | None) -> Finding:
    """The whole training's time, the jobs it chains and its node-hours."""
    if step is None:
        return Finding("whole run", "unknown", "warning", "no predicted step time")
    total = cfg.train.steps * step
    jobs = _jobs(total, walltime_seconds(cfg.site.walltime), cfg.site.save_before_end(), step)
    node_hours = cfg.parallel.nodes * total / 3600
    value = (f"{cfg.train.steps} steps: {_hours(total)} of training in at least {jobs} job(s) "
             f"of {cfg.site.walltime}, {node_hours:,.0f} node-hours")
    if cfg.site.name == "frontier" and cfg.parallel.nodes <= FRONTIER_NODES:
        number, _, limit_h = walltime_bin(cfg.parallel.nodes)
        fewest = _jobs(total, int(limit_h * 3600), cfg.site.save_before_end(), step)
        if fewest < jobs:  # every job waits in the queue and pays its start-up again
            return Finding("whole run", value, "warning",
                           f"site.walltime={int(limit_h):02d}:00:00 (bin {number}'s limit) "
                           f"needs {fewest} job(s)")
    return Finding("whole run", value)


def _jobs(total_s: float, walltime_s: int, save_before_end_s: int, step_s: float) -> int:
    """Jobs a training of ``total_s`` seconds chains at ``walltime_s`` per job: each stops
    ``save_before_end_s`` before its end, and advances at least one step."""
    return math.ceil(total_s / max(walltime_s - save_before_end_s, step_s))


def readiness(cfg: PipelineConfig, plans: list[StageDecision] | None = None) -> list[Finding]:
    """Every row of the report for ``cfg`` on its Slurm site; ``plans``: the driver's stage
    decisions (decided here when not given), whose reused plan output the report reads."""
    plans = decide_stages(PIPELINE, cfg, None, None, False) if plans is None else plans
    found_plan = reused_outputs(plans).get("plan")
    site = cfg.site
    short = site.compute_walltime or site.walltime
    rows = [job_finding("training job", cfg, cfg.parallel.nodes, site.walltime),
            job_finding("tokenize job", cfg, site.tokenize_nodes, short, "site.compute_walltime"),
            job_finding("evaluation job", cfg, declaration("evaluate").shape(cfg).nodes, short,
                        "site.compute_walltime")]
    if cfg.parallel.refine_top_k > 0:  # the plan stage measures its candidates as ranks
        rows.insert(1, job_finding("measurement job", cfg, declaration("plan").shape(cfg).nodes,
                                   short, "site.compute_walltime"))
    plan_rows, step = plan_findings(cfg, found_plan)
    rows += plan_rows
    rehearsal = rehearsal_finding(cfg, _rehearsed(found_plan))
    rows += [rehearsal] if rehearsal else []
    figures = config_interruptions(cfg)
    rows.append(checkpoint_finding(cfg, step, figures))
    rows += failure_findings(cfg, step, figures)
    rows += evaluation_findings(cfg)
    rows += [corpus_finding(cfg), runs_dir_finding(cfg), whole_run_finding(cfg, step)]
    fetch = corpus_fetch_finding(cfg, plans)
    rows += [environment_finding(cfg), *([fetch] if fetch else [])]
    return rows


def readiness_text(rows: list[Finding]) -> str:
    """The report as a table, then each warning's and error's reason or fix."""
    width = max(len(r.check) for r in rows)
    lines = ["# --- readiness ---"]
    for r in rows:
        lines.append(f"#   {r.check:<{width}}  {r.verdict:<7}  {r.value}")
        if r.fix:
            lines.append(f"#   {'':<{width}}  {'':<7}  -> {r.fix}")
    errors = sum(r.verdict == "error" for r in rows)
    warnings = sum(r.verdict == "warning" for r in rows)
    lines.append(f"#   {errors} error(s), {warnings} warning(s)")
    return "\n".join(lines)
