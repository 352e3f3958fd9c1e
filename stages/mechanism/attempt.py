"""One stage's turn in a pipeline invocation: reuse its output, or attempt it and publish.

``begin`` looks for a succeeded output with the stage's key (``stages.mechanism.keys``) and
returns an
``Attempt`` either way: ``attempt.reused`` holds the reused result, else the attempt owns
the key's lock and its ``.partial`` work directory (``stages.mechanism.outputs``) and has an MLflow
child run. ``finish`` publishes the outputs, ``fail`` records the error; both release the
lock, in whichever process they run. The split lets the work between them run anywhere:
Parsl fan-out apps, training ranks launched by ``stages.mechanism.launch`` or srun
(``workflows.apps``), or
this process (``stages.mechanism.walk``).

One attempt per key at a time: ``begin`` takes the lock ``<key>.lock``
(``stages.mechanism.locks``) in
the name of the pipeline driver (``PipelineContext.driver``), waiting while another live
driver holds it, and looks for a succeeded output again once it has it (so a pipeline that
waited reuses what the other one made). The driver keeps its locks fresh with
``stages.mechanism.locks.Heartbeat``.

One MLflow run per stage key holds a resumable stage's whole history: an attempt that
continues an unfinished ``<key>.partial`` (a rerun of the pipeline after a failure, a kill
or an interrupt) reopens the run that ``.partial/status.json`` names instead of starting
another, moves it under the current pipeline run and counts the attempts in its tags
(``attempts``, ``attempt.<n>.parent_run_id``, ``attempt.<n>.error``). A Parsl retry of the
ranks within one pipeline run is a try of the same attempt: it keeps the attempt's run.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.mechanism import keys, locks, outputs, selection, tracking
from stages.mechanism.declaration import Continuation, StageDeclaration, StageList, json_digest
from stages.mechanism.outputs import StageResult


@dataclass
class PipelineContext:
    """What every stage needs to know about the pipeline invocation (picklable).

    ``code`` is the per-stage code hash (``stages.mechanism.keys.code_hashes`` of
    ``pipeline``, computed once by the driver), or one string used for every stage.
    ``driver`` owns the stage locks this pipeline takes, whichever process takes them;
    ``lock_stale_s`` is how old a lock's heartbeat may get before another pipeline takes it
    as abandoned. ``tracking_uri`` is
    what stages talk to; ``store_uri`` names the store behind it when that differs (the
    driver's tracking server over the runs dir's SQLite file, at a new address each run):
    statuses record the store, so runs ids match across runs that reach it differently.
    """

    runs_dir: str
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    code: dict[str, str] | str | None = None
    driver: locks.Owner = field(default_factory=locks.Owner)
    lock_stale_s: float = locks.STALE_AFTER_S
    store_uri: str = ""
    triggers: tuple[str, ...] = keys.TRIGGERS
    """What makes a stage rerun (``--rerun-triggers``, ``stages.mechanism.keys.TRIGGERS``)."""
    pipeline: StageList = field(default_factory=lambda: StageList(()))
    """The stages (``stages.registry.PIPELINE``); a test's own stage may run without them."""

    def __post_init__(self) -> None:
        if self.code is None:
            self.code = keys.code_hashes(self.pipeline)

    @property
    def store(self) -> str:
        """The store's identity: ``store_uri``, else ``tracking_uri``."""
        return self.store_uri or self.tracking_uri

    def code_for(self, name: str) -> str:
        """The code hash that goes into stage ``name``'s key."""
        return keys.code_for(self.code, name)


@dataclass
class Attempt:
    """A stage's turn: a reused output (``reused``) or work in ``work_dir`` logged to MLflow
    run ``run_id``. ``prepared`` is what the work module's ``prepare`` returned (the part
    count of a fan-out, the rank spec path of a ranks stage)."""

    name: str
    key: str
    run_id: str
    final_dir: str
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    ingredients: dict[str, Any] = field(default_factory=dict)
    reused: StageResult | None = None
    prepared: Any = None
    config: dict[str, Any] = field(default_factory=dict)  # the sections' values (status.json)
    stage: StageDeclaration | None = None  # whose ``output_digest`` ``finish`` records

    @property
    def work_dir(self) -> str:
        """Where the attempt writes until it is published (``<key>.partial``)."""
        return str(outputs.partial_dir(self.final_dir))

    def tracker(self, ctx: PipelineContext) -> tracking.Tracker:
        return tracking.Tracker(ctx.tracking_uri, self.run_id)


ATTEMPTS_TAG = "attempts"
"""How many attempts (pipeline runs) a stage run holds; ``attempt.<n>.parent_run_id`` names
the pipeline run of attempt ``n`` and ``attempt.<n>.error`` the error that ended it."""
ERROR_TAG = "error"  # the error of a failed run (``fail``)
INTERRUPTED = threading.Event()
"""Set by the driver when a signal interrupts the pipeline (``workflows.session``): a stage
that fails in one of its threads from then on (its ranks died of the same Ctrl-C) was
stopped, not broken, and its run ends KILLED as the interrupt's own marking would leave it."""


def _attempt_tags(n: int, parent_run_id: str) -> dict[str, str]:
    return {ATTEMPTS_TAG: str(n), f"attempt.{n}.parent_run_id": parent_run_id}


def _child_run(ctx: PipelineContext, name: str, key: str, tags: dict[str, str]) -> str:
    return tracking.start_run(
        ctx.tracking_uri,
        ctx.experiment_id,
        run_name=f"{name}-{key[:8]}",
        parent_run_id=ctx.parent_run_id,
        tags={"stage": name, "stage_key": key, **tags},
    )


def _log_stage_params(
    tracker: tracking.Tracker,
    cfg: Any,
    sections: tuple[str, ...],
    inputs: dict[str, StageResult],
    store: str,
) -> None:
    tracker.log_params({section: dataclasses.asdict(getattr(cfg, section)) for section in sections})
    tracker.set_tags({f"input.{name}.run_id": res.producer_run_id for name, res in inputs.items()})
    # Where an input's run lives, when that is another store than this one (``store``).
    tracker.set_tags({f"input.{name}.tracking_uri": res.producer_tracking_uri
                      for name, res in inputs.items()
                      if res.producer_tracking_uri and res.producer_tracking_uri != store})
    tracker.set_tags({f"input.{name}.key": res.key for name, res in inputs.items()})
    tracker.log_dict(cfg.to_dict(), "config.yaml")


def reuse(
    ctx: PipelineContext, found: StageResult, cfg: Any, sections: tuple[str, ...],
    inputs: dict[str, StageResult], kept: str = "",
) -> StageResult:
    """Record a reused stage: a child run tagged ``reused`` that points at its producer (its
    run id and the store holding it, which may be another than this pipeline's); ``kept``
    names what differs when ``--rerun-triggers`` kept an output made otherwise (tagged
    ``kept_although`` and ``rerun_triggers``)."""
    tags = {"reused": "true", "producer_run_id": found.producer_run_id, "out_dir": found.out_dir,
            "producer_tracking_uri": found.producer_tracking_uri or "unknown"}
    if kept:
        tags.update(kept_although=kept, rerun_triggers=",".join(ctx.triggers))
    run_id = _child_run(ctx, found.name, found.key, tags)
    tracker = tracking.Tracker(ctx.tracking_uri, run_id)
    _log_stage_params(tracker, cfg, sections, inputs, ctx.store)
    # The producer's latest metric values, so the reused run reads the same in the UI; only
    # from this store (another one's run ids mean nothing here), and never fatal.
    if found.producer_tracking_uri == ctx.store:
        metrics = tracking.run_metrics_or_none(ctx.tracking_uri, found.producer_run_id)
        if metrics:
            tracker.log_metrics(metrics)
    tracker.flush()
    tracking.end_run(ctx.tracking_uri, run_id)
    return dataclasses.replace(found, run_id=run_id)


def _reused(ctx: PipelineContext, found: StageResult, cfg: Any,
            stage: StageDeclaration, inputs: dict[str, StageResult], kept: str = "") -> Attempt:
    if kept:
        print(f"[stage] {stage.name}: keeps {found.key} although {kept} changed "
              f"(--rerun-triggers {','.join(ctx.triggers)})", flush=True)
    result = reuse(ctx, found, cfg, stage.sections, inputs, kept)
    return Attempt(stage.name, found.key, result.run_id, found.out_dir, reused=result)


def _continued_run(ctx: PipelineContext, name: str, key: str,
                   status: dict[str, Any] | None) -> str | None:
    """Reopen the MLflow run of the unfinished attempt whose ``.partial`` work this attempt
    continues (``status``: its status.json); return its id, or None to start a new run.

    The run is reused only where this store holds it, live, as the run of (name, key); a
    status written beside another store, or a run deleted since, starts a new one. The run is
    set back to RUNNING and its ``mlflow.parentRunId`` moved to this pipeline run, so it shows
    under the run that finishes it and the earlier pipeline run keeps no competing child for
    the key; the attempts are counted in its tags, and the ``error`` of the attempt that
    failed is kept as ``attempt.<n>.error``."""
    run_id = (status or {}).get("run_id")
    if not run_id or status.get("key", key) != key:
        return None
    if status.get("tracking_uri", ctx.store) != ctx.store:
        return None  # its run id means nothing in this store
    run = tracking.find_run(ctx.tracking_uri, run_id)
    if run is None:
        return None
    tags = run.data.tags
    if tags.get("stage") != name or tags.get("stage_key") != key:
        return None
    done = int(tags.get(ATTEMPTS_TAG) or 1)  # a run from before attempts were counted: one
    moved = {**_attempt_tags(done + 1, ctx.parent_run_id),
             tracking.MLFLOW_PARENT_RUN_ID: ctx.parent_run_id}
    earlier = f"attempt.{done}.parent_run_id"
    if earlier not in tags and tags.get(tracking.MLFLOW_PARENT_RUN_ID):
        moved[earlier] = tags[tracking.MLFLOW_PARENT_RUN_ID]
    if tags.get(ERROR_TAG):
        moved[f"attempt.{done}.error"] = tags[ERROR_TAG]
    tracking.Tracker(ctx.tracking_uri, run_id).set_tags(moved)
    if ERROR_TAG in tags:
        tracking.delete_tags(ctx.tracking_uri, run_id, [ERROR_TAG])
    tracking.reopen_run(ctx.tracking_uri, run_id)
    print(f"[stage] {name} {key}: attempt {done + 1} continues MLflow run {run_id}", flush=True)
    return run_id


def _start_continuation(ctx: PipelineContext, source: Continuation,
                        run_id: str) -> None:
    """Tag a continued stage's new run with its source, and copy the source run's metrics up
    to the step it continues from, so the run holds the whole history (never fatal)."""
    tracker = tracking.Tracker(ctx.tracking_uri, run_id)
    tracker.set_tags({"continued_from": source.key or source.checkpoint,
                      "continued_from_step": str(source.step),
                      "continued_from_run_id": source.source_run_id or "unknown"})
    if (not source.history or not source.source_run_id
            or (source.source_store or ctx.store) != ctx.store):
        return
    try:
        copied = tracking.copy_history(ctx.tracking_uri, source.source_run_id, run_id,
                                       source.step)
    except Exception as error:  # noqa: BLE001 - the history is a convenience, the training is not
        print(f"[stage] could not copy the metric history of run {source.source_run_id}: "
              f"{error}", file=sys.stderr, flush=True)
        return
    print(f"[stage] copied {copied} metric values through step {source.step} from run "
          f"{source.source_run_id}", flush=True)


def _take_lock(ctx: PipelineContext, name: str, key: str) -> None:
    """Take (name, key)'s lock for the driver, saying whom it waits for while it waits."""

    def waiting(holder: dict[str, Any]) -> None:
        print(f"waiting for {name} {key} held by {holder.get('host')}:{holder.get('pid')}",
              flush=True)

    locks.acquire(outputs.lock_path(ctx.runs_dir, name, key), ctx.driver, ctx.lock_stale_s,
                  on_wait=waiting)


def begin(
    ctx: PipelineContext,
    stage: StageDeclaration,
    cfg: Any,
    inputs: dict[str, StageResult],
    force: bool = False,
) -> Attempt:
    """Reuse a succeeded output with the stage's key, or open an attempt to compute it.

    Resumable stages (``stage.resumable``: tokenize, train) keep an earlier attempt's
    ``.partial`` directory so they can continue from it, and its MLflow run
    (``_continued_run``); the others start from an empty one and a new run.
    """
    name = stage.name
    digests = {n: selection.digest_of(r, ctx.pipeline) for n, r in inputs.items()}
    resolution = selection.resolve(ctx.runs_dir, stage, cfg, digests, ctx.code_for(name),
                                   ctx.triggers)
    key, ingredients = resolution.key, resolution.ingredients
    if not force and resolution.found is not None:
        return _reused(ctx, resolution.found, cfg, stage, inputs, resolution.kept)
    final_dir = outputs.stage_dir(ctx.runs_dir, name, key)
    lock = outputs.lock_path(ctx.runs_dir, name, key)
    _take_lock(ctx, name, key)
    try:
        work_dir = outputs.work_dir(ctx.runs_dir, name, key)
        if not force:  # another pipeline may have made it while this one waited
            found = outputs.find_succeeded(ctx.runs_dir, name, key)
            problem = stage.output_problem(found.outputs) if found is not None else None
            if found is not None and not problem:
                locks.release(lock, ctx.driver)
                return _reused(ctx, found, cfg, stage, inputs)
            if problem and stage.resumable:
                # A damaged output: continue from it, so only what is damaged is redone.
                print(f"[stage] {name} {key}: its output is damaged ({problem}); "
                      "continuing from what is whole", flush=True)
                shutil.rmtree(work_dir, ignore_errors=True)
                os.replace(final_dir, work_dir)
        if work_dir.exists() and not stage.resumable:
            shutil.rmtree(work_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
        run_id = _continued_run(ctx, name, key, outputs.read_status(work_dir)) if \
            stage.resumable else None
        if run_id is None:
            run_id = _child_run(ctx, name, key, {"reused": "false", "out_dir": str(final_dir),
                                                 **_attempt_tags(1, ctx.parent_run_id)})
            if resolution.continues is not None:
                _start_continuation(ctx, resolution.continues, run_id)
        if resolution.continues is not None and stage.continuation.seed(resolution.continues,
                                                                        work_dir):
            print(f"[stage] {name} {key}: {resolution.continues.why}", flush=True)
            if resolution.continues.warning:
                print(f"[stage] warning: {resolution.continues.warning}", flush=True)
        outputs.write_status(work_dir, outputs.status_record(
            "running", run_id, key=key, ingredients=ingredients, tracking_uri=ctx.store,
            config=keys.config_record(stage, cfg)))
        print(f"[stage] {name} key {key}: computing", flush=True)
        attempt = Attempt(name, key, run_id, str(final_dir),
                          inputs={n: r.outputs for n, r in inputs.items()},
                          ingredients=ingredients, config=keys.config_record(stage, cfg),
                          stage=stage)
        _log_stage_params(attempt.tracker(ctx), cfg, stage.sections, inputs, ctx.store)
    except BaseException:
        locks.release(lock, ctx.driver)
        raise
    return attempt


def finish(ctx: PipelineContext, attempt: Attempt, outs: dict[str, Any]) -> StageResult:
    """Publish a stage's outputs atomically, with the digest of what it produced
    (``StageDeclaration.digest``, computed before the rename, from the work directory),
    and close its MLflow run as FINISHED."""
    work, final = Path(attempt.work_dir), Path(attempt.final_dir)
    stage = attempt.stage or ctx.pipeline.find(attempt.name)
    digest = stage.output_digest(outs) if stage else json_digest(outs)
    outs = outputs.relocate(outs, str(work), str(final))
    outputs.write_outputs(work, outs)
    outputs.write_status(work, outputs.status_record(
        "succeeded", attempt.run_id, key=attempt.key, ingredients=attempt.ingredients,
        tracking_uri=ctx.store, output_digest=digest, config=attempt.config))
    attempt.tracker(ctx).log_artifact(work / outputs.OUTPUTS_FILE)
    outputs.publish(work, final, attempt.key)
    locks.release(outputs.lock_path(ctx.runs_dir, attempt.name, attempt.key), ctx.driver)
    tracking.end_run(ctx.tracking_uri, attempt.run_id, "FINISHED")
    return StageResult(
        name=attempt.name,
        key=attempt.key,
        out_dir=str(final),
        outputs=outs,
        run_id=attempt.run_id,
        producer_run_id=attempt.run_id,
        reused=False,
        producer_tracking_uri=ctx.store,
        digest=digest,
    )


def fail(ctx: PipelineContext, attempt: Attempt, error: BaseException) -> None:
    """Record the error in status.json and close the MLflow run as FAILED (KILLED for an
    interrupt)."""
    work = Path(attempt.work_dir)
    if work.exists():
        detail = "".join(traceback.format_exception(error))
        status = outputs.status_record("failed", attempt.run_id, key=attempt.key, error=detail,
                                       ingredients=attempt.ingredients,
                                       tracking_uri=ctx.store)
        try:
            outputs.write_status(work, status)
        except OSError:
            outputs.overwrite_status(work / outputs.STATUS_FILE, status, error)
    try:
        locks.release(outputs.lock_path(ctx.runs_dir, attempt.name, attempt.key), ctx.driver)
    except OSError as lock_error:
        print(f"[stage] could not release the lock of {attempt.name} {attempt.key}: {lock_error}",
              file=sys.stderr, flush=True)
    try:
        tracking.Tracker(ctx.tracking_uri, attempt.run_id).set_tags(
            {ERROR_TAG: str(error)[:4000]})
        # An interrupt (Ctrl-C, SIGTERM) ends the run KILLED, as MLflow names a stopped run.
        stopped = isinstance(error, KeyboardInterrupt) or INTERRUPTED.is_set()
        status = "KILLED" if stopped else "FAILED"
        tracking.end_run(ctx.tracking_uri, attempt.run_id, status)
    except Exception as tracking_error:  # noqa: BLE001 - tracking must not hide the original error
        print(f"[stage] could not mark MLflow run {attempt.run_id} FAILED: {tracking_error}",
              file=sys.stderr, flush=True)


def running_attempt(ctx: PipelineContext, name: str, key: str) -> Attempt | None:
    """The attempt at (name, key) whose status.json still says ``running``, if any (the
    driver fails it when it is interrupted)."""
    final = outputs.stage_dir(ctx.runs_dir, name, key)
    status = outputs.read_status(outputs.work_dir(ctx.runs_dir, name, key))
    if not status or status.get("state") != "running":
        return None
    return Attempt(name, key, status["run_id"], str(final))
