"""The memory model's output, pinned to the float for varied plans.

``tests/golden/memory_breakdown.json`` holds, for each case, the model's shapes, the plan,
the cluster's margins and every category ``memory_breakdown`` returned when the file was
written. The inputs live in the file too, so a change to a preset or a cluster file does not
move these numbers: only a change to the memory model does. After a deliberate change to the
model, rewrite the file by hand with ``python -m tests.test_memory_terms`` and say why the
numbers moved.
"""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from model.parallel.layout import Plan
from model.planner.memory_model import memory_breakdown
from model.planner.shapes import Shapes, encode

GOLDEN = Path(__file__).parent / "golden" / "memory_breakdown.json"
REL = 1e-12

# (name, preset, cluster, train overrides, plan): the Frontier presets' models and the
# tiny/micro ones over schedules, shardings, recompute (partial included), tp, sequence
# parallelism and pipelines of one and more stages.
CASES: list[tuple[str, str, str, list[str], dict[str, Any]]] = [
    ("22b-frontier-tp2-pp1-zero3-none-sp", "frontier-22b", "frontier", [],
     {"tp": 2, "pp": 1, "dp": 512, "micro_batch": 1, "grad_accum": 2, "sharding": "zero3",
      "recompute": "none", "sequence_parallel": True}),
    ("22b-frontier-tp8-pp4-zero2-1f1b-sel", "frontier-22b", "frontier", [],
     {"tp": 8, "pp": 4, "dp": 32, "micro_batch": 1, "grad_accum": 32, "schedule": "1f1b",
      "sharding": "zero2", "recompute": "selective", "sequence_parallel": True}),
    ("22b-frontier-tp1-pp1-zero2-ga1-full", "frontier-22b", "frontier", [],
     {"tp": 1, "pp": 1, "dp": 1024, "micro_batch": 1, "grad_accum": 1, "sharding": "zero2",
      "recompute": "full"}),
    ("22b-h100-tp1-pp4-ddp-gpipe-none", "frontier-22b", "h100", [],
     {"tp": 1, "pp": 4, "dp": 256, "micro_batch": 1, "grad_accum": 4, "schedule": "gpipe",
      "sharding": "ddp", "recompute": "none"}),
    ("22b-h100-tp1-pp4-ddp-1f1b-full", "frontier-22b", "h100", [],
     {"tp": 1, "pp": 4, "dp": 256, "micro_batch": 1, "grad_accum": 4, "schedule": "1f1b",
      "sharding": "ddp", "recompute": "full"}),
    ("175b-frontier-tp8-pp8-zero3-il2-partial-sp", "frontier-175b", "frontier", [],
     {"tp": 8, "pp": 8, "dp": 48, "micro_batch": 1, "grad_accum": 32,
      "schedule": "interleaved_1f1b", "virtual_stages": 2, "sharding": "zero3",
      "recompute": "full", "recompute_layers": 2, "sequence_parallel": True}),
    ("175b-frontier-tp2-pp6-zero2-gpipe-sel", "frontier-175b", "frontier", [],
     {"tp": 2, "pp": 6, "dp": 256, "micro_batch": 2, "grad_accum": 3, "schedule": "gpipe",
      "sharding": "zero2", "recompute": "selective"}),
    ("175b-h100-tp8-pp1-zero2-partial", "frontier-175b", "h100", [],
     {"tp": 8, "pp": 1, "dp": 384, "micro_batch": 1, "grad_accum": 4, "sharding": "zero2",
      "recompute": "full", "recompute_layers": 40, "sequence_parallel": True}),
    ("1t-frontier-tp8-pp16-zero3-1f1b-full-sp", "frontier-1t", "frontier", [],
     {"tp": 8, "pp": 16, "dp": 24, "micro_batch": 1, "grad_accum": 64, "schedule": "1f1b",
      "sharding": "zero3", "recompute": "full", "sequence_parallel": True}),
    ("1t-frontier-tp8-pp16-zero2-il4-partial", "frontier-1t", "frontier", [],
     {"tp": 8, "pp": 16, "dp": 24, "micro_batch": 1, "grad_accum": 64,
      "schedule": "interleaved_1f1b", "virtual_stages": 4, "sharding": "zero2",
      "recompute": "full", "recompute_layers": 1}),
    ("1t-frontier-tp8-pp1-zero3-mb8-ga1-full-sp", "frontier-1t", "frontier", [],
     {"tp": 8, "pp": 1, "dp": 384, "micro_batch": 4, "grad_accum": 1, "sharding": "zero3",
      "recompute": "full", "sequence_parallel": True}),
    ("tiny-h100-tp1-pp1-ddp-bf16", "tiny", "h100", ["train.dtype=bfloat16"],
     {"tp": 1, "pp": 1, "dp": 2, "micro_batch": 4, "grad_accum": 2, "sharding": "ddp",
      "recompute": "none"}),
    ("tiny-h100-tp2-pp2-none-gpipe-fp32", "tiny", "h100", [],
     {"tp": 2, "pp": 2, "dp": 1, "micro_batch": 2, "grad_accum": 8, "schedule": "gpipe",
      "sharding": "none", "recompute": "full", "recompute_layers": 1}),
    ("tiny-frontier-tp2-pp2-zero3-il2-sp-bf16", "tiny", "frontier", ["train.dtype=bfloat16"],
     {"tp": 2, "pp": 2, "dp": 2, "micro_batch": 2, "grad_accum": 4,
      "schedule": "interleaved_1f1b", "virtual_stages": 2, "sharding": "zero3",
      "recompute": "selective", "sequence_parallel": True}),
    ("tiny-h100-tp1-pp2-ddp-1f1b-bf16", "tiny", "h100", ["train.dtype=bfloat16"],
     {"tp": 1, "pp": 2, "dp": 2, "micro_batch": 2, "grad_accum": 4, "schedule": "1f1b",
      "sharding": "ddp", "recompute": "full"}),
    ("micro-frontier-tp1-pp2-zero2-1f1b", "micro", "frontier", [],
     {"tp": 1, "pp": 2, "dp": 2, "micro_batch": 1, "grad_accum": 2, "schedule": "1f1b",
      "sharding": "zero2", "recompute": "none"}),
    ("micro-frontier-tp1-pp1-zero3-ga1", "micro", "frontier", [],
     {"tp": 1, "pp": 1, "dp": 2, "micro_batch": 4, "grad_accum": 1, "sharding": "zero3",
      "recompute": "none"}),
    ("micro-frontier-tp1-pp2-zero3-1f1b", "micro", "frontier", [],
     {"tp": 1, "pp": 2, "dp": 2, "micro_batch": 1, "grad_accum": 4, "schedule": "1f1b",
      "sharding": "zero3", "recompute": "none"}),
    ("tiny-h100-tp2-pp1-zero2-sel-partial-rotary", "tiny", "h100",
     ["train.dtype=bfloat16", "model.family=neox", "model.rotary_fraction=0.25"],
     {"tp": 2, "pp": 1, "dp": 2, "micro_batch": 2, "grad_accum": 2, "sharding": "zero2",
      "recompute": "selective"}),
    ("micro-h100-tp2-pp1-zero3-sp", "micro", "h100", [],
     {"tp": 2, "pp": 1, "dp": 2, "micro_batch": 1, "grad_accum": 2, "sharding": "zero3",
      "recompute": "selective", "sequence_parallel": True}),
]

# Unfused attention (the s x s scores) is no cluster file's kernel among these: one case
# each, the shapes' flash_attention turned off.
UNFUSED = ("tiny-h100-tp2-pp2-none-gpipe-fp32", "micro-h100-tp2-pp1-zero3-sp")


def _load_golden() -> list[dict[str, Any]]:
    cases = json.loads(GOLDEN.read_text())["cases"]
    assert [c["name"] for c in cases] == [c[0] for c in CASES], "golden file out of date"
    return cases


def _golden(name: str) -> dict[str, Any]:
    return next(c for c in _load_golden() if c["name"] == name)


def _breakdown(shapes: dict[str, Any], plans: list[dict[str, Any]], reserved_gb: float,
               fragmentation: float) -> dict[str, list[float]]:
    res = memory_breakdown(Shapes(**shapes), encode([Plan(**p) for p in plans]), reserved_gb,
                           fragmentation)
    return {k: [float(x) for x in v] for k, v in res.items()}


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_memory_breakdown_matches_golden(name: str) -> None:
    case = _golden(name)
    got = _breakdown(case["shapes"], [case["plan"]], case["reserved_gb"], case["fragmentation"])
    assert sorted(got) == sorted(case["expected"])
    for key, value in case["expected"].items():
        assert got[key][0] == pytest.approx(value, rel=REL, abs=0.0), key


def test_memory_breakdown_of_many_candidates_matches_each_alone() -> None:
    # The search prices thousands of plans in one call: a model's plans priced together (mixed
    # schedules, chunk counts and shardings in one array) give each plan's pinned numbers.
    by_model: dict[str, list[dict[str, Any]]] = {}
    for case in _load_golden():
        key = json.dumps([case["shapes"], case["reserved_gb"], case["fragmentation"]])
        by_model.setdefault(key, []).append(case)
    assert any(len(cases) > 2 for cases in by_model.values())
    for cases in by_model.values():
        first = cases[0]
        got = _breakdown(first["shapes"], [c["plan"] for c in cases], first["reserved_gb"],
                         first["fragmentation"])
        for i, case in enumerate(cases):
            for key, value in case["expected"].items():
                assert got[key][i] == pytest.approx(value, rel=REL, abs=0.0), (case["name"], key)


def _layout_fields(plan: Plan) -> dict[str, Any]:
    return {k: v for k, v in plan.to_dict().items() if k != "predictions"}


def write_golden() -> Path:
    """Price every case with the current model and write the golden file (run by hand)."""
    from model.planner.cluster import load_cluster
    from stages.config import load_config

    root = Path(__file__).resolve().parents[1]
    out = []
    for name, preset, cluster_name, overrides, raw_plan in CASES:
        cfg = load_config(root / "configs" / f"{preset}.yaml", overrides)
        cluster = load_cluster(cluster_name)
        plan = Plan(**raw_plan)
        train = replace(cfg.train, global_batch=plan.global_batch)
        plan.check(cfg.model, train, plan.world_size)
        shapes = Shapes.from_configs(cfg.model, train, cluster)
        if name in UNFUSED:
            shapes = replace(shapes, flash_attention=False)
        res = memory_breakdown(shapes, encode([plan]), cluster.reserved_gb,
                               cluster.fragmentation)
        out.append({"name": name, "preset": preset, "cluster": cluster_name,
                    "shapes": asdict(shapes), "plan": _layout_fields(plan),
                    "reserved_gb": cluster.reserved_gb, "fragmentation": cluster.fragmentation,
                    "expected": {k: float(v[0]) for k, v in res.items()}})
    tmp = GOLDEN.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"cases": out}, indent=1) + "\n")
    tmp.rename(GOLDEN)
    return GOLDEN


if __name__ == "__main__":
    print(write_golden())
