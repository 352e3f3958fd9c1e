"""Timing a command the way the benchmarks report it: wall seconds and the CPU seconds of
the command and every process it waited for."""
from __future__ import annotations

import resource
import statistics
import subprocess
import time
from pathlib import Path


def timed_command(command: list[str], cwd: str | Path, env: dict[str, str] | None = None,
                  timeout: float | None = None
                  ) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    """Run ``command`` (output captured); (wall s, CPU s of it and its waited-for
    descendants, the finished process). Failing is the caller's to judge."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc


def median_figures(runs: dict[str, list[tuple[float, ...]]], fields: tuple[str, ...],
                   digits: int = 3) -> dict[str, float]:
    """``{"<way>_<field>": median}`` over the repeats of each way, a run being one value per
    field in ``fields`` order (say wall and CPU seconds)."""
    return {f"{way}_{field}": round(statistics.median(run[i] for run in got), digits)
            for way, got in runs.items() for i, field in enumerate(fields)}
