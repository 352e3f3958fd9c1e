"""Tokenization on the compute nodes and evaluation in an allocation of its own, on the
multi-node test cluster (``.ci/start_slurm.sh --nodes 2``).

One micro pipeline with ``--site slurm site.tokenize_nodes=2`` and 4 input shards: the
tokenize stage's apps run on the "compute" executor, a Slurm job of both nodes with one
Parsl worker pool per node, and each shard records the host that encoded it; the plan
stage, asked to rehearse its pick, runs in that block too (its output names the host); evaluation
runs on the "evaluate" executor, in a block of its own. Checked: both nodes encoded shards and
the login node none (part records and manifest agree), the store's tokens equal the same
configuration tokenized in this process, the compute block was one Slurm job, and the
evaluation report was written on a compute node.

Skipped, with the reason, unless the cluster has two or more nodes.
"""
from __future__ import annotations

import json
import socket
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data_prep.store import SPLITS, SplitReader, open_store
from stages.config import load_config
from stages.inline import run_work
from stages.registry import declaration
from tests.test_data_common import make_tracker
from tests.test_slurm_launch import slurm_env  # noqa: F401 - fixture
from tests.test_slurm_multinode import multinode  # noqa: F401 - fixture
from tests.test_slurm_pipeline import (
    block_jobs,
    jobcomp_states,
    start_cli,
    wait_cli,
    wait_for_slurm_to_finish,
)

TOKENIZE = declaration("tokenize")

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

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


@pytest.mark.timeout(1200)
def test_tokenize_fans_out_on_compute_nodes_and_evaluate_runs_in_its_allocation(
        multinode, tmp_path, seed_microbench, seed_store):  # noqa: F811
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    seed_microbench(runs_dir)
    nodes = set(multinode["hosts"][:2])
    login = socket.gethostname()
    assert login not in nodes

    proc = start_cli(runs_dir, f"site.address={multinode['login_addr']}",
                     "site.tokenize_nodes=2", "parallel.rehearse=true", *DATA)
    output = wait_cli(proc, runs_dir, timeout=900)

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
    name, _ = jobcomp_states().get(jobs[0], ("?", "?"))
    assert name.startswith("parsl.compute.block-0"), name

    # The same configuration tokenized in this process gives the same tokens.
    cfg = load_config("micro", DATA)
    tracker, _, _ = make_tracker(tmp_path / "local-mlflow", seed_store)
    local = run_work(TOKENIZE, cfg, {}, tmp_path / "local", tracker)
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

    # The plan stage, rehearsing, ran on a compute node of the same block, not the login node.
    plan_out = json.loads((stage_dir(runs_dir, "plan") / "outputs.json").read_text())
    assert plan_out["host"] in nodes and "rehearsal" in plan_out, plan_out

    # Evaluation ran in its allocation: its report was written on a compute node.
    report = json.loads((stage_dir(runs_dir, "evaluate") / "report.json").read_text())
    assert report["host"] in nodes, report["host"]
    assert report["tokens"] > 0
