"""The evaluate stage's pre-flight checks and its memory rule (light imports only)."""
from __future__ import annotations

from typing import Any

from stages.config import PipelineConfig


class EvaluationError(ValueError):
    """An evaluation input that cannot be used; the message says what to fix."""

def check_evaluate(cfg: PipelineConfig, reused: dict[str, Any] | None = None) -> None:
    """With ``eval.layout=training``, ``eval.ranks`` fits the training's ranks and nodes and, where
    the config fixes them, ``parallel.tp`` x ``parallel.pp``. The stage's ``prepare`` checks
    it again against the plan the checkpoint was trained with."""
    if cfg.eval.layout != "training":
        return
    ranks, par = cfg.eval.ranks, cfg.parallel
    if ranks > par.nproc:
        raise EvaluationError(
            f"eval.ranks={ranks} with eval.layout=training: the evaluation ranks take the "
            f"training layout, at most the training's parallel.nproc={par.nproc} "
            f"ranks: set eval.ranks <= {par.nproc} (eval.ranks={par.nproc} always fits)")
    if par.tp and par.pp and ranks % (par.tp * par.pp):
        raise EvaluationError(ranks_problem(ranks, par.tp, par.pp, par.nproc,
                                            "parallel.tp x parallel.pp"))
    if ranks > par.ranks_per_node and ranks % par.ranks_per_node:
        raise EvaluationError(
            f"eval.ranks={ranks} with eval.layout=training spans nodes of "
            f"{par.ranks_per_node} ranks (parallel.nproc / parallel.nodes): make it a "
            f"multiple of {par.ranks_per_node} or at most {par.ranks_per_node}")


EVAL_BYTES_PER_PARAM = 4
"""Host bytes per parameter of a model loaded whole for evaluation (float32, on CPU:
``model.training.checkpoint.load_for_inference``)."""


def evaluation_host_gb(cfg: PipelineConfig) -> float:
    """Host memory, GB, of one process holding the whole model for evaluation."""
    from model.flops import GPTParams

    return GPTParams.from_config(cfg.model).total() * EVAL_BYTES_PER_PARAM / 1e9


def evaluation_memory_problem(cfg: PipelineConfig, node_memory_gb: float) -> str | None:
    """Why ``eval.layout=replicas`` cannot evaluate on a node of ``node_memory_gb``: each
    of its ``eval.ranks`` processes (all on one node) holds the whole model in float32; None
    when it fits, or with ``eval.layout=training`` (the model spread over the training
    plan's ranks)."""
    if cfg.eval.layout == "training":
        return None
    need = evaluation_host_gb(cfg) * cfg.eval.ranks
    if need <= node_memory_gb:
        return None
    return (f"eval.layout=replicas: {cfg.eval.ranks} evaluation process(es) each hold the whole "
            f"model in float32, {need:.4g} GB on one node of {node_memory_gb:g} GB: set "
            f"eval.layout=training eval.ranks={cfg.parallel.nproc} (the model spread over the "
            "training plan's ranks, in a job of the training's size)")


def ranks_problem(ranks: int, tp: int, pp: int, nproc: int, where: str) -> str:
    """Why ``ranks`` evaluation ranks cannot take a tp x pp layout (``where`` names it)."""
    size = tp * pp
    return (f"eval.layout=training: the model is split over tp={tp} x pp={pp} = {size} ranks "
            f"({where}), so the evaluation ranks come in groups of {size}; eval.ranks={ranks} "
            f"is not a multiple of {size}: set eval.ranks={size} (or a multiple of it up to "
            f"parallel.nproc={nproc})")
