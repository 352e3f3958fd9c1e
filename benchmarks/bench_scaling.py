"""Predicted scaling studies on Frontier, the figures docs/scaling.md quotes.

Every study goes through ``workflows.scaling.predict_points``, the code path of
``python -m workflows.scaling --predict`` (the plan stage's search and time model; nothing is
trained and no MLflow run is made: the runs dir is a temporary one):

1. Dash et al. 2023's sizes (arXiv 2312.12705), weak and strong: 175B from 64 to 1,024 GCDs
   and 1T from 512 to 3,072 GCDs, once with the planner's own layout per point and once with
   the study's layout family fixed (configs/published/dash2023.yaml: 175B tp 4, pp 16; 1T tp 4,
   pp 128; micro-batch 1, full recompute, no sequence parallelism, 1F1B).
2. The whole machine: the 22B, 175B and 1T presets, weak and strong, from one node (8 GCDs)
   doubling to 75,264 GCDs, the planner's layout per point.

Recorded per study: the device counts, and per point the layout, predicted MFU and
efficiency, the dominant term, the largest overhead term, the loss term (the term whose
device-seconds per token grew most from the first priced point) with its share, and each
overhead term's fraction of the step. The figures the docs quote (efficiency at the last point,
the overhead fractions at the first and last point) are in ``figures``; the per-point rows in
``studies``. Written to benchmarks/results/bench_scaling_predicted.json; the last line printed
is the figures as one JSON object.

    .venv/bin/python benchmarks/bench_scaling.py [--skip-machine]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import write_results
from model.planner.scaling import USEFUL_TERMS
from workflows.scaling import PRESETS, predict_points

STUDY_FAMILY = {
    "frontier-175b": ["tp=4", "pp=16"],
    "frontier-1t": ["tp=4", "pp=128"],
}
"""The layout family of Dash et al. 2023's plans (configs/published/dash2023.yaml)."""
COMMON_FIXES = ["micro_batch=1", "recompute=full", "sequence_parallel=false", "schedule=1f1b"]
PUBLISHED_DEVICES = {"frontier-175b": [64, 128, 256, 512, 1024],
                     "frontier-1t": [512, 1024, 2048, 3072]}
PUBLISHED = {("frontier-175b", "weak"): 1.00, ("frontier-175b", "strong"): 0.89,
             ("frontier-1t", "weak"): 1.00, ("frontier-1t", "strong"): 0.87}
"""Dash et al. 2023's efficiencies (abstract) at the largest count of each study."""


def _r(value: Any, digits: int = 4) -> Any:
    return round(value, digits) if isinstance(value, float) else value


def point_record(point: Any) -> dict[str, Any]:
    """One point's row: layout, predictions, terms that explain it."""
    row = point.row
    rec = {k: row.get(k) for k in ("devices", "global_batch", "tp", "pp", "dp", "micro_batch",
                                   "grad_accum", "schedule", "sharding", "recompute",
                                   "sequence_parallel")}
    rec.update({k: _r(row.get(k)) for k in (
        "predicted_step_time_s", "predicted_mfu", "predicted_efficiency", "dominant_term",
        "dominant_fraction", "overhead_term", "overhead_fraction", "loss_term", "loss_share")})
    if row.get("note"):
        rec["note"] = row["note"]
    step = sum(point.terms.values())
    rec["overhead_fractions"] = {k: round(v / step, 4) for k, v in sorted(point.terms.items())
                                 if k not in USEFUL_TERMS and step > 0 and v / step >= 0.001}
    return rec


def run_study(config: str, mode: str, devices: list[int] | None, fixes: list[str],
              runs_dir: Path) -> dict[str, Any]:
    """One predicted study (one configuration) through workflows.scaling.predict_points."""
    t0 = time.perf_counter()
    points = predict_points([str(ROOT / "configs" / f"{config}.yaml")],
                            [f"tracking.runs_dir={runs_dir}"], mode, devices, fixes)
    rows = [point_record(p) for p in points]
    priced = [r for r in rows if r["predicted_efficiency"] is not None]
    out = {"config": config, "mode": mode, "fix": fixes,
           "devices": [r["devices"] for r in rows],
           "efficiency": [r["predicted_efficiency"] for r in rows],
           "points": rows, "seconds": round(time.perf_counter() - t0, 1)}
    if priced:
        first, last = priced[0], priced[-1]
        out.update(first_priced=first["devices"], last=last["devices"],
                   efficiency_last=last["predicted_efficiency"],
                   mfu_first=first["predicted_mfu"], mfu_last=last["predicted_mfu"],
                   loss_term_last=last["loss_term"], loss_share_last=last["loss_share"],
                   overheads_first=first["overhead_fractions"],
                   overheads_last=last["overhead_fractions"])
    eff = out.get("efficiency_last")
    print(f"[{config} {mode}{' ' + ' '.join(fixes) if fixes else ''}] "
          f"{out['devices'][0]}..{out['devices'][-1]} GCDs: efficiency at the last point "
          f"{'-' if eff is None else f'{eff:.1%}'}, loss term {out.get('loss_term_last')} "
          f"({out['seconds']} s)", flush=True)
    return out


def published_studies(runs_dir: Path) -> dict[str, dict]:
    """175B and 1T at Dash et al.'s sizes, planner's layout and the study's family."""
    studies = {}
    for config, devices in PUBLISHED_DEVICES.items():
        for mode in ("weak", "strong"):
            for layout, fixes in (("planner", []),
                                  ("study_family", [*STUDY_FAMILY[config], *COMMON_FIXES])):
                study = run_study(config, mode, devices, fixes, runs_dir)
                study["published"] = PUBLISHED[(config, mode)]
                studies[f"{config}_{mode}_{layout}"] = study
    return studies


def machine_studies(runs_dir: Path) -> dict[str, dict]:
    """Every preset, weak and strong, from one node to the whole machine."""
    return {f"{config}_{mode}_machine": run_study(config, mode, None, [], runs_dir)
            for config in PRESETS for mode in ("weak", "strong")}


def headline(studies: dict[str, dict]) -> dict[str, Any]:
    """The figures docs/scaling.md quotes, one key per study."""
    figures: dict[str, Any] = {}
    for name, s in studies.items():
        figures[f"{name}_efficiency"] = s.get("efficiency_last")
        figures[f"{name}_loss_term"] = s.get("loss_term_last")
        if "published" in s:
            figures[f"{name}_published"] = s["published"]
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-machine", action="store_true",
                        help="only the published sizes, not the whole-machine sweeps")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        runs_dir = Path(tmp) / "runs"
        studies = published_studies(runs_dir)
        if not args.skip_machine:
            studies.update(machine_studies(runs_dir))
    figures = headline(studies)
    path = write_results("bench_scaling_predicted", figures,
                         {"args": vars(args), "studies": studies})
    print(f"written {path}", flush=True)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
