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


def eval_texts(cfg: PipelineConfig) -> dict[str, list[str]]:
    """The texts the evaluation stage scores, which decontamination removes from the corpus:
    its generation prompts and the records of its local lm-eval task files
    (``eval.task_include``; of the tasks ``eval.tasks`` names, when it names any). Hub tasks
    have no local text and are not decontaminated against. Part of the stage's key (as
    ``derived``): a change to these texts reruns curation, a change to other evaluation
    settings does not."""
    from data_prep.curate.decontaminate import local_task_texts, prompt_texts

    texts = prompt_texts(cfg.eval.prompts)
    if cfg.eval.task_include:
        local = local_task_texts(cfg.eval.task_include)
        texts.update({name: items for name, items in local.items()
                      if not cfg.eval.tasks or name in cfg.eval.tasks})
    return texts


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
    "curate", sections=("data", "curate"), derived=eval_texts, upstream=(), shape=shape,
    module="stages.curate.work", not_code=NOT_CODE,
    resumable=True,  # finished shards' signals are kept and not computed again
    check=check, digest=selection_digest,
    software=("pyarrow", "rensa", "py3langid", "ftfy", "datasets"),
    extends=SELECTION, continuation=HOOK)
