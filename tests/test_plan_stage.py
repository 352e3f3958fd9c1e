"""The plan stage on this machine: measured local cluster, real MLflow store, real ranks.

Every test has its own runs dir; the microbenchmark is measured once per session and
copied into it (tests/conftest.py), as the plan stage's cache."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from model.parallel.layout import Plan, PlanError
from model.planner.calibration import load_calibration
from model.planner.choose import calibration_file
from model.planner.microbench import load_measured_cluster
from stages.config import load_config
from stages.mechanism import tracking, tracking_store
from stages.mechanism.launch import RankSpec
from stages.mechanism.walk import run_work
from stages.plan import measure_worker
from stages.plan import work as plan_stage
from stages.registry import declaration

PLAN = declaration("plan")


def _tracker(runs: Path, name: str) -> tuple[tracking.Tracker, str, str]:
    uri = tracking_store.default_tracking_uri(runs)
    exp = tracking.ensure_experiment(uri, "plan-test", runs)
    run_id = tracking.start_run(uri, exp, name)
    return tracking.Tracker(uri, run_id), uri, run_id


def _cfg(runs: Path, *overrides: str):
    return load_config("tiny", [f"tracking.runs_dir={runs}", "parallel.nproc=2", *overrides])


def _out_dir(runs: Path, name: str) -> Path:
    path = runs / name
    path.mkdir()
    return path


def test_stage_searches_writes_plan_and_logs(runs_dir: Path, microbench_cache: Path,
                                             capfd: pytest.CaptureFixture) -> None:
    cfg = _cfg(runs_dir)
    tracker, uri, run_id = _tracker(runs_dir, "plan")
    out_dir = _out_dir(runs_dir, "plan-a")
    out = plan_stage.run(cfg, {"tokenize": {"vocab_size": 2048}}, out_dir, tracker)
    tracker.flush()
    plan = Plan.from_json(out["plan"])
    plan.check(cfg.model, cfg.train, 2)
    assert out["tp"] == plan.tp and out["sharding"] == plan.sharding
    assert plan.predictions["step_time_s"] > 0 and plan.predictions["memory_gb_per_device"] > 0
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.data.params["plan.dp"] == str(plan.dp)
    assert run.data.params["plan.world_size"] == "2"
    assert run.data.metrics["predicted_step_time_s"] == pytest.approx(
        plan.predictions["step_time_s"])
    arts = {a.path for a in client.list_artifacts(run_id)}
    assert {"plan_table.txt", "plan_comparison.png"} <= arts
    table = (out_dir / "plan_table.txt").read_text()
    assert "candidate plans fit" in table and plan.describe() in table
    # The stage read this machine's figures from the runs dir's copy: nothing was measured,
    # and plan.json says where they came from.
    assert "[microbench] measuring" not in capfd.readouterr().out
    cached = runs_dir / "cache" / "microbench" / microbench_cache.name
    assert cached.read_bytes() == microbench_cache.read_bytes()
    figures = {"cluster": "local", "figures": "cached", "source": str(cached)}
    assert json.loads(Path(out["plan"]).read_text())["figures"] == figures == out["figures"]


def test_measured_cluster_comes_from_the_cache_with_sane_figures(
        microbench_cache: Path, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    cl = load_measured_cluster("local", 2, cache_dir=microbench_cache.parent)
    assert "[microbench] measuring" not in capfd.readouterr().out
    assert cl.measured and cl.ranks_per_node == 2 and cl.source == str(microbench_cache)
    assert cl.figures == "cached"
    assert set(cl.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "send_recv"}
    assert all(v["bandwidth_gbps"] > 0 and v["latency_us"] > 0 for v in cl.collectives.values())
    assert cl.peak_tflops > 0 and cl.hbm_bandwidth_gbps > 0 and cl.layer_overhead_us >= 0
    assert 0.05 < cl.reserved_gb < 2  # the measured resident size of an idle rank
    # An explicit cache file is honoured.
    mine = tmp_path / "bench.json"
    shutil.copy(microbench_cache, mine)
    assert load_measured_cluster("local", 2, cache_path=mine).source == str(mine)
    assert "[microbench] measuring" not in capfd.readouterr().out


def test_stage_validates_a_hand_plan_with_the_same_messages(runs_dir: Path) -> None:
    fixed = ["parallel.tp=2", "parallel.pp=2", "parallel.micro_batch=4",
             "parallel.schedule=1f1b", "parallel.sharding=none", "parallel.recompute=none"]
    tracker, *_ = _tracker(runs_dir, "plan-hand")
    out_dir = _out_dir(runs_dir, "plan-hand")
    with pytest.raises(PlanError, match=r"pp\*dp\*tp = 2\*1\*2 = 4 must equal the world size 2"):
        plan_stage.run(_cfg(runs_dir, *fixed), {}, out_dir, tracker)
    good = ["parallel.tp=1", "parallel.pp=2", "parallel.micro_batch=2", "parallel.schedule=1f1b",
            "parallel.sharding=none", "parallel.recompute=full"]
    # 4 layers over pp=2: recomputing 2 blocks of a 2-block chunk is refused, naming the fix
    with pytest.raises(PlanError, match=r"recompute_layers=2 must be smaller than the 2 layers.*"
                                        r"use recompute_layers=0"):
        plan_stage.run(_cfg(runs_dir, *good, "parallel.recompute_layers=2"), {}, out_dir, tracker)
    cfg = _cfg(runs_dir, *good, "parallel.recompute_layers=1")
    out = plan_stage.run(cfg, {}, out_dir, tracker)
    # micro_batch 2 on one data-parallel rank: the rest of the global batch is accumulation.
    assert (out["tp"], out["pp"], out["dp"], out["grad_accum"]) == (
        1, 2, 1, cfg.train.global_batch // 2)
    assert Plan.from_json(out["plan"]).recompute_layers == 1  # into plan.json
    assert not (out_dir / "plan_table.txt").exists()  # validated, not searched


def test_stage_rejects_a_store_with_a_larger_vocabulary(tmp_path: Path, seed_store) -> None:
    seed_store(tmp_path)
    tracker, *_ = _tracker(tmp_path, "plan-vocab")
    out_dir = _out_dir(tmp_path, "plan-vocab")
    with pytest.raises(PlanError, match="raise model.vocab_size"):
        plan_stage.run(_cfg(tmp_path), {"tokenize": {"vocab_size": 4096}}, out_dir, tracker)
    assert not any(out_dir.iterdir())  # refused before any work


@pytest.mark.slow
def test_refinement_measures_top_plans_and_keeps_calibration(runs_dir: Path) -> None:
    cfg = _cfg(runs_dir, "parallel.refine_top_k=2")
    tracker, uri, run_id = _tracker(runs_dir, "plan-refine")
    out_dir = _out_dir(runs_dir, "plan-refine")
    # A ranks stage: the search, the two measurements as ranks (one launch each, one after
    # another, from the series spec), then the choice.
    assert PLAN.shape(cfg).kind == "ranks"
    out = run_work(PLAN, cfg, {}, out_dir, tracker)
    tracker.flush()
    series = RankSpec.read(out_dir / "spec.json")
    assert len(series.series) == 2 and series.nproc == cfg.parallel.nproc
    for path in series.series:
        launch = RankSpec.read(path)
        assert (launch.nproc, launch.steps, launch.extra) == (2, 4, {"save_final": False})
        assert not (Path(launch.out_dir) / "checkpoints").exists()  # a measurement saves none
    log = (out_dir / "measure.log").read_text()
    assert log.count("[train] step 4/4 ") == 2, log[-2000:]  # both ran their 4 steps
    records = json.loads(Path(out["measured"]).read_text())
    assert len(records) == 2 and all(r["ok"] for r in records)
    best = max(records, key=lambda r: r["tokens_per_s"])
    plan = Plan.from_json(out["plan"])
    assert plan.to_dict()["tp"] == best["plan"]["tp"] and plan.dp == best["plan"]["dp"]
    assert plan.predictions["measured_tokens_per_s"] == pytest.approx(best["tokens_per_s"])
    arts = {a.path for a in MlflowClient(uri).list_artifacts(run_id)}
    assert {"predicted_vs_measured.png", "predicted_vs_measured.txt", "calibration.json"} <= arts
    cal = load_calibration(calibration_file(runs_dir, "local", 2))
    assert len(cal["points"]) == 2 and cal["compute_scale"] > 0
    # A later search (its own stage run) reads the calibration: its predictions now sit
    # near the measurements.
    tracker_again, *_ = _tracker(runs_dir, "plan-again")
    again = plan_stage.run(_cfg(runs_dir), {}, _out_dir(runs_dir, "plan-again"), tracker_again)
    ratio = again["predictions"]["step_time_s"] / best["step_time_s"]
    assert 0.3 < ratio < 3.0


def test_plans_of_one_world_size_are_measured_in_one_launch(runs_dir: Path) -> None:
    """``measure_plans``: one launch, every plan built once and warmed up, then the plans
    taking turns step by step for each round; a plan the trainer refuses is reported and the
    others go on."""
    cfg = _cfg(runs_dir)
    plans = [Plan(dp=2, micro_batch=8, grad_accum=1, sharding="ddp"),
             Plan(dp=2, micro_batch=3, grad_accum=1, sharding="ddp"),  # 3 x 2 is not 16
             Plan(pp=2, micro_batch=4, grad_accum=4, schedule="gpipe")]
    out_dir = runs_dir / "measure-many"
    measured = measure_worker.measure_plans(cfg, plans, out_dir, steps=3, rounds=2)
    assert measured["failed"] is None, measured["failed"]
    assert "global_batch" in measured["errors"][1] and not measured["step_times"][1]
    for i in (0, 2):
        assert measured["errors"][i] is None
        rounds = measured["step_times"][i]
        assert len(rounds) == 2 and all(len(r) == 3 for r in rounds)  # the warm-up left out
        assert all(0 < t < 30 for r in rounds for t in r)
    lines = [json.loads(line) for line in (out_dir / "measurements.jsonl").read_text()
             .splitlines()]
    assert [(r["round"], r["index"]) for r in lines] == [(0, 1), (0, 0), (0, 2),
                                                        (1, 0), (1, 2)]
    assert all(r["step_time_s"] == sorted(r["step_times_s"])[1] for r in lines[1:])
    assert [measure_worker.round_order(2, turn) for turn in range(3)] == [[0, 1], [1, 0], [0, 1]]
    assert not list(out_dir.glob("plan*/checkpoints"))  # a measurement saves nothing
    with pytest.raises(ValueError, match="share a world size"):
        measure_worker.measure_plans(cfg, [plans[0], Plan()], out_dir, 2, 1)


@pytest.mark.slow
def test_a_gpu_plan_that_cannot_be_rehearsed_is_an_error_unless_opted_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan stage under a GPU cluster (Frontier's) with a rehearsal interpreter whose
    torch is another release than the one the rehearsal was checked on (as Frontier's ROCm
    build is): the stage refuses, naming both ways out, instead of keeping an unrehearsed
    plan; with ``parallel.rehearse=false`` it plans without the rehearsal."""
    import sys

    from model.rehearsal.torch_pin import REHEARSAL_PYTHON

    other_torch = tmp_path / "python"  # this interpreter, its torch calling itself 2.8
    other_torch.write_text(
        "#!/bin/sh\n"
        f"exec {sys.executable} -c \"import sys; from pathlib import Path; "
        "from model.rehearsal import fake_gpu; fake_gpu.load_runtime(); "
        "fake_gpu.load_runtime = lambda: None; import torch; "
        "torch.__version__ = '2.8.0+rocm6.4'; "
        "from model.rehearsal.rank_server import serve; "
        "serve(sys.argv[1], int(sys.argv[2]))\" \"$3\" \"$4\"\n")
    other_torch.chmod(0o755)
    monkeypatch.setenv(REHEARSAL_PYTHON, str(other_torch))
    frontier = ["parallel.cluster=frontier", "parallel.nproc=8", "parallel.nodes=1"]
    tracker, _, _ = _tracker(tmp_path, "plan-unrehearsed")
    with pytest.raises(PlanError, match=r"cannot be rehearsed .*torch 2\.8\.0\+rocm6\.4.*"
                                        r"FRONTIER_LLM_REHEARSAL_PYTHON.*parallel\.rehearse=false"):
        run_work(PLAN, _cfg(tmp_path, *frontier), {}, _out_dir(tmp_path, "refused"), tracker)
    out = run_work(PLAN, _cfg(tmp_path, *frontier, "parallel.rehearse=false"), {},
                   _out_dir(tmp_path, "opted-out"), tracker)
    assert json.loads(Path(out["plan"]).read_text())["tp"] >= 1


@pytest.mark.slow
def test_the_documented_rehearsal_install_rehearses_beside_another_torch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/frontier.md's install: the driver's torch is another release (Frontier's ROCm
    build), ``$FRONTIER_LLM_REHEARSAL_PYTHON`` names an interpreter with the checked CPU
    torch (here this one, behind a wrapper that records its calls): the plan stage under the
    Frontier cluster rehearses in that interpreter and keeps a rehearsed plan."""
    import sys

    from model.rehearsal import torch_pin

    called = tmp_path / "called"
    checked = tmp_path / "python"
    checked.write_text(f"#!/bin/sh\necho \"$@\" >> {called}\nexec {sys.executable} \"$@\"\n")
    checked.chmod(0o755)
    monkeypatch.setattr(torch_pin, "installed_torch", lambda: "2.8.0+rocm6.4")
    monkeypatch.setenv(torch_pin.REHEARSAL_PYTHON, str(checked))
    tracker, _, _ = _tracker(tmp_path, "plan-rehearsed-elsewhere")
    cfg = _cfg(tmp_path, "parallel.cluster=frontier", "parallel.nproc=8", "parallel.nodes=1")
    out = run_work(PLAN, cfg, {}, _out_dir(tmp_path, "rehearsed"), tracker)
    assert "model.rehearsal.rank_server cuda" in called.read_text()
    records = json.loads(Path(out["rehearsal"]).read_text())
    assert isinstance(records, list) and records, records  # not {"error": ...}
    assert all(r["rehearsed_peak_memory_gb"] > 0 for r in records), records
