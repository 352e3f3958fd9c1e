"""Warm command lines for the tests: ``python -m workflows.pipeline ...`` forked from an
interpreter that has imported the driver's libraries.

A micro pipeline's driver imports about 6 CPU seconds of libraries (Parsl, MLflow, torch,
transformers, matplotlib, the stages; 6.2 measured on the CI machine) and parses the
project's sources for its code keys (0.6), and the tests start dozens of drivers.
``WarmProcess`` starts one the way ``subprocess.Popen([sys.executable, "-m", MODULE, *ARGS])``
does, but forks it from a driver zygote, a fork server (``model.parallel.fork_server``) of
this process that has imported ``PRELOAD``, parsed the sources (a memo keyed by each file's
content, so an edited file is parsed again) and started no thread:

- the process takes the request's working directory, environment, stdin ``/dev/null``, and
  stdout and stderr: the caller's own descriptors (``None``), a file, ``subprocess.PIPE``,
  ``DEVNULL`` or ``STDOUT``, reopened by the zygote through ``/proc/<caller>/fd``; a new
  session when asked (``start_new_session``);
- its process title is the command line it stands for (``setproctitle``), which ``ps`` and
  psutil show, as one string;
- it runs the module as ``__main__`` (``runpy``), with ``sys.argv`` as ``python -m`` sets
  it, and ends as an interpreter does (atexit handlers, threads joined), with the code
  ``Popen.returncode`` would give (negative for a signal); it dies with the zygote, which
  dies with this process.

So the driver, its signals, children, Parsl executors, launches and MLflow runs are a real
command line's; only the exec of a fresh interpreter is skipped. With ``forked_launches``
its local launches fork as well (``tests/launch_zygote.py``), for tests whose subject is
not the launch's processes. A driver of a copy of the sources (``code``, as
``test_two_pipelines.py`` runs, so that its keys stay put while the checkout is edited)
forks from zygotes of its own, started on that copy. Tests whose subject is what a fresh
interpreter does before any work (the real console of ``test_bad_inputs.py`` and
``test_tracking_start.py``, the imports of ``--dry-run``) start drivers with
``subprocess``. A variable read at import time by a preloaded library comes from the
zygote's start (this process's environment then).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from model.parallel import fork_server
from tests import launch_zygote, rank_zygote

REPO = Path(__file__).resolve().parent.parent
# What a driver imports, at its top or when its stages run (the apps run as its threads in
# the micro preset); the libraries they pull in come with them.
PRELOAD = ("workflows.pipeline", "workflows.scaling", "workflows.session", "workflows.apps",
           "workflows.executors", "parsl", "stages.curate.work", "stages.tokenize.work",
           "stages.plan.work", "stages.train.work", "stages.evaluate.work",
           "stages.mechanism.tracking", "mlflow.store.tracking.sqlalchemy_store",
           "model.evaluation.export_hf", "transformers.models.llama.modeling_llama",
           "transformers.models.gpt_neox.modeling_gpt_neox", "matplotlib.pyplot",
           # and the ranks' own, for the launches of a driver that forks them
           # (``forked_launches``)
           *rank_zygote.PRELOAD)
ZYGOTES = "tests.warm_cli"
"""The driver zygotes' pool (``fork_server.acquire``)."""
Output = int | IO[Any] | None


def _become(request: dict[str, Any], outputs: tuple[int, int]) -> None:
    """In the forked process: take the request's session, directory, environment and
    streams, then run the module as ``python -m`` would."""
    import runpy

    import setproctitle

    if request["new_session"]:
        os.setsid()
    fork_server.take_request(request["cwd"], request["env"], outputs)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's stdin until it ends
    setproctitle.setproctitle(" ".join(request["title"]))
    if request["forked_launches"]:
        launch_zygote.start()
    sys.argv = [request["module"], *request["argv"]]
    # Preloaded, the module would run as __main__ beside its imported copy (runpy warns);
    # ``python -m`` has only the __main__ one until something imports the module.
    sys.modules.pop(request["module"], None)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def serve(reply_fd: int) -> None:
    """The zygote: import ``PRELOAD``, then fork a process per request; in that process,
    become the request's command line."""
    import importlib

    import setproctitle

    from stages.mechanism import keys
    from stages.registry import PIPELINE

    for name in PRELOAD:
        importlib.import_module(name)
    # The code keys' parse of every source file, memoized by the file's content (0.6 CPU
    # seconds a driver): a driver parses again only what changed since.
    keys.code_hashes(PIPELINE)
    # setproctitle finds the memory it may write the title to on its first call, from the
    # environment too: here, before a process replaces its environment.
    setproctitle.setproctitle(" ".join(sys.orig_argv))
    forked = fork_server.serve(reply_fd, None, fork_server.open_outputs)
    if forked is not None:
        _become(*forked)


def _acquire(code: Path = REPO) -> fork_server.ForkServer:
    """An idle driver zygote that imports the project from ``code`` (a copy of its sources:
    ``code`` first on its path; the tests' own modules from this checkout), marked busy."""
    command = [sys.executable, "-c",
               "import sys; from tests.warm_cli import serve; serve(int(sys.argv[1]))"]
    env = dict(os.environ)
    if code != REPO:
        env["PYTHONPATH"] = os.pathsep.join([str(code), str(REPO)])
    return fork_server.acquire((ZYGOTES, str(code)), lambda: fork_server.ForkServer(
        command, env=env, cwd=code))


def start_zygotes(count: int, code: Path = REPO) -> None:
    """Start ``count`` idle driver zygotes for ``code`` now, importing side by side: for
    ``count`` drivers started moments apart, none held back by a zygote's imports."""
    started = [_acquire(code) for _ in range(count)]
    for zygote in started:
        fork_server.release(zygote)


def close_zygotes(code: Path) -> None:
    """End the driver zygotes of ``code`` (a copy of the sources a test is done with)."""
    for zygote in fork_server.servers((ZYGOTES, str(code))):
        zygote.close()


def _output_path(target: Output, default_fd: int) -> str:
    """Where the zygote opens an output: this process's own descriptor (``None``), a file or
    descriptor of it (a new pipe's write end among them), or ``/dev/null``."""
    if target is None:
        return f"/proc/{os.getpid()}/fd/{default_fd}"
    if target == subprocess.DEVNULL:
        return os.devnull
    fd = target if isinstance(target, int) else target.fileno()
    return f"/proc/{os.getpid()}/fd/{fd}"


class WarmProcess:
    """``subprocess.Popen([sys.executable, "-m", module, *argv], ...)`` forked from a driver
    zygote: ``pid``, ``args``, ``stdout``/``stderr`` (with ``PIPE``), ``returncode``,
    ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate``, ``kill``.
    ``forked_launches``: its local launches forked too (``tests/launch_zygote.py``);
    ``code``: the copy of the sources it runs (a zygote of that copy's)."""

    def __init__(self, module: str, argv: list[str], *, cwd: Path = REPO,
                 env: dict[str, str] | None = None, stdout: Output = None,
                 stderr: Output = None, start_new_session: bool = False,
                 forked_launches: bool = False, code: Path = REPO) -> None:
        self.args = [sys.executable, "-m", module, *argv]
        self.returncode: int | None = None
        self.stdout = self.stderr = None
        paths, ours = [], []  # (path for the zygote), (pipe write ends to close here)
        for name, target, fd in (("stdout", stdout, 1), ("stderr", stderr, 2)):
            if target == subprocess.PIPE:
                read, write = os.pipe()
                setattr(self, name, open(read, errors="replace"))  # noqa: SIM115
                paths.append(_output_path(write, fd))
                ours.append(write)
            elif name == "stderr" and target == subprocess.STDOUT:
                paths.append(paths[0])
            else:
                paths.append(_output_path(target, fd))
        self._zygote = _acquire(code)
        try:
            self.pid = self._zygote.start({
                "module": module, "argv": list(argv), "title": self.args, "cwd": str(cwd),
                "env": dict(os.environ if env is None else env), "stdout": paths[0],
                "stderr": paths[1], "new_session": start_new_session,
                "forked_launches": forked_launches})
        except BaseException:
            fork_server.release(self._zygote)
            raise
        finally:
            for fd in ours:  # the process holds its own copies now
                os.close(fd)
        self._chunks: dict[str, list[str]] = {}  # what the pipes brought (``communicate``)
        self._readers: list[threading.Thread] = []
        self._ended = threading.Event()
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        try:
            self.returncode = self._zygote.finish()["code"]
        except RuntimeError:  # the zygote was ended (this process exiting): the process with it
            self.returncode = -signal.SIGKILL
        finally:
            fork_server.release(self._zygote)
            self._ended.set()

    def poll(self) -> int | None:
        return self.returncode if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """What the process printed to its pipes, once it ended; past ``timeout``
        ``TimeoutExpired``, the process still running (``kill_and_collect`` then)."""
        if not self._readers:
            self._readers = [threading.Thread(target=self._read, args=(name, stream),
                                              daemon=True)
                             for name, stream in (("stdout", self.stdout),
                                                  ("stderr", self.stderr)) if stream]
            for reader in self._readers:
                reader.start()
        self.wait(timeout)
        for reader in self._readers:
            reader.join()
        return self._printed()

    def kill_and_collect(self, grace_s: float = 5.0) -> tuple[str | None, str | None]:
        """Kill the process; what it printed to its pipes until then (what its children
        still holding them print within ``grace_s`` too)."""
        self.kill()
        self.wait()
        for reader in self._readers:
            reader.join(grace_s)
        return self._printed()

    def _read(self, name: str, stream: IO[str]) -> None:
        chunks = self._chunks.setdefault(name, [])
        for chunk in iter(lambda: stream.read(65536), ""):
            chunks.append(chunk)

    def _printed(self) -> tuple[str | None, str | None]:
        return tuple("".join(self._chunks[name]) if name in self._chunks else None
                     for name in ("stdout", "stderr"))

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(module: str, argv: list[str], *, timeout: float, cwd: Path = REPO,
        env: dict[str, str] | None = None, forked_launches: bool = False
        ) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", module, *argv], capture_output=True,
    text=True, timeout=timeout)`` with a ``WarmProcess``; killed past ``timeout``
    (``TimeoutExpired``)."""
    proc = WarmProcess(module, argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, forked_launches=forked_launches)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        raise subprocess.TimeoutExpired(proc.args, timeout, *proc.kill_and_collect()) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
