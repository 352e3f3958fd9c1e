"""Rehearse Frontier plans on this box: time, host memory, rehearsed vs modeled peak memory.

For each preset (default: configs/frontier-175b.yaml and configs/frontier-1t.yaml at their
``parallel.nproc`` GCDs, 3,072) the planner picks the plan as the plan stage does
(``stages.plan.choose`` on the preset's cluster with the preset's fixed fields), and each of
its busiest ranks (the first and the last pipeline stage) is rehearsed by
``stages.plan.rehearsal_records`` (``model.training.rehearse``: the real trainer, one warm-up
and one measured training step on fake tensors in a fake process group of the plan's world
size), each in a fresh process so that its host peak RSS is its own. Recorded per rank:
wall seconds of the rehearsal and of the whole process, host peak RSS and the RSS before
the rehearsal (after imports and the plan search), the rehearsed peak memory (tensor bytes,
and with the cluster's margins) beside the memory model's (with margins, and its states +
activations without), the rehearsed memory by category, FLOPs and collective bytes.
Written to benchmarks/results/bench_rehearse.json; the last line printed is the figures as
one JSON object.

    .venv/bin/python benchmarks/bench_rehearse.py [--presets frontier-175b,frontier-1t]
        [--devices N] [--timeout 900]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import write_results  # noqa: E402 (needs the repository on sys.path)

PRESETS = ("frontier-175b", "frontier-1t")
STAGES = ("first", "last")


def peak_rss_gb() -> float:
    """This process's peak resident memory so far (GB; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def chosen_plan(preset: str, devices: int | None) -> tuple[Any, Any, Any, Any, int]:
    """(model config, train config, cluster, plan, devices) as the plan stage chooses them."""
    from model.planner.microbench import load_measured_cluster
    from stages.plan import choose, fixed_fields, load_model_file

    model_cfg, train_cfg, full = load_model_file(ROOT / "configs" / f"{preset}.yaml")
    world = devices or full.parallel.nproc
    cluster = load_measured_cluster(full.parallel.cluster, world)
    plan, _ = choose(model_cfg, train_cfg, cluster, world, fixed_fields(full.parallel))
    return model_cfg, train_cfg, cluster, plan, world


def rehearse_stage(preset: str, stage: str, devices: int | None) -> dict[str, Any]:
    """In this process: rehearse the first or last stage's rank of the preset's plan."""
    t0 = time.perf_counter()
    from model.training.rehearse import busiest_ranks
    from stages.plan import rehearsal_records

    model_cfg, train_cfg, cluster, plan, world = chosen_plan(preset, devices)
    ranks = busiest_ranks(plan)
    rank = ranks[0] if stage == "first" else ranks[-1]
    before = peak_rss_gb()
    record = rehearsal_records(model_cfg, train_cfg, plan, cluster, world, ranks=[rank])[0]
    return {"preset": preset, "plan": plan.describe(), "plan_fields": plan.to_dict(),
            "devices": world, "device_memory_gb": cluster.memory_gb, **record,
            "process_seconds": time.perf_counter() - t0,
            "host_peak_rss_before_gb": before, "host_peak_rss_gb": peak_rss_gb()}


def run_child(preset: str, stage: str, devices: int | None, timeout: float) -> dict[str, Any]:
    """``rehearse_stage`` in a fresh interpreter; its record, or the reason it has none."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", preset, stage]
    if devices:
        cmd += ["--devices", str(devices)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"preset": preset, "stage": stage, "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"preset": preset, "stage": stage, "error": proc.stderr[-2000:]}
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    record["wall_seconds"] = time.perf_counter() - t0
    return record


def figures_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline figures, one set per preset and stage."""
    out: dict[str, Any] = {}
    for r in records:
        key = f"{r['preset'].replace('frontier-', '')}_{r['stage']}"
        if "error" in r:
            out[f"{key}_error"] = r["error"][:200]
            continue
        out.update({
            f"{key}_rank": r["rank"],
            f"{key}_rehearsal_seconds": round(r["rehearsal_seconds"], 1),
            f"{key}_host_peak_rss_gb": round(r["host_peak_rss_gb"], 3),
            f"{key}_rehearsed_peak_memory_gb": round(r["rehearsed_peak_memory_gb"], 2),
            f"{key}_rehearsed_with_margins_gb": round(
                r["rehearsed_peak_memory_gb_with_margins"], 2),
            f"{key}_modeled_peak_memory_gb": round(r["peak_memory_gb"], 2),
            f"{key}_modeled_tensor_memory_gb": round(r["modeled_tensor_memory_gb"], 2),
            f"{key}_rehearsed_over_modeled": round(r["rehearsed_over_modeled"], 3),
            f"{key}_fits_device": r["rehearsed_fits_device"],
        })
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS),
                    help="comma-separated config names under configs/")
    ap.add_argument("--devices", type=int, default=None,
                    help="GCDs to plan for (default: each preset's parallel.nproc)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per rehearsed rank")
    ap.add_argument("--child", nargs=2, metavar=("PRESET", "STAGE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(rehearse_stage(args.child[0], args.child[1], args.devices)))
        return 0
    records = []
    for preset in args.presets.split(","):
        for stage in STAGES:
            record = run_child(preset, stage, args.devices, args.timeout)
            records.append(record)
            print(f"[bench_rehearse] {preset} {stage}: " + (
                record["error"][-300:] if "error" in record else
                f"{record['plan']} rank {record['rank']}: rehearsed "
                f"{record['rehearsed_peak_memory_gb']:.2f} GB vs modeled "
                f"{record['modeled_tensor_memory_gb']:.2f} GB (tensors; "
                f"{record['peak_memory_gb']:.2f} GB with margins) in "
                f"{record['rehearsal_seconds']:.0f} s, host peak RSS "
                f"{record['host_peak_rss_gb']:.2f} GB"), flush=True)
    figures = figures_of(records)
    write_results("bench_rehearse", figures, {"args": vars(args), "ranks": records})
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
