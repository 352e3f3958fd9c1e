"""Checkpoints: exact resume, atomic publish, resharded load, single-process inference load;
retention, checkpoints by the clock and background saves in real training runs.

Damaged checkpoints and unsafe checkpoint files: tests/reliability/test_checkpoints.py; the
rules on their own: tests/test_checkpoint_policy.py.
"""
from __future__ import annotations

import shutil
from pathlib import Path

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
EVERY_STEP = ("train.steps=6", "train.checkpoint_every=1")


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


def _kept(out: Path) -> list[int]:
    """Steps of the checkpoint directories left under ``out/checkpoints`` (any suffix)."""
    return sorted(int(p.name.split("-")[1].split(".")[0]) for p in (out / "checkpoints").iterdir())


def test_retention_keeps_the_newest_and_the_multiples(tmp_path) -> None:
    summary = run_worker(tmp_path, SINGLE, 1, *EVERY_STEP, "train.keep_last=2",
                         "train.keep_every=3")
    assert summary["checkpoint"].endswith("step-00000006")
    assert _kept(tmp_path) == [3, 5, 6]


def test_resume_with_retention_keeps_its_start_and_the_losses(uninterrupted, tmp_path) -> None:
    """keep_last=1: the first attempt leaves only step 4; the resumed attempt never deletes
    step 4 (it started from it), lets step 5 go once step 6 is complete, and gives the
    uninterrupted run's losses bitwise."""
    _, full = uninterrupted
    first = run_worker(tmp_path, SINGLE, 1, *EVERY_STEP, "train.keep_last=1", steps=4)
    assert first["steps_done"] == 4 and _kept(tmp_path) == [4]
    resumed = run_worker(tmp_path, SINGLE, 1, *EVERY_STEP, "train.keep_last=1")
    assert resumed["losses"] == full["losses"]
    assert _kept(tmp_path) == [4, 6]


def test_checkpoints_by_the_clock(tmp_path) -> None:
    """A clock shorter than a step saves after every step, with no step count set."""
    summary = run_worker(tmp_path, SINGLE, 1, "train.steps=4", "train.checkpoint_every=0",
                         "train.checkpoint_minutes=0.000001", "train.keep_last=10")
    assert _kept(tmp_path) == [1, 2, 3, 4] and summary["checkpoint_seconds"] > 0
    minutes = run_worker(tmp_path / "long", SINGLE, 1, "train.steps=4",
                         "train.checkpoint_every=0", "train.checkpoint_minutes=60")
    assert _kept(tmp_path / "long") == [4]  # only the final one: the hour never passed
    assert minutes["losses"] == summary["losses"]


@pytest.mark.slow
def test_two_ranks_save_by_rank_zeros_clock_in_the_background(uninterrupted, tmp_path) -> None:
    """dp2 FSDP, a checkpoint after every step by the clock, written asynchronously: both
    ranks agree on every save (a disagreement would hang a collective), every published
    checkpoint holds both ranks' shards, and stopping at 3 and resuming (also asynchronous)
    matches the uninterrupted single-process losses."""
    _, full = uninterrupted
    clock = ("train.steps=6", "train.checkpoint_every=0", "train.checkpoint_minutes=0.000001",
             "train.async_checkpoint=true", "train.keep_last=2")
    dp2 = {"dp": 2, "micro_batch": 2, "grad_accum": 2, "sharding": "zero3"}
    first = run_worker(tmp_path, dp2, 2, *clock, steps=3)
    assert first["checkpoint"].endswith("step-00000003") and _kept(tmp_path) == [2, 3]
    resumed = run_worker(tmp_path, dp2, 2, *clock)
    assert _kept(tmp_path) == [3, 5, 6]  # 3: where this attempt started
    root = tmp_path / "checkpoints"
    for step in (3, 5, 6):
        ckpt = root / f"step-{step:08d}"
        assert {p.name for p in ckpt.glob("__*_0.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
        assert latest_checkpoint(root) == root / "step-00000006"
    for step, (got, want) in enumerate(zip(resumed["losses"], full["losses"], strict=True)):
        assert abs(got - want) < 1e-5, f"step {step + 1}: resumed {got} vs uninterrupted {want}"
