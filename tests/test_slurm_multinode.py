"""The micro pipeline across the two compute nodes of the multi-node test cluster.

``.ci/start_slurm.sh --nodes 2`` makes each compute node a network + UTS namespace with its
own hostname, address on a bridge and slurmd; the driver, Parsl's interchanges and MLflow
stay on the login node (this machine's own namespaces), reached by the nodes at the bridge
address the env file names.

One pipeline (``micro_on_the_cluster``), read by every test here, uses each part of the
slurm site at once: the tokenize stage fans its 4 shards out over a "compute" block of both
nodes, one Parsl worker pool per node (``site.tokenize_nodes=2``); the plan stage rehearses
its plan in that block; training runs 2 nodes x 2 ranks through the "train" block's
MPIExecutor and srun, the ranks meeting at the first node's address across the bridge, the
two pipeline stages on different nodes, logging through the driver's MLflow server; the
evaluation runs 2 ranks in a job of its own, started once the training's job was handed
back. The tests check each part's records: Slurm's accounting and slurmd's logs, the
shards' hosts and tokens against the same configuration tokenized here, every rank's
hostname, and the losses against the same rank spec run as 4 ranks on one node by the local
launcher.
(A layout whose data-parallel groups span the nodes is the lost-node test's,
``test_slurm_node_loss.py``, which ends with the same comparison; the walltime chain's
dp=2 across nodes too.)

Skipped, with the reason, unless the env file of the cluster (FRONTIER_LLM_SLURM_DIR,
default /tmp/frontier-llm-slurm) says it has two or more nodes.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data_prep.store import SPLITS, SplitReader, open_store
from stages.config import load_config
from stages.mechanism import tracking, tracking_store
from stages.mechanism.walk import run_work
from stages.registry import STAGE_ORDER, declaration
from tests.test_data_common import make_tracker
from tests.test_slurm_launch import SLURM_DIR, slurm_env  # noqa: F401 - fixture
from tests.test_slurm_pipeline import (
    block_jobs,
    jobcomp_records,
    pipeline_stage_runs,
    srun_steps,
    start_cli,
    wait_cli,
    wait_for_slurm_to_finish,
)
from tests.train_helpers import run_ranks

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
    """The same rank spec as 4 ranks on this machine, as the local launcher starts them
    (``train_helpers.run_ranks``), without tracking or the cluster's variables."""
    spec = json.loads(spec_path.read_text())
    spec.update(nodes=1, out_dir=str(out_dir), tracking=None)
    out_dir.mkdir(parents=True)
    local_spec = out_dir / "spec.json"
    local_spec.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    code, stdout, stderr = run_ranks(spec["worker"], local_spec, spec["nproc"], timeout=600,
                                     base_env=env)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    return json.loads((out_dir / "summary.json").read_text())


SHARDS = 4
DATA = [f"data.num_shards={SHARDS}"]


def stage_dir(runs_dir: Path, name: str) -> Path:
    """The one published output directory of a stage in ``runs_dir``."""
    dirs = [p for p in (runs_dir / "stages" / name).iterdir()
            if p.is_dir() and not p.name.endswith(".partial")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def split_tokens(store_path: Path) -> dict[str, np.ndarray]:
    """Every token of each split, in order."""
    info = open_store(store_path)
    return {split: SplitReader(info, split).read(0, info.splits[split].tokens)
            for split in SPLITS}


@pytest.fixture(scope="module")
def micro_on_the_cluster(multinode, tmp_path_factory: pytest.TempPathFactory,
                         seed_microbench) -> dict:
    """The module's one micro pipeline on the cluster (see the module's docstring), run
    once; its runs dir and the driver's console."""
    runs_dir = tmp_path_factory.mktemp("micro-on-the-cluster") / "runs"
    runs_dir.mkdir()
    seed_microbench(runs_dir, 4, hosts=tuple(multinode["hosts"]))
    proc = start_cli(runs_dir, f"site.address={multinode['login_addr']}",
                     "site.tokenize_nodes=2", "parallel.rehearse=true", *DATA,
                     "eval.ranks=2", "parallel.nproc=4", "parallel.nodes=2", *FIXED,
                     *LAYOUTS["pp_across_nodes"], "tracking.server=true")
    return {"runs_dir": runs_dir, "output": wait_cli(proc, runs_dir, timeout=1200)}


@pytest.mark.timeout(1500)
def test_training_and_evaluation_run_as_srun_steps_of_jobs_of_their_own(micro_on_the_cluster):
    runs_dir, output = micro_on_the_cluster["runs_dir"], micro_on_the_cluster["output"]
    parents, children = pipeline_stage_runs(runs_dir)
    assert parents[0].info.status == "FINISHED"
    assert sorted(children) == sorted(STAGE_ORDER)
    for name, run in children.items():
        assert run.info.status == "FINISHED", (name, output[-3000:])

    # Slurm ran the training block as a batch job, and the ranks as an srun step in it; the
    # evaluation ran in a job of its own, with its ranks as its one srun step, and the
    # training's job was handed back when training was done, not held through evaluation.
    jobs, evaluation = block_jobs(runs_dir, "train"), block_jobs(runs_dir, "evaluate")
    assert list(jobs) == ["0"] and list(evaluation) == ["0"], (jobs, evaluation)
    job_id, eval_id = jobs["0"], evaluation["0"]
    wait_for_slurm_to_finish([job_id, eval_id])
    records = jobcomp_records()
    name, state, _, train_end = records[job_id]
    assert name.startswith("parsl.train.block-0") and state == "CANCELLED", records[job_id]
    eval_name, _, eval_start, _ = records[eval_id]
    assert eval_name.startswith("parsl.evaluate.block-0"), eval_name
    assert train_end <= eval_start, (records[job_id], records[eval_id])
    assert srun_steps(job_id) == ["0"] and srun_steps(eval_id) == ["0"], (
        srun_steps(job_id), srun_steps(eval_id))
    assert children["evaluate"].data.metrics["eval_ranks"] == 2
    report = json.loads((stage_dir(runs_dir, "evaluate") / "report.json").read_text())
    assert report["eval_ranks"] == 2 and len(report["windows_per_rank"]) == 2
    # The plan stage ran on a node (its own hostname) and priced the plan with the runs dir's
    # copy of the measurement (``seed_microbench``'s hosts), measuring nothing there.
    figures = json.loads((stage_dir(runs_dir, "plan") / "plan.json").read_text())["figures"]
    assert figures["figures"] == "cached", figures
    assert Path(figures["source"]).parent == runs_dir / "cache" / "microbench", figures
    assert not Path(figures["source"]).name.startswith(f"microbench-{socket.gethostname()}-")


@pytest.mark.timeout(1500)
def test_pipeline_stages_across_two_nodes_equal_one_node(micro_on_the_cluster, multinode,
                                                         tmp_path):
    runs_dir, output = micro_on_the_cluster["runs_dir"], micro_on_the_cluster["output"]
    first, second = multinode["hosts"][:2]
    # The rendezvous host (first node of the job) resolves to its bridge address, which is
    # not this machine's: the ranks meet across the bridge.
    assert socket.gethostbyname(first) == node_addr(first) != multinode["login_addr"]
    # The ranks logged through the driver's MLflow server (tracking.server), reached from
    # the nodes at site.address (the lost-node test's write the runs dir's SQLite file).
    server_line = f"[tracking] MLflow server at http://{multinode['login_addr']}:"
    assert server_line in output, output[-3000:]
    summary_path = stage_dir(runs_dir, "train") / "summary.json"
    summary = json.loads(summary_path.read_text())

    plan = summary["plan"]
    assert (plan["tp"], plan["pp"], plan["dp"]) == (1, 2, 2)
    # srun placed ranks 0-1 on the first node and 2-3 on the second.
    assert summary["world_size"] == 4
    assert summary["hosts"] == [first, first, second, second]
    assert summary["steps_done"] == 6 and len(summary["losses"]) == 6
    # Every step reached the store (through the server or not), in the train run the
    # stage's status names.
    store = tracking_store.default_tracking_uri(runs_dir)
    run_id = json.loads((summary_path.parent / "status.json").read_text())["run_id"]
    losses = tracking.metric_history(store, run_id, "loss")
    assert sorted(step for step, _ in losses) == list(range(1, 7))
    report = json.loads((stage_dir(runs_dir, "evaluate") / "report.json").read_text())
    assert report["eval_ranks"] == 2 and report["host"] in (first, second)

    local = run_on_one_node(summary_path.parent / "spec.json", tmp_path / "one-node")
    assert local["hosts"] == [socket.gethostname()] * 4
    assert local["plan"]["tp"] == plan["tp"] and local["plan"]["pp"] == plan["pp"]
    diffs = [abs(a - b) for a, b in zip(summary["losses"], local["losses"], strict=True)]
    assert max(diffs) <= 1e-6, (summary["losses"], local["losses"])


@pytest.mark.timeout(1500)
def test_tokenize_fans_out_on_compute_nodes_and_the_plan_rehearses_there(
        micro_on_the_cluster, multinode, tmp_path, seed_store):
    runs_dir, output = micro_on_the_cluster["runs_dir"], micro_on_the_cluster["output"]
    nodes = set(multinode["hosts"][:2])
    login = socket.gethostname()
    assert login not in nodes

    # Every shard was encoded on a compute node, on both of them, none on the login node.
    tok_dir = stage_dir(runs_dir, "tokenize")
    records = [json.loads(p.read_text())["result"]
               for p in sorted((tok_dir / "parts").glob("*.json"))]
    assert [r["shard"] for r in records] == list(range(SHARDS))
    hosts = {r["shard"]: r["host"] for r in records}
    assert set(hosts.values()) == nodes, (hosts, output[-3000:])
    manifest = json.loads((tok_dir / "store.zarr" / "manifest.json").read_text())
    for split in SPLITS:
        parts = manifest["splits"][split]["parts"]
        assert [p["host"] for p in parts] == [hosts[i] for i in range(SHARDS)]
    counts = Counter(hosts.values())
    assert "tokenize: shards encoded on " + ", ".join(
        f"{host} ({counts[host]})" for host in sorted(counts)) in output

    # The compute block was one Slurm job of both nodes, named after its executor.
    jobs = list(block_jobs(runs_dir, "compute").values())
    assert len(jobs) == 1, jobs
    wait_for_slurm_to_finish(jobs)
    name = jobcomp_records().get(jobs[0], ("?",))[0]
    assert name.startswith("parsl.compute.block-0"), name

    # The same configuration curated and tokenized in this process gives the same tokens.
    cfg = load_config("micro", DATA)
    tracker, _, _ = make_tracker(tmp_path / "local-mlflow", seed_store)
    curated = run_work(declaration("curate"), cfg, {}, tmp_path / "local-curate", tracker)
    local = run_work(declaration("tokenize"), cfg, {"curate": curated}, tmp_path / "local",
                     tracker)
    assert open_store(local["store"]).tokenizer_hash == open_store(
        tok_dir / "store.zarr").tokenizer_hash
    here, there = split_tokens(Path(local["store"])), split_tokens(tok_dir / "store.zarr")
    for split in SPLITS:
        assert here[split].size > 0
        assert np.array_equal(here[split], there[split]), split
    local_manifest = json.loads((Path(local["store"]) / "manifest.json").read_text())
    for split in SPLITS:
        counts = [(p["tokens"], p["documents"]) for p in local_manifest["splits"][split]["parts"]]
        assert counts == [(p["tokens"], p["documents"])
                          for p in manifest["splits"][split]["parts"]]
        assert {p["host"] for p in local_manifest["splits"][split]["parts"]} == {login}

    # The plan stage, rehearsing, ran on a compute node of the same block, not the login
    # node; the evaluation's report was written on a compute node too.
    plan_out = json.loads((stage_dir(runs_dir, "plan") / "outputs.json").read_text())
    assert plan_out["host"] in nodes and "rehearsal" in plan_out, plan_out
    report = json.loads((stage_dir(runs_dir, "evaluate") / "report.json").read_text())
    assert report["host"] in nodes, report["host"]
    assert report["tokens"] > 0
