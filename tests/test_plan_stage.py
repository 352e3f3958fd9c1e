"""The plan stage on this machine: measured local cluster, real MLflow store, real ranks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from model.planner.calibration import load_calibration
from model.planner.plan import Plan, PlanError
from stages import plan as plan_stage
from stages import tracking
from stages.config import load_config


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("plan-runs")


def _tracker(runs: Path, name: str):
    uri = f"sqlite:///{runs}/mlflow.db"
    exp = tracking.ensure_experiment(uri, "plan-test", runs)
    run_id = tracking.start_run(uri, exp, name)
    return tracking.Tracker(uri, run_id), uri, run_id


def _cfg(runs: Path, *overrides: str):
    return load_config("tiny", [f"tracking.runs_dir={runs}", "parallel.nproc=2", *overrides])


def test_stage_searches_writes_plan_and_logs(runs: Path) -> None:
    cfg = _cfg(runs)
    tracker, uri, run_id = _tracker(runs, "plan")
    out_dir = runs / "plan-a"
    out_dir.mkdir()
    out = plan_stage.run(cfg, {"tokenize": {"vocab_size": 2048}}, out_dir, tracker)
    tracker.flush()
    plan = Plan.from_json(out["plan"])
    plan.check(cfg.model, cfg.train, 2)
    assert out["tp"] == plan.tp and out["sharding"] == plan.sharding
    assert plan.predictions["step_time_s"] > 0 and plan.predictions["memory_gb_per_device"] > 0
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.data.params["plan.dp"] == str(plan.dp)
    assert run.data.metrics["predicted_step_time_s"] == pytest.approx(plan.predictions["step_time_s"])
    arts = {a.path for a in client.list_artifacts(run_id)}
    assert {"plan_table.txt", "plan_comparison.png"} <= arts
    table = (out_dir / "plan_table.txt").read_text()
    assert "candidate plans fit" in table and plan.describe() in table
    # the microbenchmark was cached under the runs dir and is reused
    assert list((runs / "cache" / "microbench").glob("microbench-*-n2-*.json"))


def test_local_cluster_is_measured_once_and_cached(runs: Path, tmp_path: Path) -> None:
    import shutil
    import time

    from model.planner.microbench import load_measured_cluster

    cache_dir = runs / "cache" / "microbench"  # filled by the stage test above
    t0 = time.perf_counter()
    cl = load_measured_cluster("local", 2, cache_dir=cache_dir)
    assert time.perf_counter() - t0 < 5  # read from the cache, not measured again
    assert cl.measured and cl.ranks_per_node == 2 and cl.source.startswith(str(cache_dir))
    assert set(cl.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "send_recv"}
    assert all(v["bandwidth_gbps"] > 0 and v["latency_us"] > 0 for v in cl.collectives.values())
    assert cl.peak_tflops > 0 and cl.hbm_bandwidth_gbps > 0 and cl.layer_overhead_us >= 0
    assert 0.05 < cl.reserved_gb < 2  # the measured resident size of an idle rank
    # an explicit cache path is honoured
    src = next(cache_dir.glob("microbench-*-n2-*.json"))
    mine = tmp_path / "bench.json"
    shutil.copy(src, mine)
    assert load_measured_cluster("local", 2, cache_path=mine).source == str(mine)


def test_stage_validates_a_hand_plan_with_the_same_messages(runs: Path) -> None:
    fixed = ["parallel.tp=2", "parallel.pp=2", "parallel.micro_batch=4", "parallel.schedule=1f1b",
             "parallel.sharding=none", "parallel.recompute=none"]
    tracker, *_ = _tracker(runs, "plan-hand")
    out_dir = runs / "plan-hand"
    out_dir.mkdir()
    with pytest.raises(PlanError, match=r"pp\*dp\*tp = 2\*1\*2 = 4 must equal the world size 2"):
        plan_stage.run(_cfg(runs, *fixed), {}, out_dir, tracker)
    good = ["parallel.tp=1", "parallel.pp=2", "parallel.micro_batch=2", "parallel.schedule=1f1b",
            "parallel.sharding=none", "parallel.recompute=full"]
    cfg = _cfg(runs, *good)
    out = plan_stage.run(cfg, {}, out_dir, tracker)
    # micro_batch 2 on one data-parallel rank: the rest of the global batch is accumulation.
    assert (out["tp"], out["pp"], out["dp"], out["grad_accum"]) == (1, 2, 1, cfg.train.global_batch // 2)
    assert not (out_dir / "plan_table.txt").exists()  # validated, not searched


def test_stage_rejects_a_store_with_a_larger_vocabulary(runs: Path) -> None:
    tracker, *_ = _tracker(runs, "plan-vocab")
    with pytest.raises(PlanError, match="raise model.vocab_size"):
        plan_stage.run(_cfg(runs), {"tokenize": {"vocab_size": 4096}}, runs, tracker)


@pytest.mark.slow
def test_refinement_measures_top_plans_and_keeps_calibration(runs: Path) -> None:
    cfg = _cfg(runs, "parallel.refine_top_k=2")
    tracker, uri, run_id = _tracker(runs, "plan-refine")
    out_dir = runs / "plan-refine"
    out_dir.mkdir()
    out = plan_stage.run(cfg, {}, out_dir, tracker)
    tracker.flush()
    records = json.loads(Path(out["measured"]).read_text())
    assert len(records) == 2 and all(r["ok"] for r in records)
    best = max(records, key=lambda r: r["tokens_per_s"])
    plan = Plan.from_json(out["plan"])
    assert plan.to_dict()["tp"] == best["plan"]["tp"] and plan.dp == best["plan"]["dp"]
    assert plan.predictions["measured_tokens_per_s"] == pytest.approx(best["tokens_per_s"])
    arts = {a.path for a in MlflowClient(uri).list_artifacts(run_id)}
    assert {"predicted_vs_measured.png", "predicted_vs_measured.txt", "calibration.json"} <= arts
    cal = load_calibration(plan_stage.calibration_path(cfg, type("C", (), {"name": "local"})))
    assert len(cal["points"]) == 2 and cal["compute_scale"] > 0
    # a later search reads the calibration: its predictions now sit near the measurements
    again_dir = runs / "plan-again"
    again_dir.mkdir()
    again = plan_stage.run(_cfg(runs), {}, again_dir, tracker)
    ratio = again["predictions"]["step_time_s"] / best["step_time_s"]
    assert 0.3 < ratio < 3.0
