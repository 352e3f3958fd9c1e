"""Our DCP checkpoints read and written one tensor at a time, in one process.

``CheckpointTensors`` plans from the DCP metadata (names, shapes, dtypes: no tensor data)
and loads chosen tensors with a process-group-free partial ``dcp.load`` into tensors it
allocates, so a reader never holds more than what it asked for. ``write_model_checkpoint``
writes a model-only checkpoint (DCP ``model`` state + ``extra.pt`` + ``model.json`` +
``manifest.json``) whose tensors are produced lazily, one at a time, while DCP writes them:
the checkpoint loads into any training layout (``train.init_from``) or one process
(``load_for_inference``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from data_prep.atomic import atomic_path, write_text_atomic
from model.config import ModelConfig
from model.training.checkpoint import (
    CheckpointError,
    check_model_shape,
    checkpoint_problem,
    write_manifest,
)

PREFIX = "model."  # DCP flattens {"model": {name: tensor}} to "model.<name>"


def checkpoint_model_config(ckpt_dir: str | Path) -> ModelConfig:
    """The model shape a checkpoint of ours was written for (its ``model.json``)."""
    path = Path(ckpt_dir) / "model.json"
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir} has no model.json: not a checkpoint of this trainer")
    try:
        return ModelConfig(**json.loads(path.read_text()))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path} does not describe a model ({err})") from None


class CheckpointTensors:
    """The model tensors of a DCP checkpoint, read one group at a time without a process group.

    ``cfg`` None: the checkpoint's own model.json; otherwise it must match it.
    """

    def __init__(self, ckpt_dir: str | Path, cfg: ModelConfig | None = None) -> None:
        self.path = Path(ckpt_dir)
        problem = checkpoint_problem(self.path)
        if problem is not None:
            raise CheckpointError(f"checkpoint {self.path} cannot be read: {problem}")
        if cfg is not None:
            check_model_shape(self.path, cfg)
        self.cfg = cfg or checkpoint_model_config(self.path)
        metadata = FileSystemReader(str(self.path)).read_metadata()
        self._meta = {key[len(PREFIX):]: value
                      for key, value in metadata.state_dict_metadata.items()
                      if key.startswith(PREFIX) and isinstance(value, TensorStorageMetadata)}

    def names(self) -> list[str]:
        """Our parameter names stored in the checkpoint."""
        return list(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name].properties.dtype

    def load(self, names: tuple[str, ...] | list[str]) -> dict[str, torch.Tensor]:
        """The full (unsharded) tensors ``names``, freshly allocated on CPU."""
        state = {n: torch.empty(self.shape(n), dtype=self.dtype(n)) for n in names}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, checkpoint_id=str(self.path), no_dist=True)
        return state


class _LazySavePlanner(DefaultSavePlanner):
    """Plans from meta tensors; each tensor's data comes from ``produce(name)`` only when
    DCP writes it (``resolve_data``), and is dropped right after."""

    def __init__(self, produce: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self.produce = produce

    def resolve_data(self, write_item):
        fqn = write_item.index.fqn
        if fqn.startswith(PREFIX) and write_item.tensor_data is not None:
            return self.produce(fqn[len(PREFIX):]).detach().contiguous()
        return super().resolve_data(write_item)


def write_model_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a model-only checkpoint of ours at ``out_dir``, one tensor at a time.

    ``specs``: our parameter name -> (shape, dtype); ``produce(name)`` returns that tensor
    when it is written. Published atomically (``<out>.partial`` then a rename); the manifest
    is written last, as by the trainer.
    """
    out_dir = Path(out_dir)
    work = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    state = {"model": {name: torch.empty(shape, dtype=dtype, device="meta")
                       for name, (shape, dtype) in specs.items()}}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(str(work), thread_count=1),
                 planner=_LazySavePlanner(produce), no_dist=True)
    with atomic_path(work / "extra.pt") as part:
        torch.save({"step": 0, **(extra or {})}, part)
    write_text_atomic(work / "model.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    write_manifest(work)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(work, out_dir)
    return out_dir
