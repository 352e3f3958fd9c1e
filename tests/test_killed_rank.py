"""A rank killed by a signal is named as the cause: the launch reports "rank N was killed by
signal 9 (SIGKILL)" and exits 128 + 9, ahead of the gloo errors of the peers that failed
because it was gone (real local launches of real gloo ranks)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stages.mechanism.launch import REPO_ROOT, RanksFailed, RankSpec, read_killed_rank, run_local

pytestmark = pytest.mark.slow  # a few gloo ranks


def _spec(tmp_path: Path, victim: int, nproc: int = 3) -> Path:
    spec = RankSpec(worker="tests.killed_rank_worker", nproc=nproc, nodes=1,
                    out_dir=str(tmp_path), config={}, extra={"victim": victim}, timeout_s=120)
    return spec.write(tmp_path / "spec.json")


@pytest.mark.parametrize("victim", [1, 2])
def test_a_killed_peer_is_named_before_the_ranks_that_failed_after_it(tmp_path, victim):
    # The launcher's command, as the local ranks app runs it: its output is the ranks' log.
    proc = subprocess.run([sys.executable, "-m", "stages.mechanism.launch", "--spec",
                           str(_spec(tmp_path, victim))], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    log = tmp_path / "ranks.log"
    log.write_text(proc.stdout + proc.stderr)
    said = f"rank {victim} was killed by signal 9 (SIGKILL)"
    assert proc.returncode == 128 + 9, log.read_text()[-3000:]
    assert read_killed_rank(log).startswith(said)  # what the driver reports for the stage
    lines = proc.stdout.splitlines()
    named = next(i for i, line in enumerate(lines) if said in line)
    # rank 0 (the launch's own) waits to see a peer killed before printing its traceback
    own = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    assert own and all(named < i for i in own), proc.stdout[-3000:]
    # the launcher's verdict: the killed rank first, then the output it failed with
    assert f"[launch] stage ranks failed (exit 137): {said}" in proc.stderr.replace(
        tmp_path.name, "stage")


def test_run_local_raises_with_the_killed_rank_first(tmp_path):
    with pytest.raises(RanksFailed) as failed:
        run_local(_spec(tmp_path, victim=1, nproc=2), echo=False)
    assert failed.value.exit_code == 137 and failed.value.user_error is None
    assert str(failed.value).startswith(
        "stage ranks failed (exit 137): rank 1 was killed by signal 9 (SIGKILL)")


def test_a_lone_killed_rank_is_named_without_peers(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "stages.mechanism.launch", "--spec",
                           str(_spec(tmp_path, victim=0, nproc=1))], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 128 + 9, proc.stderr[-3000:]
    assert "rank 0 was killed by signal 9 (SIGKILL) (a killed rank" in proc.stderr, proc.stderr
    assert "other ranks" not in proc.stderr, proc.stderr


def test_rank_main_ends_the_group_a_worker_left_open(tmp_path):
    """A gloo thread still releasing the last collective's tensors while the interpreter
    finalizes aborts the rank (exit 134, "terminate called without an active exception"):
    rank_main destroys the group a successful worker left open, in this process."""
    import torch.distributed as dist

    from stages.mechanism.launch import rank_main
    from tests import killed_rank_worker

    spec = _spec(tmp_path, victim=-1, nproc=1)
    seen: list[bool] = []

    def run(spec: RankSpec) -> None:
        killed_rank_worker.run(spec)  # joins a group, all-reduces twice, leaves it open
        seen.append(dist.is_initialized())

    code = rank_main("test", run, ["--spec", str(spec)])
    assert (code, seen, dist.is_initialized()) == (0, [True], False)
