"""Checkpoints: exact resume, atomic publish, resharded load, single-process inference load.

Damaged checkpoints and unsafe checkpoint files: tests/reliability/test_checkpoints.py.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from model.training.checkpoint import CheckpointError, latest_checkpoint, load_for_inference
from tests.train_helpers import run_worker, tiny_config

SINGLE = {"micro_batch": 4, "grad_accum": 2, "sharding": "none"}
TP_FSDP = {"tp": 2, "dp": 2, "micro_batch": 2, "grad_accum": 2, "sharding": "zero3"}
PP_FSDP = {"pp": 2, "dp": 2, "micro_batch": 2, "grad_accum": 2, "schedule": "interleaved_1f1b",
           "virtual_stages": 2, "sharding": "zero3"}
INTERLEAVED = {"pp": 2, "micro_batch": 2, "grad_accum": 4, "schedule": "interleaved_1f1b",
               "virtual_stages": 2, "sharding": "none"}
STEPS = ("train.steps=6", "train.checkpoint_every=3")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """6 single-process steps, checkpoints at 3 and 6."""
    out = tmp_path_factory.mktemp("full")
    return out, run_worker(out, SINGLE, 1, *STEPS)


@pytest.mark.slow
def test_resume_gives_the_uninterrupted_losses(uninterrupted, tmp_path) -> None:
    """Stop after the step-3 checkpoint of pp2 (interleaved) x dp2 FSDP; resume as tp2 x dp2."""
    _, full = uninterrupted
    first = run_worker(tmp_path, PP_FSDP, 4, *STEPS, steps=3)
    assert first["steps_done"] == 3 and first["checkpoint"].endswith("step-00000003")
    resumed = run_worker(tmp_path, TP_FSDP, 4, *STEPS)
    assert resumed["steps_done"] == 6
    assert len(resumed["losses"]) == 6  # history carried in the checkpoint
    for step, (got, want) in enumerate(zip(resumed["losses"], full["losses"], strict=True)):
        assert abs(got - want) < 1e-5, f"step {step + 1}: resumed {got} vs uninterrupted {want}"


@pytest.mark.slow
def test_partial_checkpoints_are_ignored(uninterrupted, tmp_path) -> None:
    src, full = uninterrupted
    root = tmp_path / "checkpoints"
    shutil.copytree(src / "checkpoints" / "step-00000003", root / "step-00000003")
    # An interrupted save (complete-looking files under .tmp) and a step dir missing extra.pt.
    shutil.copytree(src / "checkpoints" / "step-00000006", root / "step-00000006.tmp")
    shutil.copytree(src / "checkpoints" / "step-00000006", root / "step-00000005")
    (root / "step-00000005" / "extra.pt").unlink()
    assert latest_checkpoint(root) == root / "step-00000003"
    resumed = run_worker(tmp_path, SINGLE, 1, *STEPS)
    assert resumed["losses"] == full["losses"]  # resumed from step 3, same process layout
    assert latest_checkpoint(root) == root / "step-00000006"
    assert not (root / "step-00000006.tmp").exists()


@pytest.mark.slow
def test_checkpoint_loads_into_another_layout(uninterrupted, tmp_path) -> None:
    src, full = uninterrupted
    # Written by one process, continued by an interleaved pipeline (two chunks per rank).
    shutil.copytree(src / "checkpoints" / "step-00000003",
                    tmp_path / "checkpoints" / "step-00000003")
    resumed = run_worker(tmp_path, INTERLEAVED, 2, *STEPS)
    for got, want in zip(resumed["losses"][3:], full["losses"][3:], strict=True):
        assert abs(got - want) < 1e-5
    # And the pipeline's checkpoint (each rank saved its own layers) loads into one process.
    cfg = tiny_config(*STEPS).model
    sharded = load_for_inference(resumed["checkpoint"], cfg)
    plain = load_for_inference(full["checkpoint"], cfg)
    pairs = zip(sharded.state_dict().items(), plain.state_dict().items(), strict=True)
    for (name, a), (_, b) in pairs:
        assert torch.allclose(a, b, atol=1e-5), name


def test_load_for_inference_refuses_a_damaged_checkpoint(uninterrupted, tmp_path) -> None:
    src, _ = uninterrupted
    ckpt = tmp_path / "step-00000003"
    shutil.copytree(src / "checkpoints" / "step-00000003", ckpt)
    metadata = ckpt / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"cannot be loaded: \.metadata is 100 bytes but "
                                              r"the manifest says \d+ \(truncated"):
        load_for_inference(ckpt, tiny_config().model)


def test_load_for_inference_refuses_another_shape(uninterrupted) -> None:
    _, full = uninterrupted
    other = tiny_config("model.d_model=64").model
    with pytest.raises(CheckpointError, match="d_model"):
        load_for_inference(full["checkpoint"], other)
    model = load_for_inference(full["checkpoint"], tiny_config().model)
    logits = model(torch.randint(0, 384, (1, 8)))
    assert logits.shape == (1, 8, 384) and torch.isfinite(logits).all()
