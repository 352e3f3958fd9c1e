"""Shared fixtures of the evaluation tests: a real micro pipeline built with the stage mechanism."""
from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from stages.config import PipelineConfig, load_config
from stages.mechanism import tracking, tracking_store
from stages.mechanism.attempt import PipelineContext
from stages.mechanism.outputs import OUTPUTS_FILE
from stages.mechanism.walk import run_stage
from stages.registry import PIPELINE, STAGE_ORDER, declaration, upstream

REPO = Path(__file__).resolve().parent.parent


def micro_config(runs_dir: Path, *overrides: str) -> PipelineConfig:
    """The micro preset writing into ``runs_dir``."""
    return load_config("micro", [f"tracking.runs_dir={runs_dir}", *overrides])


def open_pipeline(cfg: PipelineConfig, name: str = "pipeline") -> PipelineContext:
    """An MLflow experiment and parent run in cfg's runs dir, as the driver opens them."""
    uri = tracking_store.default_tracking_uri(cfg.runs_dir)
    experiment = tracking.ensure_experiment(uri, cfg.name, cfg.runs_dir)
    parent = tracking.start_run(uri, experiment, name)
    return PipelineContext(str(cfg.runs_dir), uri, experiment, parent, pipeline=PIPELINE)


def run_stages(cfg: PipelineConfig, ctx: PipelineContext,
               names: tuple[str, ...] = STAGE_ORDER, done: dict | None = None) -> dict:
    """Run (or reuse) stages in order through stages.mechanism.walk.run_stage, each after its
    upstream stages (run first when neither ``done`` nor ``names`` has them); name ->
    StageResult."""
    results = dict(done or {})

    def run(name: str) -> None:
        for up in upstream(name):
            if up not in results:
                run(up)
        results[name] = run_stage(ctx, declaration(name), cfg, {u: results[u]
                                                                 for u in upstream(name)})

    for name in names:
        run(name)
    return results


@pytest.fixture(scope="session")
def micro_pipeline(tmp_path_factory, seed_microbench: Callable[[Path], Path],
                   seed_store: Callable[[Path], str]):
    """tokenize -> plan -> train -> evaluate of the micro preset, once per test session.

    The evaluation also runs the local lm-eval task (if lm-eval is installed) and logs the
    export as an MLflow model (off in the preset)."""
    runs_dir = tmp_path_factory.mktemp("eval-pipeline")
    seed_microbench(runs_dir)
    seed_store(runs_dir)
    tasks = "[heldout_perplexity]" if importlib.util.find_spec("lm_eval") else "[]"
    cfg = micro_config(runs_dir, f"eval.tasks={tasks}", "eval.task_limit=6",
                       "eval.log_model=true")
    ctx = open_pipeline(cfg)
    results = run_stages(cfg, ctx)
    tracking.end_run(ctx.tracking_uri, ctx.parent_run_id)
    return cfg, ctx, results


@dataclass
class StageRun:
    """A stage as the pipeline driver recorded it: its MLflow run, key and outputs."""

    run_id: str
    key: str
    out_dir: str
    outputs: dict


def driver_records(runs_dir: Path, parent_run_id: str) -> tuple:
    """What one run of the pipeline CLI recorded: (ctx, {stage: StageRun}).

    ``ctx`` is the PipelineContext the driver used for its pipeline run ``parent_run_id``,
    rebuilt from the MLflow store; each StageRun is a stage run under it, with the outputs
    its directory holds now (read them before a later run rewrites that directory)."""
    uri = tracking_store.default_tracking_uri(runs_dir)
    parent = tracking.get_run(uri, parent_run_id)
    stages = {}
    for run in tracking.search_runs(uri, "micro", f"tags.mlflow.parentRunId = '{parent_run_id}'"):
        out_dir = run.data.tags["out_dir"]
        outputs = json.loads((Path(out_dir) / OUTPUTS_FILE).read_text())
        stages[run.data.tags["stage"]] = StageRun(run.info.run_id, run.data.tags["stage_key"],
                                                  out_dir, outputs)
    ctx = PipelineContext(str(runs_dir), uri, parent.info.experiment_id, parent_run_id,
                          pipeline=PIPELINE)
    return ctx, stages
