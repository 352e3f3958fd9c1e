"""A training stopped out of time runs as a chain of Slurm jobs and ends bitwise.

The micro pipeline trains on 2 nodes x 1 rank of the multi-node test cluster through the
slurm site. Each training job's script asks Slurm for SIGUSR1 ``site.save_before_end_s``
before its end (``#SBATCH --signal=USR1@N``, pinned by the golden batch script of
``test_sites.py``). Slurm sends that signal within a minute of the time asked, so a chain
paced by real walltimes costs minutes a job and more jobs the busier the box. The test
sends the same signal itself instead, to every step of the job but not its batch shell
(``scancel --signal=USR1``, as ``--signal`` without ``B:`` does), once a job's ranks have
trained 10 steps past where they started; the walltime is long enough that Slurm's own
signal never comes. So exactly three jobs run, the first two stopped.

On the signal the ranks stop after the same step with its checkpoint, the ranks' command
exits out of time, the driver hands the job back (it ends CANCELLED, not TIMEOUT) and runs
the ranks again in a new job, which resumes there, at no cost to ``site.retries`` (0 here:
any failure fails the run). The train stage's summary.json and its MLflow run count the
jobs and the node-hours they spent, and the losses equal, bitwise, the same rank spec run
uninterrupted on one node.

Skipped, with the reason, unless the cluster has two or more nodes.
"""
from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.test_slurm_launch import SLURM_DIR, slurm_env  # noqa: F401 - fixture
from tests.test_slurm_multinode import FIXED, multinode, run_on_one_node  # noqa: F401
from tests.test_slurm_pipeline import (
    jobcomp_records,
    pipeline_stage_runs,
    start_cli,
    train_block_jobs,
    wait_cli,
    wait_for_slurm_to_finish,
    watching,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 80
SIGNALLED_JOBS = 2  # then a third job trains to the end
STEPS_BEFORE_SIGNAL = 10  # past the job's first step: each job advances
CHAIN_SETTINGS = [
    "parallel.nproc=2", "parallel.nodes=2", *FIXED,
    "parallel.tp=1", "parallel.pp=1", "parallel.sharding=ddp",
    "model.d_model=256", "model.n_layers=4",
    f"train.steps={STEPS}", "train.checkpoint_every=0", "train.log_every=2",
    "site.save_before_end_s=40", "site.heartbeat_threshold=30", "site.retries=0",
    "eval.max_tokens=256",
]
PROGRESS = re.compile(r"\[train\] step (\d+)/")
STOPPED = re.compile(r"ran out of time on attempt (\d+) \(job (\d+)\) after step (\d+)")


def _signal_jobs(runs_dir: Path, found: dict, stop: threading.Event) -> None:
    """Send SIGUSR1 to the first SIGNALLED_JOBS training jobs, each once its ranks show
    STEPS_BEFORE_SIGNAL steps of progress past the last stop (read from the driver's log)."""
    log = runs_dir.parent / f"{runs_dir.name}-driver.log"
    found["signalled"] = []
    while not stop.is_set() and len(found["signalled"]) < SIGNALLED_JOBS:
        text = log.read_text()
        stops = list(STOPPED.finditer(text))
        if len(stops) == len(found["signalled"]):  # the last signalled job was reported
            since = stops[-1].end() if stops else 0
            start = int(stops[-1].group(3)) if stops else 0
            steps = [int(s) for s in PROGRESS.findall(text, since)]
            job = train_block_jobs(runs_dir).get(str(len(found["signalled"])))
            if job and steps and max(steps) >= start + STEPS_BEFORE_SIGNAL:
                subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
                found["signalled"].append(job)
        time.sleep(0.1)


@pytest.mark.timeout(1200)
def test_training_chains_jobs_across_walltimes_bitwise(multinode, slurm_env, tmp_path,  # noqa: F811
                                                       seed_microbench):
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    seed_microbench(runs_dir, hosts=tuple(multinode["hosts"]))
    started = time.time()
    proc = start_cli(runs_dir, f"site.address={multinode['login_addr']}", *CHAIN_SETTINGS)
    try:
        with watching(_signal_jobs, runs_dir) as found:
            output = wait_cli(proc, runs_dir, timeout=900)
    finally:
        for job in train_block_jobs(runs_dir).values():  # a hung run leaves none behind
            subprocess.run(["scancel", job], timeout=30, check=False)
    print(f"pipeline {time.time() - started:.0f} s")

    summary_path = next(p for p in runs_dir.glob("stages/train/*/summary.json")
                        if not p.parent.name.endswith(".partial"))
    summary = json.loads(summary_path.read_text())
    ledger = summary["job_ledger"]
    print(json.dumps(ledger, indent=1))
    assert summary["steps_done"] == STEPS and len(summary["losses"]) == STEPS
    assert [e["id"] for e in ledger[:-1]] == found["signalled"], (ledger, found)
    assert summary["jobs"] == len(ledger) == SIGNALLED_JOBS + 1, ledger
    assert [e["outcome"] for e in ledger] == ["out of time"] * (len(ledger) - 1) + ["completed"]
    for before, after in zip(ledger, ledger[1:]):  # each job resumes where the last stopped
        assert after["first_step"] == before["last_step"] > before["first_step"], ledger
    assert ledger[0]["first_step"] == 0 and ledger[-1]["last_step"] == STEPS

    # Every training job was a block of its own; the driver handed back each one that ran out
    # of time (cancelled before Slurm's time limit), and spent no retry on it.
    jobs = train_block_jobs(runs_dir)
    assert [e["id"] for e in ledger] == [jobs[str(i)] for i in range(len(ledger))], (ledger, jobs)
    wait_for_slurm_to_finish(list(jobs.values()))
    records = jobcomp_records()
    for entry in ledger[:-1]:
        assert records[entry["id"]][1].startswith("CANCELLED"), (entry, records[entry["id"]])
    stops = [(int(a), job, int(s)) for a, job, s in STOPPED.findall(output)]
    assert stops == [(i + 1, e["id"], e["last_step"]) for i, e in enumerate(ledger[:-1])], (
        output[-4000:])
    assert "failed on attempt" not in output, output[-4000:]
    for entry in ledger[1:]:
        assert f"resumed from step {entry['first_step']}" in output

    # The node-hours: 2 nodes over each job's training time, which lies inside the job's own
    # time as slurmctld recorded it (to its one-second resolution); in summary.json and MLflow.
    assert all(e["nodes"] == 2 for e in ledger)
    for entry in ledger:
        _, _, start, end = records[entry["id"]]
        job_start, job_end = (datetime.fromisoformat(t).timestamp() for t in (start, end))
        assert job_start - 1 <= entry["started"] < entry["ended"] <= job_end + 1, (
            entry, start, end)
    hours = sum(2 * (e["ended"] - e["started"]) for e in ledger) / 3600
    assert summary["node_hours"] == pytest.approx(hours)
    _, children = pipeline_stage_runs(runs_dir)
    metrics = children["train"].data.metrics
    assert metrics["jobs"] == len(ledger)
    assert metrics["node_hours"] == pytest.approx(summary["node_hours"])

    reference = run_on_one_node(summary_path.parent / "spec.json", tmp_path / "reference")
    assert summary["losses"] == reference["losses"]
