"""benchmarks/gpu_check.sh runs all its steps on the CPU in its dry mode (so that it works the
first time a GPU runs it), and records a failing step instead of stopping at it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import gpu_check  # noqa: E402 (needs the repository on sys.path)


@pytest.mark.slow
def test_dry_check_runs_every_step_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "GPU_CHECK_DRY": "1", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--results-dir", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=540,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "gpu_check_dry.json").read_text())
    figures, steps = record["figures"], record["steps"]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == figures
    assert figures["dry"] is True and figures["required_ok"] is True
    assert list(steps) == ["nvidia_smi", "torch", "bench_train", "pipeline", "rehearsal"]
    assert all(steps[name]["ok"] for name in steps if name != "nvidia_smi")
    assert steps["torch"]["result"]["cuda_available"] is False  # the GPU was hidden
    assert figures["torch"] == steps["torch"]["result"]["torch"]
    assert steps["bench_train"]["result"]["mode"] == "gpu"
    assert steps["bench_train"]["result"]["device"] == "cpu"
    assert steps["pipeline"]["result"]["steps_done"] == 2
    rehearsal = steps["rehearsal"]["result"]
    assert rehearsal["plan"].startswith("tp1 pp1 dp1")
    assert rehearsal["real_peak_memory_gb"] == steps["pipeline"]["result"]["peak_memory_gb"]
    assert rehearsal["rehearsed_peak_memory_gb"] > 0
    assert figures["rehearsal_rehearsed_over_real"] == pytest.approx(
        rehearsal["rehearsed_peak_memory_gb"] / rehearsal["real_peak_memory_gb"])
    assert "gpu_check.py" in record["code"]["script"]
    assert not (REPO / "benchmarks" / "results" / "gpu_check_dry.json").exists()


def test_a_failing_or_hanging_step_is_recorded_and_the_next_still_runs() -> None:
    steps: dict = {}
    env = dict(os.environ)
    assert gpu_check.run_step("fails", [sys.executable, "-c", "raise SystemExit(3)"], 30,
                              env, steps) is None
    assert gpu_check.run_step("hangs", [sys.executable, "-c", "import time; time.sleep(30)"],
                              1, env, steps) is None
    assert gpu_check.run_step("absent", ["no-such-command-here"], 5, env, steps) is None
    result = gpu_check.run_step("works", [sys.executable, "-c",
                                          "print('noise'); print('{\"a\": 1}')"], 30, env, steps)
    assert result == {"a": 1} and steps["works"]["result"] == {"a": 1}
    assert [steps[n]["ok"] for n in steps] == [False, False, False, True]
    assert steps["fails"]["exit_code"] == 3
    assert steps["hangs"]["exit_code"] is None and "timed out after 1 s" in \
        steps["hangs"]["output_tail"]
    assert "could not start" in steps["absent"]["output_tail"]
    figures = gpu_check.figures_of(steps)
    assert (figures["steps_ok"], figures["steps"]) == (1, 4)
