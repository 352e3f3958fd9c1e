"""What a newcomer's first steps cost here: the installed environment's disk and a first run.

Measures the disk the Python environment running this script takes (``sys.prefix``: the
venv of the README's install) and runs ``python -m workflows.pipeline --config
configs/<preset>.yaml --runs-dir <fresh temp dir>`` twice: the first run (nothing cached:
a new tokenizer, store, plan, training and evaluation, a new MLflow store) and the second
(every stage reused). Records wall seconds, the CPU seconds of the run's whole process
tree and the runs dir's size in ``benchmarks/results/bench_first_run.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import (  # noqa: E402 (needs the repository on sys.path)
    REPO,
    RESULTS_DIR,
    whole_project_code,
    write_results,
)
from benchmarks.timing import timed_command  # noqa: E402


def disk_gb(path: Path) -> float:
    """Bytes of the files under ``path`` (``du``-like, hard links once), in GB."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                stat = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_blocks * 512
    return total / 1e9


def timed_run(command: list[str], timeout: float) -> tuple[float, float]:
    """Run ``command`` from the repository root; (wall s, CPU s of its process tree).
    SystemExit with its output's tail when it fails."""
    wall, cpu, proc = timed_command(command, REPO, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}")
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    """Measure the environment's disk and two runs of a preset; print and record them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/micro.yaml", help="the preset to run")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    parser.add_argument("--tiny", action="store_true", help="run, but record nothing (tests)")
    args = parser.parse_args(argv)
    figures: dict[str, float | str] = {"config": args.config,
                                       "env_disk_gb": round(disk_gb(Path(sys.prefix)), 2)}
    with tempfile.TemporaryDirectory(prefix="first-run-") as tmp:
        command = [sys.executable, "-m", "workflows.pipeline", "--config", args.config,
                   "--runs-dir", str(Path(tmp) / "runs")]
        for which in ("first", "second"):
            wall, cpu = timed_run(command, args.timeout)
            figures[f"{which}_run_wall_s"] = round(wall, 1)
            figures[f"{which}_run_cpu_s"] = round(cpu, 1)
            print(f"[bench] {which} run: {wall:.1f} s wall, {cpu:.1f} CPU-s", flush=True)
        figures["runs_dir_mb"] = round(disk_gb(Path(tmp) / "runs") * 1000, 1)
    figures["load_average_1min"] = round(os.getloadavg()[0], 2)
    if not args.tiny:
        write_results("bench_first_run", figures, {"args": vars(args)}, args.results_dir,
                      code=whole_project_code())
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
