"""The pipeline driver: ``python -m workflows.pipeline [--config ...] [--only|--from STAGE]``.

It resolves the configuration, decides per stage whether to run, reuse or force it, opens
one MLflow parent run, loads the site's Parsl config and chains the stage apps:

    tokenize -> plan -> train -> evaluate, each submitted by its declared shape
    (stages.mechanism.shape.StageShape): one app; prepare -> one app per part -> finalize; or
    prepare -> the ranks app -> finalize.

``--only STAGE`` recomputes that stage alone and ``--from STAGE`` recomputes it and every
stage after it; the stages before must already have succeeded with the current config.
"""
from __future__ import annotations

import argparse
import sys

from stages.mechanism import keys, tracking
from stages.mechanism.config import ConfigError, PipelineConfig, load_config
from stages.mechanism.outputs import StageResult
from stages.mechanism.registry import STAGE_ORDER, declaration, upstream
from stages.mechanism.selection import StageDecision, decide_stages
from workflows.session import (
    INTERRUPTED_EXIT,
    PipelineFailed,
    PipelineSession,
    check_runs_dir,
    exit_driver,
)


def describe(plans: list[StageDecision], cfg: PipelineConfig) -> str:
    """The DAG with keys and actions, as printed by --dry-run."""
    lines = [f"pipeline '{cfg.name}' on site '{cfg.site.name}', runs in {cfg.runs_dir}", "DAG:"]
    for p in plans:
        after = ", ".join(upstream(p.name)) or "-"
        note = declaration(p.name).shape(cfg).note
        extra = f" {note}" if note else ""
        lines.append(f"  {p.name:<9} key {p.key}  {p.action:<6} (after: {after}){extra}")
        if p.reason:
            lines.append(f"  {'':<9} why: {p.reason}")
    return "\n".join(lines)


def run_pipeline(
    cfg: PipelineConfig,
    only: str | None = None,
    start: str | None = None,
    force: bool = False,
) -> dict[str, StageResult]:
    """Run the pipeline with Parsl and MLflow; return each stage's result."""
    runs_dir = cfg.runs_dir
    uri = tracking.default_tracking_uri(runs_dir, cfg.tracking.uri)
    tracking.check_store(uri)  # first: an unusable store is one line, before any work
    code = keys.code_hashes()
    plans = decide_stages(cfg, only, start, force, code)
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create the runs dir {runs_dir} ({error}); pass a writable "
                          "--runs-dir") from None
    tags = {"site": cfg.site.name, "only": only or "", "from": start or "", "force": str(force)}
    with PipelineSession(cfg, "pipeline", tags) as session:
        session.parent.log_params(cfg.to_dict())
        session.parent.log_dict(cfg.to_dict(), "config.yaml")
        session.parent.set_tags({f"stage.{p.name}": p.action for p in plans})
        print(describe(plans, cfg), flush=True)
        session.start_parsl(cfg, [p.name for p in plans if p.action in ("run", "force")])
        results = session.run_stages(cfg, plans, session.context(code), session.log_root)
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
                        help="print the DAG and keys, run nothing; on a Slurm site also the "
                             "batch scripts and the readiness report (exit 2 on its errors)")
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
            from workflows.dry_run import dry_run_text

            print(describe(decide_stages(cfg, args.only, args.start, args.force), cfg))
            print(dry_run_text(cfg, cfg.runs_dir))
            if cfg.site.name == "local":
                return 0
            from workflows.readiness import readiness, readiness_text

            rows = readiness(cfg)
            print(readiness_text(rows))
            return 2 if any(r.verdict == "error" for r in rows) else 0
        from stages.mechanism.preflight import preflight
        from workflows.frontier import check_site

        check_site(cfg)  # e.g. Frontier without site.account: before any run is opened
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
        return INTERRUPTED_EXIT
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except PipelineFailed as error:
        print(f"\npipeline failed:\n{error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_driver(main())
