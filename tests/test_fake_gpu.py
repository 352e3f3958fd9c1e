"""The rehearsal on the fake GPU (``model.rehearsal.fake_gpu``): the tiny preset's trainer runs
whole training steps on fake ``cuda`` tensors, on each schedule and sharding, with the GPU's
attention kernels; a tensor left on the host is named where it was made; a run of many
micro-batches extrapolated from two short ones, after a short warm-up, equals the full run."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from model.parallel.layout import Plan
from model.planner.rank_counts import count_errors, rank_collective_bytes, rank_flops
from model.planner.shapes import Shapes
from workflows.plan import load_model_file

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL, TINY_TRAIN, _ = load_model_file(REPO / "configs" / "tiny.yaml")


def run_case(name: str) -> dict:
    """A case of tests/fake_gpu_cases.py in a fresh interpreter (the fake GPU loads first)."""
    proc = subprocess.run([sys.executable, "-m", "tests.fake_gpu_cases", name], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rehearse_tiny(plan: Plan, rank: int, dtype: str = "bfloat16", model=TINY_MODEL, **kwargs):
    from model.rehearsal.rank_server import rehearse_isolated

    train = TINY_TRAIN.__class__(**{**TINY_TRAIN.__dict__, "dtype": dtype, "global_batch":
                                    plan.dp * plan.micro_batch * plan.grad_accum})
    return train, rehearse_isolated(model, train, plan, rank, device_type="cuda", **kwargs)


PLANS = {
    "tp2_sp_pp2_dp2_zero3_1f1b": Plan(tp=2, pp=2, dp=2, grad_accum=4, sharding="zero3",
                                      schedule="1f1b", sequence_parallel=True),
    "pp2_dp2_interleaved_zero2": Plan(pp=2, dp=2, grad_accum=4, sharding="zero2",
                                      schedule="interleaved_1f1b", virtual_stages=2),
    "pp2_gpipe_ddp_full_recompute": Plan(pp=2, dp=2, grad_accum=2, sharding="ddp",
                                         schedule="gpipe", recompute="full"),
    "tp2_dp2_zero2_selective": Plan(tp=2, dp=2, micro_batch=2, grad_accum=2, sharding="zero2",
                                    recompute="selective"),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_tiny_preset_rehearses_on_fake_cuda(name: str) -> None:
    """Every rank of the last stage runs on cuda; FLOPs and collectives (the GPU's attention
    kernels counted) equal the planner's within 0.01 %."""
    plan = PLANS[name]
    rank = (plan.pp - 1) * plan.dp * plan.tp
    train, result = rehearse_tiny(plan, rank)
    assert result.fake and result.peak_memory_bytes > 0
    assert any("flash" in op for op in result.flops_by_op), result.flops_by_op
    shapes = Shapes.from_configs(TINY_MODEL, train)
    errors = count_errors(rank_flops(shapes, plan, plan.pp - 1),
                          rank_collective_bytes(shapes, plan, plan.pp - 1),
                          result.flops_per_step[-1], result.collective_bytes_by_dim)
    assert max(abs(e) for e in errors.values()) <= 1e-4, errors


def test_fp32_takes_the_memory_efficient_kernel_and_grouped_heads_the_math_one() -> None:
    """As on a GPU: bf16 attention runs flash, fp32 the memory-efficient kernel, fp32 with
    grouped-query heads (which that kernel does not take) the math path's matmuls."""
    kernels = run_case("attention_kernels")
    assert any("_flash_attention" in op for op in kernels["bf16"]), kernels
    assert any("_efficient_attention" in op for op in kernels["fp32"]), kernels
    assert not any("attention" in op for op in kernels["fp32_gqa"]), kernels
    assert any("bmm" in op or "mm" in op for op in kernels["fp32_gqa"]), kernels


def test_silu_backward_is_one_kernel_as_on_a_gpu() -> None:
    """A CPU-only torch would run SiLU's backward as its composite form on cuda tensors,
    five temporaries a GPU never makes; the fake GPU keeps it one op."""
    ops = run_case("silu_backward_ops")["ops"]
    assert "silu_backward" in ops, ops
    assert "sigmoid" not in ops and "mul" not in ops, ops


def test_rms_norm_backward_is_one_kernel_as_on_a_gpu() -> None:
    """A CPU-only torch would run RMSNorm's backward as elementwise float32 ops, several
    temporaries of the input's size a GPU never makes; the fake GPU runs the fused kernel's
    op, which makes only the two gradients."""
    ops = run_case("rms_norm_backward_ops")["ops"]
    assert "_fused_rms_norm_backward" in ops, ops
    assert not {"mul", "sub", "mean", "sum", "_to_copy"} & set(ops), ops


def test_a_host_tensor_on_a_gpu_rank_is_named_where_it_was_made() -> None:
    error = run_case("stray_tensor")["error"]
    assert error is not None, "a host tensor added on a cuda rank went unnoticed"
    assert "mixes devices on a cuda rank" in error
    assert "on cpu" in error and "tests/fake_gpu_cases.py" in error
    assert "with_host_bias" in error and "model/gpt.py" in error


EIGHT_LAYERS = dataclasses.replace(TINY_MODEL, n_layers=8)


@pytest.mark.parametrize("plan,model,measured", [
    (Plan(pp=2, dp=2, grad_accum=8, sharding="zero2", schedule="1f1b"), TINY_MODEL, (4, 6)),
    (Plan(pp=2, grad_accum=8, sharding="zero3", schedule="gpipe"), TINY_MODEL, (4, 6)),
    (Plan(pp=2, grad_accum=10, sharding="none", schedule="interleaved_1f1b", virtual_stages=2),
     TINY_MODEL, (6, 8)),
    (Plan(pp=2, grad_accum=10, sharding="zero2", schedule="interleaved_1f1b", virtual_stages=4),
     EIGHT_LAYERS, (6, 8)),
    (Plan(pp=2, dp=2, grad_accum=6, sharding="zero3", schedule="1f1b"), TINY_MODEL, (6,)),
    (Plan(dp=2, grad_accum=4, sharding="zero2"), TINY_MODEL, (2, 3)),
], ids=["1f1b_zero2", "gpipe_zero3", "interleaved", "interleaved_v4", "short_warm_up",
        "no_pipeline"])
def test_short_rehearsals_equal_the_full_step(plan: Plan, model, measured) -> None:
    """A rehearsal that warms up on pp micro-batches (one without a pipeline) and measures
    steps of 2 pp and 3 pp (3 pp and 4 pp interleaved), extrapolated to the plan's count, or
    its own count when that is no more: peak memory, FLOPs and collective bytes equal those
    of two steps that run every micro-batch."""
    from model.rehearsal.rehearse import rehearsed_micro_batches

    assert rehearsed_micro_batches(plan) == (min(plan.pp, plan.grad_accum), measured)
    for rank in sorted({0, plan.world_size - 1}):
        _, short = rehearse_tiny(plan, rank, model=model)
        _, full = rehearse_tiny(plan, rank, model=model, extrapolate=False)
        assert any("extrapolated" in n for n in short.notes) == (len(measured) == 2)
        assert not any("extrapolated" in n for n in full.notes)
        assert short.peak_memory_bytes == pytest.approx(full.peak_memory_bytes, rel=2e-3)
        # the receive buffers, made inside a measured step's rebuilt schedule, are filed as such
        for receive_buffers in ("inputs", "other"):
            assert short.peak_memory_by_category.get(receive_buffers) == \
                full.peak_memory_by_category.get(receive_buffers)
        assert short.flops_per_step[-1] == full.flops_per_step[-1]
        assert short.collective_bytes_per_step[-1] == full.collective_bytes_per_step[-1]


def test_the_fake_gpu_refuses_a_process_that_imported_torch_first() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import torch\nfrom model.rehearsal import fake_gpu\n"
         "fake_gpu.load_runtime()"], cwd=REPO, capture_output=True, text=True, timeout=120,
        check=False)
    assert proc.returncode != 0
    assert "must be loaded before torch is imported" in proc.stderr


def test_every_guarded_call_is_named_in_the_docs() -> None:
    from model.rehearsal.fake_gpu import GUARDED

    doc = (REPO / "docs" / "planner.md").read_text()
    missing = [name for name in GUARDED if f"torch.cuda.{name}" not in doc]
    assert not missing, f"docs/planner.md does not name the guarded calls {missing}"


def test_another_interpreter_rehearses_when_one_is_named(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """$FRONTIER_LLM_REHEARSAL_PYTHON rehearses the rank (Frontier's ROCm torch is not the
    release the rehearsal was checked on): the named interpreter runs, and gives the same
    rehearsal as this one."""
    from model.rehearsal.torch_pin import REHEARSAL_PYTHON

    called = tmp_path / "called"
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\necho \"$@\" >> {called}\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    plan = Plan(dp=2, grad_accum=2, sharding="zero2")
    _, own = rehearse_tiny(plan, 0)
    monkeypatch.setenv(REHEARSAL_PYTHON, str(wrapper))
    _, other = rehearse_tiny(plan, 0)
    assert "model.rehearsal.rank_server cuda" in called.read_text()
    assert other.peak_memory_bytes == own.peak_memory_bytes > 0
    assert other.flops_per_step == own.flops_per_step
