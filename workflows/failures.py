"""What a failure means: retry it or not, and what the user is told.

A user mistake (bad config, data, plan or checkpoint: the project's errors all derive from
``ValueError``, and a ranks app that exits ``USER_ERROR_EXIT`` because a rank refused its
input) and a full disk fail at once, with their own message and no traceback. Anything else
(a lost worker, a killed rank, a cancelled job) may succeed when tried again and is retried up
to ``site.retries`` times; the console names the attempt and the cause.

Ranks that stopped out of time (``OUT_OF_TIME_EXIT``: Slurm's signal ahead of the walltime,
or a SIGTERM, after the ranks wrote the checkpoint of the step they stopped at) are neither:
the app is run again at no cost to ``site.retries``, in a new job, and resumes from that
checkpoint. So a training longer than one walltime runs as a chain of jobs until its steps
are done; every job advances at least one step (the ranks stop only after a step), so the
chain ends.

Every retry of a ranks app runs in a new job. A failed try of ranks on a Slurm site is
most often its job dying (a lost node, a cancel, a preemption); when the ranks fail first,
their worker still answers, and a retry given that block would start in the dying job,
fail with it and spend a second try on one loss. So the handler's ``hand_back`` returns
the failed try's block before the retry. A lost manager (``ManagerLost``) needs no hand
back: its block is gone, and Parsl may already be starting the next one. So one lost node
costs one retry, and the default ``site.retries=1`` survives it.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from parsl.app.errors import BashExitFailure
from parsl.dataflow.errors import DependencyError
from parsl.executors.high_throughput.errors import ManagerLost

from data_prep.atomic import STORAGE_ERRNOS
from stages.mechanism.launch import OUT_OF_TIME_EXIT, USER_ERROR_EXIT, read_out_of_time

NEVER_RETRY = 1e9  # a cost above any retry budget


def is_out_of_time(error: BaseException) -> bool:
    """Whether the ranks stopped out of time at a checkpoint: resume them, at no cost."""
    return isinstance(error, BashExitFailure) and error.exitcode == OUT_OF_TIME_EXIT


def _work_dir(task_record: dict[str, Any]) -> str | None:
    """The stage work directory of a ranks app's task (its ``attempt`` argument)."""
    for value in (*task_record.get("args", ()), *task_record.get("kwargs", {}).values()):
        work_dir = getattr(value, "work_dir", None)
        if work_dir:
            return str(work_dir)
    return None


def is_user_error(error: BaseException) -> bool:
    """Whether retrying cannot help: the input is wrong (or the disk is full) and the message
    says what to fix."""
    if isinstance(error, BashExitFailure):
        return error.exitcode == USER_ERROR_EXIT
    if isinstance(error, OSError):
        return error.errno in STORAGE_ERRNOS
    return isinstance(error, ValueError)


def retry_cost(error: Exception, task_record: dict[str, Any], budget: int = 0,
               stopping: threading.Event | None = None,
               hand_back: Callable[[dict[str, Any]], None] | None = None) -> float:
    """Parsl retry handler: user errors cost more than the budget; ranks out of time cost
    nothing; others cost one try. Before any retry, ``hand_back(task_record)`` returns the
    block the task ran in, so the retry runs in a new one (module docstring).

    ``budget`` is ``site.retries``: the console says "retrying" only when a retry follows.
    Nothing is retried once ``stopping`` is set (the driver is shutting Parsl down, and the
    apps it stops fail).
    """
    if isinstance(error, DependencyError) or is_user_error(error):
        return NEVER_RETRY
    if stopping is not None and stopping.is_set():
        return NEVER_RETRY
    if is_out_of_time(error):
        work_dir = _work_dir(task_record)
        record = (read_out_of_time(work_dir) if work_dir else None) or {}
        attempt = task_record.get("fail_count", 1)
        job = f" (job {record['job']})" if record.get("job") else ""
        print(f"[pipeline] {task_record.get('func_name', 'app')} ran out of time on attempt "
              f"{attempt}{job} after step {record.get('step', '?')}, its checkpoint saved; "
              f"resuming from it on attempt {attempt + 1} in a new job (no retry spent)",
              file=sys.stderr, flush=True)
        _hand_back(hand_back, task_record)
        return 0.0
    if task_record.get("fail_cost", 0) + 1 <= budget:
        attempt = task_record.get("fail_count", 1)
        name = task_record.get("func_name", "app")
        print(f"[pipeline] {name} failed on attempt {attempt} ({type(error).__name__}: "
              f"{_first_line(error)}); retrying", file=sys.stderr, flush=True)
        if not isinstance(error, ManagerLost):
            _hand_back(hand_back, task_record)
    return 1.0


def _hand_back(hand_back: Callable[[dict[str, Any]], None] | None,
               task_record: dict[str, Any]) -> None:
    """Return a retried task's block (``retry_cost``); the retry goes on if that fails."""
    if hand_back is None:
        return
    try:
        hand_back(task_record)
    except Exception as problem:  # noqa: BLE001 - the retry goes on; say what failed
        print(f"[pipeline] could not hand back the block of the failed try: {problem}",
              file=sys.stderr, flush=True)


def own_failure(futures: list[Any]) -> BaseException | None:
    """The first failure among a stage's own app futures that is not an upstream's."""
    for future in futures:
        if hasattr(future, "done") and future.done():
            error = future.exception()
            if error is not None and not isinstance(error, DependencyError):
                return error
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
