"""One driver's session: the lifecycle around the stages it runs, and running them on Parsl.

``PipelineSession`` is a context manager that both the pipeline (``workflows.pipeline``)
and the scaling studies (``workflows.scaling``) drive their stages through:

- on entry: the MLflow parent run, the heartbeat that keeps this driver's stage locks
  fresh, the driver's run marker exported for everything it starts and the watchdog that
  stops all of it should the driver be killed outright (``workflows.watchdog``), SIGTERM
  and SIGINT turned into ``KeyboardInterrupt``, a Parsl run dir and a log dir of its own;
- ``start_parsl(cfg)``: load the site's Parsl configuration (a study restarts it when the
  next point needs another block);
- ``run_stages(cfg, plans, ctx, log_dir)``: submit every stage's apps by its declared
  shape, tail their logs, wait, and report each failed stage's own error
  (``PipelineFailed``);
- on exit, whatever happened: stop Parsl (within deadlines, also after a group signal),
  give the signal handlers back, mark this invocation's still-running stages failed,
  stop the heartbeat, release the locks of stages that never finished, close the parent
  run (FINISHED; KILLED after an interrupt; FAILED on any other exception), and last stop
  the watchdog.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from stages.config import ConfigError, PipelineConfig
from stages.mechanism import attempt as attempts
from stages.mechanism import locks, open_runs, outputs, tracking, tracking_store
from stages.mechanism.keys import TRIGGERS
from stages.mechanism.outputs import StageResult
from stages.mechanism.selection import StageDecision
from stages.mechanism.shape import ALLOCATION, RANKS, SINGLE, StageShape
from stages.registry import PIPELINE
from workflows import failures as failures_mod
from workflows import tracking_server, watchdog


def check_runs_dir(runs_dir: Path) -> None:
    """Refuse a runs dir that cannot work, before any work: one line naming --runs-dir."""
    if any(ch.isspace() for ch in str(runs_dir.resolve())):
        raise ConfigError(
            f"--runs-dir {str(runs_dir)!r} contains white space, which Parsl's worker command "
            "lines cannot carry: choose a path without spaces"
        )
    file = next((p for p in (runs_dir, *runs_dir.parents) if p.exists() and not p.is_dir()), None)
    if file is not None:
        what = "is a file" if file == runs_dir else f"is inside {file}, a file"
        raise ConfigError(f"--runs-dir {runs_dir} {what}, not a directory: choose a directory "
                          "(an existing one or a new path)")
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        probe = runs_dir / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            f"--runs-dir {runs_dir} is not writable ({error.strerror or error}): choose a "
            "directory you can write"
        ) from None


INTERRUPTED_EXIT = 130
"""A driver's exit status after Ctrl-C or SIGTERM (128 + SIGINT, as a shell reports Ctrl-C)."""


def exit_driver(code: int) -> NoReturn:
    """End the driver with ``code``. Python waits at exit for the threads of a thread pool
    still in an app (``site.login_workers: threads``), which nothing can stop; an interrupted
    driver has marked their stages failed already, so it ends without waiting for them."""
    from workflows.executors import LOGIN_LABELS

    # Parsl names a ThreadPoolExecutor's threads "ThreadPoolExecutor-<label>_<n>".
    app_threads = tuple(f"ThreadPoolExecutor-{label}_" for label in LOGIN_LABELS)
    if code == INTERRUPTED_EXIT and any(t.name.startswith(app_threads) and t.is_alive()
                                        for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM and SIGINT stop the driver like Ctrl-C. Both are set explicitly while it runs:
    a driver started in the background by a script inherits SIGINT ignored, and a
    ``kill -INT`` (or a group SIGINT) must stop it all the same."""
    attempts.INTERRUPTED.set()  # a stage its threads still run, failing now, was stopped
    raise KeyboardInterrupt(f"signal {signum}")


@dataclass
class StageRun:
    """One stage's apps in this invocation: what the driver waits for and reports.

    ``result`` is always a future of the stage's ``StageResult`` (already done for a stage
    reused at planning time); ``attempt`` is the future of a multi-part stage's begin app."""

    name: str
    key: str | None  # None: it hashes an upstream's output, known once that one is done
    log: str
    result: concurrent.futures.Future
    ranks_log: str | None = None
    attempt: concurrent.futures.Future | None = None
    futures: list[concurrent.futures.Future] = field(default_factory=list)  # apps, in order
    upstream: dict[str, concurrent.futures.Future] = field(default_factory=dict)
    cfg: PipelineConfig | None = None

    def current_key(self, ctx: attempts.PipelineContext) -> str | None:
        """The stage's key: decided by the driver, or by its begin app, or (for a one-app
        stage that failed) resolved again from its upstream results, as that app did."""
        if self.key:
            return self.key
        if self.attempt is not None and self.attempt.done() and self.attempt.exception() is None:
            return self.attempt.result().key
        if self.cfg is None or any(not f.done() or f.exception() for f in self.upstream.values()):
            return None
        from stages.mechanism.selection import digest_of, resolve

        digests = {n: digest_of(f.result(), ctx.pipeline) for n, f in self.upstream.items()}
        return resolve(ctx.runs_dir, ctx.pipeline.get(self.name), self.cfg, digests,
                       ctx.code_for(self.name), ctx.triggers).key


@dataclass
class StageFailure:
    """What the user is told about one failed stage."""

    name: str
    message: str
    user_error: bool
    status: Path
    logs: list[str]

    def render(self) -> str:
        logs = ", ".join(self.logs)
        return (f"{self.name} failed: {self.message}\n    status: {self.status}\n"
                f"    log:    {logs}")


class PipelineFailed(RuntimeError):
    """One or more stages failed; ``failures`` says which and why."""

    def __init__(self, failures: list[StageFailure]) -> None:
        self.failures = failures
        super().__init__("\n".join(f.render() for f in failures))


def _done(value: Any) -> concurrent.futures.Future:
    """A future that already holds ``value`` (Parsl apps wait on any Future)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


@dataclass
class ParslSteps:
    """The stage walk's steps (``stages.mechanism.walk.walk``) submitted as Parsl apps: the
    Python apps on the executor of the stage's placement, the ranks as a bash app in the
    stage's allocation. Each step returns its app's future."""

    ctx: attempts.PipelineContext
    name: str
    cfg: PipelineConfig
    force: bool
    log_dir: Path
    inputs: dict[str, concurrent.futures.Future]
    shape: StageShape

    def __post_init__(self) -> None:
        from workflows import apps, executors

        label = executors.executor_label(self.cfg, self.name, self.shape.placement)
        self.on = apps.apps_on(label)
        self.spec = executors.app_resource_spec(self.cfg, label)
        self.log = str(self.log_dir / f"{self.name}.log")
        self.ranks_log = str(self.log_dir / f"{self.name}-ranks.log")

    def single(self) -> concurrent.futures.Future:
        return self.on.single(self.ctx, self.name, self.cfg, self.force, self.log,
                              parsl_resource_specification=self.spec, **self.inputs)

    def begin(self) -> concurrent.futures.Future:
        return self.on.begin(self.ctx, self.name, self.cfg, self.force, self.log,
                             parsl_resource_specification=self.spec, **self.inputs)

    def part(self, begun: concurrent.futures.Future, index: int) -> concurrent.futures.Future:
        return self.on.part(self.ctx, self.name, self.cfg, begun, index,
                            str(self.log_dir / f"{self.name}-part{index}.log"),
                            parsl_resource_specification=self.spec)

    def ranks(self, begun: concurrent.futures.Future) -> concurrent.futures.Future:
        from workflows import apps, executors, ranks

        allocation = executors.allocation_label(self.cfg, self.name)
        return apps.ranks_app_on(allocation)(
            self.cfg, begun, stdout=self.ranks_log, stderr=self.ranks_log,
            parsl_resource_specification=ranks.ranks_resource_spec(self.cfg, self.shape) or {})

    def finish(self, begun: concurrent.futures.Future, parts: list[concurrent.futures.Future],
               after: concurrent.futures.Future | None) -> concurrent.futures.Future:
        return self.on.finish(self.ctx, self.name, self.cfg, begun, self.log, *parts,
                              after=after, parsl_resource_specification=self.spec)


def submit_stages(cfg: PipelineConfig, plans: list[StageDecision], ctx: attempts.PipelineContext,
                  log_dir: Path, runs: dict[str, StageRun]) -> None:
    """Submit every stage's apps by the stage walk (``stages.mechanism.walk.walk``) into
    ``runs`` (name -> StageRun, filled as each stage is submitted, so an interrupt mid-way
    knows what runs).

    A stage's Python apps go to the executor of its shape's placement for this site
    (``executors.executor_label``); the ranks of a ranks stage go to its allocation
    (``executors.allocation_label``), which is handed back once the stage is done.
    """
    from stages.mechanism.walk import walk

    for p in plans:
        if p.action == "skip":
            continue
        stage = ctx.pipeline.get(p.name)
        inputs = {u: runs[u].result for u in stage.upstream}
        log = str(log_dir / f"{p.name}.log")
        if p.action == "reuse" and p.existing is not None:
            # Inputs of reused stages are published results already: record it right here.
            ready = {u: future.result() for u, future in inputs.items()}
            result = attempts.reuse(ctx, p.existing, cfg, stage.sections, ready)
            runs[p.name] = StageRun(p.name, p.key, log, _done(result))
            continue
        shape = stage.shape(cfg)
        steps = ParslSteps(ctx, p.name, cfg, p.action == "force", log_dir, inputs, shape)
        futures = walk(shape, steps)
        result = futures[-1]
        _hand_back_when_done(cfg, p.name, shape, result)
        runs[p.name] = StageRun(p.name, p.key, log, result,
                                steps.ranks_log if shape.kind == RANKS else None,
                                None if shape.kind == SINGLE else futures[0],
                                futures, upstream=inputs, cfg=cfg)


def _hand_back_when_done(cfg: PipelineConfig, name: str, shape: StageShape,
                         result: concurrent.futures.Future) -> None:
    """Once a stage with an allocation of its own is done, hand that allocation back."""
    from workflows import executors

    if shape.kind == RANKS or shape.placement == ALLOCATION:
        label = executors.allocation_label(cfg, name)
        result.add_done_callback(lambda _: executors.hand_back_allocation(label))


# Parsl's bash apps write their command line into their log between these two lines: it
# stays in the log (what ran, for a post-mortem), not on the console.
_COMMAND_ECHO = ("--> executable follows <--", "--> end executable <--")


def _tail_logs(log_dir: Path, offsets: dict[Path, int], hiding: set[Path]) -> None:
    """Print new lines of the apps' log files, prefixed with the log's name (``hiding``: the
    logs inside a bash app's command echo)."""
    for path in sorted(log_dir.glob("*.log")):
        with open(path, "rb") as handle:
            handle.seek(offsets.get(path, 0))
            data = handle.read()
        complete = data.rfind(b"\n") + 1
        if not complete:
            continue
        offsets[path] = offsets.get(path, 0) + complete
        for line in data[:complete].decode(errors="replace").splitlines():
            if line.strip() == _COMMAND_ECHO[0]:
                hiding.add(path)
            elif line.strip() == _COMMAND_ECHO[1]:
                hiding.discard(path)
            elif path not in hiding:
                print(f"[{path.stem}] {line}", flush=True)


def wait_for_stages(runs: dict[str, StageRun], ctx: attempts.PipelineContext, log_dir: Path,
                    runs_dir: Path) -> dict[str, StageResult]:
    """Wait for every stage, tailing logs; report each failed stage's own error."""
    offsets: dict[Path, int] = {}
    hiding: set[Path] = set()
    pending = {name: run.result for name, run in runs.items() if run.futures}
    started = time.time()
    while pending:
        _tail_logs(log_dir, offsets, hiding)
        for name in [n for n, f in pending.items() if f.done()]:
            outcome = "failed" if pending.pop(name).exception() else "done"
            print(f"[pipeline] {name} {outcome} at +{time.time() - started:.1f}s", flush=True)
        time.sleep(0.5)
    _tail_logs(log_dir, offsets, hiding)
    done: dict[str, StageResult] = {}
    failures: list[StageFailure] = []
    for name, run in runs.items():
        if run.result.exception() is None:
            done[name] = run.result.result()
            continue
        error = failures_mod.own_failure(run.futures)
        if error is None:  # only upstream stages failed: this one never ran
            continue
        _fail_open_attempt(ctx, run.attempt, error, run.ranks_log)
        failures.append(_describe_failure(run, error, runs_dir, run.current_key(ctx)))
    if failures:
        raise PipelineFailed(failures)
    return done


def _describe_failure(run: StageRun, error: BaseException, runs_dir: Path,
                      key: str | None) -> StageFailure:
    """The stage's own message (a rank's, for ranks that refused their input) and its paths
    (``key``: the stage's key, None when it never got one)."""
    from parsl.app.errors import BashExitFailure

    work_dir = outputs.work_dir(runs_dir, run.name, key or "<no key>")
    message = f"{type(error).__name__}: {error}"
    if isinstance(error, BashExitFailure):
        from stages.mechanism.launch import read_killed_rank, read_rank_error

        rank_message = read_rank_error(work_dir, run.ranks_log)
        message = (rank_message or read_killed_rank(run.ranks_log)
                   or f"the ranks exited with code {error.exitcode}")
    if isinstance(error, OSError) and error.errno in failures_mod.STORAGE_ERRNOS:
        message += (
            f" (while writing under {work_dir.parent}: free space or pass another --runs-dir)"
        )
    logs = [run.log] + ([run.ranks_log] if run.ranks_log else [])
    return StageFailure(run.name, message, failures_mod.is_user_error(error),
                        work_dir / outputs.STATUS_FILE, logs)


def _fail_open_attempt(ctx: attempts.PipelineContext, begun: concurrent.futures.Future | None,
                       error: BaseException, ranks_log: str | None = None) -> None:
    """A multi-part stage whose ranks or parts failed: record it as failed."""
    if begun is None or not begun.done() or begun.exception() is not None:
        return
    attempt = begun.result()
    if attempt.reused is not None:
        return
    status = outputs.read_status(attempt.work_dir)
    if status and status["state"] == "running":
        from stages.mechanism.launch import read_rank_error

        said = read_rank_error(attempt.work_dir, ranks_log)
        if said is not None:  # the rank's own reason, not only the launcher's exit code
            cause, error = error, RuntimeError(f"a rank failed: {said}")
            error.__cause__ = cause
        attempts.fail(ctx, attempt, error)


def fail_running(ctx: attempts.PipelineContext, runs: dict[str, StageRun]) -> None:
    """Mark this invocation's stages that are still ``running`` as failed (interrupted)."""
    for run in runs.values():
        if not run.futures:
            continue
        key = run.current_key(ctx)
        attempt = attempts.running_attempt(ctx, run.name, key) if key else None
        if attempt is not None:
            attempts.fail(ctx, attempt, KeyboardInterrupt("the pipeline was interrupted"))


class PipelineSession:
    """The lifecycle of one driver around its stages (see the module docstring).

    ``cfg`` gives the runs dir, the tracking store and the experiment; ``run_name`` and
    ``tags`` name the MLflow parent run (``<run_name>-<its id's first 8 characters>``);
    ``label`` prefixes the driver's own lines.
    """

    def __init__(self, cfg: PipelineConfig, run_name: str, tags: dict[str, str],
                 label: str = "pipeline") -> None:
        self.cfg = cfg
        self.runs_dir = cfg.runs_dir
        # The store; what the run talks to is the driver's server over it, if it runs one.
        self.store_uri = tracking_store.default_tracking_uri(self.runs_dir, cfg.tracking.uri)
        self.uri = self.store_uri
        self.server: tracking_server.TrackingServer | None = None
        self.run_name, self.tags, self.label = run_name, tags, label
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.driver = locks.Owner(run=locks.run_marker())  # this process's run, not an outer one
        self.started = time.time()
        self.dfk: Any = None
        self._watched: list[tuple[attempts.PipelineContext, dict[str, StageRun]]] = []

    def __enter__(self) -> PipelineSession:
        # A log handler that cannot write (a full disk) must not print a traceback per record.
        logging.raiseExceptions = False
        # Before Parsl and the tracking server start: every process of the run inherits the
        # marker, so the watchdog can stop them all.
        self._outer_run = os.environ.get(locks.RUN_ENV)
        os.environ[locks.RUN_ENV] = self.driver.run
        if tracking_server.wanted(self.cfg):
            self.server = tracking_server.TrackingServer(
                self.store_uri, self.runs_dir, tracking_server.advertised_host(self.cfg),
                self.runs_dir / "logs" / f"mlflow-server-{self.stamp}-{os.getpid()}.log")
            self.uri = self.server.start()
        try:
            return self._open()
        except BaseException:
            if self.server is not None:
                self.server.stop()
            raise

    def _open(self) -> PipelineSession:
        """The parent run, the heartbeat, the watchdog and the signal handlers."""
        self.experiment_id = tracking.ensure_experiment(
            self.uri, self.cfg.tracking.experiment or self.cfg.name, self.runs_dir)
        closed = open_runs.close_abandoned_runs(self.runs_dir, self.store_uri, self.uri)
        if closed:
            print(f"[{self.label}] marked FAILED {len(closed)} MLflow run(s) an earlier "
                  "pipeline run on this runs dir left RUNNING (its store took no writes)",
                  flush=True)
        self.parent_id = tracking.start_run(self.uri, self.experiment_id,
                                            f"{self.run_name}-{self.stamp}", tags=self.tags)
        open_runs.note_open_run(self.runs_dir, self.store_uri, self.parent_id)
        self.parent = tracking.Tracker(self.uri, self.parent_id)
        # Named by what it does and its id's prefix (as its log directory), which tells two
        # pipelines apart where the run list cuts names short; the id exists only now.
        self.parent.set_tags({tracking.MLFLOW_RUN_NAME: f"{self.run_name}-{self.parent_id[:8]}"})
        self.parsl_dir = self.runs_dir / "parsl" / f"{self.stamp}-{os.getpid()}"
        self.log_root = self.runs_dir / "logs" / f"{self.stamp}-{self.parent_id[:8]}"
        self.log_root.mkdir(parents=True, exist_ok=True)
        self.heartbeat = locks.Heartbeat(self.runs_dir, self.driver,
                                         locks.STALE_AFTER_S / 10).start()
        # The store itself: after a kill -9 the watchdog stops the server before it marks.
        self.watchdog = watchdog.start(self.runs_dir, self.store_uri, self.parent_id)
        attempts.INTERRUPTED.clear()  # an earlier session's interrupt is not this one's
        self._handlers = {sig: signal.signal(sig, _interrupt)
                          for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def context(self, code: dict[str, str] | str, parent_run_id: str | None = None,
                triggers: tuple[str, ...] = TRIGGERS) -> attempts.PipelineContext:
        """The context stages run with: this driver's locks, stage runs nested under
        ``parent_run_id`` (default: the session's parent run)."""
        return attempts.PipelineContext(str(self.runs_dir), self.uri, self.experiment_id,
                                        parent_run_id or self.parent_id, code,
                                        driver=self.driver, store_uri=self.store_uri,
                                        triggers=triggers, pipeline=PIPELINE)

    def start_parsl(self, cfg: PipelineConfig, running: list[str] | None = None) -> None:
        """Load ``cfg``'s site (stopping a Parsl this session started before)."""
        from workflows import executors

        if self.dfk is not None:  # a previous block goes back to the scheduler first
            dfk, self.dfk = self.dfk, None
            executors.stop_parsl(dfk)
        self.dfk = executors.start_parsl(cfg, self.runs_dir, self.parsl_dir, running)

    def run_stages(self, cfg: PipelineConfig, plans: list[StageDecision],
                   ctx: attempts.PipelineContext, log_dir: Path) -> dict[str, StageResult]:
        """Submit the stages, wait for them; their results (``PipelineFailed`` if any failed)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        runs: dict[str, StageRun] = {}
        self._watched.append((ctx, runs))
        submit_stages(cfg, plans, ctx, log_dir, runs)
        results = wait_for_stages(runs, ctx, log_dir, self.runs_dir)
        self._watched.remove((ctx, runs))
        return results

    def _own_processes(self) -> list[int]:
        """The processes this session started itself (its watchdog, its MLflow server)."""
        server = self.server.proc if self.server is not None else None
        return [proc.pid for proc in (self.watchdog, server) if proc is not None]

    def _close_parent(self, status: str) -> None:
        """End the parent run ``status``. A store on a full disk ends nothing: one line says
        so, and the run stays recorded as unclosed for the next driver to mark FAILED with
        its stage runs (``open_runs.close_abandoned_runs``)."""
        try:
            self.parent.set_tags({"wall_seconds": f"{time.time() - self.started:.1f}"})
            if status != "FINISHED":  # stage runs whose own close failed (a full store) end too
                tracking.end_run_tree(self.uri, self.parent_id, status, "the pipeline failed "
                                      "before this run was closed", include_root=False)
            tracking.end_run(self.uri, self.parent_id, status)
        except OSError as error:
            open_runs.note_closed_run(self.runs_dir, self.parent_id, closed=False)
            if error.errno not in failures_mod.STORAGE_ERRNOS:
                raise
            print(f"[{self.label}] {error}; this pipeline's MLflow runs stay RUNNING until the "
                  "next pipeline run on this runs dir marks them FAILED", file=sys.stderr,
                  flush=True)
            return
        except BaseException:
            open_runs.note_closed_run(self.runs_dir, self.parent_id, closed=False)
            raise
        open_runs.note_closed_run(self.runs_dir, self.parent_id, closed=True)

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        from workflows import executors

        interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        if interrupted:
            print(f"\n[{self.label}] interrupted: stopping workers and ranks, marking running "
                  "stages failed", file=sys.stderr, flush=True)
        try:
            if self.dfk is not None:
                executors.stop_parsl(self.dfk, interrupted, keep=self._own_processes())
        finally:
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)
            for ctx, runs in self._watched:
                try:
                    fail_running(ctx, runs)
                except Exception as error:  # noqa: BLE001 - must not hide the stage's own error
                    print(f"[{self.label}] could not mark running stages failed: {error}",
                          file=sys.stderr)
            try:
                self.heartbeat.stop()
                locks.release_all(self.runs_dir, self.driver)  # stages that never finished
                self._close_parent("FINISHED" if exc_type is None else
                                   "KILLED" if interrupted else "FAILED")
            finally:
                if self.server is not None:
                    self.server.stop()
                watchdog.stop(self.watchdog)
                if self._outer_run is None:
                    os.environ.pop(locks.RUN_ENV, None)
                else:
                    os.environ[locks.RUN_ENV] = self._outer_run
