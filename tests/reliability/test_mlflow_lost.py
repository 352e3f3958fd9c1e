"""MLflow lost mid-run: training goes on, and every step's metrics reach MLflow exactly once.

A real ``mlflow server`` (SQLite backend) on a free localhost port is stopped while one
production training rank (``stages.train.worker`` with its ``BackgroundSink`` and spool)
trains. Either it comes back before the end and the rank delivers what it kept, or it stays
away and ``python -m workflows.import_metrics`` delivers the spool afterwards. The
rank pauses at chosen steps (a gate file per step) so the test can stop and start the
server between steps; the time the training thread spends in metric calls is measured.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.training.checkpoint import load_extra
from model.training.metrics import SPOOL_FILE, append_spool, deliver_spool, spool_lines
from stages.mechanism import tracking
from stages.mechanism.launch import RankSpec, rank_environment
from tests.train_helpers import REPO, tiny_config
from workflows import import_metrics

KEYS = ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "peak_memory_gb")

# The production rank entry, with gates: at step S (steps done) it touches <gate>.reached
# and waits for <gate> to exist, or SIGKILLs itself; it records the seconds the training
# thread spent inside metric calls (log_metrics, flush, log_artifact).
DRIVER = """
import json, os, signal, sys, time
from pathlib import Path
from model.training import metrics
from model.training.trainer import Trainer
from stages.train import worker as train_worker

args = json.loads(sys.argv[1])
in_sink = [0.0]

def timed(method):
    def call(self, *a, **k):
        start = time.perf_counter()
        try:
            return method(self, *a, **k)
        finally:
            in_sink[0] += time.perf_counter() - start
    return call

for name in ("log_metrics", "flush", "log_artifact"):
    setattr(metrics.BackgroundSink, name, timed(getattr(metrics.BackgroundSink, name)))
step = Trainer.train_step

def train_step(self, batch):
    if self.step == args.get("kill_at"):
        os.kill(os.getpid(), signal.SIGKILL)
    gate = args["gates"].get(str(self.step))
    if gate:
        Path(gate + ".reached").touch()
        while not os.path.exists(gate):
            time.sleep(0.05)
    return step(self, batch)

Trainer.train_step = train_step
rc = train_worker.main(["--spec", args["spec"]])
Path(args["timing"]).write_text(json.dumps({"in_sink_s": in_sink[0]}))
sys.exit(rc)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    """The driver's ``mlflow server`` (``workflows.tracking_server``) over a SQLite store
    on a free localhost port, stopped and restarted by the test."""
    from workflows.tracking_server import TrackingServer

    work = tmp_path / "mlflow"
    work.mkdir()
    srv = TrackingServer(f"sqlite:///{work / 'db'}", work, "127.0.0.1", work / "server.log")
    yield srv
    srv.stop()


def _new_run(uri: str, tmp_path: Path) -> str:
    experiment = tracking.ensure_experiment(uri, "mlflow-lost", tmp_path)
    return tracking.start_run(uri, experiment, "train")


class Rank:
    """One training rank (the production worker under DRIVER), started in the background."""

    def __init__(self, out_dir: Path, uri: str, run_id: str, steps: int, every: int,
                 gates: tuple[int, ...] = (), kill_at: int | None = None) -> None:
        out_dir.mkdir(parents=True)
        cfg = tiny_config(f"train.steps={steps}", f"train.checkpoint_every={every}")
        spec = RankSpec(worker="stages.train.worker", nproc=1, nodes=1,
                        out_dir=str(out_dir.resolve()), config=cfg.to_dict(),
                        plan={"micro_batch": 8, "sharding": "none"},
                        tracking={"uri": uri, "run_id": run_id})
        self.out_dir = out_dir
        self.gates = {s: out_dir / f"gate-{s}" for s in gates}
        args = {"spec": str(spec.write(out_dir / "spec.json")), "kill_at": kill_at,
                "timing": str(out_dir / "timing.json"),
                "gates": {str(s): str(p) for s, p in self.gates.items()}}
        self.log = out_dir / "rank.log"
        with open(self.log, "w") as handle:
            self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(args)],
                                         cwd=REPO, env=rank_environment(), stdout=handle,
                                         stderr=subprocess.STDOUT)

    def wait_at(self, step: int, timeout: float = 120) -> None:
        reached = Path(f"{self.gates[step]}.reached")
        deadline = time.monotonic() + timeout
        while not reached.exists():
            assert self.proc.poll() is None, f"rank exited early:\n{self.log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"rank never reached step {step}"
            time.sleep(0.05)

    def release(self, step: int) -> None:
        self.gates[step].touch()

    def finish(self, timeout: float = 180) -> str:
        rc = self.proc.wait(timeout=timeout)
        output = self.log.read_text()
        assert rc == 0, f"rank failed ({rc}):\n{output[-4000:]}"
        return output

    def in_sink_s(self) -> float:
        return json.loads((self.out_dir / "timing.json").read_text())["in_sink_s"]


def _steps(uri: str, run_id: str, key: str) -> list[int]:
    return sorted(s for s, _ in tracking.metric_history(uri, run_id, key))


def _import(spool: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "workflows.import_metrics", str(spool),
                           *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.slow
def test_training_outlives_a_lost_server_and_every_step_reaches_it_once(
        tmp_path, server, capsys) -> None:
    # Two ranks on one server, each with its own run: "back" sees the server return before
    # its end; "away" ends while it is still away, and its spool is imported afterwards.
    server.start()
    back_run, away_run = _new_run(server.uri, tmp_path), _new_run(server.uri, tmp_path)
    back = Rank(tmp_path / "back", server.uri, back_run, steps=40, every=4, gates=(4, 34))
    away = Rank(tmp_path / "away", server.uri, away_run, steps=24, every=4, gates=(4,))
    back.wait_at(4)  # steps 1-4 are in MLflow (checkpoint 4 flushed them)
    away.wait_at(4)
    assert _steps(server.uri, back_run, "loss") == [1, 2, 3, 4]
    server.stop()
    back.release(4)
    away.release(4)
    away_output = away.finish()  # 20 steps and 5 checkpoints without MLflow
    back.wait_at(34)  # 30 steps and 7 checkpoints without MLflow
    back_spool = (tmp_path / "back").resolve() / SPOOL_FILE
    assert [json.loads(line)["step"] for line in spool_lines(back_spool)] == list(range(5, 33))
    server.start()
    back.release(34)
    back_output = back.finish()

    # Back before the end: the rank delivered what it kept, in order, once.
    assert back_output.count("is unreachable ([Errno 111] Connection refused)") == 1
    assert back_output.count("answers again: sent 32 record(s)") == 1, back_output
    assert f"metrics are kept in {back_spool}" in back_output
    assert not back_spool.exists()  # delivered, then removed
    summary = json.loads((tmp_path / "back" / "summary.json").read_text())
    assert summary["steps_done"] == 40
    for key in KEYS:
        assert _steps(server.uri, back_run, key) == list(range(1, 41)), key
    logged = dict(tracking.metric_history(server.uri, back_run, "loss"))
    assert [logged[s] for s in range(1, 41)] == summary["losses"]
    # Without the server the training thread waited under a few seconds in all for metric
    # calls (MLflow's own retries would hold each checkpoint's flush for minutes).
    assert back.in_sink_s() < 3.0 and away.in_sink_s() < 3.0, (back.in_sink_s(), away.in_sink_s())

    # Away to the end: the spool stays; workflows.import_metrics delivers it, and only once.
    assert away_output.count("is unreachable") == 1, away_output
    assert "answers again" not in away_output
    away_spool = tmp_path / "away" / SPOOL_FILE
    records = [json.loads(line) for line in spool_lines(away_spool)]
    assert [r["step"] for r in records] == list(range(5, 25))
    assert {r["run_id"] for r in records} == {away_run}
    first = _import(away_spool)  # the URI comes from spec.json beside the spool
    assert first.returncode == 0, first.stderr
    assert "sent 20 metric record(s)" in first.stdout
    capsys.readouterr()
    assert import_metrics.main([str(away_spool), "--tracking-uri", server.uri]) == 0
    assert "already imported" in capsys.readouterr().out
    summary = json.loads((tmp_path / "away" / "summary.json").read_text())
    for key in KEYS:
        assert _steps(server.uri, away_run, key) == list(range(1, 25)), key
    logged = dict(tracking.metric_history(server.uri, away_run, "loss"))
    assert [logged[s] for s in range(1, 25)] == summary["losses"]


@pytest.mark.slow
def test_killed_rank_keeps_its_metrics_up_to_the_checkpoint(tmp_path, seed_store) -> None:
    # The rank's tracking server is never there; the run lives in a SQLite store, which the
    # import is pointed at with --tracking-uri.
    store = seed_store(tmp_path)
    run_id = _new_run(store, tmp_path)
    dead = f"http://127.0.0.1:{_free_port()}"
    rank = Rank(tmp_path / "train", dead, run_id, steps=8, every=3, kill_at=6)
    assert rank.proc.wait(timeout=180) == -signal.SIGKILL, rank.log.read_text()[-4000:]
    spool = tmp_path / "train" / SPOOL_FILE
    assert [json.loads(line)["step"] for line in spool_lines(spool)] == list(range(1, 7))

    assert import_metrics.main([str(spool), "--tracking-uri", store]) == 0
    saved = load_extra(tmp_path / "train" / "checkpoints" / "step-00000006")["losses"]
    assert [v for _, v in sorted(tracking.metric_history(store, run_id, "loss"))] == saved
    assert _steps(store, run_id, "grad_norm") == list(range(1, 7))


def test_an_interrupted_delivery_resumes_without_repeating(tmp_path, seed_store) -> None:
    store = seed_store(tmp_path)
    run_id = _new_run(store, tmp_path)
    spool = tmp_path / SPOOL_FILE
    records = [{"run_id": run_id, "step": s, "timestamp": 1_000 + s,
                "metrics": {f"m{i}": s + i / 10 for i in range(8)}} for s in range(1, 301)]
    append_spool(spool, records[:150])
    with open(spool, "a") as handle:  # a writer killed in the middle of an append
        handle.write('{"run_id": "' + run_id + '", "step": 151, "metr')
    append_spool(spool, records[150:])
    assert len(spool_lines(spool)) == 300  # the torn line is dropped, nothing after it

    tracker = tracking.Tracker(store, run_id)
    calls = []

    def send_then_fail(run: str, batch: list) -> None:  # the store goes away mid-delivery
        calls.append(len(batch))
        if len(calls) == 2:
            raise ConnectionError("store went away")
        tracker.send_metrics(run, batch)

    with pytest.raises(ConnectionError):
        deliver_spool(spool, send_then_fail)
    assert calls == [125, 125]  # 1000 values per request
    assert len(spool_lines(spool)) == 175  # only what was not sent is left
    assert deliver_spool(spool, tracker.send_metrics) == 175
    assert not spool.exists()
    history = tracking.metric_history(store, run_id, "m3")
    assert sorted(history) == [(s, s + 0.3) for s in range(1, 301)]
