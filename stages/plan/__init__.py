"""Stage plan: the parallel plan (tp x pp x dp, sharding, micro-batch, recompute) from the
planner's memory and time models, rehearsed on fake tensors and optionally measured.

One app (the search), or with measured refinement a ranks stage. Its work is
``stages.plan.work``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from model.planner.cluster import is_measured, rehearses
from stages.config import PipelineConfig
from stages.mechanism.declaration import StageDeclaration, json_digest
from stages.mechanism.shape import COMPUTE, LOGIN, RANKS, SINGLE, StageShape
from stages.plumbing import NOT_CODE, STORE_READERS

TRAIN_WORKER = "stages.train.worker"  # measured refinement runs the training's ranks
LAYOUT_ONLY_DROP = ("predictions", "figures")  # plan.json fields: describe, not decide, a layout


def shape(cfg: PipelineConfig) -> StageShape:
    """One app, the search, which is cheap. Rehearsing the pick (minutes a rank) is not:
    when the stage rehearses, under Slurm its apps run on a compute node of the "compute"
    block. Measured refinement (``parallel.refine_top_k`` > 0) makes it a ranks stage: the
    search in ``prepare``, then its top plans measured one after another as the plan's
    ``parallel.nproc`` ranks on ``parallel.nodes`` nodes in an allocation of their own (the
    training's size), then ``finalize``. So only the search is login-node work."""
    parallel = cfg.parallel
    rehearsing = rehearses(parallel.rehearse, is_measured(parallel.cluster))
    placement = COMPUTE if rehearsing else LOGIN
    on_compute = rehearsing and cfg.site.name != "local"  # local: one machine, no login node
    where = "; rehearsed on a compute node" if on_compute else ""
    if parallel.refine_top_k > 0:
        return StageShape(RANKS, nproc=parallel.nproc, nodes=parallel.nodes, worker=TRAIN_WORKER,
                          placement=placement,
                          note=f"measures its top {parallel.refine_top_k} on "
                               f"{parallel.nproc} ranks{where}")
    return StageShape(SINGLE, placement=placement, note=where.removeprefix("; "))


def layout_digest(outputs: dict[str, Any]) -> str:
    """The output's digest: the chosen layout of plan.json, less its predictions (which
    describe the layout and do not decide it)."""
    plan = outputs.get("plan")
    if isinstance(plan, str) and Path(plan).is_file():
        plan = json.loads(Path(plan).read_text())
    if not isinstance(plan, dict):
        return json_digest(outputs)
    layout = {k: v for k, v in plan.items() if k not in LAYOUT_ONLY_DROP}
    return json_digest(layout)


STAGE = StageDeclaration(
    "plan", sections=("model", "parallel", "train"),
    upstream=("tokenize",),  # checks that the store's vocabulary fits the model
    shape=shape, module="stages.plan.work",
    worker=TRAIN_WORKER,  # its measured refinement's ranks
    not_code=NOT_CODE + STORE_READERS,
    data_files=(("model.planner.cluster", "configs/clusters/*.yaml"),),
    ranks_log="measure.log", activity="measurement", digest=layout_digest, software=("torch",))
