"""The pipeline's stages, declared: what each reads, what it needs, how it runs.

One ``StageDeclaration`` per stage, in pipeline order. The workflow, the key mechanism and
the pre-flight checks read these and know no stage by name. A declaration is light: it
imports only the configuration and the shape arithmetic; the module that does the stage's
work (``module``, under one of the protocols of ``stages.mechanism.shape``) is imported only where
the
work runs (``StageDeclaration.work``).

Adding a stage: write its work module (``run``; or ``prepare``/``part``/``finalize``; or
``prepare``/``finalize`` around a rank worker), then declare it here.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from model.planner.cluster import is_measured, rehearses
from stages.mechanism import checks, digests
from stages.mechanism.config import PipelineConfig
from stages.mechanism.shape import (
    ALLOCATION,
    COMPUTE,
    FAN_OUT,
    LOGIN,
    RANKS,
    SINGLE,
    StageShape,
    ceil_div,
)


@dataclass(frozen=True)
class StageDeclaration:
    """One stage of the pipeline.

    - ``sections``: the config sections its key hashes (and its MLflow run records);
    - ``upstream``: the stages whose outputs (and keys) it consumes;
    - ``resumable``: a failed attempt's work directory is kept to continue from;
    - ``shape``: how it runs for a config (``stages.mechanism.shape.StageShape``);
    - ``module``: the work module; ``worker``: the rank worker module of a ranks stage (both
      named so the key's code hash follows them);
    - ``check``: a cheap pre-flight of its inputs, run before any work, given the config and
      the published outputs of its upstream stages this invocation reuses (name -> outputs)
      (``stages.mechanism.checks``);
    - ``verify``: a cheap check of a published output before it is reused
      (``stages.mechanism.checks``):
      a problem it names makes the stage run again, a resumable one continuing from that
      output (``stages.mechanism.attempt.begin``), so only what is damaged is redone;
    - ``ranks_log``, ``activity``: where a local run of its ranks logs and what it is called;
    - ``digest``: what its downstream stages' keys hash of its output
      (``stages.mechanism.digests``);
    - ``software``: the libraries (distribution names) whose versions enter its key;
    - ``extends``: its *extent* fields (``section.field``): a new value continues an existing
      output of the same stage that differs only there (``stages.mechanism.continuation``).
    """

    name: str
    sections: tuple[str, ...]
    upstream: tuple[str, ...]
    shape: Callable[[PipelineConfig], StageShape]
    module: str
    resumable: bool = False
    worker: str = ""
    check: Callable[[PipelineConfig, dict[str, Any]], None] | None = None
    verify: Callable[[dict[str, Any]], str | None] | None = None
    ranks_log: str = "ranks.log"
    activity: str = ""
    digest: Callable[[dict[str, Any]], str] | None = None
    software: tuple[str, ...] = ()
    extends: tuple[str, ...] = ()

    def work(self) -> ModuleType:
        """Import the work module (lazily: training pulls in torch)."""
        return importlib.import_module(self.module)

    def output_digest(self, outputs: dict[str, Any]) -> str:
        """The digest of a published output that downstream keys hash (``digest``)."""
        return (self.digest or digests.report)(outputs)

    def output_problem(self, outputs: dict[str, Any]) -> str | None:
        """What is wrong with a published output of this stage (``verify``), or None."""
        return self.verify(outputs) if self.verify is not None else None


TRAIN_WORKER = "stages.train_worker"
EVAL_WORKER = "stages.eval_worker"


def _tokenize_shape(cfg: PipelineConfig) -> StageShape:
    """Fan-out: one part per input shard, on compute nodes under Slurm (``site.tokenize_nodes``
    nodes, ``site.max_workers`` shards at a time on each)."""
    return StageShape(FAN_OUT, parts=cfg.data.num_shards, note=f"x{cfg.data.num_shards} shards",
                      placement=COMPUTE)


def _plan_shape(cfg: PipelineConfig) -> StageShape:
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


def _train_shape(cfg: PipelineConfig) -> StageShape:
    """Ranks: ``parallel.nproc`` processes of the train worker on ``parallel.nodes`` nodes."""
    return StageShape(RANKS, nproc=cfg.parallel.nproc, nodes=cfg.parallel.nodes,
                      worker=TRAIN_WORKER, note=f"on {cfg.parallel.nproc} ranks")


def eval_nodes(cfg: PipelineConfig) -> int:
    """Nodes of the evaluation ranks: one, except a training layout with more ranks than a
    training node holds, which spreads like the training ranks (``parallel.ranks_per_node``)."""
    per_node = cfg.parallel.ranks_per_node
    if cfg.eval.layout == "training" and cfg.eval.ranks > per_node:
        return ceil_div(cfg.eval.ranks, per_node)
    return 1


def _evaluate_shape(cfg: PipelineConfig) -> StageShape:
    """Ranks when ``eval.ranks`` > 1; else one app computes everything in one process (a
    separate rank process would only add its start-up, ~5 s of the tiny preset's run).
    Under Slurm every part runs in the evaluation's own allocation, a block of its own size
    (``eval_nodes``) submitted once training is done, never in the training's block."""
    if cfg.eval.ranks > 1:
        layout = " (training layout)" if cfg.eval.layout == "training" else ""
        return StageShape(RANKS, nproc=cfg.eval.ranks, nodes=eval_nodes(cfg), worker=EVAL_WORKER,
                          note=f"on {cfg.eval.ranks} ranks{layout}", placement=ALLOCATION)
    return StageShape(SINGLE, note="in one process", placement=ALLOCATION)


STAGES: tuple[StageDeclaration, ...] = (
    StageDeclaration("tokenize", sections=("data", "tokenizer"), upstream=(),
                     shape=_tokenize_shape, module="stages.tokenize",
                     resumable=True,  # finished shards are kept and not encoded again
                     check=checks.check_tokenize, verify=checks.token_store_problem,
                     digest=digests.token_store,
                     software=("tokenizers", "datasets", "zarr", "numcodecs")),
    StageDeclaration("plan", sections=("model", "parallel", "train"),
                     upstream=("tokenize",),  # checks that the store's vocabulary fits the model
                     shape=_plan_shape, module="stages.plan",
                     worker=TRAIN_WORKER,  # its measured refinement's ranks
                     ranks_log="measure.log", activity="measurement",
                     digest=digests.plan_layout, software=("torch",)),
    StageDeclaration("train", sections=("model", "train"), upstream=("tokenize", "plan"),
                     shape=_train_shape, module="stages.train", worker=TRAIN_WORKER,
                     resumable=True,  # a failed attempt's checkpoints are kept and resumed from
                     check=checks.check_train, ranks_log="train.log", activity="training",
                     digest=digests.final_checkpoint, software=("torch",),
                     extends=("train.steps",)),
    StageDeclaration("evaluate", sections=("eval",), upstream=("tokenize", "train"),
                     shape=_evaluate_shape, module="stages.evaluate", worker=EVAL_WORKER,
                     check=checks.check_evaluate, ranks_log="eval-ranks.log",
                     activity="evaluation", digest=digests.report, software=("torch",)),
)

STAGE_ORDER: tuple[str, ...] = tuple(s.name for s in STAGES)
_BY_NAME = {s.name: s for s in STAGES}


def declaration(name: str) -> StageDeclaration:
    """The declaration of stage ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown stage {name!r}; choose one of {list(STAGE_ORDER)}") from None


def upstream(name: str) -> tuple[str, ...]:
    """The stages whose outputs (and keys) stage ``name`` consumes."""
    return declaration(name).upstream
