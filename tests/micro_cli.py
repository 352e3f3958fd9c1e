"""A user's session with the pipeline's command line: the micro preset on one runs dir.

``user_session`` takes a fresh runs dir through a first run, the same command again,
``--only evaluate``, then ``--dry-run`` with a changed evaluation config, each a real
``python -m workflows.pipeline --config micro`` (Parsl's HTEX, the local launcher's gloo
ranks, MLflow on SQLite). Each step's state (the pipeline runs it opened, every status.json,
its console) is recorded when the step ends, so tests read records and do not depend on each other's
order. Every run evaluates on 2 ranks (eval.ranks=2), so the evaluate stage's ranks app is
exercised through Parsl as well as the training ranks, and logs the export as an MLflow
model (eval.log_model=true, off in the preset), which the UI test looks for.

The session runs once per test session (``conftest.micro_cli_history``); the tests of
``test_pipeline.py`` and ``test_mlflow_ui.py`` only read it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from stages.mechanism import tracking, tracking_store
from stages.mechanism.attempt import PipelineContext
from stages.mechanism.outputs import OUTPUTS_FILE, stage_dir
from tests import warm_cli
from tests.evalkit import StageRun, driver_records

REPO = Path(__file__).resolve().parent.parent
SESSION_OVERRIDES = ("eval.ranks=2", "eval.log_model=true")  # every step's --set


def run_cli(runs_dir: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m workflows.pipeline --config micro`` on ``runs_dir``; it must succeed."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    argv = ["--config", "micro", "--runs-dir", str(runs_dir), "--set", *SESSION_OVERRIDES, *args]
    proc = warm_cli.run("workflows.pipeline", argv, cwd=REPO, env=env, timeout=timeout,
                        forked_launches=True)
    assert proc.returncode == 0, (f"pipeline failed ({proc.returncode}):\n{proc.stdout[-4000:]}"
                                  f"\n{proc.stderr[-4000:]}")
    return proc


def parent_ids(runs_dir: Path) -> set[str]:
    """The ids of every pipeline (parent) run in the runs dir's store."""
    runs = tracking.search_runs(tracking_store.default_tracking_uri(runs_dir), "micro")
    return {r.info.run_id for r in runs if "mlflow.parentRunId" not in r.data.tags}


def children(runs_dir: Path, parent_id: str) -> dict:
    """Stage name -> the stage run nested under ``parent_id``."""
    uri = tracking_store.default_tracking_uri(runs_dir)
    runs = tracking.search_runs(uri, "micro", f"tags.mlflow.parentRunId = '{parent_id}'")
    return {r.data.tags["stage"]: r for r in runs}


def published(runs_dir: Path) -> dict[str, tuple[str, dict, int]]:
    """Stage name -> (key, status.json, its mtime) of every published stage directory."""
    found = {}
    for path in (runs_dir / "stages").glob("*/*/status.json"):
        if not path.parent.name.endswith(".partial"):
            found[path.parent.parent.name] = (path.parent.name, json.loads(path.read_text()),
                                              path.stat().st_mtime_ns)
    return found


@dataclass
class Step:
    """One CLI invocation and the state it left."""

    proc: subprocess.CompletedProcess
    new_parents: set[str]  # pipeline runs this invocation opened
    stages: dict[str, tuple[str, dict, int]]  # published(runs_dir) right after it

    @property
    def parent(self) -> str:
        (parent,) = self.new_parents
        return parent


@dataclass
class History:
    """The session's steps, in order, on one runs dir."""

    runs_dir: Path
    first: Step
    report: dict  # the first run's evaluation report.json
    first_records: tuple[PipelineContext, dict[str, StageRun]]  # the first run's, read after it
    rerun: Step
    only_evaluate: Step
    dry_run: Step


def user_session(runs_dir: Path) -> History:
    """Take ``runs_dir`` (new; microbenchmark and store seeded) through first run -> same
    run -> --only evaluate -> --dry-run; return what each step left."""

    def step(*args: str) -> Step:
        before = parent_ids(runs_dir)
        proc = run_cli(runs_dir, *args)
        return Step(proc, parent_ids(runs_dir) - before, published(runs_dir))

    first = step()
    key = first.stages["evaluate"][0]
    outputs = json.loads((stage_dir(runs_dir, "evaluate", key) / OUTPUTS_FILE).read_text())
    report = json.loads(Path(outputs["report"]).read_text())
    first_records = driver_records(runs_dir, first.parent)
    rerun = step()
    only_evaluate = step("--only", "evaluate")
    dry_run = step("--dry-run", "--set", "eval.max_tokens=1024")
    return History(runs_dir, first, report, first_records, rerun, only_evaluate, dry_run)
