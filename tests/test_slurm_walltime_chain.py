"""A training longer than its walltime runs as a chain of Slurm jobs and ends bitwise.

The micro pipeline trains on 2 nodes x 1 rank of the multi-node test cluster through the
slurm site with a 2-minute walltime; the training needs more than one job's time. Each training job
asks Slurm for SIGUSR1 40 s before its end (``site.save_before_end_s``): the ranks stop
after the same step with its checkpoint, the ranks' command exits out of time, the driver
hands the job back (it ends CANCELLED, not TIMEOUT) and runs the ranks again in a new job,
which resumes there, at no cost to ``site.retries`` (no "failed on attempt" line). Three or
more jobs run; the train stage's summary.json and its MLflow run count them and the
node-hours they spent, and the losses equal, bitwise, the same rank spec run uninterrupted
on one node.

Skipped, with the reason, unless the cluster has two or more nodes.
"""
from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from tests.test_slurm_launch import SLURM_DIR, slurm_env  # noqa: F401 - fixture
from tests.test_slurm_multinode import FIXED, multinode, run_on_one_node  # noqa: F401
from tests.test_slurm_pipeline import (
    jobcomp_states,
    pipeline_stage_runs,
    start_cli,
    train_block_jobs,
    wait_cli,
    wait_for_slurm_to_finish,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# A job trains from its ranks' start to Slurm's signal, asked for 40 s before the end of the
# 2 minutes, which Slurm may send up to 60 s earlier (sbatch(1), --signal): at most 70 s of
# training a job. The model is widened (d=256, 4 layers) so that a step is compute, not
# start-up latency of collectives: then a busy box (the suite's other worker) halves the rate
# instead of dividing it by twenty. Measured on a quiet box: 5-8 steps/s, 210-410 steps a
# job; 1,200 steps cannot fit in two jobs of at most 70 s at 8 steps/s (1,120), so three or
# more jobs run, and up to eight on a busy box (about a minute each).
STEPS = 1200
CHAIN_SETTINGS = [
    "parallel.nproc=2", "parallel.nodes=2", *FIXED,
    "parallel.tp=1", "parallel.pp=1", "parallel.sharding=ddp",
    "model.d_model=256", "model.n_layers=4",
    f"train.steps={STEPS}", "train.checkpoint_every=0", "train.log_every=20",
    "site.walltime=00:02:00", "site.save_before_end_s=40", "site.heartbeat_threshold=30",
    # One retry: the evaluation's own job may meet its 2-minute walltime on a busy box;
    # the chain itself spends none (checked below).
    "site.retries=1", "eval.max_tokens=256",
]


@pytest.mark.timeout(2700)
def test_training_chains_jobs_across_walltimes_bitwise(multinode, slurm_env, tmp_path,  # noqa: F811
                                                       seed_microbench):
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    seed_microbench(runs_dir)
    started = time.time()
    proc = start_cli(runs_dir, f"site.address={multinode['login_addr']}", *CHAIN_SETTINGS)
    try:
        output = wait_cli(proc, runs_dir, timeout=2100)
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
    assert summary["jobs"] == len(ledger) >= 3, ledger
    assert [e["outcome"] for e in ledger] == ["out of time"] * (len(ledger) - 1) + ["completed"]
    for before, after in zip(ledger, ledger[1:]):  # each job resumes where the last stopped
        assert after["first_step"] == before["last_step"] > before["first_step"], ledger
    assert ledger[0]["first_step"] == 0 and ledger[-1]["last_step"] == STEPS

    # Every training job was a block of its own; the driver handed back each one that ran out
    # of time (cancelled before Slurm's time limit), and spent no retry on it.
    jobs = train_block_jobs(runs_dir)
    assert [e["id"] for e in ledger] == [jobs[str(i)] for i in range(len(ledger))], (ledger, jobs)
    wait_for_slurm_to_finish(list(jobs.values()))
    states = jobcomp_states()
    for entry in ledger[:-1]:
        assert states[entry["id"]][1].startswith("CANCELLED"), (entry, states[entry["id"]])
    stops = re.findall(r"ran out of time on attempt (\d+) \(job (\d+)\) after step (\d+)", output)
    assert [(int(a), job, int(s)) for a, job, s in stops] == [
        (i + 1, e["id"], e["last_step"]) for i, e in enumerate(ledger[:-1])], output[-4000:]
    assert "failed on attempt" not in output, output[-4000:]
    for entry in ledger[1:]:
        assert f"resumed from step {entry['first_step']}" in output

    # The node-hours: 2 nodes over each job's time, in summary.json and in MLflow.
    assert all(e["nodes"] == 2 for e in ledger)
    hours = sum(2 * (e["ended"] - e["started"]) for e in ledger) / 3600
    assert summary["node_hours"] == pytest.approx(hours)
    assert len(ledger) * 2 * 30 / 3600 < summary["node_hours"] < len(ledger) * 2 * 150 / 3600
    _, children = pipeline_stage_runs(runs_dir)
    metrics = children["train"].data.metrics
    assert metrics["jobs"] == len(ledger)
    assert metrics["node_hours"] == pytest.approx(summary["node_hours"])

    reference = run_on_one_node(summary_path.parent / "spec.json", tmp_path / "reference")
    assert summary["losses"] == reference["losses"]
