"""A hung collective fails the job within ``train.collective_timeout_s``, and the failing
rank's message (the stage's, through ``rank-error.json``) names the rank that did not arrive,
the phase it was in, and the failing rank's last completed operation; a rerun resumes from
the newest checkpoint.

The hang comes from the fault-injection switch (``model.training.progress_record.STALL_VAR``).
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from model.training.progress_record import PROGRESS_DIR, STALL_VAR, ProgressRecord, Stall
from stages.mechanism.launch import USER_ERROR_EXIT, RankSpec, read_rank_error
from tests.train_helpers import run_ranks, tiny_config

DP2 = {"dp": 2, "micro_batch": 4, "grad_accum": 1, "sharding": "ddp"}
TIMEOUT_S = 5


def launch(out: Path, stall: dict | None) -> tuple[int, str, str, float]:
    """2 gloo ranks (dp 2) of the tiny model, 4 steps, a checkpoint after each, collectives
    timing out after ``TIMEOUT_S``: (exit code, stdout, stderr, seconds)."""
    cfg = tiny_config("train.steps=4", "train.checkpoint_every=1",
                      f"train.collective_timeout_s={TIMEOUT_S}")
    out.mkdir(parents=True, exist_ok=True)
    spec = RankSpec(worker="stages.train.worker", nproc=2, nodes=1, out_dir=str(out.resolve()),
                    config=cfg.to_dict(), plan=DP2)
    env = {k: v for k, v in os.environ.items() if k != STALL_VAR}
    if stall is not None:
        env[STALL_VAR] = json.dumps(stall)
    started = time.monotonic()
    code, stdout, stderr = run_ranks(spec.worker, spec.write(out / "spec.json"), 2, 120, env)
    return code, stdout, stderr, time.monotonic() - started


def test_a_hung_rank_fails_the_job_fast_and_is_named(tmp_path) -> None:
    """Rank 1 hangs at the end of step 2's forward/backward: rank 0 waits in the step checks'
    all-reduce, times out after 5 s and names rank 1, its phase, and its own last operation;
    the launch ends well before torch's default timeout. The rerun resumes at step 1."""
    stall = {"rank": 1, "step": 2, "phase": "forward/backward", "seconds": 600}
    code, stdout, stderr, seconds = launch(tmp_path, stall)
    assert code == USER_ERROR_EXIT, f"rc {code}:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    assert seconds < TIMEOUT_S + 25, f"the hung launch took {seconds:.1f} s"
    message = read_rank_error(tmp_path)
    assert message is not None, stderr[-6000:]
    assert message.startswith(
        "CollectiveTimeout: a collective did not finish within train.collective_timeout_s=5 s: "
        "rank 0 waited in the loss/norm all-reduce of step 2 (its last completed operation: "
        "forward/backward of step 2); did not arrive: rank 1 (in the forward/backward of step "
        "2 for "), message
    waited = float(re.search(r"step 2 for ([\d.]+) s", message).group(1))
    assert TIMEOUT_S <= waited < TIMEOUT_S + 5, message
    assert " s; last completed: checkpoint save of step 1); each rank's record: " in message
    assert str(tmp_path / PROGRESS_DIR) in message
    assert f"[rank] {message}" in stderr  # the line the launcher echoes to the console

    code, stdout, stderr, _ = launch(tmp_path, None)
    assert code == 0, f"rc {code}:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    assert "resumed from step 1" in stdout
    assert json.loads((tmp_path / "summary.json").read_text())["steps_done"] == 4


def test_ranks_stuck_at_the_same_point_are_those_that_did_not_time_out(tmp_path) -> None:
    """No rank behind the one that timed out: the ranks at its point that did not time out
    themselves (stuck inside the phase) are named. A rank with no record of this launch (an
    earlier launch's counts as none) is behind any."""
    records = [ProgressRecord(tmp_path / "same", rank, 3, "launch-b", 5.0) for rank in range(3)]
    for record in records:
        record.mark("forward/backward", 1)
    records[2].explain(settle_s=0)  # rank 2 timed out too: it arrived
    message = records[0].explain(settle_s=0.2)
    assert ("rank 0 waited in the forward/backward of step 1 (its last completed operation: "
            "start-up); did not arrive: rank 1 (in the forward/backward of step 1 for ") in message
    assert "rank 2" not in message

    ProgressRecord(tmp_path / "stale", 1, 2, "launch-a", 5.0)  # an earlier launch's record
    record = ProgressRecord(tmp_path / "stale", 0, 2, "launch-b", 5.0)
    assert record.explain(settle_s=0).endswith(
        "did not arrive: rank 1 (no record from this launch: it never reached training); "
        f"each rank's record: {tmp_path / 'stale'}")


def test_a_bad_stall_switch_is_one_clear_error(monkeypatch) -> None:
    monkeypatch.setenv(STALL_VAR, '{"rank": 1}')
    with pytest.raises(ValueError, match=f"{STALL_VAR} must be a JSON object"):
        Stall.from_environ()
    with pytest.raises(ValueError, match="train.collective_timeout_s must be > 0"):
        tiny_config("train.collective_timeout_s=0")
