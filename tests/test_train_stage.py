"""The train stage end to end: a real token store, 2 gloo ranks, a real MLflow run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from stages.mechanism import tracking
from stages.mechanism.walk import run_work
from stages.registry import declaration
from tests.test_data_common import make_cfg, make_corpus, make_tracker
from tests.train_helpers import tiny_config

TOKENIZE = declaration("tokenize")
TRAIN = declaration("train")


@pytest.mark.slow
def test_train_stage_on_a_token_store_logs_to_mlflow(tmp_path: Path, seed_store) -> None:
    make_corpus(tmp_path / "corpus", n_docs=40, seed=2)
    (tmp_path / "tok").mkdir()
    tok = run_work(TOKENIZE, make_cfg(tmp_path, tmp_path / "corpus"), {},
                   tmp_path / "tok", make_tracker(tmp_path / "ml_tok", seed_store)[0])
    tracker, uri, run_id = make_tracker(tmp_path / "ml", seed_store, name="train-tests")
    cfg = tiny_config("parallel.nproc=2", "parallel.dp=2", "train.steps=8",
                      "train.checkpoint_every=4", "train.lr=0.003")
    out = tmp_path / "train"
    out.mkdir()
    outputs = run_work(TRAIN, cfg, {"tokenize": tok}, out, tracker)

    assert outputs["steps_done"] == 8
    assert Path(outputs["checkpoint"]).name == "step-00000008"
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["step-00000004", "step-00000008"]
    summary = json.loads(Path(outputs["summary"]).read_text())
    assert summary["losses"][-1] < summary["losses"][0]  # it learns real text
    assert summary["tokens_per_s"] > 0 and 0 < summary["mfu"] < 1
    assert summary["peak_memory_gb"] > 0.05
    assert Path(outputs["loss_curve"]).read_bytes()[:4] == b"\x89PNG"

    losses = tracking.metric_history(uri, run_id, "loss")
    assert [step for step, _ in losses] == list(range(1, 9))
    assert [v for _, v in losses] == pytest.approx(summary["losses"])
    for key in ("lr", "grad_norm", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu",
                "peak_memory_gb"):
        assert len(tracking.metric_history(uri, run_id, key)) == 8, key
    artifacts = {a.path for a in MlflowClient(uri).list_artifacts(run_id)}
    assert {"loss_curve.png", "summary.json"} <= artifacts
