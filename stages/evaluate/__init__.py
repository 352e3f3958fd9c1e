"""Stage evaluate: held-out loss (per source), generations, lm-eval tasks and the Hugging
Face export of the final checkpoint, in one process or on ranks.

Its work is ``stages.evaluate.work``, its rank worker ``stages.evaluate.worker``; its checks
``stages.evaluate.checks``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.config import PipelineConfig
from stages.evaluate.checks import check_evaluate
from stages.mechanism.declaration import StageDeclaration, json_digest
from stages.mechanism.shape import ALLOCATION, RANKS, SINGLE, StageShape, ceil_div
from stages.plumbing import NOT_CODE, STORE_READERS

WORKER = "stages.evaluate.worker"


def eval_nodes(cfg: PipelineConfig) -> int:
    """Nodes of the evaluation ranks: one, except a training layout with more ranks than a
    training node holds, which spreads like the training ranks (``parallel.ranks_per_node``)."""
    per_node = cfg.parallel.ranks_per_node
    if cfg.eval.layout == "training" and cfg.eval.ranks > per_node:
        return ceil_div(cfg.eval.ranks, per_node)
    return 1


def shape(cfg: PipelineConfig) -> StageShape:
    """Ranks when ``eval.ranks`` > 1; else one app computes everything in one process (a
    separate rank process would only add its start-up, ~5 s of the tiny preset's run).
    Under Slurm every part runs in the evaluation's own allocation, a block of its own size
    (``eval_nodes``) submitted once training is done, never in the training's block."""
    if cfg.eval.ranks > 1:
        layout = " (training layout)" if cfg.eval.layout == "training" else ""
        return StageShape(RANKS, nproc=cfg.eval.ranks, nodes=eval_nodes(cfg), worker=WORKER,
                          note=f"on {cfg.eval.ranks} ranks{layout}", placement=ALLOCATION)
    return StageShape(SINGLE, note="in one process", placement=ALLOCATION)


def report_digest(outputs: dict[str, Any]) -> str:
    """The output's digest: its report's numbers (nothing reads it downstream)."""
    path = outputs.get("report")
    if path and Path(path).is_file():
        report = json.loads(Path(path).read_text())
        return json_digest(report)
    return json_digest(outputs)


STAGE = StageDeclaration(
    "evaluate", sections=("eval",), upstream=("tokenize", "train"), shape=shape,
    module="stages.evaluate.work", worker=WORKER, not_code=NOT_CODE + STORE_READERS,
    check=check_evaluate, ranks_log="eval-ranks.log", activity="evaluation",
    digest=report_digest, software=("torch",))
