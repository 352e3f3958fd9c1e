"""A disk that fills during training: one clear message, the stage and its MLflow runs marked
failed, no flood, no retry; once space is freed, the rerun resumes from the last complete
checkpoint.

The runs dir lives on a small tmpfs (mounting needs root, as in CI); the MLflow store lives
elsewhere so that the test can read what was recorded, or, in the second test, is the default
one in the runs dir, on the full disk itself: its runs are closed by the rerun. Once the
training has written its first complete checkpoint, a ballast file takes the rest of the
disk, as another job writing to the same file system would.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import threading
from pathlib import Path

import pytest

from tests import warm_cli

REPO = Path(__file__).resolve().parents[2]
STEPS = 40  # the disk fills after the checkpoint of step 2; the next one fails
SETTINGS = ["--set", f"train.steps={STEPS}", "train.checkpoint_every=2", "train.log_every=10"]


@pytest.fixture()
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root (CI runs as root)")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill_after_first_checkpoint(runs: Path, ballast: Path, stop: threading.Event) -> None:
    """Wait for the training's first complete checkpoint, then fill the disk."""
    while not stop.wait(0.1):
        done = [p for p in runs.glob("stages/train/*.partial/checkpoints/step-*")
                if not p.name.endswith(".tmp")]
        if done:
            with contextlib.suppress(OSError), open(ballast, "wb") as out:
                block = b"\0" * (1 << 16)
                while True:
                    out.write(block)
                    out.flush()
            return


def fill_and_hold(runs: Path, ballast: Path, stop: threading.Event) -> None:
    """``fill_after_first_checkpoint``, then take whatever space is freed (a rank removing its
    half-written checkpoint) until ``stop``, as a job that keeps writing would: nothing on
    the disk, the store included, takes another write."""
    fill_after_first_checkpoint(runs, ballast, stop)
    if not ballast.exists():
        return
    with open(ballast, "ab", buffering=0) as out:
        while not stop.wait(0.02):
            with contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * 4096)


def run_pipeline(runs: Path, uri: str | None) -> tuple[int, str]:
    """The micro pipeline on ``runs`` (``uri`` None: the default store, in the runs dir)."""
    store = ["--tracking-uri", uri] if uri else []
    try:
        proc = warm_cli.run("workflows.pipeline", ["--config", "configs/micro.yaml",
                                                   "--runs-dir", str(runs), *store, *SETTINGS],
                            cwd=REPO, timeout=400, forked_launches=True)
    except subprocess.TimeoutExpired as hung:  # show where it stopped, not only that it did
        said = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                       for part in (hung.stdout, hung.stderr))
        pytest.fail(f"the pipeline did not end within 400 s; it said:\n{said[-5000:]}")
    return proc.returncode, proc.stdout + proc.stderr

def run_while_filling(runs: Path, uri: str | None, ballast: Path, fill) -> tuple[int, str]:
    """Run the pipeline on ``runs`` while ``fill(runs, ballast, stop)`` fills the small disk
    in a thread; (exit code, console). Asserts the training got to write a checkpoint and
    failed with exit code 1."""
    stop = threading.Event()
    filler = threading.Thread(target=fill, args=(runs, ballast, stop))
    filler.start()
    try:
        code, out = run_pipeline(runs, uri)
    finally:
        stop.set()
        filler.join()
    assert ballast.is_file(), "the training never wrote a checkpoint:\n" + out[-3000:]
    assert code == 1, out[-3000:]
    return code, out



@pytest.mark.slow
def test_full_disk_during_training_fails_once_and_the_rerun_resumes(small_disk, tmp_path,
                                                                     seed_store, seed_microbench):
    from mlflow.tracking import MlflowClient

    uri = seed_store(tmp_path)
    runs = small_disk / "runs"
    seed_microbench(runs)
    ballast = small_disk / "ballast"
    code, out = run_while_filling(runs, uri, ballast, fill_after_first_checkpoint)
    assert "Traceback" not in out and "Logging error" not in out
    assert len(out.splitlines()) < 60, out[-3000:]  # no flood
    assert "retrying" not in out  # a full disk is not retried
    # the closing report names the cause and the fix, not only an exit code, in a few lines
    report = out[out.index("pipeline failed:"):].splitlines()
    assert len(report) <= 20, report
    assert "train failed: OSError: No space left on device" in report[1], report
    assert "free space or pass another --runs-dir" in report[1], report

    statuses = {s["key"]: s for s in (json.loads(p.read_text())
                                      for p in runs.glob("stages/*/*/status.json"))}
    assert statuses and all(s["state"] != "running" for s in statuses.values())
    failed = [s for s in statuses.values() if s["state"] == "failed"]
    assert len(failed) == 1 and "No space left on device" in failed[0]["error"], failed
    # nothing half-written looks complete: a published stage directory is a finished stage,
    # the failed training stays .partial with its complete checkpoints
    for published in (p for p in runs.glob("stages/*/*") if not p.name.endswith(".partial")):
        assert json.loads((published / "status.json").read_text())["state"] == "succeeded"
    partial = runs / "stages" / "train" / f"{failed[0]['key']}.partial"
    kept = sorted(p.name for p in (partial / "checkpoints").glob("step-*")
                  if not p.name.endswith(".tmp"))
    assert kept, list((partial / "checkpoints").iterdir())
    client = MlflowClient(uri)
    experiment = client.search_experiments()[0]
    found = {r.info.run_name: r.info.status for r in client.search_runs([experiment.experiment_id])}
    assert found and "RUNNING" not in found.values(), found
    assert "FAILED" in found.values(), found

    # space freed: the rerun reuses tokenize and plan and resumes training where it stopped
    ballast.unlink()
    code, out = run_pipeline(runs, uri)
    assert code == 0, out[-3000:]
    resumed = re.search(r"resumed from step (\d+)", out)
    assert resumed, out[-3000:]
    assert int(resumed.group(1)) >= int(kept[-1].split("-")[1]), (resumed.group(0), kept)
    summary = json.loads(next(runs.glob("stages/train/*/summary.json")).read_text())
    assert summary["steps_done"] == STEPS and len(summary["losses"]) == STEPS


@pytest.mark.slow
def test_full_disk_under_the_default_store_fails_once_and_the_rerun_closes_its_runs(
        small_disk, seed_store, seed_microbench):
    from mlflow.tracking import MlflowClient

    from stages.mechanism.open_runs import OPEN_RUNS_DIR, UNCLOSED_SUFFIX

    runs = small_disk / "runs"
    uri = seed_store(runs)  # the default store: <runs dir>/mlflow.db, on the small disk
    seed_microbench(runs)
    ballast = small_disk / "ballast"
    code, out = run_while_filling(runs, None, ballast, fill_and_hold)
    assert "Traceback" not in out and "Logging error" not in out, out[-5000:]
    assert "sqlite3" not in out and "[SQL:" not in out, out[-3000:]  # no SQL error dumps
    assert len(out.splitlines()) < 60, out[-3000:]  # no flood
    assert "retrying" not in out
    # one line names the cause, the store's path and the fix
    store_line = [line for line in out.splitlines()
                  if f"MLflow store {runs / 'mlflow.db'}" in line and line.startswith("[pipeline]")]
    assert len(store_line) == 1, out[-3000:]
    assert "No space left on device" in store_line[0] and "free space" in store_line[0]
    report = out[out.index("pipeline failed:"):].splitlines()
    assert "train failed: OSError: No space left on device" in report[1], report
    # the store took no close: the pipeline run is recorded for the next driver
    unclosed = list((runs / OPEN_RUNS_DIR).glob(f"*{UNCLOSED_SUFFIX}"))
    assert len(unclosed) == 1, list((runs / OPEN_RUNS_DIR).iterdir())
    first_pipeline = unclosed[0].name.removesuffix(UNCLOSED_SUFFIX)

    ballast.unlink()
    code, again = run_pipeline(runs, None)
    assert code == 0, again[-3000:]
    assert "marked FAILED 2 MLflow run(s) an earlier pipeline run" in again, again[-3000:]
    resumed = re.search(r"resumed from step (\d+)", again)
    assert resumed and int(resumed.group(1)) >= 2, again[-3000:]
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("micro")
    found = {r.info.run_id: r for r in client.search_runs([experiment.experiment_id])}
    assert all(r.info.status != "RUNNING" for r in found.values()), \
        {r.info.run_name: r.info.status for r in found.values()}
    assert found[first_pipeline].info.status == "FAILED"
    assert "could not close" in found[first_pipeline].data.tags["error"]
    # the training run the first pipeline left open was closed FAILED, then continued and
    # finished by the rerun, whose pipeline run it now sits under
    train = [r for r in found.values() if r.data.tags.get("stage") == "train"]
    assert len(train) == 1 and train[0].info.status == "FINISHED", train
    assert "could not close" in train[0].data.tags["attempt.1.error"]
    assert not list((runs / OPEN_RUNS_DIR).iterdir())  # every record dealt with
