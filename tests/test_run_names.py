"""Pipeline (parent) runs can be told apart in MLflow's run list: each is named
``<config>-<what it does>-<its id's first 8 characters>`` and, once its stages are done, carries
the headline figures of the model it stands for (validation loss, tokens trained, MFU)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from stages.config import load_config
from stages.mechanism import tracking, tracking_store
from stages.mechanism.outputs import StageResult
from tests.micro_cli import History
from workflows.pipeline import headline_metrics, parent_run_name
from workflows.session import PipelineSession


def test_the_name_says_config_and_selection() -> None:
    cfg = load_config("micro", [])
    assert parent_run_name(cfg, None, None, False) == "micro-run"
    assert parent_run_name(cfg, "evaluate", None, False) == "micro-only-evaluate"
    assert parent_run_name(cfg, None, "train", True) == "micro-from-train-force"


def test_two_sessions_get_two_names_with_their_run_ids(
        tmp_path: Path, seed_store: Callable[[Path], str]) -> None:
    runs_dir = tmp_path / "runs"
    seed_store(runs_dir)
    cfg = load_config("micro", [f"tracking.runs_dir={runs_dir}"])
    ids = []
    for _ in range(2):
        with PipelineSession(cfg, parent_run_name(cfg, None, None, False), {}) as session:
            ids.append(session.parent_id)
    uri = tracking_store.default_tracking_uri(runs_dir)
    names = {tracking.get_run(uri, i).info.run_name for i in ids}
    assert names == {f"micro-run-{i[:8]}" for i in ids} and len(names) == 2


def _result(name: str, outputs: dict) -> StageResult:
    return StageResult(name, "k", "/nowhere", outputs, "r", "r", False)


def test_headline_metrics_come_from_the_stage_results() -> None:
    cfg = load_config("micro", [])  # 4 sequences x 64 tokens a step
    results = {"train": _result("train", {"steps_done": 6, "final_loss": 5.5, "mfu": 0.2,
                                          "tokens_per_s": 900.0}),
               "evaluate": _result("evaluate", {"val_loss": 5.75})}
    assert headline_metrics(cfg, results) == {
        "val_loss": 5.75, "train_loss": 5.5, "tokens_trained": 6 * 4 * 64.0,
        "mfu_median": 0.2, "tokens_per_s_median": 900.0}
    assert headline_metrics(cfg, {"tokenize": _result("tokenize", {"tokens": 10})}) == {}


@pytest.mark.slow
def test_a_users_pipelines_are_named_apart_with_their_figures(
        micro_cli_history: History) -> None:
    history = micro_cli_history
    uri = tracking_store.default_tracking_uri(history.runs_dir)
    runs = {step: tracking.get_run(uri, record.parent) for step, record in
            (("first", history.first), ("rerun", history.rerun),
             ("only", history.only_evaluate))}
    names = {step: run.info.run_name for step, run in runs.items()}
    assert names["first"] == f"micro-run-{runs['first'].info.run_id[:8]}"
    assert names["rerun"].startswith("micro-run-") and names["rerun"] != names["first"]
    assert names["only"] == f"micro-only-evaluate-{runs['only'].info.run_id[:8]}"
    for run in runs.values():
        metrics = run.data.metrics
        assert metrics["tokens_trained"] == 6 * 4 * 64
        assert 0 < metrics["mfu_median"] < 1 and metrics["val_loss"] > 0
