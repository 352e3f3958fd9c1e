"""A compute node lost mid-training: the job fails, a new block runs, training resumes bitwise.

The micro pipeline trains on 2 nodes x 2 ranks of the multi-node test cluster through the
slurm site. Once a complete checkpoint is on disk, the second node crashes
(``.ci/start_slurm.sh --stop-node``: its slurmd and every process in its namespace, the
two ranks there among them, are SIGKILLed). The training job must fail, and once the
failure is seen the node comes back (``--start-node``); Parsl then runs the retried app in
a new block, training resumes from the last complete checkpoint (the console says
``resumed from step N``) and ends with the losses, bitwise, of the same rank spec run
uninterrupted as 4 ranks on one node.

The node is started again whatever happens, since other tests share the cluster. Skipped,
with the reason, unless the cluster has two or more nodes.
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
    start_cli,
    train_block_jobs,
    wait_cli,
    watching,
)

REPO = Path(__file__).resolve().parent.parent
START_SLURM = REPO / ".ci" / "start_slurm.sh"
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS, EVERY = 20, 2
# A lost block is noticed within seconds; the retry's new block is polled for as often.
NODE_LOSS_SETTINGS = [f"train.steps={STEPS}", f"train.checkpoint_every={EVERY}",
                      "site.heartbeat_threshold=10", "eval.max_tokens=256"]
# The default site.retries=1: one lost node costs one try. The surviving ranks fail first
# (their peers are gone), before Slurm has declared the node down; the retry must not start
# in that dying block (workflows.executors.end_blocks hands it back first).


def node_action(action: str, node: str) -> None:
    """``.ci/start_slurm.sh --stop-node/--start-node NODE`` on the running cluster."""
    proc = subprocess.run(["bash", str(START_SLURM), "--state-dir", str(SLURM_DIR),
                           f"--{action}-node", node], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, f"--{action}-node {node}: {proc.stdout}{proc.stderr}"


def crash_node_after_checkpoint(runs_dir: Path, node: str, found: dict,
                                stop: threading.Event) -> None:
    """Once a complete checkpoint exists, crash ``node``; bring it back once the training
    job has failed (slurmctld has ended it)."""
    while not stop.is_set():
        jobs = train_block_jobs(runs_dir)
        done = complete_checkpoints(runs_dir)
        if done and "0" in jobs:
            node_action("stop", node)
            found.update(checkpoint=done[-1].name, job=jobs["0"], crashed_at=time.time())
            break
        time.sleep(0.1)
    while not stop.is_set():
        if found["job"] in jobcomp_states():
            found["failed_after"] = time.time() - found["crashed_at"]
            node_action("start", node)
            found["restarted"] = True
            return
        time.sleep(0.5)


@pytest.mark.timeout(900)
def test_training_survives_a_lost_node(multinode, slurm_env, tmp_path,  # noqa: F811
                                       seed_microbench):
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    seed_microbench(runs_dir, 4)
    lost = multinode["hosts"][1]  # not the first node: the batch script there lives on
    started = time.time()
    proc = start_cli(runs_dir, f"site.address={multinode['login_addr']}", "parallel.nproc=4",
                     "parallel.nodes=2", *FIXED, *LAYOUTS["dp_across_nodes"],
                     *NODE_LOSS_SETTINGS)
    try:
        with watching(crash_node_after_checkpoint, runs_dir, lost) as found:
            output = wait_cli(proc, runs_dir, timeout=600)
    finally:
        for job in train_block_jobs(runs_dir).values():  # a hung run leaves none behind
            subprocess.run(["scancel", job], timeout=30, check=False)
        node_action("start", lost)  # whatever happened, the node takes jobs again
    print(f"pipeline {time.time() - started:.0f} s; {found}")
    assert "job" in found, "training finished before a node could be lost"
    assert found.get("restarted"), f"the training job never ended after the node loss: {found}"

    # The first block's job failed with the node; a second block ran the retry.
    jobs = train_block_jobs(runs_dir)
    assert set(jobs) == {"0", "1"}, jobs
    assert jobs["0"] == found["job"]
    assert jobcomp_states()[jobs["0"]][1] == "NODE_FAIL"
    assert re.search(r"\[pipeline\] ranks_app failed on attempt 1 \(.*\); retrying$", output,
                     re.MULTILINE), output[-4000:]
    assert "failed on attempt 2" not in output, output[-4000:]  # one loss, one try
    # Training resumed from the last checkpoint written before the crash (or a later one of
    # the dying job), not from scratch.
    resumed = re.findall(r"resumed from step (\d+)", output)
    assert resumed, output[-4000:]
    assert int(resumed[-1]) >= int(found["checkpoint"].split("-")[1]) > 0
    assert int(resumed[-1]) < STEPS, "the node was lost after training ended"

    summary_path = next(p for p in runs_dir.glob("stages/train/*/summary.json")
                        if not p.parent.name.endswith(".partial"))
    summary = json.loads(summary_path.read_text())
    first, second = multinode["hosts"][:2]
    assert summary["hosts"] == [first, first, second, second]
    assert summary["steps_done"] == STEPS and len(summary["losses"]) == STEPS
    reference = run_on_one_node(summary_path.parent / "spec.json", tmp_path / "reference")
    assert summary["losses"] == reference["losses"], (summary["losses"], reference["losses"])
