"""Stage outputs on disk: where they live, their status file, and publishing by rename.

``<runs_dir>/stages/<name>/<key>/`` holds a succeeded stage: ``status.json`` (``state``
succeeded, the MLflow run that made it, the key's ingredients) and ``outputs.json`` (what
later stages read). Work happens in ``<key>.partial/``; ``publish`` renames it to
``<key>/`` only once the stage finished, so a failed or interrupted stage never leaves
output a later run could take as done. ``<key>.lock`` beside it is held by the one attempt
at that key (``stages.mechanism.locks``).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_prep.atomic import write_json_atomic

STATUS_FILE = "status.json"
OUTPUTS_FILE = "outputs.json"
PARTIAL_SUFFIX = ".partial"


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
    producer_tracking_uri: str = ""
    """The MLflow store holding ``producer_run_id`` ("" where an older status does not say)."""
    digest: str = ""
    """The digest of the output that downstream keys hash (``StageDeclaration.digest``);
    "" where the status predates it."""


def stage_dir(runs_dir: str | Path, name: str, key: str) -> Path:
    """Where stage ``name``'s output for ``key`` is published."""
    return Path(runs_dir) / "stages" / name / key


def partial_dir(final: str | Path) -> Path:
    """Where the attempt that publishes ``final`` writes until then: ``<key>.partial``."""
    final = Path(final)
    return final.with_name(f"{final.name}{PARTIAL_SUFFIX}")


def work_dir(runs_dir: str | Path, name: str, key: str) -> Path:
    """Where an attempt at (name, key) writes until it is published."""
    return partial_dir(stage_dir(runs_dir, name, key))


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
        producer_tracking_uri=status.get("tracking_uri", ""),
        digest=status.get("output_digest", ""),
    )


def stage_outputs(runs_dir: str | Path, name: str,
                  unfinished: bool = False) -> list[tuple[str, Path, dict[str, Any]]]:
    """(key, directory, status) of every published succeeded output of stage ``name``,
    newest first; with ``unfinished``, also every ``<key>.partial`` work directory (an
    interrupted or failed attempt) after them."""
    found: list[tuple[float, str, Path, dict[str, Any]]] = []
    for status_path in (Path(runs_dir) / "stages" / name).glob(f"*/{STATUS_FILE}"):
        directory = status_path.parent
        key, _, suffix = directory.name.partition(".")
        if suffix and not (unfinished and f".{suffix}" == PARTIAL_SUFFIX):
            continue  # <key>.old-<pid>, or an unfinished attempt nobody asked for
        status = read_status(directory)
        if not status or (not suffix and status.get("state") != "succeeded"):
            continue
        rank = status_path.stat().st_mtime - (1e12 if suffix else 0)  # published ones first
        found.append((rank, key, directory, status))
    return [(key, directory, status)
            for _, key, directory, status in sorted(found, key=lambda f: -f[0])]


def newest_succeeded(runs_dir: str | Path, name: str) -> tuple[str, dict[str, Any]] | None:
    """(key, status) of the most recently published succeeded output of stage ``name``."""
    best: tuple[float, str, dict[str, Any]] | None = None
    for status_path in (Path(runs_dir) / "stages" / name).glob(f"*/{STATUS_FILE}"):
        key = status_path.parent.name
        if "." in key:  # <key>.partial, <key>.old-<pid>
            continue
        status = read_status(status_path.parent)
        if not status or status.get("state") != "succeeded":
            continue
        when = status_path.stat().st_mtime
        if best is None or when > best[0]:
            best = (when, key, status)
    return None if best is None else (best[1], best[2])


def overwrite_status(path: Path, status: dict[str, Any], error: BaseException) -> None:
    """Last resort when the disk is full: rewrite status.json in place, short, inside the
    space the "running" status already holds (no new file, no new blocks)."""
    short = {**status, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    short.pop("ingredients", None)
    try:
        with open(path, "r+b") as handle:
            handle.write(json.dumps(short).encode())
            handle.truncate()
    except OSError as write_error:
        print(f"[stage] could not record the failure in {path}: {write_error}", file=sys.stderr,
              flush=True)


def status_record(state: str, run_id: str, **extra: Any) -> dict[str, Any]:
    """A status.json record: the state, the MLflow run, where and when it was written."""
    return {
        "state": state,
        "run_id": run_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }


def write_status(work: Path, status: dict[str, Any]) -> None:
    """Write ``status.json`` of a work directory atomically."""
    write_json_atomic(Path(work) / STATUS_FILE, status)


def write_outputs(work: Path, outputs: dict[str, Any]) -> None:
    """Write ``outputs.json`` (what later stages read) of a work directory atomically."""
    write_json_atomic(Path(work) / OUTPUTS_FILE, outputs)


def lock_path(runs_dir: str | Path, name: str, key: str) -> Path:
    """The lock that one attempt at (name, key) holds: ``<stage dir>/<key>.lock``."""
    return stage_dir(runs_dir, name, key).with_name(f"{key}.lock")


def relocate(value: Any, old: str, new: str) -> Any:
    """Rewrite paths inside the work directory to where they live once published."""
    if isinstance(value, str) and (value == old or value.startswith(old + os.sep)):
        return new + value[len(old) :]
    if isinstance(value, dict):
        return {k: relocate(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [relocate(v, old, new) for v in value]
    return value


def publish(work: Path, final: Path, key: str) -> None:
    """Rename a finished ``<key>.partial`` to ``<key>``; a forced recompute replaces the old
    output only once the new one is complete."""
    old = final.with_name(f"{key}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(work, final)
    shutil.rmtree(old, ignore_errors=True)
