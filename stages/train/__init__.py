"""Stage train: ``parallel.nproc`` ranks of the rank worker (``stages.train.worker``) train
the model on the token store with the plan's layout, checkpointing as they go.

Its work is ``stages.train.work``; its checks ``stages.train.checks``; more training
continues an earlier output (``stages.train.continuation``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.config import PipelineConfig
from stages.mechanism.declaration import StageDeclaration, json_digest
from stages.mechanism.shape import RANKS, StageShape
from stages.plumbing import NOT_CODE, STORE_READERS
from stages.train.checks import check_training
from stages.train.continuation import HOOK

WORKER = "stages.train.worker"
MANIFEST = "manifest.json"  # a checkpoint's file list (model.training.checkpoint.MANIFEST)


def shape(cfg: PipelineConfig) -> StageShape:
    """Ranks: ``parallel.nproc`` processes of the train worker on ``parallel.nodes`` nodes."""
    return StageShape(RANKS, nproc=cfg.parallel.nproc, nodes=cfg.parallel.nodes,
                      worker=WORKER, note=f"on {cfg.parallel.nproc} ranks")


def final_checkpoint_digest(outputs: dict[str, Any]) -> str:
    """The output's digest: its final checkpoint's manifest (every file's size and CRC-32)
    and model.json."""
    checkpoint = outputs.get("checkpoint")
    if not checkpoint or not (Path(checkpoint) / MANIFEST).is_file():
        return json_digest({k: outputs.get(k) for k in ("final_loss", "steps_done")})
    root = Path(checkpoint)
    parts = {name: json.loads((root / name).read_text())
             for name in (MANIFEST, "model.json") if (root / name).is_file()}
    return json_digest(parts)


REPORTING_ONLY = (
    "model.planner.cluster",  # the device peak that MFU is reported against
    "model.planner.failures",  # train.checkpoint_minutes=auto: when to save, not what
    "stages.train.checks",  # pre-flight refusals
)
"""Modules the train work imports that change no checkpoint. The plan it trains with enters
the key as the plan stage's output digest (the layout), never the planner's code."""

STAGE = StageDeclaration(
    "train", sections=("model", "train"), upstream=("tokenize", "plan"), shape=shape,
    module="stages.train.work", worker=WORKER,
    not_code=NOT_CODE + STORE_READERS + REPORTING_ONLY,
    resumable=True,  # a failed attempt's checkpoints are kept and resumed from
    check=check_training, ranks_log="train.log", activity="training",
    digest=final_checkpoint_digest, software=("torch",),
    extends=("train.steps",), continuation=HOOK)
