"""A training that diverges is a fault with one named error, not a crash: on real gloo ranks
(dp 2), a huge learning rate ends in ``TrainingDiverged`` within ``train.max_rollbacks``
rollbacks, and no rollback ever goes back to a checkpoint written inside a run of bad steps.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from model.training.checkpoint import load_extra
from model.training.health import FAULTS_VAR, written_in_bad_streak
from stages.mechanism.launch import RANK_ERROR_FILE, USER_ERROR_EXIT
from tests.train_helpers import REPO, launch_with, tiny_config

DP2 = {"dp": 2, "micro_batch": 4, "grad_accum": 1, "sharding": "ddp"}


def launch(out: Path, faults: dict[str, Any] | None, *overrides: str) -> tuple[int, str, str]:
    """2 gloo ranks of the tiny model: (exit code, stdout, stderr)."""
    return launch_with(out, tiny_config(*overrides), DP2, FAULTS_VAR, faults)


def checkpoint_steps(out: Path) -> dict[int, bool]:
    """Each checkpoint left: its step -> whether it was written inside a run of bad steps."""
    return {int(p.name.split("-")[1]): written_in_bad_streak(load_extra(p))
            for p in sorted((out / "checkpoints").glob("step-*"))}


def test_a_huge_learning_rate_fails_in_one_named_line(tmp_path) -> None:
    """lr 10000: every step after the first has a non-finite gradient norm. The ranks end with
    the user-error exit and one ``TrainingDiverged`` message (steps, last good step, the fix),
    no traceback, after at most max_rollbacks + 1 rollbacks called for; no checkpoint is
    written inside the bad run, so there is none to go back to."""
    code, stdout, stderr = launch(tmp_path, None, "train.lr=10000", "train.steps=40",
                                  "train.checkpoint_every=5", "train.spike_window=5",
                                  "train.max_rollbacks=3")
    assert code == USER_ERROR_EXIT, f"rc {code}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    message = json.loads((tmp_path / RANK_ERROR_FILE).read_text())["message"]
    assert message.startswith("TrainingDiverged: training diverged: 4 rollbacks called for "
                              "(train.max_rollbacks=3) at steps 4, 5, 6, 7"), message
    assert "the last good step was 1" in message and "train.lr (now 10000)" in message
    assert "Traceback" not in stdout + stderr
    health = json.loads((tmp_path / "health.json").read_text())
    assert len(health["rollbacks"]) == 4
    assert all(r["to_step"] is None for r in health["rollbacks"])
    assert [s["step"] for s in health["skipped_steps"]] == [2, 3, 4, 5, 6]  # step 7 raised
    assert checkpoint_steps(tmp_path) == {}  # step 5's save waited for a good step


def test_a_rollback_never_returns_into_a_bad_run(tmp_path) -> None:
    """Batches 3-5 (steps 4-6) are NaN on every rank; checkpoints are due every 2 steps. The
    save due at step 4 waits: the run of bad steps rolls back at step 6 to step 2, the newest
    checkpoint before it, and the training then completes with every checkpoint clean."""
    code, stdout, stderr = launch(tmp_path, {"nan_batches": [3, 4, 5]}, "train.steps=8",
                                  "train.checkpoint_every=2", "train.keep_last=8")
    assert code == 0, f"rc {code}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    summary = json.loads((tmp_path / "summary.json").read_text())
    [rollback] = summary["health"]["rollbacks"]
    assert (rollback["step"], rollback["to_step"]) == (6, 2)
    assert "rolled back to step 2" in stdout
    assert checkpoint_steps(tmp_path) == {2: False, 4: False, 6: False, 8: False}
    assert summary["health"]["last_good_step"] == 8


@pytest.mark.slow
def test_the_pipeline_names_the_divergence_in_one_line(tokenized_runs_dir) -> None:
    """The issue's command on the micro preset through the pipeline's command line: the
    console ends with ``train failed: TrainingDiverged: ...``, no traceback anywhere in it,
    nothing retried, and the train stage's MLflow run is FAILED with the message as its
    ``error`` tag."""
    from stages.mechanism import tracking, tracking_store
    from tests import warm_cli

    proc = warm_cli.run("workflows.pipeline", [
        "--config", "micro", "--runs-dir", str(tokenized_runs_dir), "--set", "train.lr=10000",
        "train.steps=40", "train.checkpoint_every=5", "train.spike_window=5"],
        cwd=REPO, timeout=600, forked_launches=True)
    console = proc.stdout + proc.stderr
    assert proc.returncode != 0, console[-3000:]
    assert "Traceback" not in console and "retrying" not in console, console[-6000:]
    failed = [line for line in console.splitlines() if line.startswith("train failed: ")]
    assert len(failed) == 1 and failed[0].startswith(
        "train failed: TrainingDiverged: training diverged: 6 rollbacks called for"), failed
    uri = tracking_store.default_tracking_uri(tokenized_runs_dir)
    [train] = [r for r in tracking.search_runs(uri, "micro") if r.data.tags.get("stage") == "train"]
    assert train.info.status == "FAILED"
    assert "TrainingDiverged: training diverged" in train.data.tags["error"]
