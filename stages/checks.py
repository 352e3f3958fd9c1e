"""Pre-flight checks: each stage's cheap input checks, run before any work.

A check reads no more than the start of a file and writes nothing. It raises a
``ValueError`` subclass (``ConfigError``, ``DataError``, ``EvaluationError``) whose message
names the setting and the fix. ``stages.preflight`` runs the check of every stage a run
will compute (the declarations in ``stages.registry`` name them); each stage's own work
checks the whole input again as it reads it. Imports stay light (no torch, datasets or
MLflow), so a bad input costs a second.
"""
from __future__ import annotations

from stages.config import PipelineConfig


class EvaluationError(ValueError):
    """An evaluation input that cannot be used; the message says what to fix."""


def check_tokenize(cfg: PipelineConfig) -> None:
    """The sources and the tokenizer can be used.

    Reads only the start of each input file (``data_prep.checks``): every local source exists
    and holds non-empty UTF-8 text, JSON and parquet records have ``data.text_field``;
    ``tokenizer.path`` (when set) loads, knows the eos token and its ids fit
    ``data.token_dtype`` and ``model.vocab_size``. Raises ``DataError`` naming the key and
    the fix.
    """
    from data_prep import checks
    from data_prep.errors import DataError
    from model.config import vocab_fit_problem

    checks.check_sources(cfg.data)
    vocab = checks.check_tokenizer(cfg.tokenizer, cfg.data)
    problem = vocab_fit_problem(vocab, cfg.model.vocab_size)
    if problem:
        where = f"tokenizer.path {cfg.tokenizer.path!r}: " if cfg.tokenizer.path else ""
        raise DataError(f"{where}{problem}")


def check_evaluate(cfg: PipelineConfig) -> None:
    """With ``eval.layout=training``, ``eval.ranks`` fits the training allocation and, where
    the config fixes them, ``parallel.tp`` x ``parallel.pp``. The stage's ``prepare`` checks
    it again against the plan the checkpoint was trained with."""
    if cfg.eval.layout != "training":
        return
    ranks, par = cfg.eval.ranks, cfg.parallel
    if ranks > par.nproc:
        raise EvaluationError(
            f"eval.ranks={ranks} with eval.layout=training: the evaluation ranks take the "
            f"training layout inside the training allocation of parallel.nproc={par.nproc} "
            f"ranks: set eval.ranks <= {par.nproc} (eval.ranks={par.nproc} always fits)")
    if par.tp and par.pp and ranks % (par.tp * par.pp):
        raise EvaluationError(ranks_problem(ranks, par.tp, par.pp, par.nproc,
                                            "parallel.tp x parallel.pp"))
    if ranks > par.ranks_per_node and ranks % par.ranks_per_node:
        raise EvaluationError(
            f"eval.ranks={ranks} with eval.layout=training spans nodes of "
            f"{par.ranks_per_node} ranks (parallel.nproc / parallel.nodes): make it a "
            f"multiple of {par.ranks_per_node} or at most {par.ranks_per_node}")


def ranks_problem(ranks: int, tp: int, pp: int, nproc: int, where: str) -> str:
    """Why ``ranks`` evaluation ranks cannot take a tp x pp layout (``where`` names it)."""
    size = tp * pp
    return (f"eval.layout=training: the model is split over tp={tp} x pp={pp} = {size} ranks "
            f"({where}), so the evaluation ranks come in groups of {size}; eval.ranks={ranks} "
            f"is not a multiple of {size}: set eval.ranks={size} (or a multiple of it up to "
            f"parallel.nproc={nproc})")
