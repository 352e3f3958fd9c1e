"""The rehearsal's rank processes, forked from a warm interpreter: ``rehearse_isolated``.

Each rehearsed rank needs a process of its own (DTensor caches device meshes by value: a
second rehearsal in one process reaches collectives bound to the first one's destroyed
process group), and an interpreter's start costs about 3 CPU seconds of imports (torch,
DTensor, the trainer), more than a small plan's rehearsal. So the ranks are forked from a
rank server: an interpreter (``python -m model.rehearsal.rank_server DEVICE FD``) that has
loaded the fake GPU first when DEVICE is ``cuda`` (it must come before torch), then
imported the rehearsal, and started no thread. One server per interpreter and device type
serves this process's rehearsals, one rank at a time (a busy server's caller gets another).

- The interpreter is ``model.rehearsal.torch_pin.rehearsal_python()`` on ``cuda`` (another
  Python with the checked CPU torch, where this one has Frontier's ROCm build), this one on
  the CPU.
- A rank process takes the caller's environment and working directory at the request (a
  variable torch reads at import time comes from the server's start, the caller's then);
  its output goes to the server's, which is the caller's stdout and stderr.
- The server dies with its caller, a rank process with the server (``PR_SET_PDEATHSIG``):
  a killed plan stage leaves neither behind.

The protocol: a request is one JSON line on the server's stdin (the pickled arguments' path,
the result's path, the environment, the working directory); the reply one JSON line on the
pipe FD (``{"code": <the rank process's exit code>, "maxrss_kb": <its peak resident
memory>}``, which ``rehearse_isolated`` sets as the Rehearsal's ``host_peak_rss_bytes``).
The rank process writes the pickled ``Rehearsal`` or the ``RehearsalError`` that refused it
to the result path (a temporary file renamed into place); anything else it raises is
printed as the interpreter would and makes its exit code 1.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model.parallel.parent_death import die_with_parent

if TYPE_CHECKING:  # torch: a cuda server imports it only after loading the fake GPU
    from model.config import ModelConfig, TrainConfig
    from model.parallel.layout import Plan
    from model.rehearsal.rehearse import Rehearsal

REPO = Path(__file__).resolve().parents[2]


class _Server:
    """One rank server process and its reply pipe."""

    def __init__(self, python: str, device_type: str) -> None:
        read, write = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [python, "-m", "model.rehearsal.rank_server", device_type, str(write)],
                cwd=REPO, stdin=subprocess.PIPE, pass_fds=(write,), text=True)
        finally:
            os.close(write)
        self.replies = os.fdopen(read, "r")
        self.busy = False

    def close(self) -> None:
        """End the server (and a rank process it is running, which dies with it)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            self.replies.close()

    def run(self, args: tuple, request: Path, result: Path) -> dict[str, int]:
        """Rehearse ``args`` in a forked rank process; its exit code ("code") and peak
        resident memory ("maxrss_kb")."""
        request.write_bytes(pickle.dumps(args))
        line = json.dumps({"request": str(request), "result": str(result),
                           "env": dict(os.environ), "cwd": os.getcwd()})
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            reply = self.replies.readline()
        except BaseException:  # interrupted while the rank ran: end it with the server
            self.close()
            raise
        if not reply:
            code = self.proc.wait()
            self.close()
            raise RuntimeError(f"the rehearsal's rank server ended (exit code {code}); its "
                               "error is printed above")
        return json.loads(reply)


_servers: dict[tuple[str, str], list[_Server]] = {}
_lock = threading.Lock()


@atexit.register
def _close_all() -> None:
    for servers in _servers.values():
        for server in servers:
            server.close()


def _acquire(python: str, device_type: str) -> _Server:
    with _lock:
        pool = _servers.setdefault((python, device_type), [])
        pool[:] = [s for s in pool if s.proc.poll() is None]
        server = next((s for s in pool if not s.busy), None)
        if server is None:
            server = _Server(python, device_type)
            pool.append(server)
        server.busy = True
    return server


def rehearse_isolated(model_cfg: ModelConfig, train_cfg: TrainConfig, plan: Plan, rank: int,
                      steps: int = 1, warmup: int = 1, device_type: str = "cpu",
                      extrapolate: bool = True) -> Rehearsal:
    """``rehearse`` in a process of its own, its RehearsalError re-raised here.

    One rank per process: DTensor caches device meshes by value, so a second rehearsal in
    the same process would reach collectives bound to the first one's destroyed process
    group ("Could not resolve the process group registered under the name ...").

    The process is forked from a rank server (``model.rehearsal.rank_server``), an
    interpreter that has imported this module (torch, DTensor, the trainer) and, on
    ``cuda``, loaded the fake GPU before torch: a plan stage's rehearsals cost their work,
    not seconds of imports each. On ``cuda`` that interpreter is
    ``$FRONTIER_LLM_REHEARSAL_PYTHON`` when set (``model.rehearsal.torch_pin``): one with the
    CPU torch the rehearsal was checked on, where this one has another release. The server
    dies with this process and the rank's process with the server.
    """
    from model.rehearsal.rehearse import RehearsalError
    from model.rehearsal.torch_pin import rehearsal_python

    python = sys.executable
    if device_type == "cuda":
        from model.rehearsal import fake_gpu

        python = rehearsal_python()
        if python == sys.executable:  # another interpreter builds it for its own torch
            fake_gpu.library_path()  # built here first, so that a build failure reads as one
    outcome = _rehearse_in_child((model_cfg, train_cfg, plan, rank, None, steps, warmup,
                                  device_type, extrapolate), python, device_type)
    if isinstance(outcome, RehearsalError):
        raise outcome
    return outcome


def _rehearse_in_child(args: tuple, python: str, device_type: str) -> Any:
    """``model.rehearsal.rehearse.rehearse(*args)`` in a rank process forked from the rank
    server of ``python`` and ``device_type``: its Rehearsal, or its RehearsalError (the
    caller raises it); RuntimeError when the process failed otherwise."""
    server = _acquire(python, device_type)
    try:
        with tempfile.TemporaryDirectory(prefix="rehearse-") as tmp:
            request, result = Path(tmp) / "request.pkl", Path(tmp) / "result.pkl"
            ended = server.run(args, request, result)
            if not result.exists():
                raise RuntimeError(f"the rehearsal of rank {args[3]} on {device_type} exited "
                                   f"with code {ended['code']} (its own error is printed "
                                   "above)")
            outcome = pickle.loads(result.read_bytes())
            if not isinstance(outcome, BaseException):
                outcome.host_peak_rss_bytes = ended["maxrss_kb"] * 1024  # Linux: KiB
            return outcome
    finally:
        server.busy = False


# ------------------------------------------------------------------------- the server side

def _rank_process(request: dict[str, Any]) -> None:
    """In a forked rank process: rehearse the request, write its outcome; never returns."""
    code = 1
    try:
        die_with_parent()
        from model.rehearsal.fake_gpu import LOADED_VARIABLE

        loaded = os.environ.get(LOADED_VARIABLE)  # this process's, not the caller's
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.pop(LOADED_VARIABLE, None)
        if loaded is not None:
            os.environ[LOADED_VARIABLE] = loaded
        os.chdir(request["cwd"])
        from model.rehearsal.rehearse import RehearsalError, rehearse

        args = pickle.loads(Path(request["request"]).read_bytes())
        try:
            outcome: Any = rehearse(*args)
        except RehearsalError as refused:
            outcome = refused
        result = Path(request["result"])
        tmp = result.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(outcome))
        tmp.replace(result)
        code = 0
    except BaseException:  # what the interpreter prints for an uncaught exception
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def serve(device_type: str, reply_fd: int) -> None:
    """The server's loop: load the fake GPU (``cuda``) and the rehearsal, then fork a rank
    process per request and reply with its exit code."""
    die_with_parent()
    if device_type == "cuda":
        from model.rehearsal import fake_gpu

        if not fake_gpu.runtime_loaded():
            fake_gpu.load_runtime()
    import model.rehearsal.rehearse  # noqa: F401 (torch, DTensor, the trainer: once, here)
    replies = os.fdopen(reply_fd, "w")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replies.close()
            _rank_process(request)
        _, status, usage = os.wait4(pid, 0)
        replies.write(json.dumps({"code": os.waitstatus_to_exitcode(status),
                                  "maxrss_kb": usage.ru_maxrss}) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
