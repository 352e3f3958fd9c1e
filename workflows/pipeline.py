"""The pipeline driver: ``python -m workflows.pipeline [--config ...] [--only|--from STAGE]``.

It resolves the configuration, decides per stage whether to run, reuse or force it, opens
one MLflow parent run, loads the site's Parsl config and chains the stage apps:

    tokenize (prepare -> one app per shard -> finalize) -> plan -> train (prepare -> ranks
    -> finalize) -> evaluate (prepare -> ranks -> finalize; one app when eval.ranks is 1)

``--only STAGE`` recomputes that stage alone and ``--from STAGE`` recomputes it and every
stage after it; the stages before must already have succeeded with the current config.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages import stage, tracking
from stages.config import ConfigError, PipelineConfig, load_config
from stages.registry import STAGE_ORDER, UPSTREAM, stage_module


@dataclass
class StagePlan:
    """What the driver will do with one stage."""

    name: str
    key: str
    action: str  # "run", "force", "reuse"
    existing: stage.StageResult | None


def stage_keys(cfg: PipelineConfig, version: str) -> dict[str, str]:
    """Every stage's key, computed from the config alone (no work done)."""
    keys: dict[str, str] = {}
    for name in STAGE_ORDER:
        upstream = {u: keys[u] for u in UPSTREAM[name]}
        keys[name] = stage.stage_key(name, cfg, stage_module(name).SECTIONS, upstream, version)
    return keys


def plan_stages(
    cfg: PipelineConfig, only: str | None, start: str | None, force: bool, version: str
) -> list[StagePlan]:
    """Decide run / force / reuse per stage; refuse selections whose upstream is missing."""
    keys = stage_keys(cfg, version)
    runs_dir = cfg.runs_dir
    if only:
        selected = {only}
    elif start:
        selected = set(STAGE_ORDER[STAGE_ORDER.index(start) :])
    else:
        selected = set(STAGE_ORDER)
    plans = []
    for name in STAGE_ORDER:
        existing = stage.find_succeeded(runs_dir, name, keys[name])
        if name not in selected:
            if existing is None:
                flag = f"--only {only}" if only else f"--from {start}"
                raise ConfigError(
                    f"{flag} needs the '{name}' stage's output for the current config "
                    f"(key {keys[name]}), and there is none: run the pipeline without {flag.split()[0]} first"
                )
            action = "reuse"
        elif force or only or start:
            action = "force"
        else:
            action = "reuse" if existing is not None else "run"
        plans.append(StagePlan(name, keys[name], action, existing))
    return plans


def describe(plans: list[StagePlan], cfg: PipelineConfig) -> str:
    """The DAG with keys and actions, as printed by --dry-run."""
    lines = [f"pipeline '{cfg.name}' on site '{cfg.site.name}', runs in {cfg.runs_dir}", "DAG:"]
    for p in plans:
        after = ", ".join(UPSTREAM[p.name]) or "-"
        extra = f" x{cfg.data.num_shards} shards" if p.name == "tokenize" else ""
        extra += f" on {cfg.parallel.nproc} ranks" if p.name == "train" else ""
        if p.name == "evaluate":
            extra += f" on {cfg.eval.ranks} ranks" if _multi_rank(p.name, cfg) else " in one process"
        lines.append(f"  {p.name:<9} key {p.key}  {p.action:<6} (after: {after}){extra}")
    return "\n".join(lines)


def _multi_rank(name: str, cfg: PipelineConfig) -> bool:
    """Whether a stage runs as prepare -> ranks app -> finalize (else one app, or tokenize's
    fan-out). One evaluation rank runs inside the stage's app: a separate rank process would
    only add its start-up (about 5 s of the tiny preset's ~105 s on 2 cores)."""
    return name == "train" or (name == "evaluate" and cfg.eval.ranks > 1)


def _tail_logs(log_dir: Path, offsets: dict[Path, int]) -> None:
    """Print new lines of the apps' log files, prefixed with the log's name."""
    for path in sorted(log_dir.glob("*.log")):
        with open(path, "rb") as handle:
            handle.seek(offsets.get(path, 0))
            data = handle.read()
        complete = data.rfind(b"\n") + 1
        if not complete:
            continue
        offsets[path] = offsets.get(path, 0) + complete
        for line in data[:complete].decode(errors="replace").splitlines():
            print(f"[{path.stem}] {line}", flush=True)


def _submit(cfg: PipelineConfig, plans: list[StagePlan], ctx, log_dir: Path) -> dict[str, Any]:
    """Submit the stage apps; return name -> future (or StageResult for reused stages)."""
    from workflows import apps, sites

    results: dict[str, Any] = {}
    opened: dict[str, Any] = {}
    for p in plans:
        inputs = {u: results[u] for u in UPSTREAM[p.name]}
        log = str(log_dir / f"{p.name}.log")
        force = p.action == "force"
        if p.action == "reuse" and p.existing is not None:
            # Inputs of reused stages are published results already: record it right here.
            ready = {u: r.result() if hasattr(r, "result") else r for u, r in inputs.items()}
            results[p.name] = stage.reuse(ctx, p.existing, cfg, stage_module(p.name).SECTIONS, ready)
        elif p.name == "tokenize":
            opened[p.name] = apps.begin_app(ctx, p.name, cfg, force, log, **inputs)
            shards = [
                apps.shard_app(cfg, opened[p.name], i, str(log_dir / f"tokenize-shard{i}.log"))
                for i in range(cfg.data.num_shards)
            ]
            results[p.name] = apps.finish_app(ctx, p.name, cfg, opened[p.name], log, *shards)
        elif _multi_rank(p.name, cfg):
            # prepare (checks, spec) -> every rank on the "train" executor -> finalize.
            opened[p.name] = apps.begin_app(ctx, p.name, cfg, force, log, **inputs)
            ranks_log = str(log_dir / f"{p.name}-ranks.log")
            ranks = apps.ranks_app(
                p.name,
                cfg,
                opened[p.name],
                stdout=ranks_log,
                stderr=ranks_log,
                parsl_resource_specification=sites.ranks_resource_spec(p.name, cfg) or {},
            )
            results[p.name] = apps.finish_app(ctx, p.name, cfg, opened[p.name], log, ranks)
        else:
            results[p.name] = apps.stage_app(ctx, p.name, cfg, force, log, **inputs)
    results["_opened"] = opened
    return results


def _wait(results: dict[str, Any], ctx, log_dir: Path) -> dict[str, stage.StageResult]:
    """Wait for every stage, tailing logs; mark attempts whose later parts failed."""
    opened = results.pop("_opened")
    offsets: dict[Path, int] = {}
    pending = {name: f for name, f in results.items() if hasattr(f, "done")}
    started = time.time()
    while pending:
        _tail_logs(log_dir, offsets)
        for name in [n for n, f in pending.items() if f.done()]:
            outcome = "failed" if pending.pop(name).exception() else "done"
            print(f"[pipeline] {name} {outcome} at +{time.time() - started:.1f}s", flush=True)
        time.sleep(0.5)
    _tail_logs(log_dir, offsets)
    done: dict[str, stage.StageResult] = {}
    errors: list[str] = []
    for name, value in results.items():
        try:
            done[name] = value.result() if hasattr(value, "result") else value
        except Exception as error:  # noqa: BLE001 - reported below with the stage name
            errors.append(f"{name}: {type(error).__name__}: {error}")
            _fail_open_attempt(ctx, opened.get(name), error)
    if errors:
        raise RuntimeError("pipeline failed:\n  " + "\n  ".join(errors))
    return done


def _fail_open_attempt(ctx, opened_future, error: BaseException) -> None:
    """A multi-part stage whose ranks or shards failed: record it as failed."""
    if opened_future is None or opened_future.exception() is not None:
        return
    opened = opened_future.result()
    if isinstance(opened, stage.StageResult):
        return
    attempt, _ = opened
    status = stage.read_status(attempt.work_dir)
    if status and status["state"] == "running":
        stage.fail(ctx, attempt, error)


def run_pipeline(
    cfg: PipelineConfig,
    only: str | None = None,
    start: str | None = None,
    force: bool = False,
) -> dict[str, stage.StageResult]:
    """Run the pipeline with Parsl and MLflow; return each stage's result."""
    import parsl

    from workflows import sites

    version = stage.package_version()
    plans = plan_stages(cfg, only, start, force, version)
    runs_dir = cfg.runs_dir
    runs_dir.mkdir(parents=True, exist_ok=True)
    uri = tracking.default_tracking_uri(runs_dir, cfg.tracking.uri)
    experiment_id = tracking.ensure_experiment(uri, cfg.tracking.experiment or cfg.name, runs_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    parent_id = tracking.start_run(
        uri, experiment_id, f"pipeline-{stamp}",
        tags={"site": cfg.site.name, "only": only or "", "from": start or "", "force": str(force)},
    )
    parent = tracking.Tracker(uri, parent_id)
    parent.log_params(cfg.to_dict())
    parent.log_dict(cfg.to_dict(), "config.yaml")
    parent.set_tags({f"stage.{p.name}": p.action for p in plans})
    ctx = stage.PipelineContext(str(runs_dir), uri, experiment_id, parent_id, version)
    log_dir = runs_dir / "logs" / f"{stamp}-{parent_id[:8]}"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(describe(plans, cfg), flush=True)
    started = time.time()
    status = "FAILED"
    dfk = parsl.load(sites.make_parsl_config(cfg, runs_dir))
    try:
        results = _wait(_submit(cfg, plans, ctx, log_dir), ctx, log_dir)
        status = "FINISHED"
    finally:
        dfk.cleanup()
        parsl.clear()
        parent.set_tags({"wall_seconds": f"{time.time() - started:.1f}"})
        tracking.end_run(uri, parent_id, status)
    for name in STAGE_ORDER:
        result = results[name]
        how = "reused" if result.reused else "ran"
        print(f"{name:<9} {how:<6} {result.out_dir}", flush=True)
    print(f"\nMLflow store: {uri}\nOpen the UI:  {tracking.ui_command(uri, runs_dir)}", flush=True)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m workflows.pipeline",
        description="Raw text -> tokenized Zarr store -> parallel plan -> trained GPT -> evaluation.",
    )
    parser.add_argument("--config", default=None, help="YAML preset (default configs/tiny.yaml)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], nargs="+", metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.steps=50 model.n_layers=4",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--only", choices=STAGE_ORDER, help="recompute only this stage")
    group.add_argument("--from", dest="start", choices=STAGE_ORDER, help="recompute from this stage on")
    parser.add_argument("--site", choices=["local", "slurm", "frontier"], help="where to run")
    parser.add_argument("--force", action="store_true", help="recompute every selected stage")
    parser.add_argument("--dry-run", action="store_true", help="print the DAG and keys, run nothing")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: SQLite in the runs dir)")
    parser.add_argument("--runs-dir", help="where stage outputs and the default MLflow store live")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = [item for group in args.overrides for item in group]
    if args.site:
        overrides.append(f"site.name={args.site}")
    if args.tracking_uri:
        overrides.append(f"tracking.uri={args.tracking_uri}")
    if args.runs_dir:
        overrides.append(f"tracking.runs_dir={args.runs_dir}")
    try:
        cfg = load_config(args.config, overrides)
        if args.dry_run:
            from workflows import sites

            print(describe(plan_stages(cfg, args.only, args.start, args.force, stage.package_version()), cfg))
            print(sites.dry_run_text(cfg, cfg.runs_dir))
            return 0
        run_pipeline(cfg, args.only, args.start, args.force)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(str(error), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
