"""The published GPU measurements, the fit to them, and pricing/explaining one plan."""
from __future__ import annotations

import json

import pytest

from model.planner.cluster import load_cluster
from model.planner.published import (
    FILE_FIELDS,
    PLAN_FIELDS,
    ROW_FIELDS,
    fit_all,
    fit_factors,
    leave_one_source_out,
    load_published,
    pick_versus_source,
    predict_row,
)
from workflows.plan import main as plan_main

# leave-one-source-out tokens/s MAPE per source (benchmarks/bench_plan.py --published)
LOO_BOUND = {"narayanan2021": 0.10, "korthikanti2022": 0.10, "bigscience2022": 0.05,
             "llmfoundry2024": 0.11, "torchtitan2024": 0.11, "dash2023": 0.20}


@pytest.fixture(scope="module")
def rows():
    return load_published()


def test_every_row_has_its_source_plan_and_figure(rows) -> None:
    import yaml

    from model.planner.published import PUBLISHED_DIR

    for path in sorted(PUBLISHED_DIR.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        assert set(FILE_FIELDS) <= set(raw), path
        assert raw["source"]["link"].startswith("https://"), path
        for r in raw["rows"]:
            full = {**raw.get("defaults", {}), **r}
            assert set(ROW_FIELDS) <= set(full), (path, r)
            if full.get("plan") != "best":
                assert set(PLAN_FIELDS) <= set(full), (path, r)
    assert {r.source for r in rows} == set(LOO_BOUND)
    assert all(r.measured_tps > 0 for r in rows)
    assert {r.role for r in rows if r.source == "dash2023"} == {"fit"}


@pytest.fixture(scope="module")
def loo(rows):
    return leave_one_source_out(rows)


def test_leave_one_source_out_error_stays_bounded(rows, loo) -> None:
    for src, bound in LOO_BOUND.items():
        assert loo["per_source"][src] <= bound, (src, loo["per_source"][src])
    assert loo["mape"] <= 0.10
    # a held-out source never informs its own prediction: torchtitan's PyTorch factor is the
    # one LLM Foundry's rows give, and Megatron-DeepSpeed held out (BLOOM is its only fitting
    # source) falls back to the mean of the other frameworks' factors
    foundry = fit_factors([r for r in rows if r.source == "llmfoundry2024"])
    assert loo["factors"]["torchtitan2024"]["pytorch"] == foundry["pytorch"]
    held = loo["factors"]["bigscience2022"]
    others = [v for k, v in held.items() if k != "megatron-deepspeed"]
    assert held["megatron-deepspeed"] == pytest.approx(sum(others) / len(others))
    assert loo["factors"]["dash2023"]["megatron-deepspeed"] == fit_factors(
        [r for r in rows if r.source == "bigscience2022"])["megatron-deepspeed"]
    # the study's rows fit only Frontier's stack factor: held out, there is none; with any
    # other source held out it is fitted, and never moves a framework factor
    assert loo["stacks"]["dash2023"] == {}
    assert set(loo["stacks"]["narayanan2021"]) == {"frontier"}
    assert fit_factors(rows) == fit_factors([r for r in rows if r.source != "dash2023"])


def test_eager_torchtitan_rows_are_priced_slower_than_compiled(rows, loo) -> None:
    # torchtitan's plain FSDP rows run eager kernels, its compiled rows fused ones: measured
    # 6667 / 5762 (8 GPUs) and 6514 / 5605 (128 GPUs), 1.16 times; the unfused bytes give
    # about 1.12, with no parameter fitted to the difference
    titan = {r.name: r for r in rows if r.source == "torchtitan2024"}
    assert titan["llama3.1-8b-fsdp-8gpu"].shapes.eager
    assert not titan["llama3.1-8b-fsdp-compile-8gpu"].shapes.eager
    assert all(r.shapes.eager_loss for r in titan.values())
    assert not any(r.shapes.eager for r in rows if r.source != "torchtitan2024")
    pred = {r["name"]: r["predicted_tps"] for r in loo["rows"] if r["source"] == "torchtitan2024"}
    for n in ("8gpu", "128gpu"):
        ratio = pred[f"llama3.1-8b-fsdp-compile-{n}"] / pred[f"llama3.1-8b-fsdp-{n}"]
        assert 1.08 < ratio < 1.16, (n, ratio)
    held = [r["error"] for r in loo["rows"] if r["source"] == "torchtitan2024"]
    assert all(0 < e < 0.14 for e in held), held


@pytest.fixture(scope="module")
def fitted(rows):
    return fit_all(rows)


def test_frontier_study_within_three_points_once_its_stack_is_fitted(rows, loo, fitted) -> None:
    # Held out, the MI250X stack is unknown and the study is over-predicted (3-10 points of
    # peak above the measured 38.4 / 36.1 / 32.0 %); the planner's model, whose Frontier stack
    # factor is fitted on the study, is within 3 points on all three, with one factor < 1.
    factors, stacks = fitted
    assert 0.6 < stacks["frontier"] < 0.95
    study = [r for r in rows if r.source == "dash2023"]
    off = {p["name"]: 100 * (p["predicted_pct_peak"] - p["measured_pct_peak"])
           for p in (predict_row(r, factors, stacks=stacks) for r in study)}
    assert all(abs(v) < 3 for v in off.values()), off
    held = {r["name"]: 100 * (r["predicted_pct_peak"] - r["measured_pct_peak"])
            for r in loo["rows"] if r["source"] == "dash2023"}
    assert 0 < held["gpt-1t"] < 4 < held["gpt-175b"] < held["gpt-22b"] < 10
    # the cluster file carries the fitted values
    cl = load_cluster("frontier")
    assert cl.stack_efficiency == pytest.approx(stacks["frontier"], abs=1e-3)
    assert cl.framework_factor("pytorch") == pytest.approx(
        factors["pytorch"] * stacks["frontier"], abs=2e-3)


def test_planner_pick_beats_the_study_175b_plan_without_its_pipeline(rows, fitted) -> None:
    row = next(r for r in rows if r.source == "dash2023" and r.name == "gpt-175b")
    cmp = pick_versus_source(row, fitted[0], stacks=fitted[1])
    assert cmp["source_plan"] == row.plan.describe() != cmp["pick_plan"]
    assert 1.15 < cmp["speedup"] < 1.6
    # the study pipelines 640 micro-batches over 16 stages; without recompute no pipelined
    # plan fits this trainer (torch keeps a receive buffer per micro-batch), so the pick
    # keeps full recompute and drops the pipeline: its bubble, and half the tp traffic at tp2
    assert row.plan.pp == 16 and cmp["pick"].pp == 1 and cmp["pick"].recompute == "full"
    assert max(cmp["saved_s"], key=cmp["saved_s"].get) == "tp_comm_exposed"
    assert "bubble" in cmp["saved_s"]


FULL = ["tp=2", "pp=4", "dp=128", "micro_batch=1", "grad_accum=8", "schedule=1f1b",
        "virtual_stages=1", "sharding=zero2", "recompute=full", "sequence_parallel=true"]
ARGS = ["--model", "configs/frontier-22b.yaml", "--cluster", "frontier", "--devices", "1024",
        "--global-batch", "1024"]


def test_fix_every_field_prices_exactly_that_plan(capsys) -> None:
    assert plan_main(ARGS + [a for f in FULL for a in ("--fix", f)] + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["tp"], out["pp"], out["dp"], out["micro_batch"], out["grad_accum"]) == \
        (2, 4, 128, 1, 8)
    assert (out["schedule"], out["sharding"], out["recompute"], out["sequence_parallel"]) == \
        ("1f1b", "zero2", "full", True)
    assert out["search_seconds"] == 0.0
    terms = {k: v for k, v in out["breakdown"].items() if not k.endswith("_overlapped")}
    assert sum(terms.values()) == pytest.approx(out["step_time_s"], rel=1e-9)
    assert terms["compute_recompute"] > 0 and terms["tp_comm_exposed"] > 0


def test_explain_prints_every_term_and_they_sum_to_the_step(capsys) -> None:
    assert plan_main(ARGS + ["--fix", "tp=8", "--fix", "pp=8", "--fix", "recompute=full",
                             "--explain"]) == 0
    text = capsys.readouterr().out
    for term in ("compute_gemm", "compute_attention", "compute_elementwise", "compute_recompute",
                 "compute_logits", "compute_host_overhead", "bubble", "optimizer",
                 "tp_comm_exposed", "pp_p2p", "dp_comm_exposed", "dp_comm_overlapped",
                 "states_first", "act_first", "peak"):
        assert f"  {term} " in text, term
    head = text[text.index("plan tp8 pp8"):]
    step = float(head.split(": ")[1].split(" s per step")[0])
    block = head[head.index("step time"):head.index("  sum")]
    total = sum(float(line.split()[1]) for line in block.splitlines()[1:])
    assert total == pytest.approx(step, rel=1e-3)


def test_bad_fix_is_a_clear_error(capsys) -> None:
    assert plan_main(ARGS + ["--fix", "pipeline=4"]) == 2
    assert "NAME one of" in capsys.readouterr().err
    # a value no plan can take is named before any search, not found deep inside it
    assert plan_main(ARGS + ["--fix", "schedule=pipedream"]) == 2
    assert "plan.schedule='pipedream' is not one of" in capsys.readouterr().err
    assert plan_main(ARGS + ["--fix", "sharding=zero1"]) == 2
    assert "use zero2" in capsys.readouterr().err
