"""Forked processes: ``fork_child``, the one way a rank process is made from a warm
interpreter, and the fork server, a warm interpreter that forks a process per request
(``serve`` on its side, ``ForkServer`` and ``acquire`` on its caller's).

``fork_child`` makes every forked rank: the local launcher's ranks 1 .. n-1, forked by rank 0
(``stages.mechanism.forked_ranks.fork_peers``), the tests' zygote's launches and their
ranks (``tests/rank_zygote.py``), the launches of the tests' forked drivers and their rank
0 (``tests/launch_zygote.py``), and the rehearsal's rank processes
(``model.rehearsal.rank_server``). What a fork server's processes do differs; how they
start, with their identity, and die with their parent is this one function.

Starting an interpreter for a rank costs seconds of imports (torch, DTensor, the trainer)
before it does anything. A fork server is an interpreter that has imported what its
processes need, and started no thread, then forks one process per request; each process
costs its work. The rehearsal's rank server (``model.rehearsal.rank_server``) is one, the
tests' rank zygote (``tests/rank_zygote.py``) another, and the tests' driver zygote
(``tests/warm_cli.py``, whose processes are pipeline command lines, not ranks) a third;
a driver it forks may fork a launch zygote of its own (``tests/launch_zygote.py``, requests
over a Unix socket from its ranks commands). They differ in what a process does, not in how
it starts and is reported.

- A request is one JSON line on the server's stdin. The server answers on the pipe whose
  descriptor is its command's last argument: ``{"pid": <pid>}`` once the process is forked,
  ``{"code": <exit code, negative for a signal>, "maxrss_kb": <its peak resident memory>}``
  once it ended. One request at a time: a busy server's caller acquires another.
- The server dies with its caller, and a process it forks with the server (parent-death
  signals): a killed caller leaves nothing behind.
- A forked process ends through ``exit_after``: its code (0, ``SystemExit``'s, or 1 with the
  traceback printed as the interpreter prints it), its streams flushed, never returning into
  the server's loop; or, for a program run as the interpreter's main one (``serve`` with no
  ``run``), as that interpreter ends.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from model.parallel.parent_death import arm_parent_death_signal, die_with_parent

REPO = Path(__file__).resolve().parents[2]


def flush_streams() -> None:
    """Flush stdout and stderr (before a fork or an ``os._exit``), whatever state they are in."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def fork_child(identity: Mapping[str, str] | None = None) -> int:
    """Fork this process: the child's pid in the parent, 0 in the child, as ``os.fork``.

    The streams are flushed first (else the child prints again what the parent had
    buffered). The child takes ``identity`` into its environment (a rank's variables) and
    dies with its parent (parent-death signal; it exits at once when the parent died before
    the signal was armed), so no forked process outlives the one that forked it. Fork only
    from a process that runs no other thread: a thread is lost in the child."""
    flush_streams()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        if identity:
            os.environ.update(identity)
        arm_parent_death_signal()
        if os.getppid() != parent:
            os._exit(1)
    return pid


def exit_after(body: Callable[[], Any]) -> NoReturn:
    """Run ``body`` in a forked process, then end the process: code 0, the code of a
    ``SystemExit`` it raised, or 1 with any other exception's traceback on stderr."""
    code = 1
    try:
        body()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # what the interpreter prints for an uncaught exception
        import traceback

        traceback.print_exc()
    finally:
        flush_streams()
        os._exit(code)


def open_outputs(request: Mapping[str, Any]) -> tuple[int, int]:
    """A request's ``stdout`` and ``stderr`` paths opened for appending (in the server, before
    the fork: a caller's file or ``/proc/<caller>/fd/N``), for ``take_request``."""
    return tuple(os.open(request[name], os.O_WRONLY | os.O_APPEND)
                 for name in ("stdout", "stderr"))


def take_request(cwd: str, env: Mapping[str, str], outputs: tuple[int, int]) -> None:
    """In a forked process: take the request's working directory and environment, stdin
    ``/dev/null`` (not the server's request pipe), and ``outputs`` (descriptors the server
    opened) as stdout and stderr."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, out in zip((1, 2), outputs):
        os.dup2(out, fd)
    for out in set(outputs) - {0, 1, 2}:
        os.close(out)


def serve(reply_fd: int, run: Callable[[dict[str, Any], tuple[int, ...]], Any] | None,
          open_fds: Callable[[dict[str, Any]], tuple[int, ...]] | None = None
          ) -> tuple[dict[str, Any], tuple[int, ...]] | None:
    """The server's loop, after its imports: per request, ``open_fds(request)`` (descriptors
    opened before the fork, closed in the server after it), then a forked process that runs
    ``run(request, fds)`` (which should end through ``exit_after``); replies on
    ``reply_fd``. Returns None in the server when the caller closes the server's stdin.

    With ``run`` None the forked process returns ``(request, fds)`` from here instead, to
    run a program and end as an interpreter does (its atexit handlers run and its threads
    are joined), not through ``exit_after``."""
    die_with_parent()
    replies = os.fdopen(reply_fd, "w")

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    for line in sys.stdin:
        request = json.loads(line)
        fds = open_fds(request) if open_fds else ()
        pid = fork_child()
        if pid == 0:
            replies.close()
            if run is None:
                return request, fds
            exit_after(lambda: run(request, fds))
        for fd in fds:
            os.close(fd)
        reply({"pid": pid})
        _, status, usage = os.wait4(pid, 0)
        reply({"code": os.waitstatus_to_exitcode(status), "maxrss_kb": usage.ru_maxrss})
    return None


class ForkServer:
    """One fork server process (``command`` plus its reply pipe's descriptor), one request
    at a time: ``start``, then ``finish``."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None,
                 cwd: Path = REPO) -> None:
        read, write = os.pipe()
        try:
            self.proc = subprocess.Popen([*command, str(write)], cwd=cwd, env=env,
                                         stdin=subprocess.PIPE, pass_fds=(write,), text=True)
        finally:
            os.close(write)
        self.replies = os.fdopen(read, "r")
        self.busy = False

    def _reply(self) -> dict[str, Any]:
        line = self.replies.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"the fork server {self.proc.args[:4]} ended (exit code "
                               f"{code}); its error is printed above")
        return json.loads(line)

    def start(self, request: dict[str, Any]) -> int:
        """Send a request; the forked process's pid."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return int(self._reply()["pid"])

    def finish(self) -> dict[str, Any]:
        """Wait for the process; {"code", "maxrss_kb"}. Interrupted, the server is ended
        (and with it the process)."""
        try:
            return self._reply()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End the server and a process it is running."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            self.replies.close()


_pools: dict[Hashable, list[ForkServer]] = {}
_lock = threading.Lock()


@atexit.register
def _close_all() -> None:
    for pool in _pools.values():
        for server in pool:
            server.close()


def acquire(key: Hashable, make: Callable[[], ForkServer]) -> ForkServer:
    """An idle server of this process's pool ``key``, marked busy (``release`` it after its
    request); ``make()`` starts one when none is idle (callers in several threads get one
    each)."""
    with _lock:
        pool = _pools.setdefault(key, [])
        pool[:] = [s for s in pool if s.proc.poll() is None]
        server = next((s for s in pool if not s.busy), None)
        if server is None:
            server = make()
            pool.append(server)
        server.busy = True
    return server


def release(server: ForkServer) -> None:
    """Give a server back to its pool once its request ended."""
    server.busy = False


def servers(key: Hashable) -> list[ForkServer]:
    """The live servers of pool ``key``."""
    with _lock:
        return [s for s in _pools.get(key, []) if s.proc.poll() is None]
