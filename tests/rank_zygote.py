"""Warm rank launches for the tests: torch and the trainer imported once per pytest worker.

A launch's rank 0 spends about 2.5 CPU seconds importing torch, its DTensor and checkpoint
modules and the trainer before it does anything; the tests launch ranks hundreds of times.
Instead they ask a zygote, an interpreter of their own process that has imported the ranks'
modules and started no thread, to fork the launch (``run_forked``; ``ForkedLocalRanks``
in place of ``stages.mechanism.launch.LocalRanks``; ``train_helpers.run_worker``, ``run_ranks``,
``run_script_ranks`` and ``run_function_ranks`` on top):

- the zygote forks a launch process (its own process group, dying with the zygote), which
  takes the request's environment, working directory and output files (a FIFO for
  ``ForkedLocalRanks``, which streams it as the launcher's pipe);
- for a worker module, the launch process forks rank 0, which runs ``python -m <worker>``'s
  main as ``__main__`` (``runpy``) with the identity variables and rendezvous file the
  local launcher gives it, and forks its peers as under that launcher
  (``stages.mechanism.forked_ranks``); a one-rank launch without identity variables is a plain
  ``python -m <worker>``. For a script, or a function of a test module (called with its
  rank and the request's JSON arguments), it forks one process per identity in the
  request, as ``torchrun --standalone`` gives them (``torchrun_ranks``);
- the launch process ends with the launch's code as a shell reports it; the zygote answers
  with it.

So the ranks, their rendezvous, gloo, their files and exit codes are those of a real local
launch; only the exec of a fresh interpreter is skipped. What the launcher itself does
(streaming, the exit-code mapping, killing) is tested where it is the subject
(``test_forked_ranks.py``, the pipeline and reliability tests). A variable torch or MLflow reads at
import time comes from the zygote's environment (the session's), not the request's.

The zygote is a fork server (``model.parallel.fork_server``, as the rehearsal's rank server
is): its protocol, its death with this process and a launch's with it are that module's.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from model.parallel import fork_server
from stages.mechanism.launch import LocalRanks, RankSpec

REPO = Path(__file__).resolve().parent.parent
# What the workers (``stages.train.worker``, ``eval_worker``, ``measure_worker``) import at
# their top and on their first step; not the workers themselves, which run as ``__main__``.
PRELOAD = ("torch.distributed", "torch.distributed.checkpoint", "model.training.trainer",
           "model.training.checkpoint", "model.training.batches", "model.training.metrics",
           "model.evaluation.generate", "model.training.heldout", "model.parallel.dist_env",
           "model.parallel.layout", "data_prep.atomic", "data_prep.loader", "data_prep.store",
           "stages.config", "stages.mechanism.launch", "stages.mechanism.forked_ranks",
           # the tracked ranks' (the logger rank's and the node sampler's): seconds a launch
           "stages.mechanism.tracking", "mlflow.tracking",
           "mlflow.system_metrics.system_metrics_monitor",
           "mlflow.store.tracking.sqlalchemy_store")


def _launch_process(request: dict[str, Any], outputs: tuple[int, int]) -> None:
    """In the forked launch process: become the launch, fork its processes (rank 0 alone, or
    one per identity in ``request["ranks"]``), end with the launch's code."""
    from stages.mechanism.forked_ranks import launch_code, shell_exit_code
    from stages.mechanism.launch import STACKS_SIGNAL

    os.setpgid(0, 0)
    fork_server.take_request(request["cwd"], request["env"], outputs)
    # The stacks signal is for the ranks (``stacks_then_kill``); its default would end this
    # process, and the ranks with it.
    signal.signal(STACKS_SIGNAL, signal.SIG_IGN)
    running = []
    for identity in request.get("ranks") or [{}]:
        pid = fork_server.fork_child(identity)
        if pid == 0:
            signal.signal(STACKS_SIGNAL, signal.SIG_DFL)
            fork_server.exit_after(lambda: _run_main(request))
        running.append(pid)
    codes = []
    while running:
        pid, status = os.wait()
        running.remove(pid)
        codes.append(shell_exit_code(os.waitstatus_to_exitcode(status)))
        if codes[-1] != 0:  # as torchrun: one failed rank ends the others
            for peer in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(peer, signal.SIGKILL)
    os._exit(launch_code(codes, ok=(0,)))


def _run_main(request: dict[str, Any]) -> None:
    """In a rank: call the function with the rank and the arguments, or run the module as
    ``python -m`` would, or the script as ``python PATH`` would (ended by
    ``fork_server.exit_after``)."""
    import runpy

    if "call" in request:  # a function of a test module, given its rank and JSON arguments
        import importlib
        import json

        module, name = request["call"].split(":")
        function = getattr(importlib.import_module(module), name)
        function(int(os.environ["RANK"]), *json.loads(request["argv"][0]))
    elif "module" in request:
        sys.argv = [request["module"], *request["argv"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [request["path"], *request["argv"]]
        sys.path.insert(0, str(Path(request["path"]).parent))
        runpy.run_path(request["path"], run_name="__main__")


def _open_outputs(request: dict[str, Any]) -> tuple[int, int]:
    """The launch's stdout and stderr, opened in the zygote before the fork: a reader of a
    FIFO sees its writer once the launch's pid is sent."""
    return tuple(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                 for name in ("stdout", "stderr"))


def serve(reply_fd: int) -> None:
    """The zygote: import the ranks' modules, then fork a launch per request."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    fork_server.serve(reply_fd, _launch_process, _open_outputs)


ZYGOTES = "tests.rank_zygote"
"""The zygotes' pool (``fork_server.acquire``)."""


def acquire_zygote() -> fork_server.ForkServer:
    """An idle zygote of this process, marked busy (``fork_server.release`` it after one
    launch); one is started with the ranks' environment when none is idle (launches from
    several threads each get one)."""
    from stages.mechanism.launch import rank_environment

    command = [sys.executable, "-c",
               "import sys; from tests.rank_zygote import serve; serve(int(sys.argv[1]))"]
    return fork_server.acquire(ZYGOTES, lambda: fork_server.ForkServer(
        command, env=rank_environment()))


def start_launch(zygote: fork_server.ForkServer, target: dict[str, Any], argv: list[str],
                 env: dict[str, str], stdout: Path, stderr: Path) -> int:
    """Fork a launch of ``target`` (``{"module": name}``, ``python -m``; or ``{"path":
    script}``, with ``"ranks"``, one identity per process) with ``argv`` and ``env``, its
    output to the two paths; the launch's pid, which is also its process group."""
    return zygote.start({**target, "argv": argv, "env": env, "cwd": str(REPO),
                         "stdout": str(stdout), "stderr": str(stderr)})


def finish_launch(zygote: fork_server.ForkServer) -> int:
    """Wait for the launch; its exit code as a shell reports it (128 + a signal)."""
    from stages.mechanism.forked_ranks import shell_exit_code

    return shell_exit_code(zygote.finish()["code"])


def local_launch_env(env: dict[str, str], nproc: int, store: str) -> dict[str, str]:
    """``env`` with what ``stages.mechanism.launch.LocalRanks`` gives rank 0 of an ``nproc``-rank
    launch: its identity, the rendezvous file ``store``, and the ask to fork its peers."""
    from model.parallel.dist_env import local_rank_variables
    from stages.mechanism.forked_ranks import FORK_PEERS_VAR

    return {**env, **local_rank_variables(0, nproc, store), FORK_PEERS_VAR: "1"}


def stacks_then_kill(pgid: int, grace_s: float = 2.0) -> None:
    """Ask every process of a launch for its Python stacks, then SIGKILL the launch."""
    from stages.mechanism.launch import STACKS_SIGNAL

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, STACKS_SIGNAL)
    time.sleep(grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_forked(target: dict[str, Any], argv: list[str], env: dict[str, str], stdout: Path,
               stderr: Path, timeout: float) -> int:
    """A forked launch (``start_launch``); its exit code. Past ``timeout`` the ranks print
    their stacks to ``stderr``, are killed, and TimeoutError is raised."""
    zygote = acquire_zygote()
    try:
        pgid = start_launch(zygote, target, argv, env, stdout, stderr)
        timed_out = threading.Event()

        def expire() -> None:
            timed_out.set()
            stacks_then_kill(pgid)

        timer = threading.Timer(timeout, expire)
        timer.start()
        try:
            code = finish_launch(zygote)
        finally:
            timer.cancel()
    finally:
        fork_server.release(zygote)
    if timed_out.is_set():
        raise TimeoutError(f"the launch ran past {timeout} s")
    return code


def torchrun_ranks(nproc: int) -> list[dict[str, str]]:
    """The identities ``torchrun --standalone --nproc-per-node nproc`` gives its ranks: they
    meet at a free port of this machine (``init_process_group``'s ``env://``)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
             "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)} for r in range(nproc)]


class _ForkedRankZero:
    """What ``LocalRanks`` keeps of rank 0 (``wait``, ``poll``, ``pid``), for a forked launch."""

    def __init__(self, zygote: fork_server.ForkServer, pid: int) -> None:
        self.pid, self._zygote = pid, zygote
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def wait(self) -> int:
        with self._lock:
            if self.returncode is None:
                try:
                    self.returncode = finish_launch(self._zygote)
                finally:
                    fork_server.release(self._zygote)
            return self.returncode

    def poll(self) -> int | None:
        return self.returncode


class ForkedLocalRanks(LocalRanks):
    """``stages.mechanism.launch.LocalRanks`` with rank 0 forked from a zygote: the same identity
    variables, rendezvous, fork of the peers, process group and merged output (a FIFO in
    place of a pipe); ``kill`` and ``wait`` are LocalRanks' own."""

    def __init__(self, spec_path: str | Path, spec: RankSpec, env: dict[str, str]) -> None:
        import shutil
        import tempfile

        if spec.nodes != 1:
            super().__init__(spec_path, spec, env)  # which refuses it, saying why
        self._rendezvous = tempfile.mkdtemp(prefix="ranks-")
        store = str(Path(self._rendezvous) / "store")
        fifo = Path(self._rendezvous) / "output"
        os.mkfifo(fifo)
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        os.set_blocking(reader, True)
        zygote = acquire_zygote()
        try:
            pid = start_launch(zygote, {"module": spec.worker}, ["--spec", str(spec_path)],
                               local_launch_env(env, spec.nproc, store), fifo, fifo)
        except BaseException:
            fork_server.release(zygote)
            os.close(reader)
            shutil.rmtree(self._rendezvous, ignore_errors=True)
            raise
        self.rank0 = _ForkedRankZero(zygote, pid)
        self.pgid = pid
        self.nproc = spec.nproc
        self.killed_here = False  # as LocalRanks: set by kill()
        self.stdout = open(reader, errors="replace")  # noqa: SIM115 - closed by run_local
