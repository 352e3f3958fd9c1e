"""What keeping freed host memory is worth to a CPU rank (``model.parallel.host_memory``).

The tiny preset's three micro-batch sizes (8 x 1, 4 x 2 and 2 x 4 per rank and step) are
measured on 1 rank (global batch 8) and on 2 data-parallel ranks (DDP, global batch 16), each
plan for ``--rounds`` rounds of ``--steps`` steps in one launch
(``stages.plan.measure_worker.measure_plans``, the planner's own measurement), in two ways,
alternating launch by launch ``--repeats`` times so that the box's drift falls on both alike:

- ``retained``: the ranks as they run (glibc keeps what a step frees);
- ``released``: ``FRONTIER_LLM_RETAIN_FREED_MEMORY=0``, glibc's default (large tensors are
  unmapped when freed and their pages faulted in again the next step).

Printed per setting, way and plan: the median and the 10th percentile of its step seconds
(every step after each build's first), and the ratios released / retained; and each way's
ranking of the plans beside the time model's (which prices no page faults). The last line is
one JSON object, also written to benchmarks/results/bench_host_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import write_results
from model.parallel.host_memory import RETAIN_VAR
from model.parallel.layout import Plan
from stages.config import load_config

MICRO_BATCHES = (8, 4, 2)
SETTINGS = {"n1": (1, 8), "n2": (2, 16)}  # ranks, global batch
WAYS = {"retained": "1", "released": "0"}


def plans_of(nproc: int, global_batch: int) -> list[Plan]:
    """The setting's data-parallel plans, one per micro-batch size."""
    sharding = "ddp" if nproc > 1 else "none"
    return [Plan(dp=nproc, micro_batch=mb, grad_accum=global_batch // nproc // mb,
                 sharding=sharding) for mb in MICRO_BATCHES]


def predicted_order(cfg, plans: list[Plan]) -> list[str]:
    """The plans as the time model ranks them (fastest first), this machine measured."""
    from model.planner.microbench import load_measured_cluster
    from model.planner.search import predict_plan
    from model.planner.shapes import Shapes

    nproc = plans[0].world_size
    cluster = load_measured_cluster("local", nproc, cache_dir=cfg.runs_dir / "cache" / "microbench")
    shapes = Shapes.from_configs(cfg.model, cfg.train, cluster)
    seconds = {p.describe(): predict_plan(shapes, cluster, p, nproc, cfg.train.global_batch)
               .predictions["step_time_s"] for p in plans}
    return sorted(seconds, key=seconds.get)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="launches each way (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per launch (default 3)")
    ap.add_argument("--steps", type=int, default=20, help="steps per plan and round (default 20)")
    args = ap.parse_args()
    from stages.plan.measure_worker import measure_plans

    figures: dict[str, float | bool] = {}
    details: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-host-memory-") as tmp:
        for name, (nproc, global_batch) in SETTINGS.items():
            cfg = load_config(None, [f"tracking.runs_dir={tmp}/runs",
                                     f"train.global_batch={global_batch}"])
            plans = plans_of(nproc, global_batch)
            steps: dict[str, list[list[float]]] = {w: [[] for _ in plans] for w in WAYS}
            for k in range(args.repeats):
                for way in (list(WAYS) if k % 2 == 0 else list(WAYS)[::-1]):
                    os.environ[RETAIN_VAR] = WAYS[way]
                    got = measure_plans(cfg, plans, Path(tmp) / f"{name}-{way}-{k}",
                                        args.steps, args.rounds)
                    if got["failed"] or any(got["errors"]):
                        raise SystemExit(f"{name} {way}: {got['failed'] or got['errors']}")
                    for i, rounds in enumerate(got["step_times"]):
                        steps[way][i].extend(x for r in rounds for x in r)
                    print(f"[host-memory] {name} {way} launch {k + 1}/{args.repeats}: "
                          f"{got['seconds']:.0f} s", flush=True)
            os.environ.pop(RETAIN_VAR, None)
            rows = {}
            for i, plan in enumerate(plans):
                row = {}
                for way in WAYS:
                    xs = steps[way][i]
                    row[f"{way}_median_s"] = statistics.median(xs)
                    row[f"{way}_p10_s"] = float(np.percentile(xs, 10))
                row["median_ratio"] = row["released_median_s"] / row["retained_median_s"]
                row["p10_ratio"] = row["released_p10_s"] / row["retained_p10_s"]
                rows[plan.describe()] = row
                ms = {key: value * 1e3 for key, value in row.items()}
                print(f"[host-memory] {name} {plan.describe():<32} median "
                      f"{ms['retained_median_s']:6.1f} ms retained, "
                      f"{ms['released_median_s']:6.1f} released (x{row['median_ratio']:.3f}); "
                      f"p10 {ms['retained_p10_s']:6.1f} / {ms['released_p10_s']:6.1f} "
                      f"(x{row['p10_ratio']:.3f})", flush=True)
            order = {way: sorted(rows, key=lambda p, w=way: rows[p][f"{w}_median_s"])
                     for way in WAYS}
            model = predicted_order(cfg, plans)
            for way in WAYS:
                print(f"[host-memory] {name} {way}: fastest first {order[way]}; "
                      f"{'matches' if order[way] == model else 'differs from'} the time model's "
                      f"{model}", flush=True)
                figures[f"{name}_{way}_order_matches_model"] = order[way] == model
            big = plans[0].describe()  # micro-batch 8: the most bytes a micro-batch
            figures[f"{name}_mb8_median_ratio_released_over_retained"] = round(
                rows[big]["median_ratio"], 3)
            figures[f"{name}_mb8_p10_ratio_released_over_retained"] = round(
                rows[big]["p10_ratio"], 3)
            details[name] = {"rows": rows, "order": order, "model_order": model}
    write_results("bench_host_memory", figures, {"args": vars(args), "settings": details})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
