"""Out of time: a signal to the ranks stops them at a step boundary with a checkpoint, the
launch exits with the out-of-time code, and resuming ends with the uninterrupted losses.

Real gloo ranks through the local launch path (``python -m stages.mechanism.launch``: its ranks on
this machine), as the workflow's local ranks app runs them. The first launch gets SIGUSR1
(what Slurm sends ahead of the walltime) on one rank only: the ranks must still agree on
the step they stop at. The second launch resumes there and gets SIGTERM (the walltime
itself, a scancel) on the other rank; the third finishes. Three launches, one job each in
the job ledger, and losses bitwise equal to one uninterrupted run.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from model.training.checkpoint import latest_checkpoint
from stages.mechanism.launch import (
    OUT_OF_TIME_EXIT,
    OUT_OF_TIME_FILE,
    STACKS_SIGNAL,
    USER_ERROR_EXIT,
    RankSpec,
    rank_environment,
)
from tests.train_helpers import REPO, run_worker, tiny_config, worker_ranks

pytestmark = pytest.mark.slow

DP2 = {"dp": 2, "micro_batch": 2, "grad_accum": 2, "sharding": "ddp"}
STEPS = 300  # each signal, sent at a launch's first progress line, lands ~30 steps later here
SETTINGS = (f"train.steps={STEPS}", "train.checkpoint_every=0")
PROGRESS = re.compile(r"\[train\] step (\d+)/")


def write_spec(out_dir: Path) -> Path:
    cfg = tiny_config(*SETTINGS)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = RankSpec(worker="stages.train.worker", nproc=2, nodes=1,
                    out_dir=str(out_dir.resolve()), config=cfg.to_dict(), plan=DP2)
    return spec.write(out_dir / "spec.json")


def launch(spec_path: Path, log: Path, signum: int | None, rank: int,
           timeout: float = 240) -> tuple[int, str]:
    """``python -m stages.mechanism.launch --spec``; once a progress line shows the ranks stepping
    (past
    where they started), send ``signum`` to the ``rank``-th rank. Exit code and output."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stages.mechanism.launch", "--spec",
        str(spec_path)],
                                cwd=REPO, env=rank_environment(), stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    try:
        while signum is not None and proc.poll() is None and time.monotonic() < deadline:
            if PROGRESS.search(log.read_text()):
                found = sorted(worker_ranks(psutil.Process(proc.pid)), key=lambda p: p.pid)
                if len(found) == 2:
                    found[rank].send_signal(signum)
                    break
            time.sleep(0.05)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, log.read_text()


def stopped_at(out_dir: Path, output: str) -> int:
    """Check the out-of-time record against the newest checkpoint; return its step."""
    record = json.loads((out_dir / OUT_OF_TIME_FILE).read_text())
    newest = latest_checkpoint(out_dir / "checkpoints")
    assert newest is not None and newest.name == f"step-{record['step']:08d}", (record, newest)
    assert record["checkpoint"] == str(newest), record
    assert 0 < record["step"] < STEPS, record
    assert not (out_dir / "summary.json").exists(), "an out-of-time run wrote a summary"
    assert f"out of time: stopped after step {record['step']}" in output, output[-3000:]
    return record["step"]


def test_walltime_signal_stops_at_a_checkpoint_and_resumes_bitwise(tmp_path: Path) -> None:
    reference = run_worker(tmp_path / "reference", DP2, 2, *SETTINGS)
    out_dir = tmp_path / "run"
    spec_path = write_spec(out_dir)

    code, output = launch(spec_path, tmp_path / "first.log", signal.SIGUSR1, rank=0)
    assert code == OUT_OF_TIME_EXIT, f"exit {code}:\n{output[-3000:]}"
    first = stopped_at(out_dir, output)
    assert json.loads((out_dir / OUT_OF_TIME_FILE).read_text())["signals"] in (
        ["SIGUSR1"], [])  # the logger rank may not be the one signalled

    code, output = launch(spec_path, tmp_path / "second.log", signal.SIGTERM, rank=1)
    assert code == OUT_OF_TIME_EXIT, f"exit {code}:\n{output[-3000:]}"
    assert f"resumed from step {first}" in output, output[-3000:]
    second = stopped_at(out_dir, output)
    assert second > first

    code, output = launch(spec_path, tmp_path / "third.log", None, rank=0)
    assert code == 0, f"exit {code}:\n{output[-3000:]}"
    assert f"resumed from step {second}" in output, output[-3000:]
    assert not (out_dir / OUT_OF_TIME_FILE).exists()
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["steps_done"] == STEPS
    assert summary["losses"] == reference["losses"]  # bitwise, across two stops
    assert summary["jobs"] == 3, summary["job_ledger"]
    ledger = summary["job_ledger"]
    assert [e["outcome"] for e in ledger] == ["out of time", "out of time", "completed"]
    assert [(e["first_step"], e["last_step"]) for e in ledger] == [
        (0, first), (first, second), (second, STEPS)]
    assert summary["node_hours"] == pytest.approx(
        sum(e["ended"] - e["started"] for e in ledger) / 3600)
    assert 0 < summary["node_hours"] < 0.1


def test_a_stop_signal_after_the_ranks_work_is_ignored(tmp_path: Path) -> None:
    """Slurm's signal ahead of the walltime may land once the rank's work is over, while the
    interpreter shuts down, when Python has put back the default (fatal) handlers: the rank
    ignores both stop signals from the end of its work on, and exits with its own code."""
    spec = json.loads(write_spec(tmp_path / "rank").read_text())
    spec["plan"] = None  # refused at once: the rank's work ends before torch.distributed starts
    spec_path = tmp_path / "rank" / "spec.json"
    spec_path.write_text(json.dumps(spec))
    script = ("import signal, sys\n"
              "import stages.train.worker as worker\n"
              "code = worker.main(['--spec', sys.argv[1]])\n"
              "print([signal.getsignal(s) == signal.SIG_IGN for s in worker.STOP_SIGNALS])\n"
              "signal.raise_signal(signal.SIGUSR1)\n"
              "sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(spec_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == USER_ERROR_EXIT, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "[True, True]", proc.stdout + proc.stderr


def test_a_rank_prints_its_stacks_on_request_and_trains_on(tmp_path: Path) -> None:
    """A hung run is diagnosed by asking its ranks where they wait (``STACKS_SIGNAL``): the
    rank writes every thread's stack to its stderr and goes on to finish its steps."""
    out_dir = tmp_path / "rank"
    out_dir.mkdir()
    spec_path = RankSpec(worker="stages.train.worker", nproc=1, nodes=1, out_dir=str(out_dir),
                         config=tiny_config(*SETTINGS).to_dict(),
                         plan={"micro_batch": 8, "grad_accum": 1, "sharding": "none"}
                         ).write(out_dir / "spec.json")
    proc = subprocess.Popen([sys.executable, "-m", "stages.train.worker", "--spec",
                             str(spec_path)], cwd=REPO, env=rank_environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()  # the rank is training
        assert PROGRESS.search(first), f"no progress: {first!r} {proc.stderr.read()[-3000:]}"
        proc.send_signal(STACKS_SIGNAL)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    assert "most recent call first" in stderr and "stages/train/worker.py" in stderr, stderr[-4000:]
    assert json.loads((tmp_path / "rank" / "summary.json").read_text())["steps_done"] == STEPS
