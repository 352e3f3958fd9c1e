"""One GPU, one check: what the project promises on a GPU, measured in under 8 minutes.

Run by ``benchmarks/gpu_check.sh`` (or ``python benchmarks/gpu_check.py``) on a machine with
one GPU and this project installed with a CUDA (or ROCm) build of torch. Each step runs in a
process of its own with a timeout; a step that fails or times out is recorded with its
error and the tail of its output, and the others still run:

1. ``nvidia_smi``: ``nvidia-smi`` (its output, or why there is none);
2. ``torch``: torch's version, whether it sees the GPU, its name and bf16 support;
3. ``bench_train``: ``benchmarks/bench_train.py --gpu``, the trainer benchmark (a ~1B
   LLaMA in bf16 on one device, MFU against the device's peak; it writes
   ``bench_train_gpu.json`` itself);
4. ``pipeline``: the micro preset through every stage, two steps on one rank in bf16
   (``workflows.pipeline --config configs/micro.yaml --set train.steps=2
   parallel.nproc=1 train.dtype=bfloat16``): the ranks take the GPU when torch sees one;
5. ``rehearsal``: the plan that run trained with, rehearsed on rank 0 as the plan stage
   rehearses a GPU cluster's plans (fake ``cuda`` tensors, ``rehearse_isolated``), beside
   the run's real peak (``torch.cuda.max_memory_allocated``, the trainer's
   ``peak_memory_gb``): ``rehearsed_over_real``.
   The rehearsal runs on torch 2.13 only (``model.rehearsal.torch_pin``): where the GPU's
   torch is another release, export ``FRONTIER_LLM_REHEARSAL_PYTHON`` naming an
   interpreter with the CPU build of torch 2.13 and the project's requirements.

Everything goes to one JSON file, ``benchmarks/results/gpu_check.json``. ``--dry`` (or
``GPU_CHECK_DRY=1``) runs the same steps on the CPU with the GPU hidden and tiny sizes, in
about a minute, into ``gpu_check_dry.json`` (``tests/test_gpu_check.py`` runs it, so the
script cannot rot before a GPU runs it); on the CPU the "real peak" is the rank's peak
resident memory, so the dry ratio means nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import (  # noqa: E402 (needs the repository on sys.path)
    REPO,
    RESULTS_DIR,
    whole_project_code,
    write_results,
)

PIPELINE_SETS = ["train.steps=2", "parallel.nproc=1", "train.dtype=bfloat16"]
"""The micro preset's overrides: two steps, one rank (one GPU), bf16."""
TIMEOUTS = {"nvidia_smi": 20, "torch": 60, "bench_train": 150, "pipeline": 150,
            "rehearsal": 100}
"""Seconds each step may take on the GPU: 480 in all, the check's 8 minutes."""
TORCH_PROBE = """
import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda_available": cuda,
                  "hip": getattr(torch.version, "hip", None), "cuda": torch.version.cuda,
                  "device_name": torch.cuda.get_device_name(0) if cuda else None,
                  "bf16_supported": bool(cuda and torch.cuda.is_bf16_supported()),
                  "memory_gb": torch.cuda.get_device_properties(0).total_memory / 1e9
                  if cuda else None}))
"""


def run_step(name: str, command: list[str], timeout: float, env: dict[str, str],
             steps: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Run one step's command; record its outcome under ``steps[name]`` and return the JSON
    object its last output line holds (None when it failed or printed none)."""
    t0 = time.perf_counter()
    print(f"[gpu_check] {name}: {' '.join(command)}", flush=True)
    record: dict[str, Any] = {"command": command, "timeout_s": timeout}
    stdout, code = "", None
    try:
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        stdout, code = proc.stdout, proc.returncode
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        output = partial + f"\n[gpu_check] timed out after {timeout:.0f} s"
    except OSError as exc:
        output = f"[gpu_check] could not start: {exc}"
    record.update(seconds=round(time.perf_counter() - t0, 1), exit_code=code,
                  ok=code == 0, output_tail=output[-3000:])
    result = last_json(stdout) if code == 0 else None
    if code == 0 and result is not None:
        record["result"] = result
    steps[name] = record
    print(f"[gpu_check] {name}: {'ok' if record['ok'] else 'FAILED'} in "
          f"{record['seconds']} s", flush=True)
    return result


def last_json(text: str) -> dict[str, Any] | None:
    """The JSON object on the last line of ``text`` that holds one, or None."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def train_summary(runs_dir: Path) -> dict[str, Any]:
    """The finished training stage's ``summary.json`` in a runs dir (FileNotFoundError
    naming the runs dir when there is none)."""
    found = sorted((runs_dir / "stages" / "train").glob("*/summary.json"))
    if not found:
        raise FileNotFoundError(f"no finished training stage under {runs_dir}")
    return json.loads(found[-1].read_text())


def rehearse_run(runs_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """Rehearse rank 0 of the plan a micro run trained with, on fake ``cuda`` tensors as the
    plan stage rehearses a GPU cluster's plans, and set it beside that run's real peak."""
    from model.parallel.layout import Plan
    from model.rehearsal.rank_server import rehearse_isolated
    from stages.config import load_config

    cfg = load_config(REPO / "configs" / "micro.yaml", overrides)
    summary = train_summary(runs_dir)
    plan = Plan.from_dict(summary["plan"])
    rehearsal = rehearse_isolated(cfg.model, cfg.train, plan, 0, device_type="cuda")
    real = summary["peak_memory_gb"]
    return {"plan": plan.describe(), "real_peak_memory_gb": real,
            "rehearsed_peak_memory_gb": rehearsal.peak_memory_gb,
            "rehearsed_memory_gb_by_category": {
                k: v / 1e9 for k, v in rehearsal.peak_memory_by_category.items()},
            "rehearsed_over_real": rehearsal.peak_memory_gb / real if real else None,
            "modeled_memory_gb": plan.predictions.get("memory_gb_per_device"),
            "rehearsal_seconds": rehearsal.seconds}


def figures_of(steps: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline figures: each step's outcome, and the measured numbers that came back."""
    figures: dict[str, Any] = {f"{name}_ok": step["ok"] for name, step in steps.items()}
    picks = {"torch": ("torch", "device_name", "bf16_supported"),
             "bench_train": ("mfu", "tokens_per_s", "peak_memory_gb", "step_time_s"),
             "rehearsal": ("real_peak_memory_gb", "rehearsed_peak_memory_gb",
                           "rehearsed_over_real")}
    for name, keys in picks.items():
        result = steps.get(name, {}).get("result") or {}
        figures.update({key if key == name else f"{name}_{key}": result[key]
                        for key in keys if key in result})
    figures["steps_ok"] = sum(step["ok"] for step in steps.values())
    figures["steps"] = len(steps)
    return figures


def check(dry: bool, results_dir: Path, work: Path) -> dict[str, Any]:
    """Run every step (``dry``: CPU, GPU hidden, tiny sizes); write and return the figures."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_DISABLE_TELEMETRY": "true"}
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
    scale = 1.5 if dry else 1.0  # a 2-core CI box starts Python processes slowly
    steps: dict[str, dict[str, Any]] = {}
    python = sys.executable
    run_step("nvidia_smi", ["nvidia-smi"], TIMEOUTS["nvidia_smi"], env, steps)
    run_step("torch", [python, "-c", TORCH_PROBE], TIMEOUTS["torch"] * scale, env, steps)
    bench = [python, "benchmarks/bench_train.py", "--gpu"]
    bench += ["--device", "cpu", "--tiny", "--steps", "2"] if dry else ["--device", "cuda"]
    run_step("bench_train", bench, TIMEOUTS["bench_train"] * scale, env, steps)
    runs_dir = work / "runs"
    sets = PIPELINE_SETS
    run_step("pipeline", [python, "-m", "workflows.pipeline", "--config", "configs/micro.yaml",
                          "--runs-dir", str(runs_dir), "--set", *sets],
             TIMEOUTS["pipeline"] * scale, env, steps)
    if steps["pipeline"]["ok"]:
        summary = train_summary(runs_dir)
        steps["pipeline"]["result"] = {k: summary.get(k) for k in (
            "final_loss", "steps_done", "step_time_s", "tokens_per_s", "mfu",
            "peak_memory_gb")}
    run_step("rehearsal", [python, str(Path(__file__).resolve()), "--rehearse-run",
                           str(runs_dir), "--set", *sets],
             TIMEOUTS["rehearsal"] * scale, env, steps)
    figures = {"dry": dry, **figures_of(steps)}
    # without a GPU there is no nvidia-smi: the dry check needs every other step
    figures["required_ok"] = all(step["ok"] for name, step in steps.items()
                                 if not (dry and name == "nvidia_smi"))
    path = write_results("gpu_check_dry" if dry else "gpu_check", figures, {"steps": steps},
                         results_dir, code=whole_project_code())
    print(f"[gpu_check] {figures['steps_ok']}/{figures['steps']} steps ok; written to {path}",
          flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    """Run the check (or, with ``--rehearse-run``, its rehearsal step); print the figures
    as the last line. Exit 0 when every required step ran (all; dry: all but nvidia-smi),
    1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", default=os.environ.get(
        "GPU_CHECK_DRY", "") not in ("", "0"), help="CPU, GPU hidden, tiny sizes (also "
                        "GPU_CHECK_DRY=1); writes gpu_check_dry.json")
    parser.add_argument("--results-dir", default=None,
                        help="where the JSON goes (default benchmarks/results; dry: a temp dir)")
    parser.add_argument("--rehearse-run", metavar="RUNS_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--set", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rehearse_run:
        print(json.dumps(rehearse_run(Path(args.rehearse_run), args.set)))
        return 0
    results_dir = Path(args.results_dir) if args.results_dir else (
        Path(tempfile.gettempdir()) / "gpu_check_dry" if args.dry else RESULTS_DIR)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        figures = check(args.dry, results_dir, Path(work))
    print(json.dumps(figures))
    return 0 if figures["required_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
