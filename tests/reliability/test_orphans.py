"""Nothing outlives a driver killed with ``kill -9``; the next run resumes its training.

The pipeline CLI runs for real (Parsl's interchanges and worker pools, ``stages.mechanism.launch``,
the local launcher, gloo ranks, the SQLite MLflow store). Once training has a checkpoint the driver
gets SIGKILL, so none of its own shutdown runs: its watchdog (``workflows.watchdog``) must
stop every process of the run within ``GONE_WITHIN_S`` and mark the run's MLflow runs
KILLED and the running train attempt failed. The same command then resumes the training
from the checkpoint, after breaking the dead driver's stale lock.
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from stages.mechanism import locks, tracking, tracking_store
from tests.reliability.test_interrupt import alive, drivers, process_tree  # noqa: F401 - fixture
from tests.reliability.test_resume import (
    KILL_AFTER,
    STEPS,
    TRAINING,
    Driver,
    checkpoints,
    poll,
    processes_of,
    published_summary,
    ranks_of,
    resumed_step,
    start_pipeline,
    train_key,
)

GONE_WITHIN_S = 30.0  # after the kill, no process of the run may be left

pytestmark = pytest.mark.slow


def statuses_of(runs: Path, prefix: str) -> list[str]:
    """The sorted statuses of the MLflow runs of ``runs``'s micro experiment whose name
    starts with ``prefix`` (``micro-run-``: parent runs; ``train-``: train stage runs)."""
    found = tracking.search_runs(tracking_store.default_tracking_uri(runs), "micro")
    return sorted(r.info.status for r in found if r.info.run_name.startswith(prefix))


def test_kill_9_of_the_driver_leaves_no_process_and_the_rerun_resumes(
    tokenized_runs_dir: Path, drivers: list[Driver]  # noqa: F811 - the fixture
) -> None:
    runs_dir = tokenized_runs_dir  # tokenize reused: training starts sooner
    # Worker processes: the interchanges and worker pools a dead driver leaves are the
    # watchdog's hardest sweep (the pools are not its children).
    overrides = (*TRAINING, "site.retries=0", "site.login_workers=processes")
    drivers.append(start_pipeline(runs_dir, *overrides))
    first = drivers[-1]
    poll(f"a checkpoint at step >= {KILL_AFTER}",
         lambda: ranks_of(runs_dir) and max(checkpoints(runs_dir), default=0) >= KILL_AFTER,
         first)
    run = locks.run_marker(first.proc.pid)
    tree = process_tree(first)
    marked = {p.pid for p in locks.run_processes(run)}
    assert {p.pid for p in ranks_of(runs_dir)} <= marked, "the ranks do not carry the marker"
    assert len(marked) >= 6, f"too few processes carry the run marker: {tree}"

    first.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    first.proc.wait()
    while (alive(tree) or locks.run_processes(run) or processes_of(runs_dir)) and \
            time.monotonic() - killed < GONE_WITHIN_S:
        time.sleep(0.2)
    assert not alive(tree), f"processes outlived the killed driver: {alive(tree)}"
    assert not locks.run_processes(run), [p.cmdline() for p in locks.run_processes(run)]
    assert not processes_of(runs_dir), [p.cmdline() for p in processes_of(runs_dir)]
    console = first.console()
    assert "[watchdog] stopped" in console, console[-3000:]

    assert statuses_of(runs_dir, "micro-run-") == ["KILLED"]
    assert statuses_of(runs_dir, "train-") == ["KILLED"]
    assert "RUNNING" not in statuses_of(runs_dir, "")
    (status_file,) = (runs_dir / "stages" / "train").glob("*.partial/status.json")
    status = json.loads(status_file.read_text())
    assert status["state"] == "failed" and "killed" in status["error"], status
    kept = max(checkpoints(runs_dir))
    assert kept >= KILL_AFTER

    drivers.append(start_pipeline(runs_dir, *overrides))
    second = drivers[-1]
    code = second.wait()
    console = second.console()
    assert code == 0, f"the rerun failed ({code}):\n{console[-4000:]}"
    assert train_key(console) == train_key(first.console())
    assert "breaking stale lock" in console, console[-4000:]
    assert resumed_step(console) >= KILL_AFTER
    assert len(published_summary(runs_dir)["losses"]) == STEPS
    assert statuses_of(runs_dir, "micro-run-") == ["FINISHED", "KILLED"]
    # The rerun continued the killed attempt's train run: one run for the key, finished.
    assert statuses_of(runs_dir, "train-") == ["FINISHED"]
    (train_run,) = [r for r in tracking.search_runs(tracking_store.default_tracking_uri(runs_dir),
                                                    "micro")
                    if r.info.run_name.startswith("train-")]
    assert train_run.data.tags["attempts"] == "2"
