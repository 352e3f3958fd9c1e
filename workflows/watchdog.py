"""A driver's watchdog: when the driver dies without its own shutdown (``kill -9``, the OOM
killer), stop every process of its run on this host and record the run as killed.

The driver's shutdown (``PipelineSession.__exit__``, ``workflows.executors.stop_parsl``)
runs only if the driver lives to run it. Killed outright, it leaves Parsl's interchanges,
the local worker pools, the launcher and the ranks training on with nobody to
wait for them, its MLflow runs RUNNING and its stage ``running`` in ``status.json``.

So the driver exports its run marker (``stages.mechanism.locks.RUN_ENV``: ``<host>:<pid>:<start
time>``) before it starts anything; every process it starts inherits it, and so does
everything those start (environments are inherited, and no launcher here clears it). It
then starts this watchdog in a session of its own (a signal to the driver's process group
does not reach it). The watchdog checks every ``POLL_S`` whether it is still the driver's
child: a dead driver's children are handed to another parent at once, before anyone reaps
the driver. It also notes the driver's descendants every ``SNAPSHOT_S``: a process that
sets its title (Parsl's interchanges, ``setproctitle``) overwrites the memory that
``/proc/<pid>/environ`` shows, so the marker alone does not find it. Once the driver is
gone it

1. sends SIGTERM to every process of this host whose environment carries the marker, to
   the driver's descendants it saw last (still the same processes) and to all their
   descendants, and SIGKILL to those left after ``GRACE_S`` (again, while new ones appear);
2. rewrites to ``failed`` the ``status.json`` of each stage attempt that still says
   ``running`` under a lock of the dead driver (a resumable stage keeps its ``.partial``);
3. marks the driver's parent run and its RUNNING descendant runs KILLED in MLflow;

and exits. It carries the marker itself, so the dead driver's stage locks are not broken
(``stages.mechanism.locks.is_stale``) before all of this is done. A driver that ends by its own
shutdown stops its watchdog (``stop``: SIGTERM, on which it exits at once).

Processes on other hosts (Slurm's compute nodes) are not its business: their worker pools
exit by themselves once the interchange is gone (Parsl's heartbeat), and the job with them.

    python -m workflows.watchdog --driver PID --run MARKER --runs-dir DIR \\
        --tracking-uri URI --parent-run RUN_ID
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from stages.mechanism import locks
from stages.mechanism.launch import project_environment

POLL_S = 0.5  # how often the watchdog looks for its driver
SNAPSHOT_S = 2.0  # how often it notes the driver's descendants
GRACE_S = 5.0  # between SIGTERM and SIGKILL to the run's processes
ROUNDS = 5  # sweeps at most, for processes started while the previous ones were stopped
STOP_WAIT_S = 5.0  # a driver waits this long for its watchdog to exit


def start(runs_dir: Path, tracking_uri: str, parent_run_id: str) -> subprocess.Popen:
    """Start the watchdog of this process (the driver), whose run marker must already be in
    ``os.environ`` (the watchdog inherits it)."""
    command = [sys.executable, "-m", "workflows.watchdog", "--driver", str(os.getpid()),
               "--run", os.environ[locks.RUN_ENV], "--runs-dir", str(Path(runs_dir).resolve()),
               "--tracking-uri", tracking_uri, "--parent-run", parent_run_id]
    return subprocess.Popen(command, env=project_environment(), stdin=subprocess.DEVNULL,
                            start_new_session=True)


def stop(watchdog: subprocess.Popen) -> None:
    """Stop the watchdog of a driver that shuts down by itself (nothing is left to sweep)."""
    if watchdog.poll() is None:
        watchdog.terminate()
    try:
        watchdog.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def descendants(pid: int) -> dict[int, float]:
    """pid -> start time of every descendant of process ``pid`` (empty once it is gone)."""
    found = {}
    try:
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                found[child.pid] = child.create_time()
    except psutil.NoSuchProcess:
        pass
    return found


def run_family(run: str, seen: dict[int, float]) -> list[psutil.Process]:
    """The live processes of ``run`` but this one: those carrying its marker, those of
    ``seen`` (pid -> start time) that still run, and every descendant of either."""
    roots = locks.run_processes(run, exclude=(os.getpid(),))
    for pid, started in seen.items():
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(pid)
            if process.create_time() == started:
                roots.append(process)
    family: dict[int, psutil.Process] = {}
    for root in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            for process in [root, *root.children(recursive=True)]:
                if process.pid != os.getpid() and process.status() != psutil.STATUS_ZOMBIE:
                    family[process.pid] = process
    return list(family.values())


def stop_processes(run: str, seen: dict[int, float] | None = None,
                   grace_s: float = GRACE_S) -> int:
    """SIGTERM the processes of ``run`` on this host (``run_family``), SIGKILL those left after
    ``grace_s``; repeat while new ones appear (a pool replacing its workers). How many."""
    stopped: set[int] = set()
    for _ in range(ROUNDS):
        found = run_family(run, seen or {})
        if not found:
            break
        stopped.update(process.pid for process in found)
        terminate_then_kill(found, grace_s)
    return len(stopped)


def terminate_then_kill(processes: list[psutil.Process], grace_s: float = GRACE_S) -> None:
    """SIGTERM ``processes``, SIGKILL those left after ``grace_s``, and wait for them."""
    for process in processes:
        _signal(process, "terminate")
    _, left = psutil.wait_procs(processes, timeout=grace_s)
    for process in left:
        _signal(process, "kill")
    psutil.wait_procs(left, timeout=grace_s)


def _signal(process: psutil.Process, how: str) -> None:
    try:
        getattr(process, how)()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def fail_running_stages(runs_dir: Path, run: str, reason: str) -> list[Path]:
    """Rewrite to ``failed`` (with ``reason``) each stage attempt's ``status.json`` that says
    ``running`` while its key's lock names ``run``: the attempts the dead driver had open.
    The work directories rewritten."""
    from stages.mechanism import outputs

    failed = []
    for status_path in sorted(runs_dir.glob(f"stages/*/*{outputs.PARTIAL_SUFFIX}/"
                                            f"{outputs.STATUS_FILE}")):
        work = status_path.parent
        status = outputs.read_status(work)
        if not status or status.get("state") != "running":
            continue
        key = work.name[: -len(outputs.PARTIAL_SUFFIX)]
        lock = locks.read(outputs.lock_path(runs_dir, work.parent.name, key))
        if lock is None or lock[0].get("run") != run:
            continue
        outputs.write_status(work, {**status, **outputs.status_record(
            "failed", status["run_id"]), "error": reason})
        failed.append(work)
    return failed


def driver_gone(driver: int) -> bool:
    """Whether the driver has exited: its child (this process) has another parent then."""
    return os.getppid() != driver


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--driver", type=int, required=True, help="the driver's pid")
    parser.add_argument("--run", required=True, help=f"the driver's {locks.RUN_ENV} marker")
    parser.add_argument("--runs-dir", type=Path, required=True)
    parser.add_argument("--tracking-uri", required=True)
    parser.add_argument("--parent-run", required=True, help="the driver's MLflow parent run")
    args = parser.parse_args(argv)
    seen: dict[int, float] = {}
    noted = 0.0
    while not driver_gone(args.driver):
        if time.monotonic() - noted >= SNAPSHOT_S:
            seen, noted = descendants(args.driver) or seen, time.monotonic()
        time.sleep(POLL_S)

    from stages.mechanism import tracking

    # The client (importing mlflow takes seconds) is built while the processes get their grace.
    client: list[Any] = []
    warm = threading.Thread(target=lambda: client.append(tracking.MlflowClient(args.tracking_uri)),
                            daemon=True)
    warm.start()
    say(f"the pipeline driver (pid {args.driver}) died without shutting down: stopping the "
        "processes of its run")
    stopped = stop_processes(args.run, seen)
    reason = (f"the pipeline driver (pid {args.driver}) was killed; its watchdog stopped "
              f"{stopped} processes of the run")
    failed = fail_running_stages(args.runs_dir, args.run, reason)  # local, fast: first
    try:
        warm.join()
        killed = tracking.end_run_tree(args.tracking_uri, args.parent_run, "KILLED", reason,
                                       client=client[0] if client else None)
    except Exception as error:  # noqa: BLE001 - one line, not a traceback nobody reads
        say(f"could not mark the MLflow runs KILLED: {error}")
        killed = []
    say(f"stopped {stopped} processes; {len(failed)} running stages marked failed; "
        f"{len(killed)} MLflow runs KILLED")
    return 0


def say(line: str) -> None:
    """Print to the driver's console, which may be gone (a closed pipe must not stop us)."""
    with contextlib.suppress(OSError):
        print(f"[watchdog] {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
