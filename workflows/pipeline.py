"""The pipeline driver: ``python -m workflows.pipeline [--config ...] [--only|--from STAGE]``.

It resolves the configuration, decides per stage whether to run, reuse or force it, opens
one MLflow parent run, loads the site's Parsl config and chains the stage apps:

    tokenize -> plan -> train -> evaluate, each submitted by its declared shape
    (stages.stage.StageShape): one app; prepare -> one app per part -> finalize; or
    prepare -> the ranks app -> finalize.

``--only STAGE`` recomputes that stage alone and ``--from STAGE`` recomputes it and every
stage after it; the stages before must already have succeeded with the current config.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages import locks, stage, tracking
from stages.config import ConfigError, PipelineConfig, load_config
from stages.registry import STAGE_ORDER, stage_module, upstream
from stages.selection import StagePlan, plan_stages
from stages.stage import FAN_OUT, SINGLE
from workflows import failures as failures_mod


def describe(plans: list[StagePlan], cfg: PipelineConfig) -> str:
    """The DAG with keys and actions, as printed by --dry-run."""
    lines = [f"pipeline '{cfg.name}' on site '{cfg.site.name}', runs in {cfg.runs_dir}", "DAG:"]
    for p in plans:
        after = ", ".join(upstream(p.name)) or "-"
        note = stage_module(p.name).shape(cfg).note
        extra = f" {note}" if note else ""
        lines.append(f"  {p.name:<9} key {p.key}  {p.action:<6} (after: {after}){extra}")
        if p.reason:
            lines.append(f"  {'':<9} why: {p.reason}")
    return "\n".join(lines)


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


def _submit(cfg: PipelineConfig, plans: list[StagePlan], ctx, log_dir: Path) -> dict[str, StageRun]:
    """Submit every stage's apps by its declared shape; return name -> StageRun.

    A stage's Python apps go to the executor of its shape's placement for this site
    (``sites.executor_label``); the ranks of a ranks stage always go to "train".
    """
    from workflows import apps, sites

    runs: dict[str, StageRun] = {}
    for p in plans:
        if p.action == "skip":
            continue
        module = stage_module(p.name)
        inputs = {u: runs[u].result for u in upstream(p.name)}
        log = str(log_dir / f"{p.name}.log")
        force = p.action == "force"
        run = StageRun(p.name, p.key, log)
        runs[p.name] = run
        if p.action == "reuse" and p.existing is not None:
            # Inputs of reused stages are published results already: record it right here.
            ready = {u: r.result() if hasattr(r, "result") else r for u, r in inputs.items()}
            run.result = stage.reuse(ctx, p.existing, cfg, module.SECTIONS, ready)
            continue
        shape = module.shape(cfg)
        label = sites.executor_label(cfg, shape.placement)
        on = apps.apps_on(label)
        spec = sites.app_resource_spec(cfg, label)
        if shape.kind == SINGLE:
            run.result = on.single(ctx, p.name, cfg, force, log,
                                   parsl_resource_specification=spec, **inputs)
            run.futures = [run.result]
            continue
        run.opened = on.begin(ctx, p.name, cfg, force, log,
                              parsl_resource_specification=spec, **inputs)
        if shape.kind == FAN_OUT:
            parts = [
                on.part(p.name, cfg, run.opened, i, str(log_dir / f"{p.name}-part{i}.log"),
                        parsl_resource_specification=spec)
                for i in range(shape.parts)
            ]
            run.result = on.finish(ctx, p.name, cfg, run.opened, log, *parts,
                                   parsl_resource_specification=spec)
        else:
            # RANKS: prepare (checks, rank spec) -> every rank on the "train" executor -> finalize
            run.ranks_log = str(log_dir / f"{p.name}-ranks.log")
            ranks = apps.ranks_app(
                cfg, run.opened, stdout=run.ranks_log, stderr=run.ranks_log,
                parsl_resource_specification=sites.ranks_resource_spec(cfg, shape) or {},
            )
            parts = [ranks]
            run.result = on.finish(ctx, p.name, cfg, run.opened, log, after=ranks,
                                   parsl_resource_specification=spec)
        run.futures = [run.opened, *parts, run.result]
    return runs


@dataclass
class StageRun:
    """One stage's apps in this invocation: what the driver waits for and reports."""

    name: str
    key: str
    log: str
    ranks_log: str | None = None
    opened: Any = None  # begin_app's future (multi-part stages)
    futures: list[Any] = field(default_factory=list)  # every app future, in order
    result: Any = None  # the future (or reused StageResult) of the stage's result


def _wait(
    runs: dict[str, StageRun], ctx, log_dir: Path, runs_dir: Path
) -> dict[str, stage.StageResult]:
    """Wait for every stage, tailing logs; report each failed stage's own error."""
    offsets: dict[Path, int] = {}
    pending = {name: run.result for name, run in runs.items() if hasattr(run.result, "done")}
    started = time.time()
    while pending:
        _tail_logs(log_dir, offsets)
        for name in [n for n, f in pending.items() if f.done()]:
            outcome = "failed" if pending.pop(name).exception() else "done"
            print(f"[pipeline] {name} {outcome} at +{time.time() - started:.1f}s", flush=True)
        time.sleep(0.5)
    _tail_logs(log_dir, offsets)
    done: dict[str, stage.StageResult] = {}
    failures: list[StageFailure] = []
    for name, run in runs.items():
        result = run.result
        if not hasattr(result, "result"):
            done[name] = result
            continue
        if result.exception() is None:
            done[name] = result.result()
            continue
        error = failures_mod.own_failure(run.futures)
        if error is None:  # only upstream stages failed: this one never ran
            continue
        _fail_open_attempt(ctx, run.opened, error)
        failures.append(_describe_failure(run, error, runs_dir))
    if failures:
        raise PipelineFailed(failures)
    return done


@dataclass
class StageFailure:
    """What the user is told about one failed stage."""

    name: str
    message: str
    user_error: bool
    status: Path
    logs: list[str]

    def render(self) -> str:
        logs = ", ".join(self.logs)
        return (f"{self.name} failed: {self.message}\n    status: {self.status}\n"
                f"    log:    {logs}")


class PipelineFailed(RuntimeError):
    """One or more stages failed; ``failures`` says which and why."""

    def __init__(self, failures: list[StageFailure]) -> None:
        self.failures = failures
        super().__init__("\n".join(f.render() for f in failures))


def _describe_failure(run: StageRun, error: BaseException, runs_dir: Path) -> StageFailure:
    """The stage's own message (a rank's, for ranks that refused their input) and its paths."""
    from parsl.app.errors import BashExitFailure

    work_dir = stage.stage_dir(runs_dir, run.name, run.key).with_name(f"{run.key}.partial")
    message = f"{type(error).__name__}: {error}"
    if isinstance(error, BashExitFailure):
        from stages.launch import read_rank_error

        rank_message = read_rank_error(work_dir)
        message = rank_message or f"the ranks exited with code {error.exitcode}"
    if isinstance(error, OSError) and error.errno in failures_mod.STORAGE_ERRNOS:
        message += (
            f" (while writing under {work_dir.parent}: free space or pass another --runs-dir)"
        )
    logs = [run.log] + ([run.ranks_log] if run.ranks_log else [])
    return StageFailure(run.name, message, failures_mod.is_user_error(error),
                        work_dir / stage.STATUS_FILE, logs)


def _fail_open_attempt(ctx, opened_future, error: BaseException) -> None:
    """A multi-part stage whose ranks or parts failed: record it as failed."""
    if opened_future is None or not opened_future.done() or opened_future.exception() is not None:
        return
    opened = opened_future.result()
    if isinstance(opened, stage.StageResult):
        return
    attempt, _ = opened
    status = stage.read_status(attempt.work_dir)
    if status and status["state"] == "running":
        stage.fail(ctx, attempt, error)


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM and SIGINT stop the driver like Ctrl-C. Both are set explicitly while it runs:
    a driver started in the background by a script inherits SIGINT ignored, and a
    ``kill -INT`` (or a group SIGINT) must stop it all the same."""
    raise KeyboardInterrupt(f"signal {signum}")


def _fail_running(ctx, runs: dict[str, StageRun], runs_dir: Path) -> None:
    """Mark this invocation's stages that are still ``running`` as failed (interrupted)."""
    for run in runs.values():
        if not run.futures:
            continue
        work_dir = stage.stage_dir(runs_dir, run.name, run.key).with_name(f"{run.key}.partial")
        status = stage.read_status(work_dir)
        if status and status.get("state") == "running":
            attempt = stage.StageAttempt(run.name, run.key, str(work_dir),
                                         str(stage.stage_dir(runs_dir, run.name, run.key)),
                                         status["run_id"], {})
            stage.fail(ctx, attempt, KeyboardInterrupt("the pipeline was interrupted"))


def check_runs_dir(runs_dir: Path) -> None:
    """Refuse a runs dir that cannot work, before any work: one line naming --runs-dir."""
    if any(ch.isspace() for ch in str(runs_dir.resolve())):
        raise ConfigError(
            f"--runs-dir {str(runs_dir)!r} contains white space, which Parsl's worker command "
            "lines cannot carry: choose a path without spaces"
        )
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        probe = runs_dir / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            f"--runs-dir {runs_dir} is not writable ({error.strerror or error}): choose a "
            "directory you can write"
        ) from None


def run_pipeline(
    cfg: PipelineConfig,
    only: str | None = None,
    start: str | None = None,
    force: bool = False,
) -> dict[str, stage.StageResult]:
    """Run the pipeline with Parsl and MLflow; return each stage's result."""
    from workflows import sites

    # A log handler that cannot write (a full disk) must not print a traceback per record.
    logging.raiseExceptions = False
    runs_dir = cfg.runs_dir
    uri = tracking.default_tracking_uri(runs_dir, cfg.tracking.uri)
    tracking.check_store(uri)  # first: an unusable store is one line, before any work
    code = stage.code_hashes()
    plans = plan_stages(cfg, only, start, force, code)
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create the runs dir {runs_dir} ({error}); pass a writable "
                          "--runs-dir") from None
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
    ctx = stage.PipelineContext(str(runs_dir), uri, experiment_id, parent_id, code)
    # Stage locks are held in this driver's name; keep them fresh while the stages run.
    heartbeat = locks.Heartbeat(runs_dir, ctx.driver, ctx.lock_stale_s / 10).start()
    parsl_dir = runs_dir / "parsl" / f"{stamp}-{os.getpid()}"  # one Parsl run dir per driver
    log_dir = runs_dir / "logs" / f"{stamp}-{parent_id[:8]}"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(describe(plans, cfg), flush=True)
    started = time.time()
    status = "FAILED"
    running = [p.name for p in plans if p.action in ("run", "force")]
    dfk = sites.start_parsl(cfg, runs_dir, parsl_dir, running)
    runs: dict[str, StageRun] = {}
    previous_handlers = {sig: signal.signal(sig, _interrupt)
                         for sig in (signal.SIGTERM, signal.SIGINT)}
    interrupted = False
    try:
        runs = _submit(cfg, plans, ctx, log_dir)
        results = _wait(runs, ctx, log_dir, runs_dir)
        status = "FINISHED"
    except KeyboardInterrupt:
        interrupted = True
        print("\n[pipeline] interrupted: stopping workers and ranks, marking running stages "
              "failed", file=sys.stderr, flush=True)
        raise
    finally:
        # Stops the workers; local ranks die with them (stages.launch).
        sites.stop_parsl(dfk, interrupted)
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        try:
            _fail_running(ctx, runs, runs_dir)
        except Exception as error:  # noqa: BLE001 - must not hide the stage's own error
            print(f"[pipeline] could not mark running stages failed: {error}", file=sys.stderr)
        heartbeat.stop()
        locks.release_all(runs_dir, ctx.driver)  # locks of stages that never finished
        parent.set_tags({"wall_seconds": f"{time.time() - started:.1f}"})
        tracking.end_run(uri, parent_id, status)
    for name, result in results.items():
        how = "reused" if result.reused else "ran"
        print(f"{name:<9} {how:<6} {result.out_dir}", flush=True)
    print(f"\nMLflow store: {uri}\nOpen the UI:  {tracking.ui_command(uri, runs_dir)}", flush=True)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m workflows.pipeline",
        description=(
            "Raw text -> tokenized Zarr store -> parallel plan -> trained GPT -> evaluation."
        ),
    )
    parser.add_argument("--config", default=None, help="YAML preset (default configs/tiny.yaml)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], nargs="+", metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.steps=50 model.n_layers=4",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--only", choices=STAGE_ORDER, help="recompute only this stage")
    group.add_argument("--from", dest="start", choices=STAGE_ORDER,
                       help="recompute from this stage on")
    parser.add_argument("--site", choices=["local", "slurm", "frontier"], help="where to run")
    parser.add_argument("--force", action="store_true", help="recompute every selected stage")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the DAG and keys, run nothing")
    parser.add_argument("--tracking-uri",
                        help="MLflow tracking URI (default: SQLite in the runs dir)")
    parser.add_argument("--runs-dir", help="where stage outputs and the default MLflow store live")
    return parser


def cli_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides of the shared options: ``--set``, ``--site``, ``--tracking-uri``,
    ``--runs-dir`` (the pipeline's and the scaling study's command lines)."""
    overrides = [item for group in args.overrides for item in group]
    if args.site:
        overrides.append(f"site.name={args.site}")
    if args.tracking_uri:
        overrides.append(f"tracking.uri={args.tracking_uri}")
    if args.runs_dir:
        overrides.append(f"tracking.runs_dir={args.runs_dir}")
    return overrides


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = cli_overrides(args)
    try:
        cfg = load_config(args.config, overrides)
        if args.dry_run:
            from workflows import sites

            print(describe(plan_stages(cfg, args.only, args.start, args.force), cfg))
            print(sites.dry_run_text(cfg, cfg.runs_dir))
            return 0
        from stages.preflight import preflight
        from workflows import sites

        sites.check_site(cfg)  # e.g. Frontier without site.account: before any run is opened
        try:
            preflight(cfg, args.only, args.start, args.force)  # each stage's cheap input checks
        except ConfigError:
            raise
        except ValueError as error:  # an unusable input (DataError, ...) found before any work
            print(f"input error: {error}", file=sys.stderr)
            return 2
        check_runs_dir(cfg.runs_dir)
        run_pipeline(cfg, args.only, args.start, args.force)
    except KeyboardInterrupt:
        return 130
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except PipelineFailed as error:
        print(f"\npipeline failed:\n{error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
