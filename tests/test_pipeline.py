"""End to end: the micro preset through real Parsl (HTEX), real ranks and MLflow on SQLite.

Every run here evaluates on 2 ranks (eval.ranks=2), so the evaluate stage's ranks app is
exercised through Parsl as well as the training ranks."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stages import tracking
from stages.config import load_config
from stages.registry import STAGE_ORDER
from stages.stage import package_version
from workflows.pipeline import plan_stages

REPO = Path(__file__).resolve().parent.parent
EVAL_RANKS = ("--set", "eval.ranks=2")


def run_cli(runs_dir: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "workflows.pipeline", "--config", "micro", "--runs-dir", str(runs_dir),
           *EVAL_RANKS, *args]
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"pipeline failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def pipeline_runs(runs_dir: Path) -> list:
    uri = tracking.default_tracking_uri(runs_dir)
    return [r for r in tracking.search_runs(uri, "micro") if "mlflow.parentRunId" not in r.data.tags]


def children(runs_dir: Path, parent_id: str) -> dict:
    uri = tracking.default_tracking_uri(runs_dir)
    runs = tracking.search_runs(uri, "micro", f"tags.mlflow.parentRunId = '{parent_id}'")
    return {r.data.tags["stage"]: r for r in runs}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("runs")
    proc = run_cli(runs_dir)
    return runs_dir, proc


def test_first_run_logs_one_parent_and_four_finished_stage_runs(first_run):
    runs_dir, proc = first_run
    parents = pipeline_runs(runs_dir)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    stages = children(runs_dir, parents[0].info.run_id)
    assert sorted(stages) == sorted(STAGE_ORDER)
    for name, run in stages.items():
        assert run.info.status == "FINISHED", name
        assert run.data.tags["reused"] == "false"
        assert run.info.run_name.startswith(f"{name}-")
    uri = tracking.default_tracking_uri(runs_dir)
    losses = tracking.metric_history(uri, stages["train"].info.run_id, "loss")
    assert sorted(step for step, _ in losses) == list(range(1, 7))
    evaluate = stages["evaluate"].data.metrics
    assert evaluate["val_loss"] > 0
    assert evaluate["eval_ranks"] == 2 and stages["evaluate"].data.params["eval.ranks"] == "2"
    assert evaluate["perplexity"] == pytest.approx(pytest.importorskip("math").exp(evaluate["val_loss"]), rel=1e-4)
    assert stages["tokenize"].data.metrics["tokens"] > 0
    # The resolved config is an artifact of the parent and of every stage run.
    client_dir = Path(parents[0].info.artifact_uri.replace("file://", ""))
    assert (client_dir / "config.yaml").exists()
    report = json.loads((Path(json.loads((runs_dir / "stages" / "evaluate").glob("*/outputs.json").__next__().read_text())["report"])).read_text())
    assert report["perplexity"] == pytest.approx(evaluate["perplexity"], rel=1e-6)
    assert report["eval_ranks"] == 2 and len(report["windows_per_rank"]) == 2
    assert sum(report["windows_per_rank"]) == report["windows"]
    # The ranks' output reached the driver's log tail.
    assert "[evaluate-ranks] [eval] val_loss" in proc.stdout
    assert "MLflow store: sqlite:///" in proc.stdout and "mlflow ui --backend-store-uri" in proc.stdout


def test_second_run_reuses_every_stage(first_run):
    runs_dir, _ = first_run
    before = {p: p.stat().st_mtime_ns for p in (runs_dir / "stages").glob("*/*/status.json")}
    proc = run_cli(runs_dir)
    assert proc.stdout.count(" reused ") == 4, proc.stdout
    after = {p: p.stat().st_mtime_ns for p in (runs_dir / "stages").glob("*/*/status.json")}
    assert after == before  # nothing recomputed, nothing rewritten
    newest = pipeline_runs(runs_dir)[0]
    stages = children(runs_dir, newest.info.run_id)
    assert all(run.data.tags["reused"] == "true" for run in stages.values())
    assert all(run.info.status == "FINISHED" for run in stages.values())
    assert "val_loss" in stages["evaluate"].data.metrics


def test_only_evaluate_recomputes_only_evaluate(first_run):
    runs_dir, _ = first_run
    status = {p.parent.parent.name: json.loads(p.read_text())["run_id"] for p in (runs_dir / "stages").glob("*/*/status.json")}
    run_cli(runs_dir, "--only", "evaluate")
    after = {p.parent.parent.name: json.loads(p.read_text())["run_id"] for p in (runs_dir / "stages").glob("*/*/status.json")}
    assert after["evaluate"] != status["evaluate"]
    assert {k: v for k, v in after.items() if k != "evaluate"} == {k: v for k, v in status.items() if k != "evaluate"}
    stages = children(runs_dir, pipeline_runs(runs_dir)[0].info.run_id)
    assert stages["evaluate"].data.tags["reused"] == "false"
    assert all(stages[n].data.tags["reused"] == "true" for n in ("tokenize", "plan", "train"))


def test_dry_run_prints_keys_and_runs_nothing(first_run):
    runs_dir, _ = first_run
    count = len(pipeline_runs(runs_dir))
    proc = run_cli(runs_dir, "--dry-run", "--set", "eval.max_tokens=1024")
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if " key " in line}
    assert "reuse" in lines["train"] and " run " in lines["evaluate"] + " "
    assert lines["evaluate"].endswith("on 2 ranks")
    assert "--nproc-per-node 2 -m stages.eval_worker" in proc.stdout  # the evaluate launch
    assert len(pipeline_runs(runs_dir)) == count


def test_force_only_and_from_choose_actions(tmp_path):
    cfg = load_config("micro", [f"tracking.runs_dir={tmp_path}"])
    version = package_version()
    actions = [p.action for p in plan_stages(cfg, None, None, False, version)]
    assert actions == ["run"] * 4
    assert [p.action for p in plan_stages(cfg, None, None, True, version)] == ["force"] * 4
    with pytest.raises(ValueError, match="run the pipeline without --only first"):
        plan_stages(cfg, "evaluate", None, False, version)


def test_config_error_stops_before_any_work(tmp_path):
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-m", "workflows.pipeline", "--runs-dir", str(tmp_path), "--set", "train.stepz=3"],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown key 'train.stepz'" in proc.stderr
    assert not any(tmp_path.iterdir())
