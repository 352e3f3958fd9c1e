"""Shared fixtures of the evaluation tests: a real micro pipeline built with the stage mechanism."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from stages import stage, tracking
from stages.config import PipelineConfig, load_config
from stages.registry import STAGE_ORDER, stage_module, upstream

REPO = Path(__file__).resolve().parent.parent


def micro_config(runs_dir: Path, *overrides: str) -> PipelineConfig:
    """The micro preset writing into ``runs_dir``."""
    return load_config("micro", [f"tracking.runs_dir={runs_dir}", *overrides])


def open_pipeline(cfg: PipelineConfig, name: str = "pipeline") -> stage.PipelineContext:
    """An MLflow experiment and parent run in cfg's runs dir, as the driver opens them."""
    uri = tracking.default_tracking_uri(cfg.runs_dir)
    experiment = tracking.ensure_experiment(uri, cfg.name, cfg.runs_dir)
    parent = tracking.start_run(uri, experiment, name)
    return stage.PipelineContext(str(cfg.runs_dir), uri, experiment, parent)


def run_stages(cfg: PipelineConfig, ctx: stage.PipelineContext,
               names: tuple[str, ...] = STAGE_ORDER, done: dict | None = None) -> dict:
    """Run (or reuse) stages in order through stages.stage.run_stage; name -> StageResult."""
    results = dict(done or {})
    for name in names:
        inputs = {u: results[u] for u in upstream(name)}
        results[name] = stage.run_stage(ctx, stage_module(name), cfg, inputs)
    return results


@pytest.fixture(scope="session")
def micro_pipeline(tmp_path_factory, seed_microbench: Callable[[Path], Path]):
    """tokenize -> plan -> train -> evaluate of the micro preset, once per test session.

    The evaluation also runs the local lm-eval task (if lm-eval is installed)."""
    runs_dir = tmp_path_factory.mktemp("eval-pipeline")
    seed_microbench(runs_dir)
    tasks = "[heldout_perplexity]" if importlib.util.find_spec("lm_eval") else "[]"
    cfg = micro_config(runs_dir, f"eval.tasks={tasks}", "eval.task_limit=6")
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


def run_driver(runs_dir: Path, *overrides: str, timeout: int = 1200) -> tuple:
    """Run the real pipeline CLI (micro preset) once; return (ctx, {stage: StageRun}).

    ``ctx`` is the PipelineContext the driver used, rebuilt from the MLflow store. Seed the
    runs dir with the session's microbenchmark first (the ``seed_microbench`` fixture) so the
    plan stage does not measure this machine again."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    cmd = [sys.executable, "-m", "workflows.pipeline", "--config", "micro",
           "--runs-dir", str(runs_dir)] + (["--set", *overrides] if overrides else [])
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"pipeline failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    uri = tracking.default_tracking_uri(runs_dir)
    runs = tracking.search_runs(uri, "micro")
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    stages = {}
    for run in runs:
        if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id:
            out_dir = run.data.tags["out_dir"]
            outputs = json.loads((Path(out_dir) / stage.OUTPUTS_FILE).read_text())
            stages[run.data.tags["stage"]] = StageRun(run.info.run_id, run.data.tags["stage_key"],
                                                      out_dir, outputs)
    ctx = stage.PipelineContext(str(runs_dir), uri, parent.info.experiment_id, parent.info.run_id)
    return ctx, stages
