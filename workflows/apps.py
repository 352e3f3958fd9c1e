"""Parsl apps: thin wrappers that run stage functions on executors, by the stage's shape.

Single-app stages, and the prepare / part / finalize steps of multi-part stages, run as
Python apps on the executor of the stage's placement (``workflows.executors.executor_label``:
"cpu" locally; "cpu", "compute" or the stage's own allocation under Slurm); the ranks of a
ranks stage run as one bash app on the executor of its allocation
(``workflows.executors.allocation_label``: ``stages.mechanism.launch`` locally,
``$PARSL_MPI_PREFIX``
under Slurm). Parsl fixes an app's executors when the app is made, so each app is made once
per executor label here (``apps_on``, ``ranks_app_on``), from one plain function. Every python app
sends its prints to a log file that the driver tails, since worker output is otherwise only
in Parsl's worker logs. No app knows a stage by name.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from parsl import bash_app, python_app
from parsl.app.python import PythonApp

from workflows.executors import EXECUTOR_LABELS


class _ThreadRoutedStream:
    """sys.stdout or sys.stderr sent, thread by thread, where ``_logged`` points it: apps that
    run as threads of one process (``site.login_workers: threads``) each write to their own
    log, which a process-wide ``contextlib.redirect_stdout`` cannot do."""

    def __init__(self, default: TextIO) -> None:
        self.default = default
        self.local = threading.local()

    def _target(self) -> TextIO:
        return getattr(self.local, "stream", None) or self.default

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self._target(), name)


_ROUTING = threading.Lock()


def _routed(name: str) -> _ThreadRoutedStream:
    """``sys.<name>`` as a ``_ThreadRoutedStream`` (put in place once)."""
    with _ROUTING:
        stream = getattr(sys, name)
        if not isinstance(stream, _ThreadRoutedStream):
            stream = _ThreadRoutedStream(stream)
            setattr(sys, name, stream)
        return stream


@contextlib.contextmanager
def _logged(log_path: str) -> Iterator[None]:
    """Send this app's (this thread's) stdout/stderr to ``log_path`` (line buffered,
    appended)."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    streams = [_routed("stdout"), _routed("stderr")]
    with open(log_path, "a", buffering=1) as log:
        previous = [getattr(s.local, "stream", None) for s in streams]
        for stream in streams:
            stream.local.stream = log
        try:
            yield
        finally:
            for stream, before in zip(streams, previous):
                stream.local.stream = before


def _declared(ctx, name: str):
    return ctx.pipeline.get(name)


def stage_app(ctx, name: str, cfg, force: bool, log_path: str,
              parsl_resource_specification=None, **upstream):
    """A whole single-app stage (``stages.mechanism.walk.single_step``)."""
    from stages.mechanism.walk import single_step

    with _logged(log_path):
        return single_step(ctx, _declared(ctx, name), cfg, upstream, force)


def begin_app(ctx, name: str, cfg, force: bool, log_path: str,
              parsl_resource_specification=None, **upstream):
    """Open a multi-part stage and run its ``prepare`` (``stages.mechanism.walk.begin_step``)."""
    from stages.mechanism.walk import begin_step

    with _logged(log_path):
        return begin_step(ctx, _declared(ctx, name), cfg, upstream, force)


def part_app(ctx, name: str, cfg, attempt, index: int, log_path: str,
             parsl_resource_specification=None) -> dict[str, Any] | None:
    """One part of a fan-out stage (``stages.mechanism.walk.part_step``)."""
    from stages.mechanism.walk import part_step

    if attempt.reused is not None:
        return None
    with _logged(log_path):
        return part_step(_declared(ctx, name), cfg, attempt, index)


def finish_app(ctx, name: str, cfg, attempt, log_path: str, *parts, after=None,
               parsl_resource_specification=None):
    """A multi-part stage's ``finalize`` and publish (``stages.mechanism.walk.finish_step``).
    ``after`` is the ranks app's future, only waited for."""
    from stages.mechanism.walk import finish_step

    if attempt.reused is not None:
        return attempt.reused
    with _logged(log_path):
        return finish_step(ctx, _declared(ctx, name), cfg, attempt, list(parts))


def ranks_app(cfg, attempt, stdout=None, stderr=None, parsl_resource_specification=None):
    """The shell command that starts every rank from the spec the stage's ``prepare`` wrote
    (``true`` when the stage is reused)."""
    from stages.mechanism.launch import RankSpec
    from workflows.ranks import ranks_command

    if attempt.reused is not None:
        return "true"
    return ranks_command(cfg, RankSpec.read(attempt.prepared), attempt.prepared)


@dataclass(frozen=True)
class StageApps:
    """The Python apps of a stage, all bound to one executor."""

    single: PythonApp  # stage_app
    begin: PythonApp  # begin_app
    part: PythonApp  # part_app
    finish: PythonApp  # finish_app


_APPS = {
    label: StageApps(*(python_app(fn, executors=[label])
                       for fn in (stage_app, begin_app, part_app, finish_app)))
    for label in EXECUTOR_LABELS
}


_RANKS_APPS = {label: bash_app(ranks_app, executors=[label]) for label in EXECUTOR_LABELS}


def apps_on(label: str) -> StageApps:
    """The Python apps bound to executor ``label`` (made once, at import)."""
    return _APPS[label]


def ranks_app_on(label: str) -> Any:
    """The bash app that starts a stage's ranks on executor ``label`` (made once, at import)."""
    return _RANKS_APPS[label]
