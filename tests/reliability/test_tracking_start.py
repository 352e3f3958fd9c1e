"""MLflow start-up: a store created from nothing, by one driver and by two at once, and
stores that cannot be used.

These tests make their stores from nothing; most other tests start from a copy of one
store migrated per session (``conftest.seed_store``), which the first test shows to be the
store a new runs dir gets.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.mechanism import tracking, tracking_store

REPO = Path(__file__).resolve().parents[2]


def _schema(db: Path) -> tuple[list[str], list[str]]:
    """The store's migration version(s) and its tables."""
    with contextlib.closing(sqlite3.connect(db)) as connection:
        versions = [row[0] for row in connection.execute("SELECT version_num FROM alembic_version")]
        tables = [row[0] for row in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
    return versions, tables


def test_a_new_runs_dir_gets_a_migrated_store_as_the_tests_seed_it(tmp_path: Path,
                                                                   migrated_store: Path):
    runs = tmp_path / "runs"
    uri = tracking_store.default_tracking_uri(runs)
    experiment = tracking.ensure_experiment(uri, "fresh", runs)
    assert uri == f"sqlite:///{runs.resolve() / 'mlflow.db'}"
    made = tracking.MlflowClient(uri).get_experiment(experiment)
    assert made.name == "fresh"
    assert made.artifact_location == (runs.resolve() / "mlartifacts").as_uri()
    versions, tables = _schema(runs / "mlflow.db")
    assert len(versions) == 1 and {"experiments", "runs", "metrics"} <= set(tables)
    assert (versions, tables) == _schema(migrated_store)
    assert not (runs / "mlflow.db.lock").exists()


def _create(runs_dir: str, barrier, out: str) -> None:
    uri = tracking_store.default_tracking_uri(Path(runs_dir))
    barrier.wait()
    experiment = tracking.ensure_experiment(uri, "together", Path(runs_dir))
    run_id = tracking.start_run(uri, experiment, f"pipeline-{os.getpid()}")
    Path(out).write_text(json.dumps({"experiment": experiment, "run": run_id}))


def test_two_drivers_create_one_store_at_once(tmp_path: Path):
    runs = tmp_path / "runs"
    mp = multiprocessing.get_context("spawn")  # fresh interpreters, as two drivers are
    barrier = mp.Barrier(3)
    outs = [str(tmp_path / f"{i}.json") for i in range(3)]
    procs = [mp.Process(target=_create, args=(str(runs), barrier, out)) for out in outs]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    results = [json.loads(Path(out).read_text()) for out in outs]
    assert len({r["experiment"] for r in results}) == 1
    uri = tracking_store.default_tracking_uri(runs)
    assert len(tracking.search_runs(uri, "together")) == 3
    assert not (runs / "mlflow.db.lock").exists()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("kind", ["unreachable server", "no store's scheme"])
def test_unusable_tracking_uri_fails_fast_with_one_line(tmp_path: Path, kind: str):
    uri, says = ((f"http://127.0.0.1:{_free_port()}", "not reachable") if kind.startswith("un")
                 else ("foo://bar", "names no MLflow store"))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "workflows.pipeline", "--config", "micro",
         "--runs-dir", str(tmp_path / "runs"), "--tracking-uri", uri],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )
    assert time.monotonic() - started < 15
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert uri in lines[0] and says in lines[0]
    assert not (tmp_path / "runs" / "stages").exists()  # no work started


def test_check_store_names_what_cannot_be_used(tmp_path: Path):
    started = time.monotonic()
    uri = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(tracking_store.TrackingError, match=f"{uri} is not reachable"):
        tracking.ensure_experiment(uri, "x", tmp_path)
    assert time.monotonic() - started < 10
    bad = "sqlite:////proc/no-such-dir/mlflow.db"
    with pytest.raises(tracking_store.TrackingError, match="cannot be written") as info:
        tracking_store.check_store(bad)
    assert bad in str(info.value) and "\n" not in str(info.value)
    # A writable one passes.
    tracking_store.check_store(tracking_store.default_tracking_uri(tmp_path))
    for nonsense in ("foo://bar", "runs/mlflow.db", "sqlite3:///x.db"):
        with pytest.raises(tracking_store.TrackingError, match="names no MLflow store") as info:
            tracking_store.check_store(nonsense)
        assert repr(nonsense) in str(info.value) and "\n" not in str(info.value)
    tracking_store.check_store("postgresql+psycopg2://user@db.example/mlflow")  # no connection made


@pytest.mark.slow
def test_the_drivers_tracking_server_serves_the_runs_dir_store(tmp_path: Path):
    """workflows.tracking_server: ``mlflow server`` over the runs dir's SQLite file, reached
    at the advertised host; what is logged through it lands in the file; stop() leaves no
    process of it."""
    import psutil

    from workflows.tracking_server import TrackingServer

    runs = tmp_path / "runs"
    store = tracking_store.default_tracking_uri(runs)
    server = TrackingServer(store, runs, "127.0.0.1", runs / "logs" / "mlflow-server.log")
    uri = server.start()
    try:
        assert uri == f"http://127.0.0.1:{server.port}"
        experiment = tracking.ensure_experiment(uri, "served", runs)
        run_id = tracking.start_run(uri, experiment, "through-the-server")
        tracker = tracking.Tracker(uri, run_id)
        tracker.log_metrics({"loss": 2.5}, step=1)
        tracker.flush()
        tracking.end_run(uri, run_id)
        group = [server.proc.pid, *(c.pid for c in psutil.Process(server.proc.pid).children(
            recursive=True))]
    finally:
        server.stop()
    assert tracking.metric_history(store, run_id, "loss") == [(1, 2.5)]  # in the SQLite file
    assert tracking.get_run(store, run_id).info.status == "FINISHED"
    assert not [pid for pid in group if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
