"""Ctrl-C and SIGTERM stop everything; training ranks never outlive their launcher.

The pipeline CLI runs for real (Parsl's interchange and worker pools, or its thread pool in
the driver; ``stages.mechanism.launch``, gloo ranks, the SQLite MLflow store) on a training long
enough
to be interrupted. After the driver is signalled, it must exit promptly, leave no process of its
runs dir behind, and record the interrupted stage as failed on disk and in MLflow. A killed
launcher (``stages.mechanism.launch``, run as the local ranks app runs it) must take its
ranks with it, so nothing writes into the stage directory afterwards.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from model.training.checkpoint import latest_checkpoint
from stages.mechanism import tracking, tracking_store
from stages.mechanism.launch import RankSpec, rank_environment
from tests.reliability.test_resume import (
    CONFIG,
    RANK_MODULE,
    REPO,
    Driver,
    checkpoints,
    poll,
    processes_of,
    ranks_of,
    resumed_step,
    runs_module,
    start_pipeline,
    stop,
)
from tests.train_helpers import tiny_config

LONG_TRAINING = ("train.steps=100000", "train.checkpoint_every=10", "site.retries=0")
EXIT_WITHIN_S = 20.0  # the driver exits this soon after the signal (on a CPU-starved box too)
SETTLE_S = 10.0  # after which no process of the runs dir may be left
RANKS_GONE_WITHIN_S = 5.0  # after the launcher was killed

pytestmark = pytest.mark.slow


@pytest.fixture
def drivers() -> Iterator[list[Driver]]:
    """Drivers a test starts; any still running at its end are stopped with their processes."""
    started: list[Driver] = []
    yield started
    stop(started)


def training_under_way(driver: Driver) -> None:
    """Wait until the ranks run and have written a checkpoint."""
    poll("a running training with a checkpoint",
         lambda: ranks_of(driver.runs) and checkpoints(driver.runs), driver)


def process_tree(driver: Driver) -> list[psutil.Process]:
    """The driver, its descendants (Parsl's interchange), and every process of its runs dir
    (worker pools, launcher, ranks) with their descendants (Parsl's workers)."""
    roots = [psutil.Process(driver.proc.pid), *processes_of(driver.runs)]
    found: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            for proc in [root, *root.children(recursive=True)]:
                found[proc.pid] = proc
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def alive(procs: list[psutil.Process]) -> list[str]:
    """The processes of ``procs`` still running (same pid and start time; not zombies)."""
    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.pid}: {' '.join(proc.cmdline())[:200]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return left


def train_status(runs: Path) -> dict:
    found = list((runs / "stages" / "train").glob("*.partial/status.json"))
    assert len(found) == 1, f"expected one train attempt, found {found}"
    return json.loads(found[0].read_text())


@pytest.mark.parametrize("how, workers", [
    ("SIGTERM to the driver", "processes"), ("SIGTERM to the driver", "threads"),
    ("SIGINT to its process group", "threads"), ("SIGTERM to its process group", "processes"),
])
def test_a_signal_stops_every_process_and_marks_training_failed(
    how: str, workers: str, tokenized_runs_dir: Path, drivers: list[Driver]
) -> None:
    runs_dir = tokenized_runs_dir  # tokenize reused: training starts sooner
    # Ctrl-C in a terminal signals the whole foreground group with SIGINT; timeout, scancel
    # and a closed terminal signal it with SIGTERM, which kills Parsl's interchanges too.
    # With the apps in the driver's threads, a SIGTERM to the driver alone reaches none of
    # the processes they started: the driver stops them itself.
    group = "group" in how
    drivers.append(start_pipeline(runs_dir, *LONG_TRAINING, f"site.login_workers={workers}",
                                  new_session=group))
    driver = drivers[-1]
    training_under_way(driver)
    tree = process_tree(driver)
    kinds = " ".join(" ".join(p.cmdline()) for p in tree if p.is_running())
    for part in ("stages.mechanism.launch", "stages.train.worker"):
        assert part in kinds, f"no {part} among the pipeline's processes: {kinds[:2000]}"
    assert ("process_worker_pool" in kinds) == (workers == "processes"), kinds[:2000]

    if group:  # the driver leads a session of its own: this signals none of the tests
        os.killpg(driver.proc.pid, signal.SIGTERM if "SIGTERM" in how else signal.SIGINT)
    else:
        driver.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    try:
        code = driver.proc.wait(EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - signalled
    console = driver.console()
    assert code is not None, f"the driver was still running {EXIT_WITHIN_S} s after {how}:\n" \
        f"{console[-3000:]}"
    assert code == 130, f"exit {code} after {how}:\n{console[-3000:]}"
    assert "[pipeline] interrupted" in console

    time.sleep(max(0.0, SETTLE_S - (time.monotonic() - signalled - took)))
    assert not alive(tree), f"processes outlived the driver: {alive(tree)}"
    assert not processes_of(runs_dir), [p.cmdline() for p in processes_of(runs_dir)]

    assert train_status(runs_dir)["state"] == "failed"
    uri = tracking_store.default_tracking_uri(runs_dir)
    runs = {r.info.run_name: r.info.status for r in tracking.search_runs(uri, "micro")}
    parent = [s for name, s in runs.items() if name.startswith("micro-run-")]
    train = [s for name, s in runs.items() if name.startswith("train-")]
    assert parent == ["KILLED"], runs
    assert train == ["KILLED"], runs
    assert "RUNNING" not in runs.values(), runs


def test_ranks_die_with_a_killed_launcher(tmp_path: Path) -> None:
    """The local ranks app's own command (``python -m stages.mechanism.launch --spec``, which it
    execs) on a long training: once the ranks have written a checkpoint, the launcher is
    SIGKILLed; the ranks are gone within RANKS_GONE_WITHIN_S and
    nothing writes a checkpoint afterwards. How the driver takes a ranks app that failed is
    ``test_resume``'s: a killed rank fails the train stage, and the rerun resumes."""
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    cfg = tiny_config("train.steps=100000", "train.checkpoint_every=10")
    spec_path = RankSpec(worker=RANK_MODULE, nproc=2, nodes=1, out_dir=str(out_dir),
                         config=cfg.to_dict(),
                         plan={"dp": 2, "micro_batch": 2, "grad_accum": 2, "sharding": "ddp"}
                         ).write(out_dir / "spec.json")
    with open(tmp_path / "launch.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "stages.mechanism.launch", "--spec",
        str(spec_path)],
                                cwd=REPO, env=rank_environment(), stdout=log,
                                stderr=subprocess.STDOUT)
    saved = out_dir / "checkpoints"
    try:
        wait_for("two ranks and a checkpoint", lambda: len(ranks_of(out_dir)) == 2
                 and latest_checkpoint(saved) is not None, timeout=240)
        (launcher,) = runs_module(out_dir, "stages.mechanism.launch")
        launcher.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while ranks_of(out_dir) and time.monotonic() - killed < RANKS_GONE_WITHIN_S:
            time.sleep(0.1)
        assert not ranks_of(out_dir), \
            f"ranks outlived their launcher by {RANKS_GONE_WITHIN_S} s: {ranks_of(out_dir)}"

        def newest() -> tuple[Path | None, float]:
            files = [p for p in saved.rglob("*") if p.is_file()]
            return latest_checkpoint(saved), max(p.stat().st_mtime for p in files)

        before = newest()
        time.sleep(SETTLE_S)
        assert newest() == before, "something wrote checkpoints after the ranks were stopped"
        assert proc.wait(30) != 0, (tmp_path / "launch.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for rank in processes_of(out_dir):
            rank.kill()


def wait_for(what: str, check, timeout: float = 60.0) -> None:
    """Call ``check`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def _poller_waits_on(dfk, call: str) -> bool:
    """Whether Parsl's job-status poller thread is inside ``call`` right now."""
    import sys
    import traceback

    thread = dfk.job_status_poller._thread
    frame = sys._current_frames().get(thread.ident)
    return frame is not None and any(f.name == call for f in traceback.extract_stack(frame))


def test_shutdown_ends_when_the_poller_waits_on_a_dead_interchange(runs_dir: Path) -> None:
    # The cause of a hang after a group SIGTERM: the poller's status query to an interchange
    # the same signal killed blocks forever, and Parsl's cleanup joins the poller forever.
    import threading

    from stages.config import load_config
    from workflows import executors

    cfg = load_config(REPO / CONFIG, [f"tracking.runs_dir={runs_dir}",
                                      "site.login_workers=processes"])
    dfk = executors.start_parsl(cfg, runs_dir, runs_dir / "parsl")
    wait_for("two worker pools", lambda: len(processes_of(runs_dir)) >= 2)
    for executor in dfk.executors.values():
        process = getattr(executor, "interchange_proc", None)
        if process is not None:
            process.kill()
            process.wait()
    wait_for("the poller stuck on a dead interchange",
             lambda: _poller_waits_on(dfk, "connected_blocks"))

    stopper = threading.Thread(target=executors.stop_parsl, args=(dfk, True), daemon=True)
    started = time.monotonic()
    stopper.start()
    limit = executors.INTERCHANGE_EXIT_GRACE_S + executors.CLEANUP_DEADLINE_S[True] + 2.0
    stopper.join(limit)
    assert not stopper.is_alive(), f"stop_parsl still ran {limit} s after it was called"
    assert time.monotonic() - started < limit
    wait_for("the worker pools gone", lambda: not processes_of(runs_dir), timeout=10.0)


def test_ctrl_c_with_worker_processes_leaves_nothing_and_a_rerun_resumes(
    tokenized_runs_dir: Path, drivers: list[Driver]
) -> None:
    """Ctrl-C in the terminal of the default preset's setup (the stages' apps in Parsl worker
    processes: ``site.login_workers=processes``, as configs/tiny.yaml has it; the micro
    preset's sizes): every process ends, nothing stays RUNNING in MLflow, and the next
    invocation resumes the training from the interrupted attempt's checkpoint."""
    runs_dir = tokenized_runs_dir
    overrides = (*LONG_TRAINING, "site.login_workers=processes")
    drivers.append(start_pipeline(runs_dir, *overrides, new_session=True))
    first = drivers[-1]
    training_under_way(first)
    tree = process_tree(first)
    kinds = " ".join(" ".join(p.cmdline()) for p in tree if p.is_running())
    assert "process_worker_pool" in kinds and "stages.train.worker" in kinds, kinds[:2000]

    os.killpg(first.proc.pid, signal.SIGINT)  # what Ctrl-C sends the foreground group
    signalled = time.monotonic()
    code = first.proc.wait(EXIT_WITHIN_S)
    assert code == 130, first.console()[-3000:]
    time.sleep(max(0.0, SETTLE_S - (time.monotonic() - signalled)))
    assert not alive(tree), f"processes outlived the driver: {alive(tree)}"
    assert not processes_of(runs_dir), [p.cmdline() for p in processes_of(runs_dir)]
    kept = max(checkpoints(runs_dir))
    assert train_status(runs_dir)["state"] == "failed"
    uri = tracking_store.default_tracking_uri(runs_dir)
    interrupted = {r.info.run_name: r.info.status for r in tracking.search_runs(uri, "micro")}
    assert "RUNNING" not in interrupted.values(), interrupted

    drivers.append(start_pipeline(runs_dir, *overrides, new_session=True))
    second = drivers[-1]
    poll("the rerun's resumed training", lambda: "resumed from step" in second.console(),
         second)
    assert resumed_step(second.console()) >= kept
    os.killpg(second.proc.pid, signal.SIGINT)
    assert second.proc.wait(EXIT_WITHIN_S) == 130, second.console()[-3000:]

    stopped = [status for name, status in interrupted.items()
               if name.startswith(("micro-run-", "train-"))]
    assert stopped == ["KILLED", "KILLED"], interrupted


def test_a_stage_failing_while_the_pipeline_is_interrupted_ends_killed(
        tmp_path: Path, seed_store) -> None:
    """With the apps in the driver's threads, a Ctrl-C also kills the ranks: the stage's
    thread may fail on them before the driver's interrupt marks it. It is stopped all the
    same, so its run ends KILLED, not FAILED; any other failure stays FAILED."""
    from stages.mechanism import attempt as attempts
    from stages.registry import PIPELINE

    runs = tmp_path / "runs"
    uri = seed_store(runs)
    experiment = tracking.ensure_experiment(uri, "micro", runs)
    ctx = attempts.PipelineContext(str(runs), uri, experiment, None, pipeline=PIPELINE)
    statuses = []
    for interrupted in (False, True):
        run_id = tracking.start_run(uri, experiment, f"train-{interrupted}")
        attempt = attempts.Attempt("train", "k", run_id, str(runs / "stages" / "train" / "k"))
        if interrupted:
            attempts.INTERRUPTED.set()
        try:
            attempts.fail(ctx, attempt, RuntimeError("the ranks exited with code 1"))
        finally:
            attempts.INTERRUPTED.clear()
        statuses.append(tracking.get_run(uri, run_id).info.status)
    assert statuses == ["FAILED", "KILLED"]
