"""Distributed checkpoints (torch.distributed.checkpoint) keyed by the full model's FQNs.

Layout of ``<root>/step-00000020/``: DCP files holding ``model`` (the unsharded GPT's
state_dict names) and ``optim`` (flattened optimizer state, also keyed by FQN), plus
``extra.pt`` (step, scheduler, data loader and RNG state) and ``model.json`` (the model
shape). A checkpoint is written to ``step-N.tmp`` by all ranks and renamed to ``step-N``
by rank 0 only after every rank finished, so a partial checkpoint is never picked up.
Because keys are FQNs, a checkpoint loads into any (pp, dp, tp) layout, and into one
plain process (``load_for_inference``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from model.config import ModelConfig
from model.gpt import GPT

_STEP_DIR = re.compile(r"^step-(\d+)$")
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used here (other model shape, missing files)."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (``*.tmp`` are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / ".metadata").is_file() and (child / "extra.pt").is_file():
            found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


def check_model_shape(ckpt_dir: str | Path, model_cfg: ModelConfig) -> None:
    """Raise CheckpointError naming each model field that differs from the checkpoint's."""
    path = Path(ckpt_dir) / "model.json"
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir} has no model.json: not a checkpoint of this trainer")
    saved = json.loads(path.read_text())
    mine = dataclasses.asdict(model_cfg)
    diff = [f"model.{k}: checkpoint {saved.get(k)!r} vs config {mine[k]!r}"
            for k in mine if saved.get(k) != mine[k] and k != "init_std"]
    if diff:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} was written for another model shape ({'; '.join(diff)}): "
            "use the checkpoint's model config or start from an empty checkpoints directory"
        )


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    model_cfg: ModelConfig,
) -> Path:
    """Collectively save ``model``/``optimizer`` (+ rank 0's ``extra``) as ``root/step-N``."""
    root = Path(root)
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover from an interrupted save
        tmp.mkdir()
    _barrier()
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS),
    }
    dcp.save(state, checkpoint_id=str(tmp))
    if _rank() == 0:
        torch.save(extra, tmp / "extra.pt")
        (tmp / "model.json").write_text(json.dumps(dataclasses.asdict(model_cfg), indent=2))
    _barrier()  # every rank's shards are on disk
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier()
    return final


def load_checkpoint(
    ckpt_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Collectively load a checkpoint into this rank's (sharded) model/optimizer; return extra."""
    ckpt_dir = Path(ckpt_dir)
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
    dcp.load(state, checkpoint_id=str(ckpt_dir))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIM_OPTIONS)
    return torch.load(ckpt_dir / "extra.pt", weights_only=False)


def load_for_inference(ckpt_dir: str | Path, model_cfg: ModelConfig) -> GPT:
    """The checkpoint's weights in a plain single-process GPT on CPU (no process group)."""
    check_model_shape(ckpt_dir, model_cfg)
    model = GPT(model_cfg)
    model.init_weights(0)  # rotary tables; every weight is overwritten below
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=True)
    model.load_state_dict(state["model"])
    model.eval()
    return model
