"""Validation in the training loop, on real gloo ranks: it changes no training loss (bitwise),
its loss falls as the model learns, and every layout scores the same slice to the same figure
(pipeline, tensor parallel and FSDP included).
"""
from __future__ import annotations

import math

import pytest

from tests.train_helpers import run_worker

EVAL = ("train.steps=8", "train.eval_every=2", "train.eval_tokens=256")
SINGLE = {"micro_batch": 4, "grad_accum": 2, "sharding": "none"}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    """One process, validation every 2 steps."""
    return run_worker(tmp_path_factory.mktemp("single"), SINGLE, 1, *EVAL)


def test_validation_changes_no_training_loss_and_falls(single, tmp_path) -> None:
    """dp 2 (DDP) with validation on and off: bitwise the same losses; the validation loss,
    taken at steps 2, 4, 6 and 8 on the same 8 windows of 32 tokens, falls; the figures equal
    the single process's (the windows dealt over two replicas, summed in float64)."""
    dp2 = {"dp": 2, "micro_batch": 4, "grad_accum": 1, "sharding": "ddp"}
    on = run_worker(tmp_path / "on", dp2, 2, *EVAL)
    off = run_worker(tmp_path / "off", dp2, 2, "train.steps=8", "train.eval_every=0")
    assert on["losses"] == off["losses"]
    assert off["validation"] is None
    validation = on["validation"]
    assert (validation["tokens"], validation["windows"], validation["seq_len"]) == (256, 8, 32)
    history = validation["history"]
    assert [e["step"] for e in history] == [2, 4, 6, 8]
    losses = [e["val_loss"] for e in history]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.05, losses
    assert validation["last"] == history[-1]
    for mine, theirs in zip(history, single["validation"]["history"]):
        assert math.isclose(mine["val_loss"], theirs["val_loss"], rel_tol=1e-5)


@pytest.mark.parametrize("plan,nproc", [
    ({"pp": 2, "dp": 2, "micro_batch": 2, "grad_accum": 2, "schedule": "1f1b",
      "sharding": "zero3"}, 4),
    ({"tp": 2, "micro_batch": 4, "grad_accum": 2, "sharding": "none",
      "sequence_parallel": True}, 2),
    ({"pp": 2, "micro_batch": 2, "grad_accum": 4, "schedule": "interleaved_1f1b",
      "virtual_stages": 2, "sharding": "none"}, 2),
], ids=["pp2_dp2_fsdp", "tp2_sequence_parallel", "pp2_interleaved"])
def test_every_layout_scores_the_same_figure(single, tmp_path, plan, nproc) -> None:
    """The slice runs through the layout's own chunks (hidden states sent between pipeline
    stages, FSDP replicas in lockstep) and gives the single process's validation losses."""
    summary = run_worker(tmp_path, plan, nproc, *EVAL)
    for mine, theirs in zip(summary["validation"]["history"], single["validation"]["history"],
                            strict=True):
        assert mine["step"] == theirs["step"]
        assert math.isclose(mine["val_loss"], theirs["val_loss"], rel_tol=1e-5), (mine, theirs)
    assert summary["losses"] == pytest.approx(single["losses"], rel=1e-5)


def test_the_benchmark_runs(tmp_path) -> None:
    """``benchmarks/bench_validation.py --tiny``: two ranks, rounds with and without a
    validation; its last line is the JSON figures, and a --tiny run records nothing."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_validation.py"
    proc = subprocess.run([sys.executable, str(script), "--tiny", "--rounds", "1",
                           "--results-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["eval_every"] == 2 and figures["validations_per_run"] == 12
    assert figures["validation_s"] > 0 and figures["step_s"] > 0
    assert figures["validation_overhead"] == pytest.approx(
        12 * figures["validation_s"] / (300 * figures["step_s"]))
    assert list(tmp_path.iterdir()) == []
