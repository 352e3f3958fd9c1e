"""A killed training resumes: on the next invocation, and within a run by a retry.

The whole pipeline runs as the command-line user runs it (``python -m workflows.pipeline``
with Parsl, the local launcher's gloo ranks and the SQLite MLflow store), each in a runs dir of its
own. One training rank is killed with SIGKILL once a checkpoint at step >= KILL_AFTER is on
disk; the resumed training must end with exactly the losses of an uninterrupted run, and its
whole history must be in one MLflow run: each step's loss once, the attempts in its tags.

The helpers here (starting the driver, finding its ranks, reading checkpoints) are shared
with ``test_interrupt``.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests import warm_cli

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/micro.yaml"
STEPS = 80  # long enough that a kill after step KILL_AFTER lands well before the end
CHECKPOINT_EVERY = 10
KILL_AFTER = 20
TRAINING = (f"train.steps={STEPS}", f"train.checkpoint_every={CHECKPOINT_EVERY}")
STEP_DIR = re.compile(r"^step-(\d+)$")
RANK_MODULE = "stages.train.worker"
PIPELINE_TIMEOUT_S = 300

pytestmark = pytest.mark.slow


@dataclass
class Driver:
    """One ``python -m workflows.pipeline`` process; its console goes to ``log``."""

    proc: warm_cli.WarmProcess
    runs: Path
    log: Path

    def wait(self, timeout: float = PIPELINE_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the pipeline ran over {timeout} s:\n{self.console()[-4000:]}")

    def console(self) -> str:
        return self.log.read_text(errors="replace")


def start_pipeline(runs: Path, *overrides: str, new_session: bool = False,
                   forked_launches: bool = False) -> Driver:
    """Start the pipeline CLI on configs/micro.yaml in ``runs`` (console to a file);
    ``forked_launches``: its launches forked warm (``tests.launch_zygote``), for a test
    whose subject is not the launch's processes."""
    runs.mkdir(parents=True, exist_ok=True)
    log = runs.parent / f"{runs.name}-console-{time.monotonic_ns()}.txt"
    argv = ["--config", CONFIG, "--runs-dir", str(runs), "--set", *overrides]
    with open(log, "w") as console:
        proc = warm_cli.WarmProcess("workflows.pipeline", argv, cwd=REPO, env=dict(os.environ),
                                    stdout=console, stderr=subprocess.STDOUT,
                                    start_new_session=new_session,
                                    forked_launches=forked_launches)
    return Driver(proc, runs, log)


def stop(started: list[Driver]) -> None:
    """Stop drivers still running (SIGTERM, then SIGKILL) and every process of their runs dirs."""
    for driver in started:
        if driver.proc.poll() is None:
            driver.proc.send_signal(signal.SIGTERM)
            try:
                driver.proc.wait(30)
            except subprocess.TimeoutExpired:
                driver.proc.kill()
                driver.proc.wait()
        for proc in processes_of(driver.runs):
            proc.kill()


@pytest.fixture
def drivers() -> Iterator[list[Driver]]:
    """Drivers a test starts; any still running at its end are stopped with their processes."""
    started: list[Driver] = []
    yield started
    stop(started)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def processes_of(runs: Path) -> list[psutil.Process]:
    """Live processes whose command line names a path inside ``runs`` (not zombies)."""
    inside = f"{runs}{os.sep}"
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid() or not any(inside in arg for arg in _cmdline(proc)):
            continue
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.NoSuchProcess:
            pass
    return found


def runs_module(runs: Path, module: str) -> list[psutil.Process]:
    """The processes of ``runs`` started as ``python [-u] -m <module>``."""
    found = []
    for proc in processes_of(runs):
        args = _cmdline(proc)
        if "-m" in args and args.index("-m") + 1 < len(args) and \
                args[args.index("-m") + 1] == module:
            found.append(proc)
    return found


def ranks_of(runs: Path) -> list[psutil.Process]:
    """The training ranks (stages.train.worker processes) of ``runs``."""
    return runs_module(runs, RANK_MODULE)


def checkpoints(runs: Path) -> dict[int, Path]:
    """step -> complete checkpoint directory, over every train attempt of ``runs``."""
    found = {}
    for path in (runs / "stages" / "train").glob("*.partial/checkpoints/step-*"):
        match = STEP_DIR.match(path.name)
        if match:
            found[int(match.group(1))] = path
    return found


def poll(what: str, check: Callable[[], object], driver: Driver, timeout: float = 240,
         every: float = 0.05) -> object:
    """Call ``check`` until it returns something truthy; fail if the driver exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if driver.proc.poll() is not None:
            raise AssertionError(f"the pipeline exited ({driver.proc.returncode}) before "
                                 f"{what}:\n{driver.console()[-4000:]}")
        time.sleep(every)
    raise AssertionError(f"no {what} within {timeout} s:\n{driver.console()[-4000:]}")


def kill_rank_after_checkpoint(driver: Driver, step: int = KILL_AFTER) -> int:
    """SIGKILL one training rank once a complete checkpoint at >= ``step`` exists.

    Returns the newest checkpointed step seen just before the kill."""
    ranks: list[psutil.Process] = []

    def ready() -> int:
        ranks[:] = ranks or ranks_of(driver.runs)
        done = max(checkpoints(driver.runs), default=0)
        return done if done >= step and ranks else 0

    seen = int(poll(f"a checkpoint at step >= {step}", ready, driver))
    ranks[0].send_signal(signal.SIGKILL)
    assert seen < STEPS, f"training finished (step {seen}) before a rank could be killed"
    return seen


def published_summary(runs: Path) -> dict:
    """The summary.json of the published (succeeded) train stage of ``runs``."""
    found = [p for p in (runs / "stages" / "train").glob("*/summary.json")
             if not p.parent.name.endswith(".partial")]
    assert len(found) == 1, f"expected one published train stage, found {found}"
    return json.loads(found[0].read_text())


def assert_one_train_run(runs: Path, key: str, losses: list[float]) -> None:
    """The store of ``runs`` holds one train run for ``key``, FINISHED under the newest
    pipeline run, whose "loss" history has each step 1..len(losses) once with ``losses``; its
    ``attempts`` tags name each pipeline run (oldest first) that worked on it."""
    from stages.mechanism import tracking, tracking_store

    uri = tracking_store.default_tracking_uri(runs)
    every = tracking.search_runs(uri, "micro")
    parents = [r.info.run_id for r in reversed(every)
               if tracking.MLFLOW_PARENT_RUN_ID not in r.data.tags]  # oldest first
    trains = [r for r in every if r.data.tags.get("stage") == "train"]
    assert [r.data.tags.get("stage_key") for r in trains] == [key], (
        f"expected one train run for {key}, found "
        f"{[(r.info.run_id, r.info.status, r.data.tags.get('stage_key')) for r in trains]}")
    (run,) = trains
    tags = run.data.tags
    assert run.info.status == "FINISHED", run.info.status
    assert tags[tracking.MLFLOW_PARENT_RUN_ID] == parents[-1], "not under the run that finished it"
    assert tags["attempts"] == str(len(parents)), tags
    assert [tags[f"attempt.{n}.parent_run_id"] for n in range(1, len(parents) + 1)] == parents
    assert "error" not in tags, tags["error"]
    history = sorted(tracking.metric_history(uri, run.info.run_id, "loss"))
    assert [step for step, _ in history] == list(range(1, len(losses) + 1)), (
        "the loss history misses or repeats steps")
    assert [value for _, value in history] == losses


def train_key(console: str) -> str:
    """The train stage's key: in the DAG the driver printed, or, when the DAG shows it
    pending (it hashes an upstream's output), where its attempt began."""
    match = re.search(r"^  train +key ([0-9a-f]{16})", console, re.MULTILINE) or re.search(
        r"\[stage\] train key ([0-9a-f]{16}): computing", console)
    assert match, f"the console shows no train key:\n{console[-4000:]}"
    return match.group(1)


def resumed_step(console: str) -> int:
    """The step the trainer said it resumed from (the driver tails the ranks' log)."""
    match = re.search(r"resumed from step (\d+)", console)
    assert match, f"the console does not say the training resumed:\n{console[-4000:]}"
    return int(match.group(1))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory,
              seed_microbench: Callable[[Path], Path],
              seed_store: Callable[[Path], str]) -> Iterator[Callable[[], list[float]]]:
    """An uninterrupted run of the same training in a runs dir of its own, started at once
    in the background; calling the fixture's value waits for it and returns its losses."""
    runs = tmp_path_factory.mktemp("reference") / "runs"
    seed_microbench(runs)
    seed_store(runs)
    driver = start_pipeline(runs, *TRAINING, "site.retries=0", forked_launches=True)
    losses: list[list[float]] = []

    def result() -> list[float]:
        if not losses:
            code = driver.wait()
            assert code == 0, f"the reference run failed ({code}):\n{driver.console()[-4000:]}"
            losses.append(published_summary(runs)["losses"])
        return losses[0]

    yield result
    if driver.proc.poll() is None:
        driver.proc.kill()
        driver.proc.wait()
    for proc in processes_of(runs):
        proc.kill()


def test_rerun_resumes_a_killed_training_with_identical_losses(
    tokenized_runs_dir: Path, drivers: list[Driver], reference: Callable[[], list[float]]
) -> None:
    runs_dir = tokenized_runs_dir  # tokenize reused: training starts sooner
    overrides = (*TRAINING, "site.retries=0")
    drivers.append(start_pipeline(runs_dir, *overrides, forked_launches=True))
    first = drivers[-1]
    kill_rank_after_checkpoint(first)
    code = first.wait()
    console = first.console()
    assert code == 1, f"a killed rank must fail the pipeline, got exit {code}:\n{console}"
    assert "pipeline failed:" in console and "train failed:" in console, console[-4000:]
    kept = checkpoints(runs_dir)
    assert max(kept, default=0) >= KILL_AFTER, f"the failed attempt kept {sorted(kept)}"
    status = json.loads(next(iter(kept.values())).parent.parent.joinpath(
        "status.json").read_text())
    assert status["state"] == "failed"

    drivers.append(start_pipeline(runs_dir, *overrides, forked_launches=True))
    second = drivers[-1]
    code = second.wait()
    console = second.console()
    assert code == 0, f"the rerun failed ({code}):\n{console[-4000:]}"
    assert train_key(console) == train_key(first.console()), (
        "the train key changed between the two runs: the code changed under the test")
    assert resumed_step(console) >= KILL_AFTER
    losses = published_summary(runs_dir)["losses"]
    assert len(losses) == STEPS
    assert losses == reference(), "the resumed training's losses differ from an uninterrupted run"
    assert "attempt 2 continues MLflow run" in console, console[-4000:]
    assert_one_train_run(runs_dir, train_key(console), reference())


def test_retry_resumes_a_killed_rank_within_the_run(
    tokenized_runs_dir: Path, drivers: list[Driver], reference: Callable[[], list[float]]
) -> None:
    runs_dir = tokenized_runs_dir  # tokenize reused: training starts sooner
    drivers.append(start_pipeline(runs_dir, *TRAINING,  # site.retries: the default, 1
                                  forked_launches=True))
    driver = drivers[-1]
    kill_rank_after_checkpoint(driver)
    code = driver.wait()
    console = driver.console()
    assert code == 0, f"the retried run failed ({code}):\n{console[-4000:]}"
    assert re.search(r"\[pipeline\] ranks_app failed on attempt 1 \(.*\); retrying$", console,
                     re.MULTILINE), console[-4000:]
    assert resumed_step(console) >= KILL_AFTER
    assert published_summary(runs_dir)["losses"] == reference()
    assert_one_train_run(runs_dir, train_key(console), reference())


def test_a_resumable_stage_continues_its_run_and_counts_the_attempts(tmp_path: Path) -> None:
    """The stage mechanism alone (no ranks): a resumable stage that failed is continued by
    the next pipeline run in the same MLflow run, which moves under it and keeps the error."""
    from stages.config import load_config
    from stages.mechanism import tracking, tracking_store
    from stages.mechanism.attempt import PipelineContext
    from stages.mechanism.walk import run_stage
    from tests.stagekit import declare

    uri = tracking_store.default_tracking_uri(tmp_path)
    experiment = tracking.ensure_experiment(uri, "test", tmp_path)
    stage, cfg = declare("resumable", resumable=True), load_config()

    def pipeline(fail: bool) -> PipelineContext:
        ctx = PipelineContext(str(tmp_path), uri, experiment,
                              tracking.start_run(uri, experiment, "pipeline"), "1.0")

        def run(cfg, inputs, out_dir, tracker):
            if fail:
                raise RuntimeError("boom")
            return {}

        work = type("Work", (), {"run": staticmethod(run)})
        try:
            run_stage(ctx, stage, cfg, {}, work=work)
        except RuntimeError:
            assert fail
        return ctx

    first, second = pipeline(fail=True), pipeline(fail=False)
    (run,) = [r for r in tracking.search_runs(uri, "test")
              if r.data.tags.get("stage") == "resumable"]
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags[tracking.MLFLOW_PARENT_RUN_ID] == second.parent_run_id
    assert (tags["attempts"], tags["attempt.1.parent_run_id"], tags["attempt.2.parent_run_id"]) \
        == ("2", first.parent_run_id, second.parent_run_id)
    assert "boom" in tags["attempt.1.error"] and "error" not in tags
