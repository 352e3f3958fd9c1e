"""Pre-flight checks: each stage's cheap input checks, run before any work.

A check reads no more than the start of a file and writes nothing. It raises a
``ValueError`` subclass (``ConfigError``, ``DataError``, ``EvaluationError``) whose message
names the setting and the fix. ``stages.mechanism.preflight`` runs the check of every stage a run
will compute (the declarations in ``stages.mechanism.registry`` name them); each stage's own work
checks the whole input again as it reads it. Imports stay light (no torch, datasets or
MLflow), so a bad input costs a second.
"""
from __future__ import annotations

import math
import os
from typing import Any

from model.config import TrainConfig
from stages.mechanism.config import ConfigError, PipelineConfig, SiteConfig


class EvaluationError(ValueError):
    """An evaluation input that cannot be used; the message says what to fix."""


def check_tokenize(cfg: PipelineConfig, reused: dict[str, Any] | None = None) -> None:
    """The sources and the tokenizer can be used.

    Reads only the start of each input file (``data_prep.checks``): every local source exists
    and holds non-empty UTF-8 text, JSON and parquet records have ``data.text_field``;
    ``tokenizer.path`` (when set) loads, knows the eos token and its ids fit
    ``data.token_dtype`` and ``model.vocab_size``. On a Slurm site a hub source needs a
    budget (``hub_budget_problem``). Raises ``DataError`` naming the key and the fix.
    """
    from data_prep import checks
    from data_prep.errors import DataError
    from model.config import vocab_fit_problem

    problem = hub_budget_problem(cfg)
    if problem:
        raise DataError(problem)
    checks.check_sources(cfg.data)
    vocab = checks.check_tokenizer(cfg.tokenizer, cfg.data)
    problem = vocab_fit_problem(vocab, cfg.model.vocab_size)
    if problem:
        where = f"tokenizer.path {cfg.tokenizer.path!r}: " if cfg.tokenizer.path else ""
        raise DataError(f"{where}{problem}")


def token_store_problem(outputs: dict[str, Any]) -> str | None:
    """What makes a published tokenize output unusable, from its manifest and part
    directories alone (no chunk is read): a missing manifest or part; None when whole.

    A part removed after its chunk failed its checksum is found here, so the next run
    re-encodes just that part (``stages.mechanism.attempt.begin``)."""
    from data_prep.errors import StoreError
    from data_prep.store import open_store

    store = outputs.get("store")
    if not store:
        return None
    try:
        open_store(store)
    except StoreError as error:
        return str(error)
    return None


def hub_budget_problem(cfg: PipelineConfig) -> str | None:
    """A hub source (``hf:``) with no document budget on a Slurm site, or None.

    Tokenize streams a hub dataset in its prepare step, on a compute node, inside the
    compute block's walltime: without ``data.max_documents`` it would read the whole split
    there. Locally (a laptop with internet) streaming the whole split is allowed.
    """
    data = cfg.data
    sources = [data.source] if data.source else list(data.sources.values())
    hub = [source for source in sources if source.startswith("hf:")]
    if not hub or data.max_documents is not None or cfg.site.name == "local":
        return None
    return (f"data.source {', '.join(hub)}: a hub dataset on site {cfg.site.name!r} needs a "
            "budget, or tokenize streams the whole split inside one compute job; set "
            "data.max_documents=N (the first N documents are streamed), or download it first "
            "where the site allows the network and point data.source at the copy")


def walltime_seconds(walltime: str) -> int:
    """``site.walltime`` (HH:MM:SS, hours may exceed 24) in seconds."""
    hours, minutes, seconds = (int(part) for part in walltime.split(":"))
    return hours * 3600 + minutes * 60 + seconds


def predicted_step_time(predictions: dict[str, Any] | None) -> float | None:
    """Seconds per step a plan expects: its measured time when the plan stage refined it,
    else the planner's prediction; None when the plan carries neither."""
    predictions = predictions or {}
    for key in ("measured_step_time_s", "step_time_s"):
        value = predictions.get(key)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return None


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.3g} h" if seconds >= 3600 else f"{seconds / 60:.3g} min"


def checkpoint_cadence_problem(train: TrainConfig, site: SiteConfig,
                               step_time_s: float | None) -> str | None:
    """Why no checkpoint can land within one Slurm job of ``site.walltime``, or None.

    At ``step_time_s`` seconds per step, the first checkpoint by step count comes after
    ``train.checkpoint_every`` steps (or all ``train.steps`` when it is 0); when that takes
    longer than the walltime and ``train.checkpoint_minutes`` is unset or not shorter than
    the walltime, every job ends before saving and a resumed run never advances. None when
    the step time is unknown, the site has no walltime (``local``), or the training block
    is signalled to save before its end (``site.save_before_end()``) early enough for a step.
    ``train.checkpoint_minutes: auto`` is judged only once resolved to minutes (the train
    stage and the readiness report resolve it first: ``model.planner.failures``).
    """
    if step_time_s is None or step_time_s <= 0 or site.name == "local":
        return None
    if train.checkpoint_minutes == "auto":  # resolved, then checked, before the ranks start
        return None
    if site.save_before_end() > step_time_s:  # every job ends with a checkpoint of its own
        return None
    wall = walltime_seconds(site.walltime)
    steps = min(train.checkpoint_every or train.steps, train.steps)
    minutes = train.checkpoint_minutes
    if steps * step_time_s <= wall or (minutes is not None and minutes * 60 < wall):
        return None
    by = (f"train.checkpoint_every={train.checkpoint_every} steps" if train.checkpoint_every
          else f"train.checkpoint_every=0 (only at the end: train.steps={train.steps} steps)")
    clock = ("train.checkpoint_minutes is unset" if minutes is None else
             f"train.checkpoint_minutes={minutes:g} is not shorter than the walltime")
    head = (f"no checkpoint can land within one Slurm job: at the plan's {step_time_s:.4g} "
            f"s/step, {by} take {_duration(steps * step_time_s)} but site.walltime="
            f"{site.walltime} is {_duration(wall)}, and {clock}; every job would end before "
            "its first checkpoint and a resumed run would never advance")
    max_every = math.floor(wall / step_time_s)
    if max_every < 1:
        return (f"{head}. One step takes longer than the walltime: raise site.walltime or "
                "give the training more ranks (parallel.nproc)")
    suggest = max(round(wall / 120, 1), 0.1)  # half the walltime, in minutes
    return (f"{head}. Set train.checkpoint_minutes={suggest:g} (a checkpoint every "
            f"{suggest:g} min of training; keep it well below the walltime, which also pays "
            f"for start-up and the save itself), or train.checkpoint_every <= {max_every}, "
            "or raise site.walltime, or let the job save before its end "
            "(site.save_before_end_s longer than a step)")


LOCAL_RANKS_PER_CORE = 8
"""The most training ranks per core the local site starts: gloo ranks on CPU run one thread
each, and beyond a few per core a step is mostly context switches while each rank's
interpreter and torch (about 0.3 GB) add up."""


def check_train(cfg: PipelineConfig, reused: dict[str, Any] | None = None) -> None:
    """On the local site, ``parallel.nproc`` fits this machine's cores (at most
    ``LOCAL_RANKS_PER_CORE`` ranks per core); on Slurm sites some checkpoint can land
    within one job (``checkpoint_cadence_problem``).

    The checkpoint check needs the plan's predicted step time, so it applies only when this
    invocation reuses the plan stage's output (``reused``: upstream name -> its published
    outputs, from the driver's one decision); otherwise the train stage makes the same check
    before its ranks start. Raises ``ConfigError`` naming the settings and the fix.
    """
    if cfg.site.name == "local":
        cores = len(os.sched_getaffinity(0))
        if cfg.parallel.nproc > LOCAL_RANKS_PER_CORE * cores:
            raise ConfigError(
                f"parallel.nproc={cfg.parallel.nproc} on the local site starts that many "
                f"training ranks on this machine's {cores} core(s); at most "
                f"{LOCAL_RANKS_PER_CORE * cores} ({LOCAL_RANKS_PER_CORE} per core) run here: "
                "lower parallel.nproc, or run on a Slurm site (--site slurm or frontier)")
        return
    plan = (reused or {}).get("plan")
    if plan is None:
        return
    step_time = predicted_step_time(plan.get("predictions"))
    problem = checkpoint_cadence_problem(cfg.train, cfg.site, step_time)
    if problem:
        raise ConfigError(problem)


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
