"""Frontier at scale: above NODE_LOCAL_ENV_NODES nodes in one job the readiness report errors
unless the ranks import Python from node-local NVMe (site.node_local_env), and a hub corpus
is an error unless the compute nodes that fetch it go through OLCF's proxy; each with the fix."""
from __future__ import annotations

from pathlib import Path

import pytest

from stages.config import load_config
from workflows.frontier import FRONTIER_PROXY, NODE_LOCAL_ENV_NODES, hub_fetch_problem
from workflows.pipeline import main
from workflows.readiness import readiness

ROOT = Path(__file__).resolve().parents[1]
# The same preset's plan is asked for by most tests: searched once (conftest.py).
pytestmark = pytest.mark.usefixtures("plan_search_once")
LUSTRE = "/lustre/orion/abc123/scratch/user/runs"
PACKED = "site.node_local_env=/lustre/orion/abc123/proj-shared/envs/frontier-llm.tar.gz"
PROXY = f"site.worker_init=module load x; export https_proxy={FRONTIER_PROXY}"
LOCAL_CORPUS = "data.source=/lustre/orion/abc123/proj-shared/fineweb/*.parquet"


def rows(*overrides: str, preset: str = "frontier-175b") -> dict:
    cfg = load_config(str(ROOT / "configs" / f"{preset}.yaml"),
                      ["site.account=abc123", f"tracking.runs_dir={LUSTRE}", *overrides])
    return {row.check: row for row in readiness(cfg)}


def test_a_384_node_job_needs_the_environment_on_node_local_nvme() -> None:
    found = rows(PROXY)["environment"]  # 175b: 384 nodes
    assert found.verdict == "error" and "largest job 384 node(s)" in found.value
    assert "site.node_local_env=" in found.fix and "sbcast" in found.fix
    assert f"above {NODE_LOCAL_ENV_NODES} nodes" in found.fix
    conda = rows(PROXY, "site.conda_env=/ccs/proj/abc123/envs/llm")["environment"]
    assert conda.verdict == "error" and "unset site.conda_env" in conda.fix
    packed = rows(PROXY, PACKED)["environment"]
    assert packed.verdict == "ok" and "NVMe" in packed.value
    # at the threshold the shared file system is still fine
    small = rows(PROXY, f"parallel.nodes={NODE_LOCAL_ENV_NODES}",
                 f"parallel.nproc={NODE_LOCAL_ENV_NODES * 8}", "eval.layout=replicas",
                 "eval.ranks=1", preset="frontier-22b")["environment"]
    assert small.verdict == "ok", small


def test_a_hub_corpus_on_frontier_needs_the_proxy_or_a_copy() -> None:
    found = rows(PACKED)["corpus fetch"]
    assert found.verdict == "error" and "compute node" in found.value
    assert "login node or a data-transfer node" in found.fix
    assert f"https_proxy={FRONTIER_PROXY}" in found.fix
    assert rows(PACKED, PROXY)["corpus fetch"].verdict == "ok"
    assert "corpus fetch" not in rows(PACKED, LOCAL_CORPUS)  # nothing to fetch
    local = load_config("micro", ["data.source=hf:org/corpus"])
    assert hub_fetch_problem(local) is None  # a laptop fetches over its own network


def test_the_dry_run_exits_2_on_them(capsys) -> None:
    args = ["--config", str(ROOT / "configs" / "frontier-175b.yaml"), "--dry-run",
            "--runs-dir", LUSTRE, "--set", "site.account=abc123"]
    assert main(args) == 2
    out = capsys.readouterr().out
    assert "2 error(s)" in out and "environment" in out and "corpus fetch" in out
    assert main([*args, PACKED, PROXY]) == 0
