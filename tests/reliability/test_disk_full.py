"""A full disk: the stage is marked failed, MLflow runs end FAILED, one clear message, no flood.

The runs dir lives on a 4 MB tmpfs (mounting needs root, as in CI); the MLflow store lives
elsewhere so that the test can read what was recorded.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root (CI runs as root)")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_full_disk_fails_once_with_one_clear_message(small_disk, tmp_path, seed_store):
    from mlflow.tracking import MlflowClient

    uri = seed_store(tmp_path)
    runs = small_disk / "runs"
    proc = subprocess.run(
        [sys.executable, "-m", "workflows.pipeline", "--config", "configs/micro.yaml",
         "--runs-dir", str(runs), "--tracking-uri", uri],
        cwd=REPO, capture_output=True, text=True, timeout=400, check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "No space left on device" in out and "free space or pass another --runs-dir" in out
    assert "Traceback" not in out and "Logging error" not in out
    assert len(out.splitlines()) < 60, out[-3000:]  # no flood
    assert "retrying" not in out  # a full disk is not retried
    statuses = [json.loads(p.read_text()) for p in runs.glob("stages/*/*/status.json")]
    assert statuses and all(s["state"] != "running" for s in statuses)
    assert any(s["state"] == "failed" and "No space left" in s["error"] for s in statuses)
    # nothing half-written looks complete: a published stage directory is a finished stage
    # (the disk fills where it fills), the failed one stays .partial
    failed = [s for s in statuses if s["state"] == "failed"]
    for published in (p for p in runs.glob("stages/*/*") if not p.name.endswith(".partial")):
        assert json.loads((published / "status.json").read_text())["state"] == "succeeded"
    assert all(list(runs.glob(f"stages/*/{s['key']}.partial")) for s in failed)
    client = MlflowClient(uri)
    experiment = client.search_experiments()[0]
    found = {r.info.run_name: r.info.status for r in client.search_runs([experiment.experiment_id])}
    assert found and "RUNNING" not in found.values(), found
