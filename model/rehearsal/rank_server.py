"""The rehearsal's rank processes, forked from a warm interpreter: ``rehearse_isolated``.

Each rehearsed rank needs a process of its own (DTensor caches device meshes by value: a
second rehearsal in one process reaches collectives bound to the first one's destroyed
process group), and an interpreter's start costs about 3 CPU seconds of imports (torch,
DTensor, the trainer), more than a small plan's rehearsal. So the ranks are forked from a
rank server, a fork server (``model.parallel.fork_server``: its protocol, and how its
processes die with it) started as ``python -m model.rehearsal.rank_server DEVICE FD``, which
has loaded the fake GPU first when DEVICE is ``cuda`` (it must come before torch), then
imported the rehearsal. One server per interpreter and device type serves this process's
rehearsals, one rank at a time (a busy server's caller gets another).

- The interpreter is ``model.rehearsal.torch_pin.rehearsal_python()`` on ``cuda`` (another
  Python with the checked CPU torch, where this one has Frontier's ROCm build), this one on
  the CPU.
- A rank process takes the caller's environment and working directory at the request (a
  variable torch reads at import time comes from the server's start, the caller's then);
  its output goes to the server's, which is the caller's stdout and stderr.
- A request names the pickled arguments' path, the result's path, the environment and the
  working directory. The rank process writes the pickled ``Rehearsal`` or the
  ``RehearsalError`` that refused it to the result path (a temporary file renamed into
  place); anything else it raises is printed as the interpreter would and makes its exit
  code 1. The process's peak resident memory comes back as the Rehearsal's
  ``host_peak_rss_bytes``.
"""
from __future__ import annotations

import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model.parallel import fork_server

if TYPE_CHECKING:  # torch: a cuda server imports it only after loading the fake GPU
    from model.config import ModelConfig, TrainConfig
    from model.parallel.layout import Plan
    from model.rehearsal.rehearse import Rehearsal


def rehearse_isolated(model_cfg: ModelConfig, train_cfg: TrainConfig, plan: Plan, rank: int,
                      steps: int = 1, warmup: int = 1, device_type: str = "cpu",
                      extrapolate: bool = True) -> Rehearsal:
    """``rehearse`` in a process of its own, its RehearsalError re-raised here.

    One rank per process: DTensor caches device meshes by value, so a second rehearsal in
    the same process would reach collectives bound to the first one's destroyed process
    group ("Could not resolve the process group registered under the name ...").

    The process is forked from a rank server (this module's), an interpreter that has
    imported the rehearsal (torch, DTensor, the trainer) and, on ``cuda``, loaded the fake
    GPU before torch: a plan stage's rehearsals cost their work, not seconds of imports
    each. On ``cuda`` that interpreter is ``$FRONTIER_LLM_REHEARSAL_PYTHON`` when set
    (``model.rehearsal.torch_pin``): one with the CPU torch the rehearsal was checked on,
    where this one has another release. The server dies with this process and the rank's
    process with the server.
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


def _acquire(python: str, device_type: str) -> fork_server.ForkServer:
    """An idle rank server of ``python`` and ``device_type`` (started when none is)."""
    command = [python, "-m", "model.rehearsal.rank_server", device_type]
    return fork_server.acquire(("rehearsal", python, device_type),
                               lambda: fork_server.ForkServer(command))


def _rehearse_in_child(args: tuple, python: str, device_type: str) -> Any:
    """``model.rehearsal.rehearse.rehearse(*args)`` in a rank process forked from the rank
    server of ``python`` and ``device_type``: its Rehearsal, or its RehearsalError (the
    caller raises it); RuntimeError when the process failed otherwise."""
    server = _acquire(python, device_type)
    try:
        with tempfile.TemporaryDirectory(prefix="rehearse-") as tmp:
            request, result = Path(tmp) / "request.pkl", Path(tmp) / "result.pkl"
            request.write_bytes(pickle.dumps(args))
            server.start({"request": str(request), "result": str(result),
                          "env": dict(os.environ), "cwd": os.getcwd()})
            ended = server.finish()
            if not result.exists():
                raise RuntimeError(f"the rehearsal of rank {args[3]} on {device_type} exited "
                                   f"with code {ended['code']} (its own error is printed "
                                   "above)")
            outcome = pickle.loads(result.read_bytes())
            if not isinstance(outcome, BaseException):
                outcome.host_peak_rss_bytes = ended["maxrss_kb"] * 1024  # Linux: KiB
            return outcome
    finally:
        fork_server.release(server)


# ------------------------------------------------------------------------- the server side

def _rank_process(request: dict[str, Any], fds: tuple[int, ...]) -> None:
    """In a forked rank process: rehearse the request and write its outcome."""
    from model.rehearsal.fake_gpu import LOADED_VARIABLE
    from model.rehearsal.rehearse import RehearsalError, rehearse

    loaded = os.environ.get(LOADED_VARIABLE)  # this process's, not the caller's
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.pop(LOADED_VARIABLE, None)
    if loaded is not None:
        os.environ[LOADED_VARIABLE] = loaded
    os.chdir(request["cwd"])
    args = pickle.loads(Path(request["request"]).read_bytes())
    try:
        outcome: Any = rehearse(*args)
    except RehearsalError as refused:
        outcome = refused
    result = Path(request["result"])
    tmp = result.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(outcome))
    tmp.replace(result)


def serve(device_type: str, reply_fd: int) -> None:
    """The server: load the fake GPU (``cuda``) and the rehearsal, then fork a rank process
    per request."""
    if device_type == "cuda":
        from model.rehearsal import fake_gpu

        if not fake_gpu.runtime_loaded():
            fake_gpu.load_runtime()
    import model.rehearsal.rehearse  # noqa: F401 (torch, DTensor, the trainer: once, here)

    fork_server.serve(reply_fd, _rank_process)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
