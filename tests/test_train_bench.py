"""benchmarks/bench_train.py end to end on CPU: both modes run, report JSON, record results."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def bench(*args: str) -> tuple[dict, str]:
    """Run the benchmark; return the JSON of its last stdout line and its stderr."""
    proc = subprocess.run([sys.executable, "benchmarks/bench_train.py", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.slow
def test_ratio_mode_times_both_loops_and_records_its_figures(tmp_path: Path) -> None:
    out, stderr = bench("--steps", "1", "--rounds", "2", "--batch", "1",
                        "--results-dir", str(tmp_path))
    # The warm-up round is not measured: two rounds of one step each.
    assert out["mode"] == "ratio" and out["steps_each"] == 2
    assert out["trainer_tokens_per_s"] > 0 and out["plain_tokens_per_s"] > 0
    # Both loops do the same work on the same model: their rates are of one order.
    assert 0.1 < out["trainer_ratio"] < 10
    # The figures printed are the figures recorded, with what they were measured on.
    record = json.loads((tmp_path / "bench_train.json").read_text())
    assert record["figures"] == out
    assert record["args"]["steps"] == 1 and record["args"]["rounds"] == 2
    assert record["machine"]["cpu_count"] >= 1 and record["machine"]["torch"]
    assert str(tmp_path / "bench_train.json") in stderr


@pytest.mark.slow
def test_tiny_gpu_mode_trains_on_cpu_and_records_nothing(tmp_path: Path) -> None:
    out, stderr = bench("--gpu", "--device", "cpu", "--tiny", "--steps", "3",
                        "--peak-tflops", "0.5", "--results-dir", str(tmp_path))
    assert out["mode"] == "gpu" and out["device"] == "cpu" and out["steps"] == 3
    assert out["peak_tflops"] == 0.5  # the given peak, not a guessed one
    assert out["step_time_s"] > 0 and out["tokens_per_s"] > 0 and out["peak_memory_gb"] > 0
    # A tiny model on CPU reaches a small part of a 0.5 TFLOP/s peak.
    assert 0 < out["mfu"] < 1
    # Three steps from a random init: a finite loss near ln(vocabulary) (256 tokens).
    uniform = math.log(256)
    assert math.isfinite(out["final_loss"]) and 0.5 * uniform < out["final_loss"] < 2 * uniform
    # --tiny is a smoke run: its figures are not recorded.
    assert not any(tmp_path.iterdir())
    assert "figures not recorded" in stderr
