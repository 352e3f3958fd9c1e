"""A scaling study across the two nodes of the multi-node Slurm test cluster.

The micro preset's weak study on 2 and 4 ranks at 2 ranks per node, through the slurm site:
the 2-rank point trains on one node, the 4-rank point on both (its ranks meeting across the
bridge). Each point runs in a Slurm block of its own size, so the one-node point is not
placed inside a two-node job. Then the weak study again, which reuses every stage and
submits no job. (The strong study, and its reuse of the weak study's point, are the same
code on any site: ``test_scaling.py`` runs them locally.)

Skipped, with the reason, unless the cluster's env file says it has two or more nodes.
"""
from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from stages.mechanism import tracking, tracking_store
from tests import warm_cli
from tests.test_scaling import point_runs, read_csv, stage_dirs
from tests.test_slurm_launch import slurm_env  # noqa: F401 - fixture
from tests.test_slurm_multinode import multinode  # noqa: F401 - fixture
from tests.test_slurm_pipeline import SLURM_SETTINGS
from workflows import scaling

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slurm, pytest.mark.slow]
DEVICES = (2, 4)
RANKS_PER_NODE = 2


def run_study(runs_dir: Path, out: Path, mode: str, login_addr: str) -> str:
    """One study through the slurm site; its driver output."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    argv = ["--config", "micro", "--mode", mode, "--devices", ",".join(map(str, DEVICES)),
            "--site", "slurm", "--ranks-per-node", str(RANKS_PER_NODE), "--runs-dir",
            str(runs_dir), "--out", str(out), "--set", f"site.address={login_addr}",
            *SLURM_SETTINGS, "train.steps=3", "train.checkpoint_every=0"]
    proc = warm_cli.run("workflows.scaling", argv, cwd=REPO, env=env, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def train_summary(runs_dir: Path, train_key: str) -> dict:
    return json.loads((runs_dir / "stages" / "train" / train_key / "summary.json").read_text())


def train_blocks(runs_dir: Path) -> list[int]:
    """The node count of every training block (Slurm job) Parsl submitted, in order (its
    batch script: ``parsl.train.block-<n>.<submit time>``, beside .stdout and .stderr)."""
    scripts = [p for p in runs_dir.glob("parsl/*/*/submit_scripts/parsl.train.block-*")
               if p.suffix not in (".stdout", ".stderr")]
    scripts.sort(key=lambda p: float(p.name.split(".", 3)[3]))
    return [int(re.search(r"#SBATCH --nodes=(\d+)", p.read_text()).group(1)) for p in scripts]


@pytest.mark.timeout(2400)
def test_weak_study_across_two_nodes_runs_tracks_and_reruns_from_reuse(
        multinode, tmp_path: Path, seed_microbench: Callable[[Path], Path]) -> None:  # noqa: F811
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    seed_microbench(runs_dir, *DEVICES, hosts=tuple(multinode["hosts"]))
    first, second = multinode["hosts"][:2]
    out = tmp_path / "weak"
    run_study(runs_dir, out, "weak", multinode["login_addr"])
    rows = read_csv(out / scaling.CSV_FILE)
    assert [int(r["devices"]) for r in rows] == list(DEVICES)
    assert [int(r["nodes"]) for r in rows] == [1, 2]
    assert [int(r["ranks_per_node"]) for r in rows] == [RANKS_PER_NODE] * 2
    # micro: 4 sequences on 2 ranks
    assert [int(r["global_batch"]) for r in rows] == [4, 8]
    for r in rows:
        assert int(r["tp"]) * int(r["pp"]) * int(r["dp"]) == int(r["devices"])
        assert float(r["tokens_per_s"]) > 0 and float(r["predicted_tokens_per_s"]) > 0
    # the 2-rank point on one compute node, the 4-rank point on both, 2 ranks each
    one, both = (train_summary(runs_dir, r["train_key"]) for r in rows)
    assert one["world_size"] == 2 and len(set(one["hosts"])) == 1
    assert one["hosts"][0] in (first, second) and rows[0]["hosts"] == one["hosts"][0]
    assert both["world_size"] == 4 and both["hosts"] == [first, first, second, second]
    assert rows[1]["hosts"] == f"{first} {second}"
    # efficiency: throughput per device against the 2-rank point
    assert float(rows[0]["efficiency"]) == pytest.approx(1.0)
    ratio = (float(rows[1]["tokens_per_s"]) / 4) / (float(rows[0]["tokens_per_s"]) / 2)
    assert float(rows[1]["efficiency"]) == pytest.approx(ratio, rel=1e-4)
    for name in (scaling.EFFICIENCY_PNG, scaling.THROUGHPUT_PNG, scaling.COMPARE_PNG):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    parent, children = point_runs(runs_dir, "scaling-weak-")
    assert parent.info.status == "FINISHED" and parent.data.tags["site"] == "slurm"
    children.sort(key=lambda c: int(c.data.params["devices"]))
    assert [int(c.data.params["devices"]) for c in children] == list(DEVICES)
    assert [int(c.data.params["nodes"]) for c in children] == [1, 2]
    assert [c.data.tags["hosts"] for c in children] == [r["hosts"] for r in rows]
    assert all(c.info.status == "FINISHED" and c.data.metrics["tokens_per_s"] > 0
               for c in children)
    artifacts = {a.path for a in tracking.MlflowClient(tracking_store.default_tracking_uri(
        runs_dir)).list_artifacts(parent.info.run_id)}
    assert {scaling.CSV_FILE, scaling.EFFICIENCY_PNG, scaling.THROUGHPUT_PNG,
            scaling.COMPARE_PNG} <= artifacts

    # One block per trained point, each of the point's own size.
    assert train_blocks(runs_dir) == [1, 2]

    before = stage_dirs(runs_dir)
    rerun = run_study(runs_dir, tmp_path / "again", "weak", multinode["login_addr"])
    assert stage_dirs(runs_dir) == before, "a rerun of the same study made new stage outputs"
    assert train_blocks(runs_dir) == [1, 2], "a rerun that trains nothing submitted a job"
    again = read_csv(tmp_path / "again" / scaling.CSV_FILE)
    assert all(r["reused"] == "True" for r in again)
    for key in ("train_key", "tokens_per_s", "hosts", "efficiency"):
        assert [r[key] for r in again] == [r[key] for r in rows]
    assert "train run" not in rerun
