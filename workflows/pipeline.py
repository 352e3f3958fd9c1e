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

from stages.config import ConfigError, PipelineConfig, load_config
from stages.mechanism import keys, tracking_store
from stages.mechanism.outputs import StageResult
from stages.mechanism.selection import StageDecision, decide_stages
from stages.registry import PIPELINE, STAGE_ORDER, declaration, upstream
from workflows.session import (
    INTERRUPTED_EXIT,
    PipelineFailed,
    PipelineSession,
    check_runs_dir,
    exit_driver,
)


def describe(plans: list[StageDecision], cfg: PipelineConfig,
             triggers: tuple[str, ...] = keys.TRIGGERS) -> str:
    """The DAG with keys and actions, as printed by --dry-run (a key still to be decided,
    because it hashes an upstream's output that is not made yet, shows as "pending")."""
    lines = [f"pipeline '{cfg.name}' on site '{cfg.site.name}', runs in {cfg.runs_dir}", "DAG:"]
    if set(triggers) != set(keys.TRIGGERS):
        lines.insert(1, f"rerun triggers: {','.join(triggers)} (outputs made with other "
                        f"{', '.join(t for t in keys.TRIGGERS if t not in triggers)} are kept)")
    for p in plans:
        after = ", ".join(upstream(p.name)) or "-"
        note = declaration(p.name).shape(cfg).note
        extra = f" {note}" if note else ""
        key = p.key or "pending".ljust(16)
        lines.append(f"  {p.name:<9} key {key}  {p.action:<6} (after: {after}){extra}")
        if p.reason:
            lines.append(f"  {'':<9} why: {p.reason}")
    return "\n".join(lines)


def run_pipeline(
    cfg: PipelineConfig,
    only: str | None = None,
    start: str | None = None,
    force: bool = False,
    triggers: tuple[str, ...] = keys.TRIGGERS,
    decided: tuple[dict[str, str], list[StageDecision]] | None = None,
) -> dict[str, StageResult]:
    """Run the pipeline with Parsl and MLflow; return each stage's result. ``decided``: the
    code hashes and the decisions the caller already made (else made here, once)."""
    runs_dir = cfg.runs_dir
    uri = tracking_store.default_tracking_uri(runs_dir, cfg.tracking.uri)
    tracking_store.check_store(uri)  # first: an unusable store is one line, before any work
    code, plans = decided or decide(cfg, only, start, force, triggers)
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create the runs dir {runs_dir} ({error}); pass a writable "
                          "--runs-dir") from None
    tags = {"site": cfg.site.name, "only": only or "", "from": start or "", "force": str(force),
            "rerun_triggers": ",".join(triggers)}
    with PipelineSession(cfg, parent_run_name(cfg, only, start, force), tags) as session:
        session.parent.log_params(cfg.to_dict())
        session.parent.log_dict(cfg.to_dict(), "config.yaml")
        session.parent.set_tags({f"stage.{p.name}": p.action for p in plans})
        print(describe(plans, cfg, triggers), flush=True)
        session.start_parsl(cfg, [p.name for p in plans if p.action in ("run", "force")])
        results = session.run_stages(cfg, plans, session.context(code, triggers=triggers),
                                     session.log_root)
        session.parent.log_metrics(headline_metrics(cfg, results))
        session.parent.flush()
    for name, result in results.items():
        how = "reused" if result.reused else "ran"
        print(f"{name:<9} {how:<6} {result.out_dir}", flush=True)
    ui = tracking_store.ui_command(uri, runs_dir)
    print(f"\nMLflow store: {uri}\nOpen the UI:  {ui}", flush=True)
    return results


def parent_run_name(cfg: PipelineConfig, only: str | None, start: str | None,
                    force: bool) -> str:
    """The parent run's name before its id: ``<config name>-<what it does>``, where what
    it does is ``run`` (every stage, reusing what it can), ``only-<stage>`` or
    ``from-<stage>``, with ``-force`` when it recomputes every selected stage: ``tiny-run``,
    ``tiny-only-evaluate``, ``tiny-from-train-force``. The session adds the run id's first 8
    characters (``tiny-run-1a2b3c4d``)."""
    does = f"only-{only}" if only else f"from-{start}" if start else "run"
    return f"{cfg.name}-{does}" + ("-force" if force else "")


def headline_metrics(cfg: PipelineConfig, results: dict[str, StageResult]) -> dict[str, float]:
    """What the pipeline's model came to, for its parent run, from the stage results (run
    or reused): ``val_loss`` (evaluate), ``train_loss`` (the last step's), ``tokens_trained``
    (steps x global batch x seq_len), ``mfu_median`` and ``tokens_per_s_median`` (the
    training's median step: its outputs' ``mfu`` and ``tokens_per_s``). Stages this run did
    not select give nothing."""
    train = results["train"].outputs if "train" in results else {}
    evaluate = results["evaluate"].outputs if "evaluate" in results else {}
    tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
    found = {"val_loss": evaluate.get("val_loss"), "train_loss": train.get("final_loss"),
             "tokens_trained": (train["steps_done"] * tokens_per_step
                                if train.get("steps_done") is not None else None),
             "mfu_median": train.get("mfu"), "tokens_per_s_median": train.get("tokens_per_s")}
    return {k: float(v) for k, v in found.items() if isinstance(v, (int, float))}


def decide(cfg: PipelineConfig, only: str | None, start: str | None, force: bool,
           triggers: tuple[str, ...]) -> tuple[dict[str, str], list[StageDecision]]:
    """The code hashes and the stage decisions, made once per invocation."""
    code = keys.code_hashes(PIPELINE)
    return code, decide_stages(PIPELINE, cfg, only, start, force, code, triggers)


def parse_triggers(text: str) -> tuple[str, ...]:
    """``--rerun-triggers config,input,...`` as a tuple; argparse's error for an unknown one."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in keys.TRIGGERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown rerun trigger(s) {unknown or [text]}: choose from {','.join(keys.TRIGGERS)}")
    return names


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
    parser.add_argument(
        "--rerun-triggers", type=parse_triggers, default=keys.TRIGGERS, metavar="T[,T...]",
        help="what makes a stage rerun: any of config,input,code,software (default: all); "
             "e.g. config,input keeps outputs made by other code or software (docs/reruns.md)")
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
        triggers = args.rerun_triggers
        decided = decide(cfg, args.only, args.start, args.force, triggers)
        if args.dry_run:
            from workflows.dry_run import dry_run_text

            print(describe(decided[1], cfg, triggers))
            print(dry_run_text(cfg, cfg.runs_dir))
            if cfg.site.name == "local":
                return 0
            from workflows.readiness import readiness, readiness_text

            rows = readiness(cfg, decided[1])
            print(readiness_text(rows))
            return 2 if any(r.verdict == "error" for r in rows) else 0
        from stages.mechanism.preflight import preflight
        from workflows.frontier import check_site

        # e.g. Frontier without site.account, or no Slurm here: before any run is opened
        check_site(cfg, controller=True)
        try:
            preflight(PIPELINE, cfg, decided[1])  # each stage's cheap input checks
        except ConfigError:
            raise
        except ValueError as error:  # an unusable input (DataError, ...) found before any work
            print(f"input error: {error}", file=sys.stderr)
            return 2
        check_runs_dir(cfg.runs_dir)
        run_pipeline(cfg, args.only, args.start, args.force, triggers, decided)
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
