"""One attempt per stage key: pipelines on one runs dir wait for each other and reuse.

Real processes (multiprocessing), a real SQLite MLflow store, stages.mechanism.attempt's
begin/finish as the
pipeline's apps call them."""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import socket
import subprocess
import threading
import time
import types
from pathlib import Path

import pytest

from stages.config import load_config
from stages.mechanism import keys, locks, outputs, tracking, tracking_store
from stages.mechanism.attempt import PipelineContext
from stages.mechanism.walk import run_stage
from tests.stagekit import declare

SLEEP_S = 2.0


def _ctx(runs_dir: Path, stale_s: float = locks.STALE_AFTER_S) -> PipelineContext:
    uri = tracking_store.default_tracking_uri(runs_dir)
    experiment = tracking.ensure_experiment(uri, "locks", runs_dir)
    parent = tracking.start_run(uri, experiment, f"pipeline-{os.getpid()}")
    return PipelineContext(str(runs_dir), uri, experiment, parent, "code-1",
                                 lock_stale_s=stale_s)


def _slow_stage(name: str, log: Path) -> types.ModuleType:
    """A stage that records each computation in ``log`` and takes SLEEP_S seconds."""
    module = types.ModuleType(f"stages.{name}")
    module.SECTIONS = ("train",)

    def run(cfg, inputs, out_dir, tracker):
        with open(log, "a") as handle:
            handle.write(f"{name} {os.getpid()}\n")
        time.sleep(SLEEP_S)
        (out_dir / "value.txt").write_text(name)
        return {"value": str(out_dir / "value.txt")}

    module.run = run
    return module


def _pipeline(runs_dir: str, out: str) -> None:
    """Two chained stages, as one driver runs them; what happened goes to ``out``."""
    runs, log = Path(runs_dir), Path(runs_dir) / "computed.log"
    with open(out + ".stdout", "w") as stdout, contextlib.redirect_stdout(stdout):
        ctx, cfg = _ctx(runs), load_config()
        first = run_stage(ctx, declare("first"), cfg, {}, work=_slow_stage("first", log))
        second = run_stage(ctx, declare("second"), cfg, {"first": first},
                           work=_slow_stage("second", log))
    Path(out).write_text(json.dumps({
        "pid": os.getpid(),
        "reused": [first.reused, second.reused],
        "keys": [first.key, second.key],
        "runs": [first.producer_run_id, second.producer_run_id],
    }))


def test_two_pipelines_compute_each_key_once(tmp_path: Path, seed_store):
    runs = tmp_path / "runs"
    seed_store(runs)
    _ctx(runs)  # the store exists; its creation is tested in test_tracking_start
    mp = multiprocessing.get_context("fork")
    outs = [str(tmp_path / f"p{i}.json") for i in range(2)]
    procs = [mp.Process(target=_pipeline, args=(str(runs), out)) for out in outs]
    procs[0].start()
    time.sleep(0.5)
    procs[1].start()
    for proc in procs:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    a, b = (json.loads(Path(out).read_text()) for out in outs)
    computed = (runs / "computed.log").read_text().splitlines()
    assert sorted(line.split()[0] for line in computed) == ["first", "second"]
    assert a["keys"] == b["keys"] and a["runs"] == b["runs"]  # same outputs, made once
    assert a["reused"] == [False, False] and b["reused"] == [True, True]
    waited = Path(outs[1] + ".stdout").read_text()
    host = socket.gethostname()
    assert f"waiting for first {a['keys'][0]} held by {host}:{a['pid']}" in waited
    assert not list(runs.glob("stages/*/*.lock"))  # every lock released


def _lock_file(path: Path, host: str, pid: int, age_s: float = 0.0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.time() - age_s
    path.write_text(json.dumps({"host": host, "pid": pid, "token": "other",
                                "started": now, "heartbeat": now}))
    os.utime(path, (now, now))


def _dead_pid() -> int:
    proc = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
    proc.start()
    proc.join()
    return proc.pid


def test_a_lock_of_a_dead_driver_is_broken(tmp_path: Path, capsys, seed_store):
    runs = tmp_path / "runs"
    seed_store(runs)
    ctx, cfg, log = _ctx(runs), load_config(), tmp_path / "computed.log"
    key = keys.key_of(keys.key_ingredients(declare("first"), cfg, {}, ctx.code_for("first")))
    lock = outputs.lock_path(runs, "first", key)
    _lock_file(lock, socket.gethostname(), _dead_pid())
    started = time.monotonic()
    result = run_stage(ctx, declare("first"), cfg, {}, work=_slow_stage("first", log))
    assert not result.reused and time.monotonic() - started < SLEEP_S + 10
    assert "breaking stale lock" in capsys.readouterr().out
    assert not lock.exists()


def test_stale_rule(tmp_path: Path):
    owner, path = locks.Owner(), tmp_path / "x.lock"
    # Another host, fresh heartbeat: held, whatever the pid.
    _lock_file(path, "elsewhere", 1)
    holder = locks.try_acquire(path, owner, stale_after=60)
    assert holder is not None and holder["host"] == "elsewhere"
    # Same host, live pid (this process), heartbeat old: stale (the pid may be reused).
    _lock_file(path, socket.gethostname(), os.getpid(), age_s=61)
    assert locks.try_acquire(path, owner, stale_after=60) is None and locks.holds(path, owner)
    locks.release(path, owner)
    # Another host, heartbeat older than the timeout: stale.
    _lock_file(path, "elsewhere", 1, age_s=61)
    assert locks.try_acquire(path, owner, stale_after=60) is None
    # A second owner waits with a limit and is told who holds it.
    told = []
    with pytest.raises(locks.LockTimeout, match="still held"):
        locks.acquire(path, locks.Owner(), wait_s=0.3, poll_s=0.1, on_wait=told.append)
    assert told[0]["token"] == owner.token
    assert locks.release(path, owner) and not path.exists()


def test_driver_heartbeat_keeps_its_stage_locks_fresh(tmp_path: Path):
    owner, other = locks.Owner(), locks.Owner()
    mine = tmp_path / "stages" / "train" / "k1.lock"
    theirs = tmp_path / "stages" / "train" / "k2.lock"
    locks.acquire(mine, owner)
    locks.acquire(theirs, other)
    old = time.time() - 300
    for path in (mine, theirs):
        os.utime(path, (old, old))
    beat = locks.Heartbeat(tmp_path, owner, period_s=0.1).start()
    time.sleep(0.5)
    beat.stop()
    assert time.time() - mine.stat().st_mtime < 5
    assert theirs.stat().st_mtime == pytest.approx(old)
    assert locks.release_all(tmp_path, owner) == 1 and theirs.exists()


def test_a_failed_stage_releases_its_lock(tmp_path: Path, seed_store):
    runs = tmp_path / "runs"
    seed_store(runs)
    ctx, cfg = _ctx(runs), load_config()
    module = types.ModuleType("stages.broken")
    module.SECTIONS = ("train",)

    def run(cfg, inputs, out_dir, tracker):
        raise RuntimeError("boom")

    module.run = run
    with pytest.raises(RuntimeError, match="boom"):
        run_stage(ctx, declare("broken"), cfg, {}, work=module)
    assert not list(runs.glob("stages/*/*.lock"))


def test_a_dead_drivers_lock_is_kept_while_a_process_of_its_run_lives(tmp_path: Path):
    # A driver killed with kill -9 leaves its pid dead but its ranks (which inherited its
    # run marker) maybe still writing its .partial dir: the lock holds until they are gone.
    host, dead = socket.gethostname(), _dead_pid()
    run = f"{host}:{dead}:12345.00"  # the dead driver's marker (its start time is gone too)
    path = tmp_path / "stages" / "train" / "k.lock"
    _lock_file(path, host, dead)
    path.write_text(json.dumps({**json.loads(path.read_text()), "run": run}))
    orphan = subprocess.Popen(["sleep", "30"], env={**os.environ, locks.RUN_ENV: run})
    try:
        assert [p.pid for p in locks.run_processes(run)] == [orphan.pid]
        holder = locks.try_acquire(path, locks.Owner(), stale_after=0)  # heartbeat: no say
        assert holder is not None and holder["run"] == run

        owner, told = locks.Owner(), []
        waiter = threading.Thread(target=locks.acquire, args=(path, owner),
                                  kwargs={"poll_s": 0.1, "wait_s": 20, "on_wait": told.append},
                                  daemon=True)
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive() and told and told[0]["pid"] == dead  # it waits, and says so
    finally:
        orphan.kill()
        orphan.wait()
    waiter.join(10)
    assert not waiter.is_alive() and locks.holds(path, owner)  # broken once the orphan died


def test_a_run_marker_names_one_process_and_its_lock_keeps_its_run(tmp_path: Path):
    marker = locks.run_marker()
    assert marker == locks.run_marker(os.getpid()) and marker.startswith(socket.gethostname())
    assert locks.run_alive(marker)  # the driver itself
    assert not locks.run_alive(f"{socket.gethostname()}:{_dead_pid()}:1.00")
    assert not locks.run_alive(f"elsewhere:{os.getpid()}:1.00")  # another host: unknown here
    owner = locks.Owner(run=marker)
    path = tmp_path / "x.lock"
    locks.acquire(path, owner)
    assert json.loads(path.read_text())["run"] == marker
    # The holder lives (same pid and start time): an old heartbeat does not make it stale.
    old = time.time() - 3600
    os.utime(path, (old, old))
    assert locks.try_acquire(path, locks.Owner(), stale_after=60) is not None
