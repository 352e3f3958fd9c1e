"""Stage curate: raw text -> which documents tokenization keeps, and why the others go.

A fan-out over the same input shards as tokenization: each part computes and keeps the
signals of one shard's documents (``data_prep.curate``: quality and repetition values,
language, exact hash, MinHash band keys, contamination hits); ``finalize`` deduplicates
across the whole corpus, applies the thresholds and writes a keep mask per shard,
``removed.parquet``, a sample of removed documents per reason and a chart. A threshold
change recomputes no signal: the new attempt takes the signals of the output that differs
only in its selection fields (``stages.curate.reuse``) and reruns the selection alone.
Its work is ``stages.curate.work``.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from stages.config import PipelineConfig
from stages.curate.reuse import HOOK
from stages.mechanism.declaration import StageDeclaration, json_digest
from stages.mechanism.shape import COMPUTE, FAN_OUT, StageShape
from stages.plumbing import NOT_CODE
from stages.tokenize.checks import check_sources

SELECTION = ("curate.enabled", "curate.preset", "curate.thresholds", "curate.languages",
             "curate.sample_per_reason")
"""The curate fields that decide only the selection (``data_prep.curate.SELECTION_FIELDS``)."""
EVAL_TEXTS = ("eval.prompts", "eval.tasks", "eval.task_include")
"""The evaluation's texts, which decontamination removes from the corpus."""


def shape(cfg: PipelineConfig) -> StageShape:
    """Fan-out: one part per input shard (``data.num_shards``), on compute nodes under
    Slurm, as tokenization."""
    return StageShape(FAN_OUT, parts=cfg.data.num_shards, note=f"x{cfg.data.num_shards} shards",
                      placement=COMPUTE)


def selection_digest(outputs: dict[str, Any]) -> str:
    """The output's digest: the keep masks' bytes (what tokenization reads), or the outputs'
    own values when curation was off."""
    keep = outputs.get("keep")
    if not keep or not Path(keep).is_dir():
        return json_digest(outputs)
    digest = hashlib.sha256()
    for path in sorted(Path(keep).glob("*.npy")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def check(cfg: PipelineConfig, reused: dict[str, Any] | None = None) -> None:
    """The sources can be read (their start only) and a hub source has a budget on Slurm."""
    check_sources(cfg)


STAGE = StageDeclaration(
    "curate", sections=("data", "curate"), fields=EVAL_TEXTS, upstream=(), shape=shape,
    module="stages.curate.work", not_code=NOT_CODE,
    resumable=True,  # finished shards' signals are kept and not computed again
    check=check, digest=selection_digest,
    software=("pyarrow", "rensa", "py3langid", "ftfy", "datasets"),
    extends=SELECTION, continuation=HOOK)
