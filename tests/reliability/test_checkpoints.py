"""Checkpoints are verified before use: a corrupt newest one is skipped for the previous one.

Real training runs (tests.train_helpers.run_worker: 1 or 2 gloo ranks, a 4-layer d_model 32
model, 6 steps, a checkpoint every 2, all three kept) write step-2/4/6; the newest kept one
is then damaged the way a crash or a full disk damages it, and resuming must give the
uninterrupted losses.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from model.gpt import GPT
from model.training.checkpoint import (
    MANIFEST,
    CheckpointError,
    checkpoint_problem,
    latest_checkpoint,
    load_checkpoint,
    load_extra,
    save_checkpoint,
    write_manifest,
)
from tests.train_helpers import run_worker, tiny_config

SINGLE = {"micro_batch": 4, "grad_accum": 2, "sharding": "none"}
DP2 = {"dp": 2, "micro_batch": 2, "grad_accum": 2, "sharding": "zero3"}
STEPS = ("train.steps=6", "train.checkpoint_every=2", "train.keep_last=3")
STEP2, STEP4 = "step-00000002", "step-00000004"


def _shard(ckpt: Path, rank: int = 0) -> Path:
    return ckpt / f"__{rank}_0.distcp"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# name -> (damage step-4, words the skip message must hold)
DAMAGE: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "truncated_distcp": (lambda c: _truncate(_shard(c)), ["__0_0.distcp is", "truncated"]),
    "missing_distcp": (lambda c: _shard(c).unlink(), ["__0_0.distcp is missing"]),
    "truncated_metadata": (lambda c: _truncate(c / ".metadata"), [".metadata is", "truncated"]),
    "missing_manifest": (lambda c: (c / MANIFEST).unlink(), ["no manifest.json", "older"]),
    "flipped_byte": (lambda c: _flip_byte(_shard(c)), ["__0_0.distcp has CRC-32", "damaged"]),
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, dict]:
    """6 single-process steps; checkpoints at 2, 4 and 6."""
    out = tmp_path_factory.mktemp("full")
    return out, run_worker(out, SINGLE, 1, *STEPS)


def _two_checkpoints(src: Path, dst: Path) -> Path:
    """dst/checkpoints with copies of src's step-2 and step-4; returns the checkpoints root."""
    root = dst / "checkpoints"
    for name in (STEP2, STEP4):
        shutil.copytree(src / "checkpoints" / name, root / name)
    return root


def test_manifest_lists_every_file(uninterrupted) -> None:
    src, _ = uninterrupted
    ckpt = src / "checkpoints" / STEP2
    manifest = json.loads((ckpt / MANIFEST).read_text())
    on_disk = {p.name: p.stat().st_size for p in ckpt.iterdir() if p.name != MANIFEST}
    assert {".metadata", "__0_0.distcp", "extra.pt", "model.json"} <= set(on_disk)
    assert {name: e["size"] for name, e in manifest["files"].items()} == on_disk
    assert all(len(e["crc32"]) == 8 for e in manifest["files"].values())
    assert not list(src.glob("checkpoints/*.tmp"))
    assert checkpoint_problem(ckpt) is None


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_checkpoint_is_skipped_with_a_message(
    uninterrupted, tmp_path, capsys, damage
) -> None:
    src, _ = uninterrupted
    root = _two_checkpoints(src, tmp_path)
    harm, words = DAMAGE[damage]
    harm(root / STEP4)
    assert latest_checkpoint(root) == root / STEP2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"[checkpoint] skipping {root / STEP4}: ")
    assert lines[0].endswith(f"falling back to {root / STEP2}")
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_no_intact_checkpoint_left(uninterrupted, tmp_path, capsys) -> None:
    src, _ = uninterrupted
    root = _two_checkpoints(src, tmp_path)
    _truncate(root / STEP4 / "extra.pt")
    (root / STEP2 / MANIFEST).unlink()
    assert latest_checkpoint(root) is None
    err = capsys.readouterr().err
    assert err.count("[checkpoint] skipping") == 2 and "extra.pt is" in err
    assert "no complete checkpoint is left" in err


def test_checksums_of_shards_are_skipped_above_the_limit(uninterrupted, tmp_path) -> None:
    src, _ = uninterrupted
    root = _two_checkpoints(src, tmp_path)
    _flip_byte(_shard(root / STEP4))
    assert "CRC-32" in checkpoint_problem(root / STEP4)
    assert checkpoint_problem(root / STEP4, checksum_limit=1) is None  # sizes still match
    _flip_byte(root / STEP4 / ".metadata")  # small files are always checksummed
    assert ".metadata has CRC-32" in checkpoint_problem(root / STEP4, checksum_limit=1)


def _resume_from_step2(src: Path, out: Path, damage: str, plan: dict, nproc: int) -> dict:
    """Copy step-2 and step-4, damage step-4, train to step 6; check step-2 was the start."""
    root = _two_checkpoints(src, out)
    DAMAGE[damage][0](root / STEP4)
    before = (root / STEP2 / MANIFEST).stat()
    resumed = run_worker(out, plan, nproc, *STEPS)
    after = (root / STEP2 / MANIFEST).stat()
    # step-2 was never saved again (training started after it), step-4 was rewritten whole.
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert checkpoint_problem(root / STEP4) is None
    assert resumed["steps_done"] == 6 and resumed["checkpoint"] == str(root / "step-00000006")
    return resumed


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated_distcp", "missing_distcp", "truncated_metadata",
                                    "missing_manifest"])
def test_resume_from_the_fallback_gives_the_uninterrupted_losses(
    uninterrupted, tmp_path, damage
) -> None:
    src, full = uninterrupted
    resumed = _resume_from_step2(src, tmp_path, damage, SINGLE, 1)
    assert resumed["losses"] == full["losses"]  # bitwise


@pytest.mark.slow
def test_two_ranks_agree_on_the_fallback(tmp_path_factory) -> None:
    """Rank 1's shard of step-4 is truncated: rank 0 decides, both ranks resume from step 2."""
    src = tmp_path_factory.mktemp("full_dp2")
    full = run_worker(src, DP2, 2, *STEPS)
    root = src / "checkpoints"
    assert {p.name for p in root.glob("step-*/__*_0.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    out = tmp_path_factory.mktemp("resumed_dp2")
    DAMAGE["rank1_truncated"] = (lambda c: _truncate(_shard(c, 1)), [])
    try:
        resumed = _resume_from_step2(src, out, "rank1_truncated", DP2, 2)
    finally:
        del DAMAGE["rank1_truncated"]
    assert resumed["losses"] == full["losses"]


# ---------------------------------------------------------------- extra.pt is not trusted
class _RunsCode:
    """Unpickling this runs ``exec(code)``: what a hostile extra.pt could hold."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return (exec, (self.code,))


def _hostile_checkpoint(src: Path, dst: Path) -> tuple[Path, Path]:
    """A copy of step-2 whose extra.pt runs code when unpickled, with a matching manifest."""
    ckpt = dst / "checkpoints" / STEP2
    shutil.copytree(src / "checkpoints" / STEP2, ckpt)
    marker = dst / "code-ran"
    extra = torch.load(ckpt / "extra.pt", weights_only=True)
    extra["loader"] = _RunsCode(f"open({str(marker)!r}, 'w').write('ran')")
    torch.save(extra, ckpt / "extra.pt")
    write_manifest(ckpt)  # whoever can write the directory can rewrite the manifest too
    return ckpt, marker


def test_extra_pt_holding_an_object_is_refused(uninterrupted, tmp_path) -> None:
    src, _ = uninterrupted
    ckpt, marker = _hostile_checkpoint(src, tmp_path)
    assert latest_checkpoint(ckpt.parent) == ckpt  # intact as far as the manifest goes
    model = GPT(tiny_config().model)
    model.init_weights(0)
    with pytest.raises(CheckpointError, match=r"extra\.pt holds objects other than tensors") as err:
        load_checkpoint(ckpt, model, None)
    assert "weights_only=True" in str(err.value) and str(ckpt) in str(err.value)
    assert not marker.exists()
    torch.load(ckpt / "extra.pt", weights_only=False)  # the file really does run code
    assert marker.read_text() == "ran"


@pytest.mark.slow
def test_training_refuses_a_hostile_extra_pt(uninterrupted, tmp_path) -> None:
    src, _ = uninterrupted
    _, marker = _hostile_checkpoint(src, tmp_path)
    with pytest.raises(AssertionError, match=r"CheckpointError: .*extra\.pt holds objects"):
        run_worker(tmp_path, SINGLE, 1, *STEPS)
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_saved_extra_state_loads_with_weights_only(tmp_path) -> None:
    """numpy values become plain Python ones; any other object is refused before writing."""
    cfg = tiny_config().model
    model = GPT(cfg)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    extra = {"step": np.int64(3), "rng": torch.get_rng_state(), "losses": [np.float32(2.5)],
             "loader": {"consumed": np.int64(24), "order": np.arange(3), "split": "train"}}
    path = save_checkpoint(tmp_path, 3, model, opt, extra, cfg)
    assert checkpoint_problem(path) is None
    back = load_extra(path)
    assert back["step"] == 3 and type(back["step"]) is int
    assert back["loader"] == {"consumed": 24, "order": [0, 1, 2], "split": "train"}
    assert back["losses"] == [2.5] and torch.equal(back["rng"], extra["rng"])
    with pytest.raises(CheckpointError, match=r"extra\['loader'\]\['sampler'\] is a .*_RunsCode"):
        save_checkpoint(tmp_path, 4, model, opt, {"loader": {"sampler": _RunsCode("")}}, cfg)
    assert not (tmp_path / "step-00000004.tmp").exists()
    assert not (tmp_path / "step-00000004").exists()
