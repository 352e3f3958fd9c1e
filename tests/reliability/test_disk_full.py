"""A disk that fills during training: one clear message, the stage and its MLflow runs marked
failed, no flood, no retry; once space is freed, the rerun resumes from the last complete
checkpoint.

The runs dir lives on a small tmpfs (mounting needs root, as in CI); the MLflow store lives
elsewhere so that the test can read what was recorded. Once the training has written its
first complete checkpoint, a ballast file takes the rest of the disk, as another job writing
to the same file system would.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

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


def run_pipeline(runs: Path, uri: str) -> tuple[int, str]:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "workflows.pipeline", "--config", "configs/micro.yaml",
             "--runs-dir", str(runs), "--tracking-uri", uri, *SETTINGS],
            cwd=REPO, capture_output=True, text=True, timeout=400, check=False,
        )
    except subprocess.TimeoutExpired as hung:  # show where it stopped, not only that it did
        said = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                       for part in (hung.stdout, hung.stderr))
        pytest.fail(f"the pipeline did not end within 400 s; it said:\n{said[-5000:]}")
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_full_disk_during_training_fails_once_and_the_rerun_resumes(small_disk, tmp_path,
                                                                     seed_store, seed_microbench):
    from mlflow.tracking import MlflowClient

    uri = seed_store(tmp_path)
    runs = small_disk / "runs"
    seed_microbench(runs)
    ballast = small_disk / "ballast"
    stop = threading.Event()
    filler = threading.Thread(target=fill_after_first_checkpoint, args=(runs, ballast, stop))
    filler.start()
    try:
        code, out = run_pipeline(runs, uri)
    finally:
        stop.set()
        filler.join()
    assert ballast.is_file(), "the training never wrote a checkpoint:\n" + out[-3000:]
    assert code == 1, out[-3000:]
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
