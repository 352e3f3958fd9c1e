"""What starting local ranks costs: the project's launcher against torchrun, same spec.

One short training (the tiny test model, 2 steps, 2 gloo ranks, no checkpoint) is launched
``--repeats`` times each way, alternating so that the box's drift falls on both alike:

- ``launcher``: ``python -m stages.mechanism.launch --spec``
  (``stages.mechanism.launch.LocalRanks``: rank 0 is
  its child and forks the other ranks once it has imported torch and the trainer,
  ``stages.mechanism.forked_ranks``; the launcher itself imports no torch);
- ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node 2 -m
  stages.train.worker --spec``: every rank a fresh interpreter that imports torch and the
  trainer itself, and torchrun imports torch as well.

Printed per way: the median wall seconds and CPU seconds (user + system of the command and
every process it waited for) of one launch; and the ratios torchrun / launcher. The last line
is one JSON object, also written to benchmarks/results/bench_launch.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import write_results
from benchmarks.timing import median_figures, timed_command
from stages.mechanism.launch import RankSpec, local_command, rank_command, rank_environment
from tests.train_helpers import tiny_config

PLAN = {"dp": 2, "micro_batch": 4, "grad_accum": 1, "sharding": "ddp"}


def torchrun_command(spec_path: Path, spec: RankSpec) -> list[str]:
    """The same ranks under torchrun: each starts (and imports) on its own."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(spec.nproc), *rank_command(spec_path, spec)[1:]]


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall s, CPU s of the command and its waited-for descendants) of one run of ``cmd``."""
    wall, cpu, proc = timed_command(cmd, ROOT, rank_environment())
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                         f"\n{proc.stderr[-2000:]}")
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="launches each way (default 5)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        out_dir = Path(tmp)
        cfg = tiny_config("train.steps=2")
        spec = RankSpec(worker="stages.train.worker", nproc=2, nodes=1, out_dir=str(out_dir),
                        config=cfg.to_dict(), plan=PLAN, extra={"save_final": False})
        spec_path = spec.write(out_dir / "spec.json")
        ways = {"launcher": local_command(spec_path), "torchrun": torchrun_command(spec_path, spec)}
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
        for k in range(args.repeats):
            for name, cmd in (ways.items() if k % 2 == 0 else reversed(ways.items())):
                runs[name].append(timed(cmd))
                wall, cpu = runs[name][-1]
                print(f"[launch] {k + 1}/{args.repeats} {name:<8} {wall:5.2f} s wall, "
                      f"{cpu:5.2f} CPU-s", flush=True)
    figures = median_figures(runs, ("wall_s", "cpu_s"))
    figures["wall_ratio_torchrun_over_launcher"] = round(
        figures["torchrun_wall_s"] / figures["launcher_wall_s"], 3)
    figures["cpu_ratio_torchrun_over_launcher"] = round(
        figures["torchrun_cpu_s"] / figures["launcher_cpu_s"], 3)
    figures["cpu_s_saved_per_launch"] = round(
        figures["torchrun_cpu_s"] - figures["launcher_cpu_s"], 3)
    write_results("bench_launch", figures, {"args": vars(args), "plan": PLAN,
                                            "runs": {k: v for k, v in runs.items()}})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
