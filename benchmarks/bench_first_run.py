"""What a newcomer's first steps cost here: the install, its disk and a first run.

With ``--install``, makes a fresh venv in a temp dir and times the README's install in it:
``pip install torch==2.13.0 --index-url <--torch-index>`` (PyTorch's CPU index by default;
``--torch-index ''``: the indexes pip is configured with, e.g. a local mirror), then
``pip install -e ".[dev,eval]"``; the runs below then use that venv. Without it, the
environment running this script (``sys.prefix``) is measured as it is.

Measures the environment's disk and runs ``python -m workflows.pipeline --config
configs/<preset>.yaml --runs-dir <fresh temp dir>`` twice: the first run (nothing cached:
a new tokenizer, store, plan, training and evaluation, a new MLflow store; in a fresh venv
also no bytecode yet) and the second (every stage reused). Records wall seconds, the CPU
seconds of the run's whole process tree and the runs dir's size in
``benchmarks/results/bench_first_run.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

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


TORCH = "torch==2.13.0"
"""The torch the README installs."""


def fresh_install(venv: Path, torch_index: str, timeout: float) -> tuple[str, dict[str, Any]]:
    """Make ``venv`` and install torch and the project into it as the README says; its
    interpreter and the timings (SystemExit when a step fails)."""
    timed_run([sys.executable, "-m", "venv", str(venv)], timeout)
    python = str(venv / "bin" / "python")
    index = ["--index-url", torch_index] if torch_index else []
    torch_s = timed_run([python, "-m", "pip", "install", "-q", TORCH, *index], timeout)[0]
    project_s = timed_run([python, "-m", "pip", "install", "-q", "-e", f"{REPO}[dev,eval]"],
                          timeout)[0]
    print(f"[bench] install: torch {torch_s:.0f} s, the project {project_s:.0f} s", flush=True)
    return python, {"install_torch_s": round(torch_s, 1), "install_project_s": round(project_s, 1),
                    "install_s": round(torch_s + project_s, 1), "torch_index": torch_index}


def main(argv: list[str] | None = None) -> int:
    """Measure the environment's disk and two runs of a preset; print and record them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/micro.yaml", help="the preset to run")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    parser.add_argument("--install", action="store_true",
                        help="time the README's install into a fresh venv and run in it")
    parser.add_argument("--torch-index", default="https://download.pytorch.org/whl/cpu",
                        help="--install: torch's index ('': pip's configured indexes)")
    parser.add_argument("--tiny", action="store_true", help="run, but record nothing (tests)")
    args = parser.parse_args(argv)
    figures: dict[str, Any] = {"config": args.config, "fresh_install": args.install}
    with tempfile.TemporaryDirectory(prefix="first-run-") as tmp:
        python, env = sys.executable, Path(sys.prefix)
        if args.install:
            env = Path(tmp) / "venv"
            python, timings = fresh_install(env, args.torch_index, args.timeout)
            figures.update(timings)
        figures["env_disk_gb"] = round(disk_gb(env), 2)
        command = [python, "-m", "workflows.pipeline", "--config", args.config,
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
