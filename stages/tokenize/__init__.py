"""Stage tokenize: raw text -> tokenizer.json + a Zarr token store (train/validation).

A fan-out: one part per input shard, on compute nodes under Slurm. Its work is
``stages.tokenize.work``; its checks ``stages.tokenize.checks``.
"""
from __future__ import annotations

from typing import Any

from stages.config import PipelineConfig
from stages.mechanism.declaration import StageDeclaration, json_digest
from stages.mechanism.shape import COMPUTE, FAN_OUT, StageShape
from stages.plumbing import NOT_CODE
from stages.tokenize.checks import check_tokenize, token_store_problem


def shape(cfg: PipelineConfig) -> StageShape:
    """Fan-out: one part per input shard, on compute nodes under Slurm (``site.tokenize_nodes``
    nodes, ``site.max_workers`` shards at a time on each)."""
    return StageShape(FAN_OUT, parts=cfg.data.num_shards, note=f"x{cfg.data.num_shards} shards",
                      placement=COMPUTE)


def token_store_digest(outputs: dict[str, Any]) -> str:
    """The output's digest: its store's manifest, tokenizer and every chunk's stored CRC32C
    (``data_prep.store.content_digest``), or the outputs' own values where it made no store."""
    from data_prep.store import content_digest

    store = outputs.get("store")
    return content_digest(store) if store else json_digest(outputs)


STAGE = StageDeclaration(
    "tokenize", sections=("data", "tokenizer"), upstream=("curate",), shape=shape,
    module="stages.tokenize.work", not_code=NOT_CODE,
    resumable=True,  # finished shards are kept and not encoded again
    check=check_tokenize, verify=token_store_problem, digest=token_store_digest,
    software=("tokenizers", "datasets", "zarr", "numcodecs"))
