"""benchmarks/results.py records a benchmark's figures with the commit, date and machine."""
from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.results import write_results  # noqa: E402 (needs the repository on sys.path)


def test_write_results_records_figures_commit_date_and_machine(tmp_path: Path) -> None:
    figures = {"trainer_ratio": 0.97, "trainer_tokens_per_s": 6397}
    path = write_results("bench_x", figures, {"args": {"rounds": 5}}, directory=tmp_path)
    assert path == tmp_path / "bench_x.json"
    record = json.loads(path.read_text())
    assert record["figures"] == figures
    assert record["args"] == {"rounds": 5}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=False).stdout.strip()
    assert record["commit"] == (head or "unknown")
    date = dt.datetime.fromisoformat(record["date"])
    assert date.utcoffset() == dt.timedelta(0)
    assert abs((dt.datetime.now(dt.UTC) - date).total_seconds()) < 60
    machine = record["machine"]
    assert machine["cpu_count"] == os.cpu_count() and machine["hostname"]
    import torch

    assert machine["torch"] == torch.__version__
    assert (machine["gpu"] is None) == (not torch.cuda.is_available())
    assert [p.name for p in tmp_path.iterdir()] == ["bench_x.json"]  # no temp file left


def test_rewrite_replaces_the_file_and_bad_input_is_refused(tmp_path: Path) -> None:
    write_results("bench_x", {"a": 1}, directory=tmp_path)
    write_results("bench_x", {"a": 2}, directory=tmp_path)
    assert json.loads((tmp_path / "bench_x.json").read_text())["figures"] == {"a": 2}
    with pytest.raises(ValueError, match="non-empty dict"):
        write_results("bench_x", {}, directory=tmp_path)
    with pytest.raises(ValueError, match="letters, digits"):
        write_results("../escape", {"a": 1}, directory=tmp_path)
    with pytest.raises(ValueError, match="commit"):
        write_results("bench_x", {"a": 1}, {"commit": "abc"}, directory=tmp_path)


def test_timed_command_counts_the_cpu_of_the_command_and_what_it_waited_for() -> None:
    from benchmarks.timing import timed_command

    busy = "x = 0\nwhile x < 10_000_000: x += 1"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {busy!r}])"
    wall, cpu, proc = timed_command([sys.executable, "-c", child], REPO)
    assert proc.returncode == 0
    assert cpu > 0.3, "the grandchild's busy loop is counted"
    assert wall > 0.3 * cpu
    wall, cpu, proc = timed_command([sys.executable, "-c", "raise SystemExit(4)"], REPO)
    assert proc.returncode == 4 and cpu < 1.0
