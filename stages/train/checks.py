"""The train stage's pre-flight checks: ranks that fit this machine, a checkpoint that can
land within one Slurm job, and a fixed parallel layout that can form a plan.

Light imports only (no torch), so a bad setting costs a second.
"""
from __future__ import annotations

import math
import os
from typing import Any

from model.config import TrainConfig
from stages.config import ConfigError, PipelineConfig, SiteConfig, walltime_seconds


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


def check_layout(cfg: PipelineConfig) -> None:
    """The ``parallel.*`` fields the config fixes can form a plan for this model, batch and
    ``parallel.nproc`` (``model.planner.choose.layout_problem``: the plan stage's own
    rules); ConfigError with the plan stage's message otherwise."""
    from model.planner.choose import fixed_fields, hand_plan, layout_problem

    nproc, fixed = cfg.parallel.nproc, fixed_fields(cfg.parallel)
    problem = layout_problem(cfg.model, cfg.train, nproc, fixed,
                             hand_plan(fixed, cfg.train.global_batch, nproc))
    if problem:
        raise ConfigError(f"parallel.* on parallel.nproc={cfg.parallel.nproc} ranks: {problem}")


def check_training(cfg: PipelineConfig, reused: dict[str, Any] | None = None) -> None:
    """The train stage's pre-flight: ``check_train``, then the fixed layout (``check_layout``;
    after, since the ranks this machine runs are the more direct cause)."""
    check_train(cfg, reused)
    check_layout(cfg)
