"""benchmarks/bench_train.py runs both modes end to end (tiny model on CPU) and reports JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def bench(*args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "benchmarks/bench_train.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_ratio_mode_reports_trainer_ratio() -> None:
    out = bench("--tiny", "--steps", "3", "--rounds", "1")
    assert out["mode"] == "ratio" and out["steps_each"] == 3
    assert out["trainer_ratio"] == pytest.approx(
        out["trainer_tokens_per_s"] / out["plain_tokens_per_s"])
    assert out["trainer_ratio"] > 0


@pytest.mark.slow
def test_gpu_mode_path_runs_on_cpu_with_a_tiny_model() -> None:
    out = bench("--gpu", "--device", "cpu", "--tiny", "--steps", "3", "--peak-tflops", "0.5")
    assert out["mode"] == "gpu" and out["device"] == "cpu" and out["steps"] == 3
    assert out["peak_tflops"] == 0.5
    assert out["mfu"] == pytest.approx(out["tflops_per_device"] / 0.5)
    assert out["tokens_per_s"] == pytest.approx(8 * 32 / out["step_time_s"])
    assert out["final_loss"] > 0 and out["peak_memory_gb"] > 0
