"""MFU is measured against the device's own peak (a CPU's from its clock and vector units,
never the planner's measured block rate), so it stays below 1; and each throughput label has
one meaning on the console and in MLflow: unsuffixed, one step's own figure; ``_median``, the
figure at the median step time so far."""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from model.flops import cpu_peak_tflops, default_peak_tflops
from model.planner.cluster import load_cluster
from model.training.metrics import MEDIAN_SUFFIX, progress_line, throughput
from model.training.validate import plan_from_parallel
from stages.config import load_config
from stages.mechanism import tracking
from stages.mechanism.launch import RankSpec
from stages.train.work import peak_tflops
from tests.train_helpers import run_ranks, tiny_config

ZEN4 = ("processor\t: 0\ncpu MHz\t\t: 2596.150\n"
        "flags\t\t: fpu sse avx avx2 fma avx512f avx512_bf16\n")


def test_cpu_peak_from_clock_and_vector_width() -> None:
    # one core, 2 x 16 fp32 FMA lanes x 2 FLOPs a cycle at 2.596 GHz
    assert cpu_peak_tflops("float32", 1, ZEN4) == pytest.approx(2.59615 * 64 / 1e3)
    assert cpu_peak_tflops("bfloat16", 1, ZEN4) == pytest.approx(2.59615 * 128 / 1e3)
    cores = len(os.sched_getaffinity(0))  # threads beyond the cores add no FLOPs
    assert cpu_peak_tflops("float32", 1000, ZEN4) == pytest.approx(cores * 2.59615 * 64 / 1e3)
    avx2 = ZEN4.replace(" avx512f avx512_bf16", "")
    assert cpu_peak_tflops("bfloat16", 1, avx2) == pytest.approx(2.59615 * 32 / 1e3)
    # a machine that says nothing gets a clock above any CPU's: still a bound
    assert cpu_peak_tflops("float32", 1, "") >= 5.0 * 64 / 1e3


def test_the_train_stage_uses_the_device_peak_on_a_measured_cluster() -> None:
    cfg = load_config(None, [])  # the tiny preset: parallel.cluster=local, measured at plan time
    plan = plan_from_parallel(cfg.parallel, cfg.train)
    # a plan priced against the measured block rate (35 GFLOP/s here) must not set the peak
    plan.predictions.update(mfu=0.9, tflops_per_device=0.9 * 0.035)
    assert peak_tflops(cfg, plan) is None  # -> the trainer's default_peak_tflops
    assert default_peak_tflops("cpu", "", "float32") == cpu_peak_tflops("float32")
    frontier = load_config(None, ["parallel.cluster=frontier", "train.dtype=bfloat16"])
    plan = plan_from_parallel(frontier.parallel, frontier.train)
    assert peak_tflops(frontier, plan) == pytest.approx(
        load_cluster("frontier").peak_tflops)
    assert default_peak_tflops("cuda", "NVIDIA H100 80GB HBM3") == 989.0


def test_progress_line_names_its_figures_as_mlflow_does() -> None:
    last = throughput(2048, 0.5, 1e6, 2, 0.1)
    median = throughput(2048, 0.4, 1e6, 2, 0.1, MEDIAN_SUFFIX)
    assert set(median) == {"tokens_per_s_median", "tflops_per_device_median", "mfu_median"}
    line = progress_line(10, 100, 3.25, last, median, 0.4)
    assert "tokens_per_s 4,096 tokens_per_s_median 5,120 mfu_median 0.026" in line
    assert "ETA 36 s" in line


def test_a_cpu_training_logs_one_meaning_per_label_and_mfu_below_one(
        tmp_path: Path, seed_store: Callable[[Path], str]) -> None:
    uri = seed_store(tmp_path / "ml")
    run_id = tracking.start_run(uri, tracking.ensure_experiment(uri, "mfu", tmp_path), "train")
    steps = 20
    cfg = tiny_config(f"train.steps={steps}", "train.log_every=1")
    spec = RankSpec(worker="stages.train.worker", nproc=1, nodes=1,
                    out_dir=str(tmp_path.resolve()), config=cfg.to_dict(),
                    plan={"micro_batch": 8, "grad_accum": 1, "sharding": "none"},
                    tracking={"uri": uri, "run_id": run_id})
    code, stdout, stderr = run_ranks(spec.worker, spec.write(tmp_path / "spec.json"), 1, 240)
    assert code == 0, stdout[-2000:] + stderr[-4000:]
    per_step = tracking.metric_history(uri, run_id, "tokens_per_s")
    mfu = tracking.metric_history(uri, run_id, "mfu")
    median = dict(tracking.metric_history(uri, run_id, "tokens_per_s_median"))
    assert [s for s, _ in per_step] == list(range(1, steps + 1))
    assert all(0 < v < 1 for _, v in mfu), mfu
    assert all(0 < v < 1 for _, v in tracking.metric_history(uri, run_id, "mfu_median"))
    # the console prints each step's figure and the median under the names MLflow logs
    lines = re.findall(r"step (\d+)/\d+ loss \S+ tokens_per_s ([\d,]+) "
                       r"tokens_per_s_median ([\d,]+) mfu_median", stdout)
    assert lines, stdout[-2000:]
    steps_logged = dict(per_step)
    for step, now, typical in lines:
        assert abs(float(now.replace(",", "")) - steps_logged[int(step)]) <= 1
        assert abs(float(typical.replace(",", "")) - median[int(step)]) <= 1
