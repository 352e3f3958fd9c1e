"""Shared fixtures of the evaluation tests: a real micro pipeline built with the stage mechanism."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from stages import stage, tracking
from stages.config import PipelineConfig, load_config
from stages.registry import STAGE_ORDER, UPSTREAM, stage_module

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
        inputs = {u: results[u] for u in UPSTREAM[name]}
        results[name] = stage.run_stage(ctx, stage_module(name), cfg, inputs)
    return results


@pytest.fixture(scope="session")
def micro_pipeline(tmp_path_factory):
    """tokenize -> plan -> train -> evaluate of the micro preset, once per test session.

    The evaluation also runs the local lm-eval task (if lm-eval is installed)."""
    runs_dir = tmp_path_factory.mktemp("eval-pipeline")
    os.environ.setdefault("HF_HOME", str(runs_dir / "hf_home"))
    tasks = "[heldout_perplexity]" if importlib.util.find_spec("lm_eval") else "[]"
    cfg = micro_config(runs_dir, f"eval.tasks={tasks}", "eval.task_limit=6")
    ctx = open_pipeline(cfg)
    results = run_stages(cfg, ctx)
    tracking.end_run(ctx.tracking_uri, ctx.parent_run_id)
    return cfg, ctx, results
