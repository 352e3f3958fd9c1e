"""The micro pipeline with ``--site slurm`` on the local Slurm cluster (.ci/start_slurm.sh),
and the helpers the Slurm tests share (starting the driver, reading Parsl's blocks and
Slurm's records).

Training runs as 2 gloo ranks launched by srun inside a Slurm job that Parsl's SlurmProvider
submits for the MPIExecutor. The first test kills the driver mid-training and checks that
the training job ends by itself. The second measures the plan stage's candidates as ranks
in an allocation. A whole pipeline on the cluster, every stage checked, is
``test_slurm_multinode.py``'s; a cancelled training job and a lost node, each retried in a
new job, ``test_slurm_node_loss.py``'s.
"""
from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stages.mechanism import tracking, tracking_store
from tests import warm_cli
from tests.test_slurm_launch import SLURM_DIR, slurm_env  # noqa: F401 - fixture

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# A cancelled job is noticed within 30 s (heartbeat and job polling), yet a worker starved
# on a busy 2-core box is not mistaken for a lost one.
SLURM_SETTINGS = ["site.walltime=00:15:00", "site.heartbeat_threshold=30", "site.retries=1"]


@contextlib.contextmanager
def watching(target: Callable[..., None], *args: Any) -> Iterator[dict]:
    """Run ``target(*args, found, stop)`` in a thread while the block runs; yield ``found``
    (what the watcher saw) and stop and join the thread on the way out. A watcher that
    raised fails the test with its own error, not with an empty ``found``."""
    found: dict = {}
    stop = threading.Event()
    raised: list[BaseException] = []

    def watch() -> None:
        try:
            target(*args, found, stop)
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=watch)
    thread.start()
    try:
        yield found
    finally:
        stop.set()
        thread.join()
    if raised:
        raise raised[0]


def glob_settled(root: Path, pattern: str) -> list[Path]:
    """``root.glob(pattern)`` taken again while a directory it walks is renamed or removed
    under it (a checkpoint or a stage's work directory published, an old checkpoint pruned),
    which pathlib reports as FileNotFoundError."""
    while True:
        try:
            return sorted(root.glob(pattern))
        except FileNotFoundError:
            time.sleep(0.05)


def complete_checkpoints(runs_dir: Path) -> list[Path]:
    """The training's complete checkpoints so far (``step-N.tmp`` is renamed ``step-N`` once
    its manifest is written), oldest first."""
    manifests = glob_settled(runs_dir, "stages/train/*/checkpoints/step-*/manifest.json")
    return [p.parent for p in manifests if not p.parent.name.endswith(".tmp")]


def start_cli(runs_dir: Path, *overrides: str) -> warm_cli.WarmProcess:
    argv = ["--config", "micro", "--runs-dir", str(runs_dir), "--site", "slurm",
            "--set", *SLURM_SETTINGS, *overrides]
    with open(runs_dir.parent / f"{runs_dir.name}-driver.log", "w") as log:
        # The child keeps its own copy of the file descriptor.
        return warm_cli.WarmProcess("workflows.pipeline", argv, cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT)


def wait_cli(proc: warm_cli.WarmProcess, runs_dir: Path, timeout: float) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    output = (runs_dir.parent / f"{runs_dir.name}-driver.log").read_text()
    assert proc.returncode == 0, f"pipeline failed ({proc.returncode}):\n{output[-5000:]}"
    return output


def block_jobs(runs_dir: Path, label: str) -> dict[str, str]:
    """Block number -> Slurm job id of this run's blocks of executor ``label`` (from Parsl's
    log)."""
    jobs = {}
    pattern = rf"\[Scaling executor {label}\] Launched block (\d+) with job ID (\d+)"
    for log in glob_settled(runs_dir, "parsl/**/parsl.log"):  # parsl/<driver>/<run>/parsl.log
        for block, job in re.findall(pattern, log.read_text()):
            jobs[block] = job
    return jobs


def train_block_jobs(runs_dir: Path) -> dict[str, str]:
    """Block number -> Slurm job id of this run's training blocks."""
    return block_jobs(runs_dir, "train")


def jobcomp_states() -> dict[str, tuple[str, str]]:
    """Job id -> (name, state) for every finished job, as recorded by slurmctld."""
    return {job: (name, state) for job, (name, state, _, _) in jobcomp_records().items()}


def jobcomp_records() -> dict[str, tuple[str, str, str, str]]:
    """Job id -> (name, state, start, end) for every finished job, as recorded by slurmctld
    (times as ISO 8601 text, which sorts in time order)."""
    out = subprocess.run(["sacct", "-c", "--noheader", "-P", "-o",
                          "JobID,JobName,State,Start,End"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    return {row[0]: (row[1], row[2], row[3], row[4]) for row in rows}


def srun_steps(job_id: str) -> list[str]:
    """Steps slurmd launched for a job (each srun inside the job is one step)."""
    # One slurmd log per node (slurmd.log on one node, slurmd-<node>.log on several).
    logs = "".join(p.read_text() for p in sorted((SLURM_DIR / "log").glob("slurmd*.log")))
    return sorted(set(re.findall(rf"launch task StepId={job_id}\.(\d+)", logs)))


def pipeline_stage_runs(runs_dir: Path) -> tuple[list, dict]:
    uri = tracking_store.default_tracking_uri(runs_dir)
    runs = tracking.search_runs(uri, "micro")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in parents]
    children = {r.data.tags["stage"]: r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    return parents, children


def train_summary(runs_dir: Path) -> tuple[Path, dict]:
    summaries = sorted(runs_dir.rglob("summary.json"))
    train = [p for p in summaries if (p.parent / "checkpoints").is_dir()]
    assert len(train) == 1, summaries
    return train[0].parent, json.loads(train[0].read_text())


def wait_for_slurm_to_finish(job_ids: list[str], timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(j in jobcomp_states() for j in job_ids):
            return
        time.sleep(1)


@pytest.mark.timeout(900)
def test_a_killed_driver_leaves_no_training_job(slurm_env, tokenized_runs_dir):  # noqa: F811
    """kill -9 of the driver mid-training: the training job ends by itself. The driver's
    watchdog stops the interchanges on this machine; the block's worker pool on the compute
    node misses their heartbeat for ``site.heartbeat_threshold`` seconds and exits, and the
    job with it (the ranks are its srun step)."""
    runs_dir = tokenized_runs_dir
    threshold = 10
    # A progress line every 200 steps (a tenth of the run), the first within seconds; the
    # rest of the run is ~10x longer than the wait for that line.
    proc = start_cli(runs_dir, "train.steps=2000", "train.checkpoint_every=0",
                     f"site.heartbeat_threshold={threshold}")
    log = runs_dir.parent / f"{runs_dir.name}-driver.log"
    try:
        deadline = time.time() + 600
        while "[train] step" not in log.read_text():  # the ranks train in the block's job
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        jobs = train_block_jobs(runs_dir)
        assert list(jobs) == ["0"], jobs
        assert jobs["0"] not in jobcomp_states()  # running when the driver dies
        proc.kill()
        proc.wait()
        killed = time.time()
        wait_for_slurm_to_finish([jobs["0"]], timeout=threshold + 120)
        assert jobs["0"] in jobcomp_states(), "the training job outlived its driver"
        print(f"job {jobs['0']} ended {time.time() - killed:.0f} s after the driver's kill")
    finally:
        for job in train_block_jobs(runs_dir).values():  # a failed test leaves none behind
            subprocess.run(["scancel", job], timeout=30, check=False)


@pytest.mark.timeout(900)
def test_measured_refinement_runs_its_candidates_as_ranks_in_an_allocation(
        slurm_env, tokenized_runs_dir):  # noqa: F811
    """parallel.refine_top_k=2 on 2 nodes: the search in the driver's apps, then each
    candidate measured as the plan's 2 ranks, one on each node, one srun step after the
    other in one Slurm job of the plan stage's own; none runs outside an allocation."""
    if int(slurm_env.get("FRONTIER_LLM_SLURM_NODES", "1")) < 2:
        pytest.skip(f"the Slurm cluster in {SLURM_DIR} has one node: start a multi-node one "
                    "with .ci/start_slurm.sh --nodes 2")
    runs_dir = tokenized_runs_dir
    proc = start_cli(runs_dir, "parallel.refine_top_k=2", "parallel.nodes=2",
                     f"site.address={slurm_env['FRONTIER_LLM_SLURM_LOGIN_ADDR']}",
                     "--only", "plan")
    output = wait_cli(proc, runs_dir, timeout=840)
    jobs = block_jobs(runs_dir, "plan")
    assert list(jobs) == ["0"], (jobs, output[-3000:])
    wait_for_slurm_to_finish([jobs["0"]])
    assert srun_steps(jobs["0"]) == ["0", "1"]  # one step per measured plan
    for node_log in sorted((SLURM_DIR / "log").glob("slurmd-*.log")):  # each node ran both
        launched = set(re.findall(rf"launch task StepId={jobs['0']}\.(\d+)", node_log.read_text()))
        assert launched == {"0", "1"}, (node_log.name, launched)
    _, children = pipeline_stage_runs(runs_dir)
    plan_run = children["plan"]
    assert plan_run.info.status == "FINISHED"
    assert plan_run.data.metrics["measured_tokens_per_s"] > 0
    outputs = json.loads(next(runs_dir.glob("stages/plan/*/outputs.json")).read_text())
    records = json.loads(Path(outputs["measured"]).read_text())
    assert [r["ok"] for r in records] == [True, True], records
    assert max(r["tokens_per_s"] for r in records) == pytest.approx(
        outputs["predictions"]["measured_tokens_per_s"])
