"""Training across two compute nodes of the multi-node test cluster.

``.ci/start_slurm.sh --nodes 2`` makes each compute node a network + UTS namespace with its
own hostname, address on a bridge and slurmd; the driver, Parsl's interchange and MLflow stay
on the login node (this machine's own namespaces), reached by the nodes at the bridge
address the env file names. The micro pipeline trains on 2 nodes x 2 ranks through the slurm
site (SlurmProvider block, MPIExecutor, srun), the ranks meeting at the first node's address
across the bridge; every rank's hostname is in summary.json, and the losses equal the same
rank spec run as 4 ranks on one node by torchrun, for a layout whose pipeline stages sit on
different nodes. (A layout whose data-parallel groups span the nodes is the lost-node
test's, ``test_slurm_node_loss.py``, which ends with the same comparison; the walltime
chain's dp=2 across nodes too.)

Skipped, with the reason, unless the env file of the cluster (FRONTIER_LLM_SLURM_DIR,
default /tmp/frontier-llm-slurm) says it has two or more nodes.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stages import tracking
from tests.test_slurm_launch import SLURM_DIR, slurm_env  # noqa: F401 - fixture
from tests.test_slurm_pipeline import start_cli, wait_cli

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Fixed plans (the plan stage takes them as given): tp pairs stay on one node, so the dp
# groups span the nodes; with tp=1 the two pipeline stages sit on different nodes.
FIXED = ["parallel.micro_batch=1", "parallel.schedule=1f1b", "parallel.recompute=none"]
LAYOUTS = {
    "dp_across_nodes": ["parallel.tp=2", "parallel.pp=1", "parallel.sharding=zero2"],
    "pp_across_nodes": ["parallel.tp=1", "parallel.pp=2", "parallel.sharding=ddp"],
}


@pytest.fixture(scope="module")
def multinode(slurm_env) -> dict[str, str]:  # noqa: F811
    """The cluster's facts: its node names and the login node's address on the bridge."""
    nodes = int(slurm_env.get("FRONTIER_LLM_SLURM_NODES", "1"))
    if nodes < 2:
        pytest.skip(f"the Slurm cluster in {SLURM_DIR} has one node: start a multi-node one "
                    "with .ci/start_slurm.sh --nodes 2")
    names = subprocess.run(["sinfo", "-h", "-o", "%N"], capture_output=True, text=True,
                           timeout=30, check=True).stdout.strip()
    hosts = subprocess.run(["scontrol", "show", "hostnames", names], capture_output=True,
                           text=True, timeout=30, check=True).stdout.split()
    assert len(hosts) == nodes, (names, hosts)
    return {"login_addr": slurm_env["FRONTIER_LLM_SLURM_LOGIN_ADDR"], "hosts": hosts}


def node_addr(host: str) -> str:
    """The address slurmctld reaches a node at (its NodeAddr)."""
    out = subprocess.run(["scontrol", "show", "node", host], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return out.split("NodeAddr=")[1].split()[0]


def run_on_one_node(spec_path: Path, out_dir: Path) -> dict:
    """The same rank spec as 4 ranks on this machine (torchrun), without tracking."""
    spec = json.loads(spec_path.read_text())
    spec.update(nodes=1, out_dir=str(out_dir), tracking=None)
    out_dir.mkdir(parents=True)
    local_spec = out_dir / "spec.json"
    local_spec.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run([sys.executable, "-m", "stages.launch", "--spec", str(local_spec)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out_dir / "summary.json").read_text())


@pytest.mark.timeout(1500)
def test_pipeline_stages_across_two_nodes_equal_one_node(multinode, tmp_path, seed_microbench):
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    seed_microbench(runs_dir, 4)
    first, second = multinode["hosts"][:2]
    # The rendezvous host (first node of the job) resolves to its bridge address, which is
    # not this machine's: the ranks meet across the bridge.
    assert socket.gethostbyname(first) == node_addr(first) != multinode["login_addr"]

    # Two evaluation ranks in the evaluation's allocation, on one node. The ranks log
    # through the driver's MLflow server (tracking.server), reached from the nodes at
    # site.address (the lost-node test's write the runs dir's SQLite file directly).
    proc = start_cli(runs_dir, f"site.address={multinode['login_addr']}", "eval.ranks=2",
                     "parallel.nproc=4", "parallel.nodes=2", *FIXED,
                     *LAYOUTS["pp_across_nodes"], "tracking.server=true")
    output = wait_cli(proc, runs_dir, timeout=1200)
    server_line = f"[tracking] MLflow server at http://{multinode['login_addr']}:"
    assert server_line in output, output[-3000:]
    train_dirs = sorted(runs_dir.glob("stages/train/*/summary.json"))
    summary_path = max(train_dirs, key=lambda p: p.stat().st_mtime)
    summary = json.loads(summary_path.read_text())

    plan = summary["plan"]
    assert (plan["tp"], plan["pp"], plan["dp"]) == (1, 2, 2)
    # srun placed ranks 0-1 on the first node and 2-3 on the second.
    assert summary["world_size"] == 4
    assert summary["hosts"] == [first, first, second, second]
    assert summary["steps_done"] == 6 and len(summary["losses"]) == 6
    # Every step reached the store (through the server or not), in the train run the
    # stage's status names.
    store = tracking.default_tracking_uri(runs_dir)
    run_id = json.loads((summary_path.parent / "status.json").read_text())["run_id"]
    losses = tracking.metric_history(store, run_id, "loss")
    assert sorted(step for step, _ in losses) == list(range(1, 7))
    reports = sorted(runs_dir.glob("stages/evaluate/*/report.json"),
                     key=lambda p: p.stat().st_mtime)
    report = json.loads(reports[-1].read_text())
    assert report["eval_ranks"] == 2 and report["host"] in (first, second)

    local = run_on_one_node(summary_path.parent / "spec.json", tmp_path / "one-node")
    assert local["hosts"] == [socket.gethostname()] * 4
    assert local["plan"]["tp"] == plan["tp"] and local["plan"]["pp"] == plan["pp"]
    diffs = [abs(a - b) for a, b in zip(summary["losses"], local["losses"], strict=True)]
    assert max(diffs) <= 1e-6, (summary["losses"], local["losses"])
