"""bench_plan: how it measures a setting (a survey launch of every plan, a contest launch of
the contenders, every step counted) and the Frontier picks' rehearsals it records."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import bench_plan  # noqa: E402 (needs the repository on sys.path)
from model.parallel.layout import Plan  # noqa: E402


def _plans(predicted: list[float]) -> list[Plan]:
    out = []
    for i, t in enumerate(predicted):
        p = Plan(micro_batch=i + 1, grad_accum=1, sharding="none")
        p.predictions = {"step_time_s": t, "tokens_per_s": 1 / t, "compute_s": 0.9 * t,
                         "comm_s": 0.1 * t}
        out.append(p)
    return out


def _run(monkeypatch, tmp_path, predicted, measured, rounds=3):
    """measure_setting over fake plans: plan i's steps in every round are ``measured[i]``
    (the survey's and the contest's alike); the launches are recorded."""
    plans = _plans(predicted)
    launches: list[tuple[list[int], int, int]] = []

    def fake_measure(cfg, batch, out_dir, steps, n_rounds):
        indices = [plans.index(p) for p in batch]
        launches.append((indices, n_rounds, steps))
        return {"step_times": [[list(measured[i][len(launches) - 1])] * n_rounds
                               for i in indices],
                "errors": [None] * len(batch), "seconds": 10.0, "failed": None}

    monkeypatch.setattr(bench_plan, "candidates", lambda cfg, n, m: (plans, 40))
    monkeypatch.setattr(bench_plan, "measure_plans", fake_measure)
    cfg = SimpleNamespace(train=SimpleNamespace(global_batch=8, seq_len=128))
    out = bench_plan.measure_setting("t", cfg, 2, 6, tmp_path, steps=6, rounds=rounds,
                                     contest_steps=20)
    return out, launches


def _steps(median: float, spread: float, n: int = 8) -> list[float]:
    """n step times around ``median``, evenly spread over +-spread (relative)."""
    return [median * (1 + spread * (2 * k / (n - 1) - 1)) for k in range(n)]


def test_every_plan_is_surveyed_then_the_contenders_contest_in_one_launch(monkeypatch,
                                                                          tmp_path):
    # plan 1 looks 40 % faster in the survey (a lucky launch); the contest says it is not
    measured = [[_steps(1.00, 0.02), _steps(1.00, 0.02)], [_steps(0.60, 0.02), _steps(1.10, 0.02)],
                [_steps(1.30, 0.02)], [_steps(2.0, 0.02)], [_steps(3.0, 0.02)],
                [_steps(4.0, 0.02)]]
    out, launches = _run(monkeypatch, tmp_path, [1.0, 1.05, 1.1, 2.0, 3.0, 4.0], measured)
    # the survey: every plan in one launch, two rounds of --steps; then the pick (0) and the
    # fastest (1) in one launch, --rounds rounds of the contest's steps; plan 2 was not within
    # 10 % of the fastest
    assert launches == [([0, 1, 2, 3, 4, 5], 2, 6), ([0, 1], 3, 20)]
    assert out["pick_ratio_survey"] == pytest.approx(0.60)
    # every step counts: plan 1's 16 survey steps at 0.6 and 24 contest steps at 1.1
    rows = {p["plan"]: p for p in out["plans"]}
    assert rows[out["pick"]]["steps"] == 40 and rows[out["pick"]]["median_s"] == 1.0
    assert out["best"] == out["pick"] and out["pick_ratio"] == 1.0 and out["launches"] == 2
    assert rows[out["best"]]["round_medians_s"] == pytest.approx([1.0] * 5)
    slow = [p for p in out["plans"] if p["plan"] != out["pick"] and p["steps"] == 40][0]
    assert slow["median_s"] == pytest.approx(1.10, rel=0.03)


def test_a_plan_only_the_survey_measured_contests_once_it_beats_the_contenders(monkeypatch,
                                                                              tmp_path):
    # plan 3 was fourth in the survey (not a contender); the contest then measured the pick
    # and the two fastest 10-18 % slower than the survey had them, so plan 3's survey median
    # leads: it is measured again beside the pick, which the same launch shows faster
    measured = [[_steps(1.00, 0.02), _steps(1.10, 0.02), _steps(1.10, 0.02)],
                [_steps(0.95, 0.02), _steps(1.12, 0.02)],
                [_steps(0.97, 0.02), _steps(1.15, 0.02)],
                [_steps(0.98, 0.02), None, _steps(1.14, 0.02)],
                [_steps(3.0, 0.02)], [_steps(4.0, 0.02)]]
    out, launches = _run(monkeypatch, tmp_path, [1.0, 1.05, 1.1, 1.2, 3.0, 4.0], measured)
    assert launches == [([0, 1, 2, 3, 4, 5], 2, 6), ([0, 1, 2], 3, 20), ([0, 3], 3, 20)]
    assert out["best"] == out["pick"] and out["pick_ratio"] == 1.0 and out["launches"] == 3
    # without the further contest plan 3's 16 survey steps alone would have been the best
    assert bench_plan.unmatched([[1.1] * 4, [1.12] * 4, [1.15] * 4, [0.98] * 4],
                                [0, 1, 2, 3], {0, 1, 2}) == [3]
    assert bench_plan.unmatched([[1.1] * 4, [1.3] * 4], [0, 1], {0}) == []  # 18 % slower


def test_a_gap_is_resolved_only_by_intervals_narrower_than_it(monkeypatch, tmp_path):
    # the pick is 30 % slower than plan 1, both measured to +-2 %: resolved
    measured = [[_steps(1.30, 0.02)] * 2, [_steps(1.00, 0.02)] * 2, [_steps(2.0, 0.02)],
                [_steps(3.0, 0.02)]]
    out, _ = _run(monkeypatch, tmp_path, [1.0, 1.1, 2.0, 3.0], measured)
    assert out["resolved"] and out["pick_ratio"] == pytest.approx(1.0 / 1.3)
    assert out["gap_pick_best"] == pytest.approx(0.3)
    assert max(out["median_ci_compared"]) < 0.03
    # the same gap under steps spread +-60 %, the spells falling on the two plans apart
    # (one's slow steps meet the other's fast ones), is not
    measured = [[_steps(1.30, 0.6)] * 2, [_steps(1.00, 0.6)[::-1]] * 2, [_steps(2.0, 0.6)],
                [_steps(3.0, 0.6)]]
    out, _ = _run(monkeypatch, tmp_path, [1.0, 1.1, 2.0, 3.0], measured)
    assert not out["resolved"] and min(out["median_ci_compared"]) > 0.15
    gap, width = out["paired_gaps_compared"][0]
    assert width > 0.15


def test_plans_taking_turns_are_compared_step_by_step(monkeypatch, tmp_path):
    # both plans' steps spread +-60 % by the same spells of load (they took turns): each
    # median alone is known to no better than +-15 %, their 30 % gap step by step exactly
    measured = [[_steps(1.30, 0.6)] * 2, [_steps(1.00, 0.6)] * 2, [_steps(2.0, 0.6)],
                [_steps(3.0, 0.6)]]
    out, _ = _run(monkeypatch, tmp_path, [1.0, 1.1, 2.0, 3.0], measured)
    assert min(out["median_ci_compared"]) > 0.15
    assert out["paired_gaps_compared"][0] == pytest.approx((0.3, 0.0), abs=1e-9)
    assert out["resolved"]
    # measured apart (different step counts), the independent intervals decide
    assert bench_plan.paired_gap([1.0] * 8, [1.0] * 9) is None


def test_median_interval_narrows_with_more_steps():
    few, width_few = bench_plan.median_ci(_steps(1.0, 0.2, n=10))
    many, width_many = bench_plan.median_ci(_steps(1.0, 0.2, n=160))
    assert few == pytest.approx(1.0) and many == pytest.approx(1.0)
    assert width_many < width_few / 3  # about 1 / sqrt(16)
    assert bench_plan.median_ci([1.0, 2.0])[1] == float("inf")  # too few to say


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
