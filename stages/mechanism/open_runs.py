"""Pipeline runs a driver holds open, recorded on disk so none stays RUNNING for good.

A driver that dies, or whose store takes no more writes, cannot close its MLflow run; the
next driver on the runs dir closes it (``close_abandoned_runs``).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from stages.mechanism import locks
from stages.mechanism.tracking import end_run_tree

OPEN_RUNS_DIR = "open-runs"
"""Under the runs dir: ``<run id>.json`` for each pipeline run a driver holds open (its store
and the driver's run marker), removed once the driver closed the run; renamed
``<run id>.unclosed.json`` where it could not (the store's disk was full, the store was
away). The next driver on the runs dir that can write the store closes those runs
(``close_abandoned_runs``), so no pipeline run stays RUNNING for good."""
UNCLOSED_SUFFIX = ".unclosed.json"


def note_open_run(runs_dir: str | Path, store_uri: str, run_id: str) -> None:
    """Record that this driver holds pipeline run ``run_id`` of ``store_uri`` open. Best
    effort: a runs dir that takes no file now takes no stage either."""
    from data_prep.atomic import write_json_atomic

    record = {"store": store_uri, "run_id": run_id,
              "driver": os.environ.get(locks.RUN_ENV, ""), "opened": time.time()}
    with contextlib.suppress(OSError):
        write_json_atomic(Path(runs_dir) / OPEN_RUNS_DIR / f"{run_id}.json", record)


def note_closed_run(runs_dir: str | Path, run_id: str, closed: bool) -> None:
    """Drop run ``run_id``'s record once the driver closed it; ``closed=False``: keep it as
    unclosed, for the next driver (a rename, which a full disk still allows)."""
    path = Path(runs_dir) / OPEN_RUNS_DIR / f"{run_id}.json"
    with contextlib.suppress(OSError):
        if closed:
            path.unlink(missing_ok=True)
        else:
            path.rename(path.with_name(f"{run_id}{UNCLOSED_SUFFIX}"))


def close_abandoned_runs(runs_dir: str | Path, store_uri: str, uri: str) -> list[str]:
    """Mark FAILED the pipeline runs of ``store_uri`` (reached at ``uri``) that earlier
    drivers on this runs dir left open: those recorded unclosed, and those whose driver on
    this host is gone (``note_open_run``), with every stage run under them still RUNNING.
    Their records are dropped once done; a store that still takes no write keeps them for
    the next driver. The ids marked."""
    marked: list[str] = []
    for path in sorted((Path(runs_dir) / OPEN_RUNS_DIR).glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        driver = str(record.get("driver", ""))
        abandoned = path.name.endswith(UNCLOSED_SUFFIX) or (
            driver.split(":", 1)[0] == socket.gethostname() and not locks.run_alive(driver))
        if record.get("store") != store_uri or not abandoned:
            continue
        reason = ("the pipeline's driver could not close this run (its MLflow store took no "
                  "more writes, or the driver was gone); marked by a later pipeline run")
        try:
            marked += end_run_tree(uri, record["run_id"], "FAILED", reason)
        except OSError:
            continue  # still full: the next driver tries again
        except Exception:  # noqa: BLE001 - a run the store does not have: nothing to close
            pass
        path.unlink(missing_ok=True)
    return marked
