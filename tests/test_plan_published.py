"""The published GPU measurements, the fit to them, and pricing/explaining one plan."""
from __future__ import annotations

import json

import pytest

from model.planner.published import (
    FILE_FIELDS,
    PLAN_FIELDS,
    ROW_FIELDS,
    leave_one_source_out,
    load_published,
)
from stages.plan import main as plan_main

LOO_BOUND = {"narayanan2021": 0.15, "korthikanti2022": 0.15, "dash2023": 0.25,
             "torchtitan2024": 0.40}


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
    assert {r.role for r in rows if r.source == "dash2023"} == {"test"}


def test_leave_one_source_out_error_stays_bounded(rows) -> None:
    loo = leave_one_source_out(rows)
    for src, bound in LOO_BOUND.items():
        assert loo["per_source"][src] <= bound, (src, loo["per_source"][src])
    # a held-out source never informs its own prediction
    assert loo["factors"]["torchtitan2024"]["pytorch"] == loo["factors"]["torchtitan2024"][
        "megatron"]


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
