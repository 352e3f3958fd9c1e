"""A training job cancelled, then a compute node lost: each costs one try, a new block
runs, and training resumes bitwise.

The micro pipeline trains on 2 nodes x 2 ranks of the multi-node test cluster through the
slurm site, with two retries. Once a complete checkpoint is on disk the first training job
is cancelled (``scancel``): Parsl retries the app in a new block (job), which resumes from
the last complete checkpoint. Once that job has written a checkpoint of its own, the second
node crashes (``.ci/start_slurm.sh --stop-node``: its slurmd and every process in its
namespace, the two ranks there among them, are SIGKILLed). That job must fail, and once the
failure is seen the node comes back (``--start-node``); a third block runs the last try,
training resumes again and ends with the losses, bitwise, of the same rank spec run
uninterrupted as 4 ranks on one node. Every checkpoint is kept, so the one the cancelled
job left is looked at after the run: it was not rewritten.

One pipeline carries both failures (they share the driver, the tokenized corpus and the
plan). The node is started again whatever happens, since other tests share the cluster.
Skipped, with the reason, unless the cluster has two or more nodes.
"""
from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.test_slurm_launch import SLURM_DIR, slurm_env  # noqa: F401 - fixture
from tests.test_slurm_multinode import FIXED, LAYOUTS, multinode, run_on_one_node  # noqa: F401
from tests.test_slurm_pipeline import (
    complete_checkpoints,
    jobcomp_states,
    pipeline_stage_runs,
    srun_steps,
    start_cli,
    train_block_jobs,
    wait_cli,
    wait_for_slurm_to_finish,
    watching,
)

REPO = Path(__file__).resolve().parent.parent
START_SLURM = REPO / ".ci" / "start_slurm.sh"
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS, EVERY = 24, 2
# A lost block is noticed within seconds; the retry's new block is polled for as often.
# Every checkpoint kept: the one seen before the cancel is looked at after the run.
FAILURES_SETTINGS = [f"train.steps={STEPS}", f"train.checkpoint_every={EVERY}",
                     "train.keep_last=100", "site.heartbeat_threshold=10", "site.retries=2",
                     "eval.max_tokens=256"]
# Two failures, two tries. After the node loss the surviving ranks fail first (their peers
# are gone), before Slurm has declared the node down; the retry must not start in that
# dying block (workflows.executors.end_blocks hands it back first).


def node_action(action: str, node: str) -> None:
    """``.ci/start_slurm.sh --stop-node/--start-node NODE`` on the running cluster."""
    proc = subprocess.run(["bash", str(START_SLURM), "--state-dir", str(SLURM_DIR),
                           f"--{action}-node", node], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, f"--{action}-node {node}: {proc.stdout}{proc.stderr}"


def cancel_then_crash_node(runs_dir: Path, node: str, found: dict,
                           stop: threading.Event) -> None:
    """Once a complete checkpoint exists, scancel the first training job; once the second
    job has written a checkpoint of its own, crash ``node``; bring it back once that job has
    failed (slurmctld has ended it)."""
    while not stop.is_set():
        done = complete_checkpoints(runs_dir)
        jobs = train_block_jobs(runs_dir)
        if done and "0" in jobs:
            found.update(cancelled_checkpoint=done[0], cancelled_job=jobs["0"],
                         cancelled_at=time.time())
            subprocess.run(["scancel", jobs["0"]], check=True, timeout=30)
            break
        time.sleep(0.1)
    while not stop.is_set():
        jobs = train_block_jobs(runs_dir)
        if "1" in jobs:
            found["second_seen_at"] = time.time()
            break
        time.sleep(0.1)
    while not stop.is_set():
        fresh = [c for c in complete_checkpoints(runs_dir)
                 if c.stat().st_mtime > found["second_seen_at"]]
        if fresh:
            node_action("stop", node)
            found.update(checkpoint=fresh[-1].name, job=train_block_jobs(runs_dir)["1"],
                         crashed_at=time.time())
            break
        time.sleep(0.1)
    while not stop.is_set():
        if found["job"] in jobcomp_states():
            found["failed_after"] = time.time() - found["crashed_at"]
            node_action("start", node)
            found["restarted"] = True
            return
        time.sleep(0.5)


@pytest.mark.timeout(1200)
def test_training_survives_a_cancelled_job_and_a_lost_node(multinode, slurm_env,  # noqa: F811
                                                           tmp_path, seed_microbench):
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    seed_microbench(runs_dir, 4, hosts=tuple(multinode["hosts"]))
    lost = multinode["hosts"][1]  # not the first node: the batch script there lives on
    started = time.time()
    proc = start_cli(runs_dir, f"site.address={multinode['login_addr']}", "parallel.nproc=4",
                     "parallel.nodes=2", *FIXED, *LAYOUTS["dp_across_nodes"],
                     *FAILURES_SETTINGS)
    try:
        with watching(cancel_then_crash_node, runs_dir, lost) as found:
            output = wait_cli(proc, runs_dir, timeout=900)
    finally:
        for job in train_block_jobs(runs_dir).values():  # a hung run leaves none behind
            subprocess.run(["scancel", job], timeout=30, check=False)
        node_action("start", lost)  # whatever happened, the node takes jobs again
    print(f"pipeline {time.time() - started:.0f} s; {found}")
    assert "cancelled_job" in found, "training finished before a checkpoint could be cancelled"
    assert "job" in found, "training finished before a node could be lost"
    assert found.get("restarted"), f"the training job never ended after the node loss: {found}"

    parents, children = pipeline_stage_runs(runs_dir)
    assert parents[0].info.status == "FINISHED"
    assert children["train"].info.status == "FINISHED", output[-3000:]

    # Parsl replaced the cancelled block (job) with a new one and reran the ranks there; that
    # job failed with the node, and a third block ran the last try.
    jobs = train_block_jobs(runs_dir)
    assert set(jobs) == {"0", "1", "2"}, jobs
    wait_for_slurm_to_finish(list(jobs.values()))
    states = jobcomp_states()
    assert jobs["0"] == found["cancelled_job"] and states[jobs["0"]][1].startswith("CANCELLED")
    assert jobs["1"] == found["job"]
    assert states[jobs["1"]][1] == "NODE_FAIL"
    for retry in ("1", "2"):
        assert srun_steps(jobs[retry]), f"no srun step of retry job {jobs[retry]}"
    for attempt in (1, 2):
        assert re.search(rf"\[pipeline\] ranks_app failed on attempt {attempt} \(.*\); "
                         "retrying$", output, re.MULTILINE), output[-4000:]
    assert "failed on attempt 3" not in output, output[-4000:]  # two failures, two tries

    # Training resumed each time from a checkpoint written before the failure (or a later
    # one of the dying job), not from scratch; the checkpoint the cancelled job left was not
    # rewritten, and the last one is newer than both failures.
    resumed = [int(step) for step in re.findall(r"resumed from step (\d+)", output)]
    assert len(resumed) >= 2, output[-4000:]
    first = found["cancelled_checkpoint"]
    assert resumed[0] >= int(first.name.split("-")[1]) > 0
    assert resumed[-1] >= int(found["checkpoint"].split("-")[1]) > resumed[0]
    assert resumed[-1] < STEPS, "the node was lost after training ended"

    summary_path = next(p for p in runs_dir.glob("stages/train/*/summary.json")
                        if not p.parent.name.endswith(".partial"))
    train_dir = summary_path.parent
    summary = json.loads(summary_path.read_text())
    # The stage publishes its work directory when done: look the checkpoint up there.
    kept = train_dir / "checkpoints" / first.name
    assert kept.is_dir() and kept.stat().st_mtime < found["cancelled_at"], (
        f"{kept} was rewritten after the cancel: training restarted from scratch")
    final = train_dir / "checkpoints" / Path(summary["checkpoint"]).name
    assert final.name == f"step-{STEPS:08d}" and final.stat().st_mtime > found["crashed_at"]
    first_host, second_host = multinode["hosts"][:2]
    assert summary["hosts"] == [first_host, first_host, second_host, second_host]
    assert summary["steps_done"] == STEPS and len(summary["losses"]) == STEPS
    reference = run_on_one_node(summary_path.parent / "spec.json", tmp_path / "reference")
    assert summary["losses"] == reference["losses"], (summary["losses"], reference["losses"])
