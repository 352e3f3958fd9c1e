"""What a failure means: retry it or not, and what the user is told.

A user mistake (bad config, data, plan or checkpoint: the project's errors all derive from
``ValueError``, and a ranks app that exits ``USER_ERROR_EXIT`` because a rank refused its
input) and a full disk fail at once, with their own message and no traceback. Anything else
(a lost worker, a killed rank, a cancelled job) may succeed when tried again and is retried up
to ``site.retries`` times; the console names the attempt and the cause.
"""
from __future__ import annotations

import sys
import threading
from typing import Any

from parsl.app.errors import BashExitFailure
from parsl.dataflow.errors import DependencyError

from stages.launch import STORAGE_ERRNOS, USER_ERROR_EXIT

NEVER_RETRY = 1e9  # a cost above any retry budget




def is_user_error(error: BaseException) -> bool:
    """Whether retrying cannot help: the input is wrong (or the disk is full) and the message
    says what to fix."""
    if isinstance(error, BashExitFailure):
        return error.exitcode == USER_ERROR_EXIT
    if isinstance(error, OSError):
        return error.errno in STORAGE_ERRNOS
    return isinstance(error, ValueError)


def retry_cost(error: Exception, task_record: dict[str, Any], budget: int = 0,
               stopping: threading.Event | None = None) -> float:
    """Parsl retry handler: user errors cost more than the budget; others cost one try.

    ``budget`` is ``site.retries``: the console says "retrying" only when a retry follows.
    Nothing is retried once ``stopping`` is set (the driver is shutting Parsl down, and the
    apps it stops fail).
    """
    if isinstance(error, DependencyError) or is_user_error(error):
        return NEVER_RETRY
    if stopping is not None and stopping.is_set():
        return NEVER_RETRY
    if task_record.get("fail_cost", 0) + 1 <= budget:
        attempt = task_record.get("fail_count", 1)
        name = task_record.get("func_name", "app")
        print(f"[pipeline] {name} failed on attempt {attempt} ({type(error).__name__}: "
              f"{_first_line(error)}); retrying", file=sys.stderr, flush=True)
    return 1.0


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
