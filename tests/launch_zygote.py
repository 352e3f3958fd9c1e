"""Warm local launches for a driver the tests fork (``tests.warm_cli``, ``forked_launches``).

The local site starts a ranks stage with the shell command ``exec python -m
stages.mechanism.launch --spec PATH`` (``workflows.ranks.ranks_command``): a fresh launcher
whose rank 0, a fresh interpreter too, imports torch, the trainer and (the logger rank)
MLflow, about 6 CPU seconds a launch before any work. A driver forked from the tests' warm
driver zygote has all of that imported already, so at its start, while it runs no thread,
``start`` forks a launch zygote from it and has its ranks commands run
``python -m tests.launch_client`` in place of the launcher:

- the client (``tests/launch_client.py``, standard library only) sends its argv, directory,
  environment and output streams (``/proc/<client>/fd/1`` and ``2``) to the zygote over a
  Unix socket named by ``SOCKET_VAR``, forwards the signals it gets to the launch, and ends
  as the launch ended (its code; killed by the same signal);
- per connection the zygote forks a handler, which forks the launch: it takes the client's
  directory, environment and streams, shows the launcher's command line as its title and
  runs ``stages.mechanism.launch.main`` with ``RankZeroForkedHere`` as its ``LocalRanks``:
  rank 0 is forked from the launch (warm) instead of started, with the identity, rendezvous
  file, process group and output pipe ``LocalRanks`` gives it, and forks its peers as
  always. The handler kills the launch when the client's connection closes first (a
  client killed by SIGKILL), and sends the launch's exit code back;
- the zygote is in a process group of its own (a signal to the driver's group reaches the
  launch only through the client, as it reaches a launcher only through its shell), and
  dies with the driver; the handlers and launches die with it.

So what the launcher does (streaming the ranks' output, their exit codes, the rank error
file, killing the ranks when it dies) is the real launcher's; only the two execs are
skipped. Tests whose subject is the launch's processes (the driver's signals, orphans) keep
real launchers.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from model.parallel import fork_server
from stages.mechanism.launch import LocalRanks, RankSpec
from tests.launch_client import SOCKET_VAR

CLIENT_MODULE = "tests.launch_client"
LAUNCHER_MODULE = "stages.mechanism.launch"
POLL_S = 0.2


def start() -> None:
    """In a forked driver that runs no thread yet: fork its launch zygote and have its local
    ranks commands use it (``SOCKET_VAR``, ``workflows.ranks.ranks_command``)."""
    import setproctitle

    import workflows.ranks

    path = Path(tempfile.mkdtemp(prefix="launches-")) / "socket"
    atexit.register(shutil.rmtree, path.parent, True)  # the driver ends as an interpreter
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    if fork_server.fork_child() == 0:
        os.setpgid(0, 0)
        setproctitle.setproctitle(f"{sys.executable} -c tests.launch_zygote.serve")
        fork_server.exit_after(lambda: _serve(listener))
    listener.close()
    os.environ[SOCKET_VAR] = str(path)
    real = workflows.ranks.ranks_command

    def ranks_command(cfg: Any, spec: RankSpec, spec_path: str | Path) -> str:
        command = real(cfg, spec, spec_path)
        if cfg.site.name != "local":
            return command
        launcher = f" -m {LAUNCHER_MODULE} --spec "
        assert launcher in command, command
        return command.replace(launcher, f" -m {CLIENT_MODULE} --spec ")

    workflows.ranks.ranks_command = ranks_command


def _serve(listener: socket.socket) -> None:
    """The zygote: a handler forked per connection (they reap themselves)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        conn, _ = listener.accept()
        if fork_server.fork_child() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            fork_server.exit_after(lambda: _handle(conn))
        conn.close()


def _handle(conn: socket.socket) -> None:
    """A handler: fork the client's launch, wait for it (or kill it when the client went
    first), send its exit code."""
    with conn.makefile("r") as reader:
        request = json.loads(reader.readline())
    outputs = fork_server.open_outputs(request)
    pid = fork_server.fork_child()
    if pid == 0:
        conn.close()
        fork_server.exit_after(lambda: _launch(request, outputs))
    for fd in outputs:
        os.close(fd)
    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    while True:
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            break
        readable, _, _ = select.select([conn], [], [], POLL_S)
        if readable and not conn.recv(1):  # the client is gone: so is its launch
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        conn.sendall((json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n").encode())


def _launch(request: dict[str, Any], outputs: tuple[int, ...]) -> None:
    """The launch: the client's context, the launcher's title and main, rank 0 forked."""
    import setproctitle

    import stages.mechanism.launch as launch

    fork_server.take_request(request["cwd"], request["env"], outputs)
    setproctitle.setproctitle(" ".join([sys.executable, "-m", LAUNCHER_MODULE,
                                        *request["argv"]]))
    launch.LocalRanks = RankZeroForkedHere
    sys.argv = [LAUNCHER_MODULE, *request["argv"]]
    sys.exit(launch.main(request["argv"]))


class _ForkedChild:
    """What ``LocalRanks`` keeps of rank 0 (``subprocess.Popen``'s ``pid``, ``returncode``,
    ``poll``, ``wait``) for a child forked by this process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self) -> int:
        code = self._reap(0)
        assert code is not None
        return code


class RankZeroForkedHere(LocalRanks):
    """``LocalRanks`` with rank 0 forked from this process (a launch forked from a warm
    zygote, which runs no thread yet) instead of started: everything else, its identity,
    rendezvous, process group, output pipe, ``kill`` and ``wait``, is LocalRanks' own."""

    def _start_rank0(self, command: list[str], env: dict[str, str],
                     output: int) -> _ForkedChild:
        import runpy

        import setproctitle

        from stages.mechanism.launch import REPO_ROOT

        pid = fork_server.fork_child()  # dies with this process, as LocalRanks' rank 0
        if pid == 0:
            os.setpgid(0, 0)
            fork_server.take_request(str(REPO_ROOT), env, (output, output))
            setproctitle.setproctitle(" ".join(command))  # python -m <worker> --spec PATH
            worker = command[2]
            sys.argv = [worker, *command[3:]]
            fork_server.exit_after(lambda: runpy.run_module(worker, run_name="__main__",
                                                            alter_sys=True))
        with contextlib.suppress(OSError):  # as the child does: before anyone signals it
            os.setpgid(pid, pid)
        return _ForkedChild(pid)
