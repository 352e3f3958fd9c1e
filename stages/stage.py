"""The one stage mechanism every stage shares: keys, status, atomic publish, reuse, MLflow.

A stage's output directory is ``<runs_dir>/stages/<name>/<key>`` where the key hashes
(stage name, the config sections the stage reads, its inputs' keys, package version).
Work happens in ``<key>.partial``; only a stage that finished is renamed to ``<key>``
with ``status.json`` saying ``succeeded``. So a failed or interrupted stage never leaves
output that a later run could take as done, and a succeeded stage with the same key is
reused instead of recomputed.

The flow is split in ``begin`` / ``finish`` / ``fail`` so that work between them can run
anywhere (Parsl fan-out apps, training ranks launched by torchrun or srun);
``run_stage`` chains them for a stage that is one plain function.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from stages import tracking
from stages.config import PipelineConfig

STATUS_FILE = "status.json"

SINGLE, FAN_OUT, RANKS = "single", "fan-out", "ranks"


@dataclass(frozen=True)
class StageShape:
    """How the workflow runs a stage; each stage module's ``shape(cfg)`` returns one.

    - ``single``: one app calls ``run(cfg, inputs, out_dir, tracker) -> outputs``.
    - ``fan-out``: ``prepare(cfg, inputs, out_dir, tracker)``, then ``parts`` apps each call
      ``part(cfg, out_dir, index) -> dict``, then ``finalize(cfg, out_dir, parts, tracker)``.
    - ``ranks``: ``prepare`` writes a ``stages.launch.RankSpec`` and returns its path, the
      launcher starts ``nproc`` ranks of ``python -m <worker> --spec PATH`` on ``nodes``
      nodes, then ``finalize(cfg, out_dir, [], tracker)``.
    """

    kind: str
    parts: int = 0
    nproc: int = 1
    nodes: int = 1
    worker: str = ""
    note: str = ""  # what --dry-run prints after the stage, e.g. "x2 shards"

    def __post_init__(self) -> None:
        if self.kind not in (SINGLE, FAN_OUT, RANKS):
            raise ValueError(f"unknown stage shape {self.kind!r}")
        if self.kind == RANKS and not self.worker:
            raise ValueError("a ranks stage names its worker module")
OUTPUTS_FILE = "outputs.json"


def package_version() -> str:
    """Version of the installed project (part of every stage key)."""
    try:
        return metadata.version("frontier-llm")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass
class PipelineContext:
    """What every stage needs to know about the pipeline invocation (picklable)."""

    runs_dir: str
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    version: str = field(default_factory=package_version)


@dataclass
class StageResult:
    """A finished (or reused) stage: where its outputs are and which runs describe it."""

    name: str
    key: str
    out_dir: str
    outputs: dict[str, Any]
    run_id: str
    producer_run_id: str
    reused: bool


@dataclass
class StageAttempt:
    """A stage in progress: writing into ``work_dir``, logging to MLflow run ``run_id``."""

    name: str
    key: str
    work_dir: str
    final_dir: str
    run_id: str
    inputs: dict[str, dict[str, Any]]

    def tracker(self, ctx: PipelineContext) -> tracking.Tracker:
        return tracking.Tracker(ctx.tracking_uri, self.run_id)


def stage_key(
    name: str, cfg: PipelineConfig, sections: tuple[str, ...], input_keys: dict[str, str], version: str
) -> str:
    """Hash of everything that decides a stage's output."""
    payload = {
        "stage": name,
        "config": {section: dataclasses.asdict(getattr(cfg, section)) for section in sections},
        "inputs": dict(sorted(input_keys.items())),
        "version": version,
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def stage_dir(runs_dir: str | Path, name: str, key: str) -> Path:
    return Path(runs_dir) / "stages" / name / key


def read_status(directory: str | Path) -> dict[str, Any] | None:
    """status.json of a stage directory, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((Path(directory) / STATUS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def find_succeeded(runs_dir: str | Path, name: str, key: str) -> StageResult | None:
    """The published result of (name, key) if a run already produced it."""
    directory = stage_dir(runs_dir, name, key)
    status = read_status(directory)
    if not status or status.get("state") != "succeeded":
        return None
    outputs = json.loads((directory / OUTPUTS_FILE).read_text())
    return StageResult(
        name=name,
        key=key,
        out_dir=str(directory),
        outputs=outputs,
        run_id=status["run_id"],
        producer_run_id=status["run_id"],
        reused=True,
    )


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def _status(state: str, run_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "state": state,
        "run_id": run_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }


def _child_run(ctx: PipelineContext, name: str, key: str, tags: dict[str, str]) -> str:
    return tracking.start_run(
        ctx.tracking_uri,
        ctx.experiment_id,
        run_name=f"{name}-{key[:8]}",
        parent_run_id=ctx.parent_run_id,
        tags={"stage": name, "stage_key": key, **tags},
    )


def _log_stage_params(
    tracker: tracking.Tracker, cfg: PipelineConfig, sections: tuple[str, ...], inputs: dict[str, StageResult]
) -> None:
    tracker.log_params({section: dataclasses.asdict(getattr(cfg, section)) for section in sections})
    tracker.set_tags({f"input.{name}.run_id": res.producer_run_id for name, res in inputs.items()})
    tracker.set_tags({f"input.{name}.key": res.key for name, res in inputs.items()})
    tracker.log_dict(cfg.to_dict(), "config.yaml")


def reuse(ctx: PipelineContext, found: StageResult, cfg: PipelineConfig, sections, inputs) -> StageResult:
    """Record a reused stage: a child run tagged ``reused`` that points at its producer."""
    run_id = _child_run(
        ctx,
        found.name,
        found.key,
        {"reused": "true", "producer_run_id": found.producer_run_id, "out_dir": found.out_dir},
    )
    tracker = tracking.Tracker(ctx.tracking_uri, run_id)
    _log_stage_params(tracker, cfg, sections, inputs)
    # Copy the producer's latest metric values so the reused run reads the same in the UI.
    producer = tracking.get_run(ctx.tracking_uri, found.producer_run_id)
    tracker.log_metrics(dict(producer.data.metrics))
    tracker.flush()
    tracking.end_run(ctx.tracking_uri, run_id)
    return dataclasses.replace(found, run_id=run_id)


def begin(
    ctx: PipelineContext,
    name: str,
    sections: tuple[str, ...],
    cfg: PipelineConfig,
    inputs: dict[str, StageResult],
    force: bool = False,
    resumable: bool = False,
) -> StageAttempt | StageResult:
    """Reuse a succeeded stage with the same key, or open an attempt to compute it.

    ``resumable`` stages (training) keep an earlier attempt's ``.partial`` directory so
    they can continue from its checkpoints; the others start from an empty directory.
    """
    key = stage_key(name, cfg, sections, {n: r.key for n, r in inputs.items()}, ctx.version)
    if not force:
        found = find_succeeded(ctx.runs_dir, name, key)
        if found is not None:
            return reuse(ctx, found, cfg, sections, inputs)
    final_dir = stage_dir(ctx.runs_dir, name, key)
    work_dir = final_dir.with_name(f"{key}.partial")
    if work_dir.exists() and not resumable:
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    run_id = _child_run(ctx, name, key, {"reused": "false", "out_dir": str(final_dir)})
    _write_json_atomic(work_dir / STATUS_FILE, _status("running", run_id, key=key))
    attempt = StageAttempt(
        name=name,
        key=key,
        work_dir=str(work_dir),
        final_dir=str(final_dir),
        run_id=run_id,
        inputs={n: r.outputs for n, r in inputs.items()},
    )
    _log_stage_params(attempt.tracker(ctx), cfg, sections, inputs)
    return attempt


def _relocate(value: Any, old: str, new: str) -> Any:
    """Rewrite paths inside the work directory to where they live once published."""
    if isinstance(value, str) and (value == old or value.startswith(old + os.sep)):
        return new + value[len(old) :]
    if isinstance(value, dict):
        return {k: _relocate(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_relocate(v, old, new) for v in value]
    return value


def finish(ctx: PipelineContext, attempt: StageAttempt, outputs: dict[str, Any]) -> StageResult:
    """Publish a stage's outputs atomically and close its MLflow run as FINISHED."""
    work, final = Path(attempt.work_dir), Path(attempt.final_dir)
    outputs = _relocate(outputs, str(work), str(final))
    _write_json_atomic(work / OUTPUTS_FILE, outputs)
    _write_json_atomic(work / STATUS_FILE, _status("succeeded", attempt.run_id, key=attempt.key))
    attempt.tracker(ctx).log_artifact(work / OUTPUTS_FILE)
    # A forced recompute replaces the old output only once the new one is complete.
    old = final.with_name(f"{attempt.key}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(work, final)
    shutil.rmtree(old, ignore_errors=True)
    tracking.end_run(ctx.tracking_uri, attempt.run_id, "FINISHED")
    return StageResult(
        name=attempt.name,
        key=attempt.key,
        out_dir=str(final),
        outputs=outputs,
        run_id=attempt.run_id,
        producer_run_id=attempt.run_id,
        reused=False,
    )


def fail(ctx: PipelineContext, attempt: StageAttempt, error: BaseException) -> None:
    """Record the error in status.json and close the MLflow run as FAILED."""
    work = Path(attempt.work_dir)
    if work.exists():
        detail = "".join(traceback.format_exception(error))
        _write_json_atomic(
            work / STATUS_FILE, _status("failed", attempt.run_id, key=attempt.key, error=detail)
        )
    try:
        tracking.Tracker(ctx.tracking_uri, attempt.run_id).set_tags({"error": str(error)[:4000]})
        tracking.end_run(ctx.tracking_uri, attempt.run_id, "FAILED")
    except Exception as tracking_error:  # noqa: BLE001 - tracking must not hide the original error
        print(f"[stage] could not mark MLflow run {attempt.run_id} FAILED: {tracking_error}",
              file=sys.stderr, flush=True)


def run_stage(
    ctx: PipelineContext,
    module: ModuleType,
    cfg: PipelineConfig,
    inputs: dict[str, StageResult],
    force: bool = False,
) -> StageResult:
    """Run a stage module's ``run(cfg, inputs, out_dir, tracker)`` under the mechanism."""
    name = module.__name__.rsplit(".", 1)[-1]
    attempt = begin(ctx, name, module.SECTIONS, cfg, inputs, force, getattr(module, "RESUMABLE", False))
    if isinstance(attempt, StageResult):
        return attempt
    tracker = attempt.tracker(ctx)
    try:
        outputs = module.run(cfg, attempt.inputs, Path(attempt.work_dir), tracker)
        tracker.flush()
    except BaseException as error:
        fail(ctx, attempt, error)
        raise
    return finish(ctx, attempt, outputs)
