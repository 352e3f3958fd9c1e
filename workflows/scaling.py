"""Scaling studies: ``python -m workflows.scaling --config ... --mode weak|strong``.

Measured (the default): for each device count of ``--devices`` the pipeline's stages up to
training (tokenize -> plan -> train) run as stage runs of their own, one point after the
other so that no two points share the machine while they are timed. Weak scaling keeps the
configuration's sequences per device (the global batch grows with the devices), strong
scaling keeps its global batch (``model.planner.scaling.point_batch``). The plan stage
chooses each point's layout; ``--fix tp=1`` (any plan field the parallel section has)
fixes a layout family. Stage outputs are reused by key exactly as in the pipeline
(``stages.mechanism.selection.decide_stages``, ``workflows.session.PipelineSession``): the token
store
is made once, and running the same study again recomputes nothing.

On a Slurm site a point spans ``devices / ranks per node`` nodes (``--ranks-per-node``, by
default the configuration's ``parallel.nproc / parallel.nodes``), and each point runs in a
Slurm block sized to it: the Parsl configuration is built again whenever a point's nodes or
ranks per node differ from the previous point's, so a one-node point never shares a block
of several nodes (where Parsl's node pool could hand it a node other than the job's first,
at which the ranks meet). Each row records the nodes and the hosts its ranks ran on.

``--predict`` trains nothing: the plan stage's search and time model price each point of
the Frontier presets (22B, 175B, 1T; or the ``--config`` given) from one node to the whole
machine, with the breakdown term that dominates each point and the one that explains its
loss of efficiency.

Either way the results are one MLflow parent run ``scaling-<mode>-<time>`` with a child
run per point (nested under it: that point's stage runs), and in the output directory (and
as the parent's artifacts): ``scaling.csv``, ``efficiency.png``, ``throughput.png`` and,
where measured and predicted throughput both exist, ``measured_vs_predicted.png``.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_prep.atomic import write_text_atomic
from model.parallel.layout import CONFIG_FIELDS, LAYOUT_FIELDS, PlanError
from model.planner import scaling
from model.training.files import SUMMARY_FILE
from stages.config import CONFIG_DIR, ConfigError, PipelineConfig, load_config
from stages.mechanism import keys, tracking, tracking_store
from stages.mechanism.outputs import StageResult
from stages.mechanism.selection import decide_stages
from stages.registry import PIPELINE, STAGE_ORDER
from workflows.session import (
    INTERRUPTED_EXIT,
    PipelineFailed,
    PipelineSession,
    check_runs_dir,
    exit_driver,
)

STUDY_STAGES = STAGE_ORDER[: STAGE_ORDER.index("train") + 1]
"""The stages each measured point runs (evaluation is no part of a throughput study)."""
PRESETS = ("frontier-22b", "frontier-175b", "frontier-1t")
"""What ``--predict`` prices when no --config is given."""
MEASURED_DEVICES = "1,2,4"
PARALLEL_FIXES = CONFIG_FIELDS
"""Plan fields a measured study can fix (the parallel section's)."""
PLAN_FIELDS = LAYOUT_FIELDS
COLUMNS = ("model", "mode", "devices", "nodes", "ranks_per_node", "hosts", "global_batch",
           *PLAN_FIELDS,
           "step_time_s", "tokens_per_s", "mfu", "efficiency",
           "predicted_step_time_s", "predicted_tokens_per_s", "predicted_mfu",
           "predicted_efficiency", "dominant_term", "dominant_fraction", "overhead_term",
           "overhead_fraction", "loss_term", "loss_share", "plan_key", "train_key", "reused",
           "note")
"""The columns of scaling.csv, one row per point (empty where a value does not apply);
``hosts``: the distinct hostnames of a measured point's ranks, in rank order, space-separated."""
CSV_FILE, EFFICIENCY_PNG, THROUGHPUT_PNG = "scaling.csv", "efficiency.png", "throughput.png"
COMPARE_PNG = "measured_vs_predicted.png"


@dataclass
class Point:
    """One device count of a study: its configuration and, once done, its table row."""

    devices: int
    nodes: int
    global_batch: int
    cfg: PipelineConfig
    row: dict[str, Any] = field(default_factory=dict)
    terms: dict[str, float] = field(default_factory=dict)  # the predicted step breakdown


# --- configuration of a study --------------------------------------------------------------

def fix_overrides(fixes: list[str]) -> list[str]:
    """``--fix NAME=VALUE`` items as ``parallel.NAME=VALUE`` overrides, checked by the plan
    stage's parser; a field the parallel section does not have is a ConfigError."""
    from model.planner.choose import parse_fix

    try:
        fixed = parse_fix(fixes)
    except PlanError as error:
        raise ConfigError(str(error)) from None
    other = sorted(set(fixed) - set(PARALLEL_FIXES))
    if other:
        raise ConfigError(f"--fix {other[0]}: a measured study fixes only {list(PARALLEL_FIXES)} "
                          "(grad_accum follows from the batch: fix micro_batch instead)")
    return [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}"
            for k, v in fixed.items()]


def study_ranks_per_node(cfg: PipelineConfig, ranks_per_node: int | None) -> int:
    """The ranks per node of a study's points: ``--ranks-per-node``, else the configuration's
    ``parallel.nproc / parallel.nodes``; checked before any work."""
    if ranks_per_node is None:
        return cfg.parallel.ranks_per_node
    if ranks_per_node < 1:
        raise ConfigError(f"--ranks-per-node {ranks_per_node}: give a count >= 1")
    if cfg.site.name == "local":
        raise ConfigError("--ranks-per-node places ranks on the nodes of a Slurm site; the "
                          "local site runs every point on this machine: drop it or pass "
                          "--site slurm")
    return ranks_per_node


def point_nodes(cfg: PipelineConfig, devices: int, per_node: int | None = None) -> int:
    """Nodes a point spans: one on the local site, else whole nodes of ``per_node`` ranks
    (default the configuration's ranks per node); a point up to one node's ranks takes one."""
    per_node = per_node or cfg.parallel.ranks_per_node
    if cfg.site.name == "local" or devices <= per_node:
        return 1
    if devices % per_node:
        raise ConfigError(f"{devices} devices do not fill whole nodes of {per_node} ranks "
                          "(--ranks-per-node, else parallel.nproc / parallel.nodes): choose "
                          "device counts that are multiples of it")
    return devices // per_node


def _check_formable(cfg: PipelineConfig) -> None:
    """Refuse, before any work, a point for which no layout can be formed at all (the plan
    stage's rule, ``model.planner.choose.layout_problem``)."""
    from model.planner.choose import fixed_fields, layout_problem

    problem = layout_problem(cfg.model, cfg.train, cfg.parallel.nproc, fixed_fields(cfg.parallel))
    if problem:
        raise ConfigError(problem)


def study_points(config: str | None, overrides: list[str], mode: str,
                 devices: list[int], ranks_per_node: int | None = None) -> list[Point]:
    """Every point's validated configuration (a bad one stops the study before any work)."""
    from workflows.frontier import check_site

    base = load_config(config, overrides)
    per_node = study_ranks_per_node(base, ranks_per_node)
    points = []
    for n in devices:
        try:
            batch = scaling.point_batch(mode, base.train.global_batch, base.parallel.nproc, n)
        except scaling.ScalingError as error:
            raise ConfigError(str(error)) from None
        nodes = point_nodes(base, n, per_node)
        cfg = load_config(config, [*overrides, f"parallel.nproc={n}", f"parallel.nodes={nodes}",
                                   f"train.global_batch={batch}"])
        check_site(cfg)  # e.g. more ranks per node than a Frontier node has GCDs
        _check_formable(cfg)
        points.append(Point(n, nodes, batch, cfg))
    return points


def block_shape(cfg: PipelineConfig) -> tuple[int, int] | None:
    """What a point's Parsl configuration depends on: (nodes, ranks per node) of its Slurm
    block; None on the local site, where one configuration serves every point."""
    if cfg.site.name == "local":
        return None
    return cfg.parallel.nodes, cfg.parallel.ranks_per_node


# --- the planner's view of a point ---------------------------------------------------------

def plan_row(plan: Any) -> dict[str, Any]:
    """A plan's layout and predictions as table columns."""
    pred = plan.predictions
    row = {k: getattr(plan, k) for k in PLAN_FIELDS}
    row.update(predicted_step_time_s=pred.get("step_time_s"),
               predicted_tokens_per_s=pred.get("tokens_per_s"), predicted_mfu=pred.get("mfu"))
    return row


def breakdown(cfg: PipelineConfig, plan: Any, cluster: Any | None = None) -> dict[str, float]:
    """The planner's step-time terms (seconds per step) for ``plan`` at ``cfg``'s point; the
    cluster is loaded as the plan stage loads it (a measured one from its cache)."""
    from model.planner.calibration import load_calibration
    from model.planner.choose import calibration_file, planning_cluster
    from model.planner.search import explain
    from model.planner.shapes import Shapes

    world = cfg.parallel.nproc
    if cluster is None:
        cluster = planning_cluster(cfg.parallel.cluster, world, cfg.runs_dir)
    cal = load_calibration(calibration_file(cfg.runs_dir, cluster.name, world))
    return explain(Shapes.from_configs(cfg.model, cfg.train, cluster), cluster, plan, world,
                   cfg.train.global_batch, cal)["step"]


def describe_terms(row: dict[str, Any], terms: dict[str, float]) -> None:
    """Fill the dominant and overhead terms of a row from its step breakdown."""
    row["dominant_term"], row["dominant_fraction"] = scaling.dominant(terms)
    row["overhead_term"], row["overhead_fraction"] = scaling.dominant(terms, overheads_only=True)


def finish_table(points: list[Point]) -> None:
    """Efficiencies and loss terms against the smallest point with a value (per model)."""
    for model in dict.fromkeys(p.row["model"] for p in points):
        group = [p for p in points if p.row["model"] == model]
        devices = [p.devices for p in group]
        for key, source in (("efficiency", "tokens_per_s"),
                            ("predicted_efficiency", "predicted_tokens_per_s")):
            for p, eff in zip(group, scaling.efficiencies(devices, [p.row.get(source)
                                                                    for p in group])):
                p.row[key] = eff
        base = next((p for p in group if p.terms), None)
        for p in group:
            if base is None or not p.terms:
                continue
            seq = p.cfg.train.seq_len
            p.row["loss_term"], p.row["loss_share"] = scaling.loss_term(
                p.terms, p.devices, p.global_batch * seq,
                base.terms, base.devices, base.global_batch * base.cfg.train.seq_len)


# --- measured study ------------------------------------------------------------------------

def _point_row(point: Point, mode: str, results: dict[str, StageResult]) -> dict[str, Any]:
    """A measured point's row: the train stage's figures, the plan and its predictions."""
    from model.parallel.layout import Plan

    train, plan_out = results["train"].outputs, results["plan"].outputs
    row: dict[str, Any] = {"model": point.cfg.name, "mode": mode, "devices": point.devices,
                           "nodes": point.nodes,
                           "ranks_per_node": point.cfg.parallel.ranks_per_node,
                           "hosts": " ".join(train_hosts(results["train"])),
                           "global_batch": point.global_batch}
    plan = Plan.from_json(plan_out["plan"])
    row.update(plan_row(plan))
    row.update(step_time_s=train.get("step_time_s"), tokens_per_s=train.get("tokens_per_s"),
               mfu=train.get("mfu"), plan_key=results["plan"].key,
               train_key=results["train"].key,
               reused=all(results[s].reused for s in STUDY_STAGES if s in results))
    try:
        point.terms = breakdown(point.cfg, plan)
        describe_terms(row, point.terms)
    except (OSError, ValueError) as error:  # the plan's figures stand without a breakdown
        row["note"] = f"no breakdown: {error}"[:200]
    return row


def train_hosts(result: StageResult) -> list[str]:
    """The distinct hostnames a train stage's ranks ran on, in rank order (its summary.json;
    for a reused stage, the run that made it)."""
    path = Path(result.out_dir) / SUMMARY_FILE
    try:
        hosts = json.loads(path.read_text()).get("hosts") or []
    except (OSError, ValueError):
        return []
    return list(dict.fromkeys(hosts))


def run_measured(points: list[Point], mode: str, out_dir: Path | None = None) -> Path:
    """Run every point's stages with Parsl (one point at a time, each in a block sized to
    it), track the study in MLflow and write its table and plots; return the output
    directory."""
    first = points[0].cfg
    runs_dir = first.runs_dir
    uri = tracking_store.default_tracking_uri(runs_dir, first.tracking.uri)
    tracking_store.check_store(uri)
    check_runs_dir(runs_dir)
    code = keys.code_hashes(PIPELINE)
    devices = ",".join(str(p.devices) for p in points)
    tags = {"scaling": mode, "devices": devices, "site": first.site.name}
    status, point_ids = "FAILED", {}
    session = PipelineSession(first, f"scaling-{mode}", tags, label="scaling")
    try:
        with session:
            session.parent.log_dict(first.to_dict(), "config.yaml")
            block = None
            for point in points:
                if session.dfk is None or block_shape(point.cfg) != block:
                    session.start_parsl(point.cfg)
                    block = block_shape(point.cfg)
                plans = [p for p in decide_stages(PIPELINE, point.cfg, None, None, False, code)
                         if p.name in STUDY_STAGES]
                actions = ", ".join(f"{p.name} {p.action}" for p in plans)
                where = (f" on {point.nodes} node(s) x {point.cfg.parallel.ranks_per_node} ranks"
                         if block else "")
                print(f"[scaling] {point.devices} devices{where}, global batch "
                      f"{point.global_batch}: {actions}", flush=True)
                point_ids[point.devices] = tracking.start_run(
                    session.uri, session.experiment_id, f"{first.name}-{mode}-{point.devices}",
                    parent_run_id=session.parent_id,
                    tags={"scaling_point": "true", "devices": str(point.devices), "mode": mode})
                ctx = session.context(code, parent_run_id=point_ids[point.devices])
                log_dir = session.log_root / f"devices-{point.devices}"
                results = session.run_stages(point.cfg, plans, ctx, log_dir)
                point.row = _point_row(point, mode, results)
            finish_table(points)
            out_dir = out_dir or runs_dir / "scaling" / f"{first.name}-{mode}-{session.stamp}"
            files = write_report([p.row for p in points], out_dir, f"{first.name}, {mode} scaling")
            for point in points:
                log_point(tracking.Tracker(session.uri, point_ids[point.devices]), point.row)
            for path in files:
                session.parent.log_artifact(path)
            status = "FINISHED"
    finally:  # the session is closed: its tracking server too, so straight to the store
        for run_id in point_ids.values():
            tracking.end_run(uri, run_id, status)
    print(table_text([p.row for p in points]), flush=True)
    print(f"\nresults: {out_dir}\nMLflow:  {tracking_store.ui_command(uri, runs_dir)}", flush=True)
    return out_dir


# --- predicted study -----------------------------------------------------------------------

def predict_points(configs: list[str], overrides: list[str], mode: str,
                   devices: list[int] | None, fixes: list[str]) -> list[Point]:
    """Price every point of every configuration with the plan stage's search and time model.

    A point where no plan fits (too few devices for the model, or no layout that divides
    the batch) keeps a row with the planner's reason in ``note``."""
    from model.config import TrainConfig
    from model.planner.choose import choose, fixed_fields, parse_fix, planning_cluster

    extra = parse_fix(fixes)
    points: list[Point] = []
    for config in configs:
        base = load_config(config, overrides)
        fixed = {**fixed_fields(base.parallel), **extra}
        if devices is None and _measured(base):
            raise ConfigError(f"{base.parallel.cluster} is measured on this machine: give "
                              "--devices for a prediction on it")
        for n in devices or scaling.frontier_ladder():
            batch = scaling.point_batch(mode, base.train.global_batch, base.parallel.nproc, n)
            try:
                cluster = planning_cluster(base.parallel.cluster, n, base.runs_dir)
            except ValueError as error:
                raise ConfigError(str(error)) from None
            per_node = cluster.ranks_per_node
            nodes = n // per_node if n % per_node == 0 else 1
            cfg = load_config(config, [*overrides, f"parallel.nproc={n}",
                                       f"parallel.nodes={nodes}", f"train.global_batch={batch}"])
            point = Point(n, max(1, math.ceil(n / per_node)), batch, cfg)
            point.row = {"model": cfg.name, "mode": mode, "devices": n, "nodes": point.nodes,
                         "ranks_per_node": min(n, per_node), "global_batch": batch,
                         "reused": ""}
            train = TrainConfig(global_batch=batch, seq_len=cfg.train.seq_len,
                                dtype=cfg.train.dtype)
            try:
                plan, _ = choose(cfg.model, train, cluster, n, fixed)
            except PlanError as error:
                point.row["note"] = str(error).split(". ")[0][:300]
                points.append(point)
                continue
            point.row.update(plan_row(plan))
            point.terms = breakdown(cfg, plan, cluster)
            describe_terms(point.row, point.terms)
            points.append(point)
    finish_table(points)
    return points


def _measured(cfg: PipelineConfig) -> bool:
    """Whether the cluster file is measured at plan time (its figures depend on the ranks)."""
    from model.planner.cluster import read_cluster_file

    return bool(read_cluster_file(cfg.parallel.cluster)[1].get("measured"))


def run_predicted(points: list[Point], mode: str, out_dir: Path | None = None) -> Path:
    """Track a predicted study (parent run, a child per point) and write its report."""
    first = points[0].cfg
    runs_dir = first.runs_dir
    uri = tracking_store.default_tracking_uri(runs_dir, first.tracking.uri)
    tracking_store.check_store(uri)
    experiment_id = tracking.ensure_experiment(uri, first.tracking.experiment or "scaling",
                                               runs_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    models = ",".join(dict.fromkeys(p.row["model"] for p in points))
    parent_id = tracking.start_run(uri, experiment_id, f"scaling-predict-{mode}-{stamp}",
                                   tags={"scaling": mode, "predicted": "true", "models": models})
    status = "FAILED"
    try:
        out_dir = out_dir or runs_dir / "scaling" / f"predict-{mode}-{stamp}"
        files = write_report([p.row for p in points], out_dir, f"predicted {mode} scaling")
        for point in points:
            child = tracking.start_run(
                uri, experiment_id, f"{point.row['model']}-{mode}-{point.devices}",
                parent_run_id=parent_id,
                tags={"scaling_point": "true", "devices": str(point.devices), "mode": mode})
            log_point(tracking.Tracker(uri, child), point.row)
            tracking.end_run(uri, child, "FINISHED")
        parent = tracking.Tracker(uri, parent_id)
        for path in files:
            parent.log_artifact(path)
        status = "FINISHED"
    finally:
        tracking.end_run(uri, parent_id, status)
    print(table_text([p.row for p in points]), flush=True)
    print(f"\nresults: {out_dir}\nMLflow:  {tracking_store.ui_command(uri, runs_dir)}", flush=True)
    return out_dir


# --- the report ----------------------------------------------------------------------------

def log_point(tracker: tracking.Tracker, row: dict[str, Any]) -> None:
    """A point's layout as params, its figures as metrics, its terms and note as tags."""
    numbers = {k: float(v) for k, v in row.items()
               if k not in (*PLAN_FIELDS, "devices", "ranks_per_node")
               and isinstance(v, (int, float)) and not isinstance(v, bool)}
    tracker.log_params({k: row[k] for k in ("devices", "nodes", "ranks_per_node",
                                            "global_batch", *PLAN_FIELDS)
                        if row.get(k) is not None})
    tracker.log_metrics(numbers)
    tracker.set_tags({k: row[k] for k in ("model", "hosts", "dominant_term", "overhead_term",
                                          "loss_term", "plan_key", "train_key", "reused", "note")
                      if row.get(k) not in (None, "")})
    tracker.flush()


def csv_text(rows: list[dict[str, Any]]) -> str:
    """The table as CSV text (COLUMNS; floats with 6 significant digits)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else "" if v is None else v)
                         for k, v in row.items()})
    return out.getvalue()


def write_report(rows: list[dict[str, Any]], out_dir: Path, title: str) -> list[Path]:
    """scaling.csv and the plots in ``out_dir``; return the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [write_text_atomic(out_dir / CSV_FILE, csv_text(rows))]
    files += plot_report(rows, out_dir, title)
    return files


def _series(rows: list[dict[str, Any]], model: str, key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["devices"], r[key]) for r in rows
             if r["model"] == model and isinstance(r.get(key), (int, float))]
    return [n for n, _ in pairs], [v for _, v in pairs]


def plot_report(rows: list[dict[str, Any]], out_dir: Path, title: str) -> list[Path]:
    """efficiency.png, throughput.png and, where both exist, measured_vs_predicted.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from model.training.plots import save_png

    def save(fig: Any, name: str) -> Path:
        return save_png(fig, out_dir / name)

    models = list(dict.fromkeys(r["model"] for r in rows))
    files = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, model in enumerate(models):
        color = f"C{i}"
        x, y = _series(rows, model, "efficiency")
        if x:
            ax.plot(x, y, "o-", color=color, label=f"{model} measured")
        x, y = _series(rows, model, "predicted_efficiency")
        if x:
            ax.plot(x, y, "s--", color=color, label=f"{model} predicted")
            last = ""
            for r in rows:  # name the loss term where it changes
                if r["model"] == model and r.get("loss_term") and r["loss_term"] != last:
                    ax.annotate(r["loss_term"].replace("_exposed", ""),
                                (r["devices"], r["predicted_efficiency"]), fontsize=7,
                                color=color, textcoords="offset points", xytext=(3, -10))
                    last = r["loss_term"]
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="devices", ylabel="efficiency vs the smallest point",
           title=f"{title}: efficiency")
    ax.legend(fontsize=8)
    files.append(save(fig, EFFICIENCY_PNG))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, model in enumerate(models):
        color = f"C{i}"
        for key, style, what in (("tokens_per_s", "o-", "measured"),
                                 ("predicted_tokens_per_s", "s--", "predicted")):
            x, y = _series(rows, model, key)
            if x:
                ax.plot(x, y, style, color=color, label=f"{model} {what}")
                ax.plot(x, [y[0] * n / x[0] for n in x], ":", color=color, lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="devices", ylabel="tokens/s",
           title=f"{title}: throughput (dotted: linear from the smallest point)")
    ax.legend(fontsize=8)
    files.append(save(fig, THROUGHPUT_PNG))

    both = [r for r in rows if isinstance(r.get("tokens_per_s"), (int, float))
            and isinstance(r.get("predicted_tokens_per_s"), (int, float))]
    if both:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, model in enumerate(models):
            sel = [r for r in both if r["model"] == model]
            x = [r["devices"] for r in sel]
            ax.plot(x, [r["tokens_per_s"] for r in sel], "o-", color=f"C{i}",
                    label=f"{model} measured")
            ax.plot(x, [r["predicted_tokens_per_s"] for r in sel], "s--", color=f"C{i}",
                    label=f"{model} predicted")
        ax.set(xscale="log", xlabel="devices", ylabel="tokens/s",
               title=f"{title}: measured vs predicted throughput")
        ax.legend(fontsize=8)
        files.append(save(fig, COMPARE_PNG))
    return files


def table_text(rows: list[dict[str, Any]]) -> str:
    """The table as printable lines."""

    def num(value: Any, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    head = (f"{'model':<15} {'devices':>7} {'batch':>6} {'tp':>3} {'pp':>3} {'dp':>5} "
            f"{'tokens/s':>10} {'eff':>6} {'pred tok/s':>10} {'pred eff':>8}  dominant / loss")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['model']:<15} {r['devices']:>7} {r['global_batch']:>6} {num(r.get('tp'), 'd'):>3} "
            f"{num(r.get('pp'), 'd'):>3} {num(r.get('dp'), 'd'):>5} "
            f"{num(r.get('tokens_per_s'), '.4g'):>10} {num(r.get('efficiency'), '.1%'):>6} "
            f"{num(r.get('predicted_tokens_per_s'), '.4g'):>10} "
            f"{num(r.get('predicted_efficiency'), '.1%'):>8}  "
            + (f"{r.get('overhead_term') or '-'} ({num(r.get('overhead_fraction'), '.0%')}) / "
               f"{r.get('loss_term') or '-'}"
               if not r.get("note") or r.get("dominant_term") else r["note"][:60]))
    return "\n".join(lines)


# --- command line --------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m workflows.scaling",
        description="Weak or strong scaling: measured by training each device count, or "
                    "predicted by the planner (--predict).")
    parser.add_argument("--config", action="append", default=None,
                        help="YAML preset (measured: one, default configs/tiny.yaml; "
                             "--predict: repeatable, default the Frontier 22B, 175B and 1T)")
    parser.add_argument("--mode", choices=scaling.MODES, required=True,
                        help="weak: the batch grows with the devices; strong: a fixed batch")
    parser.add_argument("--devices", default=None,
                        help=f"device counts, e.g. 1,2,4,8 (measured default {MEASURED_DEVICES}; "
                             "--predict default one Frontier node doubling to the whole machine)")
    parser.add_argument("--predict", action="store_true",
                        help="train nothing: price each point with the planner's time model")
    parser.add_argument("--fix", action="append", default=[], metavar="NAME=VALUE",
                        help="fix a plan field for every point, e.g. tp=1; repeatable")
    parser.add_argument("--set", dest="overrides", action="append", default=[], nargs="+",
                        metavar="KEY=VALUE", help="override a config value")
    parser.add_argument("--site", choices=["local", "slurm", "frontier"], help="where to run")
    parser.add_argument("--ranks-per-node", type=int, default=None, metavar="N",
                        help="Slurm sites: ranks per node of every point, a point of n devices "
                             "spanning n / N nodes (default parallel.nproc / parallel.nodes)")
    parser.add_argument("--tracking-uri",
                        help="MLflow tracking URI (default: SQLite in the runs dir)")
    parser.add_argument("--runs-dir", help="where stage outputs and the default MLflow store live")
    parser.add_argument("--out", type=Path, help="where the table and plots go (default "
                        "<runs dir>/scaling/<study>-<time>)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from workflows.pipeline import cli_overrides

    args = build_parser().parse_args(argv)
    overrides = cli_overrides(args)
    try:
        if args.predict:
            if args.ranks_per_node is not None:
                raise ConfigError("--ranks-per-node places a measured study's ranks; a "
                                  "prediction takes the cluster file's ranks per node")
            configs = args.config or [str(CONFIG_DIR / f"{name}.yaml") for name in PRESETS]
            devices = scaling.parse_devices(args.devices) if args.devices else None
            points = predict_points(configs, overrides, args.mode, devices, args.fix)
            run_predicted(points, args.mode, args.out)
            return 0
        if args.config and len(args.config) > 1:
            raise ConfigError("a measured study takes one --config")
        config = args.config[0] if args.config else None
        devices = scaling.parse_devices(args.devices or MEASURED_DEVICES)
        points = study_points(config, [*overrides, *fix_overrides(args.fix)], args.mode, devices,
                              args.ranks_per_node)
        run_measured(points, args.mode, args.out)
    except KeyboardInterrupt:
        return INTERRUPTED_EXIT
    except (ConfigError, scaling.ScalingError, PlanError) as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except PipelineFailed as error:
        print(f"\nscaling study failed:\n{error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_driver(main())
