"""Scaling studies end to end: weak and strong on 1 and 2 local gloo ranks (the cores of
the CI machine) through real Parsl, the train stage and MLflow on SQLite, run twice (the
second time reusing every point); and the Frontier 175B prediction from one node to the
whole machine. Studies of more ranks than one node's cores run on the Slurm cluster
(``test_scaling_slurm.py``).

The plan stage measures this machine per rank count; the session's 2-rank measurement
(``seed_microbench``) stands in for 1 rank too, so no test measures it again (the layouts
the planner picks may differ from a fresh measurement; nothing here depends on which it
picks).
"""
from __future__ import annotations

import csv
import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from model.planner.scaling import FRONTIER_NODES, efficiencies, frontier_ladder, point_batch
from stages.mechanism import tracking, tracking_store
from tests import warm_cli
from workflows import scaling

REPO = Path(__file__).resolve().parent.parent
DEVICES = (1, 2)  # ranks of the local studies: no more than the CI machine's 2 cores


def run_study(runs_dir: Path, out: Path, mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    argv = ["--config", "micro", "--mode", mode, "--devices", ",".join(map(str, DEVICES)),
            "--runs-dir", str(runs_dir), "--out", str(out), "--set", "train.steps=3",
            "train.checkpoint_every=0"]
    proc = warm_cli.run("workflows.scaling", argv, cwd=REPO, env=env, timeout=900,
                        forked_launches=True)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def stage_dirs(runs_dir: Path) -> dict[str, int]:
    """Every published stage directory -> its status.json's mtime."""
    return {str(p.parent): p.stat().st_mtime_ns
            for p in (runs_dir / "stages").glob("*/*/status.json")
            if not p.parent.name.endswith(".partial")}


def point_runs(runs_dir: Path, parent_name: str) -> tuple[object, list]:
    """The study's parent run (by name prefix, newest) and its point children."""
    uri = tracking_store.default_tracking_uri(runs_dir)
    runs = tracking.search_runs(uri, "micro")
    parent = next(r for r in runs if r.info.run_name.startswith(parent_name)
                  and "mlflow.parentRunId" not in r.data.tags)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
                and r.data.tags.get("scaling_point") == "true"]
    return parent, children


@pytest.mark.slow
def test_weak_and_strong_studies_run_track_and_rerun_from_reuse(
        tmp_path: Path, runs_dir: Path, seed_microbench: Callable[[Path], Path]) -> None:
    seed_microbench(runs_dir, *DEVICES)
    tables = {}
    for mode in ("weak", "strong"):
        out = tmp_path / mode
        run_study(runs_dir, out, mode)
        rows = read_csv(out / scaling.CSV_FILE)
        assert [int(r["devices"]) for r in rows] == list(DEVICES)
        # micro: global batch 4 on parallel.nproc=2 ranks
        expected = [n * 2 for n in DEVICES] if mode == "weak" else [4] * len(DEVICES)
        assert [int(r["global_batch"]) for r in rows] == expected
        for r in rows:
            assert int(r["tp"]) * int(r["pp"]) * int(r["dp"]) == int(r["devices"])
            assert float(r["tokens_per_s"]) > 0 and float(r["predicted_tokens_per_s"]) > 0
            assert r["overhead_term"] and r["dominant_term"]
        assert float(rows[0]["efficiency"]) == pytest.approx(1.0)
        for r in rows:  # efficiency is throughput per device against the 1-rank point
            ratio = (float(r["tokens_per_s"]) / int(r["devices"])) / float(rows[0]["tokens_per_s"])
            assert float(r["efficiency"]) == pytest.approx(ratio, rel=1e-4)
        for name in (scaling.EFFICIENCY_PNG, scaling.THROUGHPUT_PNG, scaling.COMPARE_PNG):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        parent, children = point_runs(runs_dir, f"scaling-{mode}-")
        assert parent.info.status == "FINISHED"
        assert sorted(int(c.data.params["devices"]) for c in children) == list(DEVICES)
        assert all(c.info.status == "FINISHED" and "tokens_per_s" in c.data.metrics
                   for c in children)
        artifacts = {a.path for a in tracking.MlflowClient(tracking_store.default_tracking_uri(
            runs_dir)).list_artifacts(parent.info.run_id)}
        assert {scaling.CSV_FILE, scaling.EFFICIENCY_PNG, scaling.COMPARE_PNG} <= artifacts
        tables[mode] = rows
    # weak and strong share the 1-rank point (batch 2 vs 4 differ; tokenize is shared)
    assert tables["weak"][0]["train_key"] != tables["strong"][0]["train_key"]

    before = stage_dirs(runs_dir)
    rerun = run_study(runs_dir, tmp_path / "again", "strong")
    assert stage_dirs(runs_dir) == before, "a rerun of the same study made new stage outputs"
    rows = read_csv(tmp_path / "again" / scaling.CSV_FILE)
    assert all(r["reused"] == "True" for r in rows)
    assert [r["train_key"] for r in rows] == [r["train_key"] for r in tables["strong"]]
    assert [r["tokens_per_s"] for r in rows] == [r["tokens_per_s"] for r in tables["strong"]]
    assert "train run" not in rerun.stdout


def test_predicted_175b_frontier_table_from_one_node_to_the_whole_machine(
        tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    out = tmp_path / "out"
    code = scaling.main(["--predict", "--mode", "weak", "--config",
                         str(REPO / "configs" / "frontier-175b.yaml"),
                         "--runs-dir", str(runs), "--out", str(out)])
    assert code == 0
    rows = read_csv(out / scaling.CSV_FILE)
    ladder = frontier_ladder()
    assert [int(r["devices"]) for r in rows] == ladder
    assert ladder[0] == 8 and ladder[-1] == FRONTIER_NODES * 8 == 75264
    assert list(rows[0]) == list(scaling.COLUMNS)
    # 175B needs more than a few nodes' memory: the first points say why, the rest are priced
    priced = [r for r in rows if r["predicted_tokens_per_s"]]
    unpriced = [r for r in rows if not r["predicted_tokens_per_s"]]
    assert unpriced and all("no plan fits" in r["note"] for r in unpriced)
    assert int(priced[0]["devices"]) <= 128 and priced[-1]["devices"] == "75264"
    throughput = [float(r["predicted_tokens_per_s"]) for r in priced]
    assert all(b > a for a, b in itertools.pairwise(throughput))
    assert [int(r["global_batch"]) for r in rows] == [n // 2 for n in ladder]  # 1536 per 3072
    assert all(int(r["nodes"]) * 8 == int(r["devices"]) and r["ranks_per_node"] == "8"
               for r in rows)
    for r in priced:
        assert r["dominant_term"] == "compute_gemm"
        assert 0 < float(r["predicted_efficiency"]) < 1.5
        assert int(r["tp"]) * int(r["pp"]) * int(r["dp"]) == int(r["devices"])
    assert float(priced[0]["predicted_efficiency"]) == pytest.approx(1.0)
    for name in (scaling.EFFICIENCY_PNG, scaling.THROUGHPUT_PNG):
        assert (out / name).stat().st_size > 1000
    assert not (out / scaling.COMPARE_PNG).exists()  # nothing measured
    uri = tracking_store.default_tracking_uri(runs)
    children = [r for r in tracking.search_runs(uri, "scaling")
                if r.data.tags.get("scaling_point") == "true"]
    assert len(children) == len(ladder)


def test_batch_and_efficiency_rules() -> None:
    assert point_batch("weak", 1536, 3072, 8) == 4
    assert point_batch("strong", 1536, 3072, 8) == 1536
    with pytest.raises(ValueError, match="multiple of 3"):
        point_batch("weak", 4, 3, 2)
    # 2 devices at 1.8x the throughput of 1: 90 %; a point without a figure has none
    assert efficiencies([1, 2, 4], [100.0, 180.0, None]) == [1.0, 0.9, None]
    assert efficiencies([8, 16], [None, 50.0]) == [None, 1.0]


@pytest.mark.parametrize(("args", "message"), [
    (["--ranks-per-node", "2"], "local site runs every point on this machine"),
    (["--site", "slurm", "--ranks-per-node", "3"], "4 devices do not fill whole nodes of 3"),
    (["--site", "slurm", "--ranks-per-node", "0"], "--ranks-per-node 0: give a count >= 1"),
    (["--predict", "--ranks-per-node", "2"], "takes the cluster file's ranks per node"),
])
def test_ranks_per_node_mistakes_stop_the_study_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
        message: str) -> None:
    runs = tmp_path / "runs"
    code = scaling.main(["--config", "micro", "--mode", "weak", "--devices", "2,4",
                         "--runs-dir", str(runs), *args])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not runs.exists()  # no store, no stage, no Slurm job


def test_a_point_with_no_formable_layout_stops_the_study_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    code = scaling.main(["--config", "micro", "--mode", "weak", "--devices", "2,4",
                         "--runs-dir", str(runs), "--fix", "pp=3"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no parallel plan can be formed for 2 devices" in err
    assert "parallel.pp=3 is not possible here: pp can be [1, 2]" in err
    assert not runs.exists()


def test_points_span_whole_nodes_of_the_ranks_per_node() -> None:
    points = scaling.study_points("micro", ["site.name=slurm"], "weak", [1, 2, 4, 8], 2)
    assert [(p.devices, p.nodes, p.cfg.parallel.ranks_per_node) for p in points] == [
        (1, 1, 1), (2, 1, 2), (4, 2, 2), (8, 4, 2)]
    # the Parsl configuration is rebuilt where the block's shape changes: 1 -> 2 ranks, 4 -> 8
    assert [scaling.block_shape(p.cfg) for p in points] == [(1, 1), (1, 2), (2, 2), (4, 2)]
    local = scaling.study_points("micro", [], "weak", [1, 4], None)
    assert [p.nodes for p in local] == [1, 1] and scaling.block_shape(local[1].cfg) is None

