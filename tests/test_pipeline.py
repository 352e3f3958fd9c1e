"""End to end: the micro preset through real Parsl (HTEX), real ranks and MLflow on SQLite.

One runs dir is taken through a user's session by the session fixture
``micro_cli_history`` (``tests/micro_cli.py``): a first run, the same command again,
``--only evaluate``, then ``--dry-run`` with a changed evaluation config. Each step's state
(its MLflow parent run, every status.json, stdout) is recorded when the step ends, so the
tests read records and do not depend on each other's order. Every run evaluates on 2 ranks
(eval.ranks=2), so the evaluate stage's ranks app is exercised through Parsl as well as the
training ranks. ``test_mlflow_ui.py`` reads the same session's store.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from stages.config import ConfigError, load_config
from stages.mechanism import keys, tracking, tracking_store
from stages.registry import PIPELINE, STAGE_ORDER
from tests.conftest import Console
from tests.micro_cli import SESSION_OVERRIDES, History, children
from workflows.pipeline import decide_stages

MICRO_STEPS = 6  # train.steps of configs/micro.yaml


@pytest.fixture
def history(micro_cli_history: History) -> History:
    """The session's recorded user session with the CLI (read only)."""
    return micro_cli_history


@pytest.mark.slow
def test_first_run_logs_one_parent_and_four_finished_stage_runs(history: History) -> None:
    runs_dir, first = history.runs_dir, history.first
    uri = tracking_store.default_tracking_uri(runs_dir)
    assert tracking.get_run(uri, first.parent).info.status == "FINISHED"
    stages = children(runs_dir, first.parent)
    assert sorted(stages) == sorted(STAGE_ORDER)
    for name, run in stages.items():
        assert run.info.status == "FINISHED", name
        assert run.data.tags["reused"] == "false"
        assert run.info.run_name == f"{name}-{first.stages[name][0][:8]}"
        assert first.stages[name][1]["state"] == "succeeded"
        assert first.stages[name][1]["run_id"] == run.info.run_id
    losses = tracking.metric_history(uri, stages["train"].info.run_id, "loss")
    assert sorted(step for step, _ in losses) == list(range(1, MICRO_STEPS + 1))
    assert all(math.isfinite(loss) and loss > 0 for _, loss in losses)
    evaluate = stages["evaluate"].data.metrics
    assert evaluate["eval_ranks"] == 2 and stages["evaluate"].data.params["eval.ranks"] == "2"
    assert evaluate["perplexity"] == pytest.approx(math.exp(evaluate["val_loss"]), rel=1e-4)
    assert stages["tokenize"].data.metrics["tokens"] > 0
    # The resolved config is an artifact of the parent run, and it loads back as the same one.
    parent = tracking.get_run(uri, first.parent)
    config_yaml = Path(parent.info.artifact_uri.replace("file://", "")) / "config.yaml"
    assert load_config(config_yaml) == load_config("micro", [f"tracking.runs_dir={runs_dir}",
                                                             *SESSION_OVERRIDES])
    # The report on disk is what the evaluate run logged, split over both ranks.
    report = history.report
    assert report["perplexity"] == pytest.approx(evaluate["perplexity"], rel=1e-6)
    assert report["eval_ranks"] == 2 and len(report["windows_per_rank"]) == 2
    assert sum(report["windows_per_rank"]) == report["windows"]
    # The ranks' output reached the driver's log tail; the store and the UI command are named.
    out = first.proc.stdout
    assert "[evaluate-ranks] [eval] val_loss" in out
    assert f"sqlite:///{runs_dir.resolve()}/mlflow.db" in out and "mlflow ui" in out


@pytest.mark.slow
def test_second_run_reuses_every_stage(history: History) -> None:
    runs_dir, first, rerun = history.runs_dir, history.first, history.rerun
    assert rerun.proc.stdout.count(" reused ") == len(STAGE_ORDER), rerun.proc.stdout
    assert rerun.stages == first.stages  # nothing recomputed, no status rewritten
    made = children(runs_dir, first.parent)
    stages = children(runs_dir, rerun.parent)
    assert sorted(stages) == sorted(STAGE_ORDER)
    for name, run in stages.items():
        assert run.info.status == "FINISHED" and run.data.tags["reused"] == "true", name
        assert run.data.tags["producer_run_id"] == made[name].info.run_id, name
    # A reused stage's run still carries the figures of the run that made its output.
    assert stages["evaluate"].data.metrics["val_loss"] == pytest.approx(
        made["evaluate"].data.metrics["val_loss"])


@pytest.mark.slow
def test_only_evaluate_recomputes_only_evaluate(history: History) -> None:
    runs_dir, before, after = history.runs_dir, history.rerun, history.only_evaluate
    assert after.stages["evaluate"][0] == before.stages["evaluate"][0]  # same key, same dir
    assert after.stages["evaluate"][1]["run_id"] != before.stages["evaluate"][1]["run_id"]
    assert {n: s for n, s in after.stages.items() if n != "evaluate"} == {
        n: s for n, s in before.stages.items() if n != "evaluate"}
    stages = children(runs_dir, after.parent)
    assert stages["evaluate"].data.tags["reused"] == "false"
    assert all(stages[n].data.tags["reused"] == "true" for n in ("tokenize", "plan", "train"))
    # Evaluating the same checkpoint again gives the same numbers.
    first = children(runs_dir, history.first.parent)["evaluate"].data.metrics
    assert stages["evaluate"].data.metrics["val_loss"] == pytest.approx(first["val_loss"],
                                                                         rel=1e-6)


@pytest.mark.slow
def test_dry_run_prints_keys_and_runs_nothing(history: History) -> None:
    dry, before = history.dry_run, history.only_evaluate
    assert dry.new_parents == set() and dry.stages == before.stages
    rows = [line.split() for line in dry.proc.stdout.splitlines()]
    lines = {row[0]: " ".join(row) for row in rows if len(row) > 2 and row[1] == "key"}
    assert set(lines) == set(STAGE_ORDER)
    for name in ("tokenize", "plan", "train"):  # unchanged: the keys of their directories
        assert f"key {before.stages[name][0]}" in lines[name] and " reuse " in lines[name]
    # eval.max_tokens changed: a new evaluate key, to be run on 2 ranks.
    assert before.stages["evaluate"][0] not in lines["evaluate"]
    assert " run " in lines["evaluate"] and lines["evaluate"].endswith("on 2 ranks")
    # How the evaluate ranks would be launched: 2 processes on this machine.
    assert re.search(r"evaluate runs 2 ranks on this machine", dry.proc.stdout), dry.proc.stdout


@pytest.mark.slow
def test_selection_decides_run_reuse_and_force_per_stage(history: History, tmp_path) -> None:
    cfg = load_config("micro", [f"tracking.runs_dir={history.runs_dir}", *SESSION_OVERRIDES])
    code = keys.code_hashes(PIPELINE)

    def actions(only=None, start=None, force=False) -> list[str]:
        return [p.action for p in decide_stages(PIPELINE, cfg, only, start, force, code)]

    assert actions() == ["reuse"] * 5
    assert actions(force=True) == ["force"] * 5
    assert actions(only="evaluate") == ["reuse", "reuse", "reuse", "reuse", "force"]
    assert actions(start="train") == ["reuse", "reuse", "reuse", "force", "force"]
    assert [p.key for p in decide_stages(PIPELINE, cfg, None, None, False, code)] == [
        history.only_evaluate.stages[n][0] for n in STAGE_ORDER]
    # An empty runs dir: everything runs, and a selection that needs upstream output is refused.
    empty = load_config("micro", [f"tracking.runs_dir={tmp_path}", *SESSION_OVERRIDES])
    fresh = decide_stages(PIPELINE, empty, None, None, False, code)
    assert [p.action for p in fresh] == ["run"] * 5
    with pytest.raises(ConfigError, match="--only evaluate needs the 'curate' stage's output"):
        decide_stages(PIPELINE, empty, "evaluate", None, False, code)
    with pytest.raises(ConfigError, match="--from train needs the 'curate' stage's output"):
        decide_stages(PIPELINE, empty, None, "train", False, code)


def test_config_error_stops_before_any_work(tmp_path: Path,
                                            pipeline_main: Callable[..., Console]) -> None:
    proc = pipeline_main("--runs-dir", str(tmp_path), "--set", "train.stepz=3")
    assert proc.returncode == 2
    assert "unknown key 'train.stepz'" in proc.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_published_outputs_name_only_published_paths(history: History) -> None:
    """Work happens in <key>.partial, renamed when done: no published stage's outputs.json
    still names a path in the work directory (the loss curve, the summary, checkpoints),
    and every path it names under the runs dir exists."""
    runs_dir = history.runs_dir
    named = []
    for outputs_file in (runs_dir / "stages").glob("*/*/outputs.json"):
        if outputs_file.parent.name.endswith(".partial"):
            continue
        text = outputs_file.read_text()
        assert ".partial" not in text, (outputs_file, text)
        named += [Path(p) for p in re.findall(rf'"({re.escape(str(runs_dir))}[^"]*)"', text)]
    assert any(p.name == "loss_curve.png" for p in named), named
    assert all(p.exists() for p in named), [p for p in named if not p.exists()]
