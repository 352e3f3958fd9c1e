"""bench_plan: its measuring order (every plan once, then the contenders round-robin to a
median) and the Frontier picks' rehearsals it records."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import bench_plan  # noqa: E402 (needs the repository on sys.path)
from model.planner.plan import Plan  # noqa: E402


def _plans(predicted: list[float]) -> list[Plan]:
    out = []
    for i, t in enumerate(predicted):
        p = Plan(micro_batch=i + 1, grad_accum=1, sharding="none")
        p.predictions = {"step_time_s": t, "tokens_per_s": 1 / t, "compute_s": 0.9 * t,
                         "comm_s": 0.1 * t}
        out.append(p)
    return out


def _run(monkeypatch, tmp_path, predicted, measured, max_repeats=3):
    """measure_setting over fake plans whose k-th measurement is measured[plan][k]."""
    plans = _plans(predicted)
    order: list[int] = []

    def fake_measure(cfg, plan, out_dir, steps):
        i = plans.index(plan)
        k = sum(1 for j in order if j == i)
        order.append(i)
        return {"ok": True, "step_time_s": measured[i][k], "tokens_per_s": 1 / measured[i][k],
                "seconds": 10.0}

    monkeypatch.setattr(bench_plan, "candidates", lambda cfg, n, m: (plans, 40))
    monkeypatch.setattr(bench_plan, "measure_plan", fake_measure)
    cfg = SimpleNamespace(train=SimpleNamespace(global_batch=8, seq_len=128))
    out = bench_plan.measure_setting("t", cfg, 2, 6, tmp_path, steps=6, max_repeats=max_repeats)
    return out, order


def test_contenders_are_measured_round_robin_and_the_median_counts(monkeypatch, tmp_path):
    # plan 1 looks 40 % faster once (a lucky launch); its repeats say it is not
    measured = [[1.00, 1.02, 0.98], [0.60, 1.05, 1.04], [1.03, 1.01, 1.00], [2.0], [3.0], [4.0]]
    out, order = _run(monkeypatch, tmp_path, [1.0, 1.05, 1.1, 2.0, 3.0, 4.0], measured)
    assert order[:6] == [0, 1, 2, 3, 4, 5]  # every plan once, in predicted order
    # then the pick (0) and the fastest (1), rotated each round; plan 2 was not within 10 %
    assert sorted(order[6:8]) == [0, 1] and order[6:8] != order[8:10]
    assert sorted(order[8:]) == [0, 1] and len(order) == 10
    assert out["pick_ratio_one_measurement"] == pytest.approx(0.60)
    assert out["best"] == out["pick"]  # the median of three: 1.00 against 1.04
    assert out["pick_ratio"] == 1.0 and out["launches"] == 10
    rows = {p["plan"]: p for p in out["plans"]}
    assert rows[out["pick"]]["median_s"] == 1.00
    assert out["repeat_spread_max"] == pytest.approx((1.05 - 0.60) / 1.04)


def test_a_plan_set_apart_stops_and_an_unresolved_pick_is_reported(monkeypatch, tmp_path):
    # the pick is 30 % slower than plan 1 and both repeat within 2 %: resolved after two
    measured = [[1.30, 1.31, 1.30], [1.00, 1.01, 1.00], [2.0], [3.0]]
    out, order = _run(monkeypatch, tmp_path, [1.0, 1.1, 2.0, 3.0], measured)
    assert len(order) == 6 and out["resolved"]
    assert out["pick_ratio"] == pytest.approx(1.005 / 1.305)  # medians of two
    assert out["gap_pick_best"] == pytest.approx(1.305 / 1.005 - 1)
    # the same gap under a 60 % spread is not resolved, and the pick counts in that check
    measured = [[1.30, 2.10, 1.30], [1.00, 1.60, 1.00], [2.0], [3.0]]
    out, order = _run(monkeypatch, tmp_path, [1.0, 1.1, 2.0, 3.0], measured)
    assert len(order) == 8 and not out["resolved"]


def test_a_pick_records_the_stored_rehearsal_of_the_same_plan_and_gcds(monkeypatch,
                                                                       tmp_path) -> None:
    """A pick's rehearsal is read from bench_rehearse.py's results only for the same preset,
    plan and GCD count; its memory error is this checkout's model against the rehearsal."""
    import json

    stored = json.loads((bench_plan.RESULTS_DIR / "bench_rehearse.json").read_text())
    record = next(r for r in stored["ranks"]
                  if r.get("preset") == "frontier-22b" and "error" not in r
                  and "skipped" not in r)
    (tmp_path / "bench_rehearse.json").write_text(json.dumps(
        {"ranks": [record], "rehearsed_at": {"commit": "abc", "date": "then"}}))
    monkeypatch.setattr(bench_plan, "RESULTS_DIR", tmp_path)
    preset, devices, plan = record["preset"], record["devices"], record["plan"]

    found, source = bench_plan.stored_rehearsals(preset, devices, plan)
    assert found == [record]
    assert source == {"file": "bench_rehearse.json", "commit": "abc", "date": "then"}
    assert bench_plan.stored_rehearsals(preset, devices * 3, plan) == ([], {})
    assert bench_plan.stored_rehearsals(preset, devices, plan + " x") == ([], {})

    rehearsal = bench_plan.rehearsal_of(found)
    stage = rehearsal[record["stage"]]
    assert stage["rehearsed_peak_memory_gb"] == round(record["rehearsed_peak_memory_gb"], 2)
    assert stage["memory_error_pct"] == pytest.approx(
        100 * (stage["modeled_tensor_memory_gb"] / stage["rehearsed_peak_memory_gb"] - 1),
        abs=0.1)
    figures = bench_plan.rehearsal_figures({"22b_1024": {"rehearsal": rehearsal},
                                            "1t_3072": {}})
    assert figures["rehearsal_picks"] == 1
    assert figures["rehearsal_memory_error_pct_max"] == stage["memory_error_pct"]
    assert figures["rehearsal_seconds_max"] == stage["rehearsal_seconds"]
    assert bench_plan.rehearsal_figures({"1t_3072": {}}) == {"rehearsal_picks": 0}
