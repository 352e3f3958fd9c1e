"""What the planner prices a whole training run at, for the runs docs/planner.md quotes.

Runs ``workflows.plan ... --json`` (the command the docs give, in this process) for the 1T preset
trained on 20T tokens and the 175B preset's own 10,000 steps, both on 3,072 Frontier GCDs
at a global batch of 1,536, and records each pick's ``run_cost`` (steps, wall-clock,
node-hours, FLOPs, checkpoint cost) and its step time in
``benchmarks/results/bench_run_cost.json``. Seconds on one core; predictions, not
measurements, so they change only with the planner's models and the presets.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import REPO, RESULTS_DIR, report  # noqa: E402 (repository on sys.path)
from workflows import plan as plan_cli  # noqa: E402

RUNS = {
    "1t": ["--model", "configs/frontier-1t.yaml", "--tokens", "20e12"],
    "175b": ["--model", "configs/frontier-175b.yaml"],
}
"""Per quoted run, the plan CLI's arguments beyond the cluster, devices and batch."""
KEPT = ("steps", "wall_hours", "wall_days", "node_hours", "device_hours", "params",
        "params_with_embedding", "train_flops", "train_exaflops", "machine_days",
        "checkpoint_s", "checkpoint_s_per_step")


def priced(extra: list[str], devices: int, global_batch: int) -> dict:
    """The plan CLI's JSON pick for one run (its ``run_cost`` and predictions), run in this
    process so that the code it ran is what the results file records."""
    argv = ["--cluster", "frontier", "--devices", str(devices),
            "--global-batch", str(global_batch), "--json", *extra]
    out = io.StringIO()
    cwd = Path.cwd()
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out):
            code = plan_cli.main(argv)
    finally:
        os.chdir(cwd)
    if code:
        raise SystemExit(f"workflows.plan {' '.join(argv)} exited {code}")
    return json.loads(out.getvalue().strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Price each run, print the figures as the last line and record them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=3072)
    parser.add_argument("--global-batch", type=int, default=1536)
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    parser.add_argument("--tiny", action="store_true", help="run, but record nothing")
    args = parser.parse_args(argv)
    figures: dict[str, float | int] = {}
    for name, extra in RUNS.items():
        pick = priced(extra, args.devices, args.global_batch)
        cost = pick["run_cost"]
        figures[f"{name}_step_time_s"] = round(pick["step_time_s"], 2)
        figures.update({f"{name}_{key}": cost[key] for key in KEPT})
        figures[f"{name}_node_hours_millions"] = round(cost["node_hours"] / 1e6, 2)
        figures[f"{name}_checkpoint_tb"] = round(12 * cost["params_with_embedding"] / 1e12, 2)
    report("bench_run_cost", figures, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
