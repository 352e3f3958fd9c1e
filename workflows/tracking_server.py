"""An MLflow tracking server the driver runs for a run that spans hosts.

On a Slurm site the training's logger rank writes metrics from a compute node. SQLite's
own guidance rules out a database file written by several hosts over a shared file
system (its locks are not reliable there), so with ``tracking.server`` (on by default on
Frontier) the driver starts ``mlflow server`` on its own host over the runs dir's SQLite
file: only that one process writes the file, and every stage, rank and the driver itself
talk HTTP to it. The server listens on all interfaces and is advertised at
``site.address`` (default: this host's name), so compute nodes reach it as they reach
Parsl's interchange. It lives as long as the driver: stopped when the session ends, and,
carrying the run's marker, reaped with the other processes of a driver that died.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from stages.config import ConfigError, PipelineConfig
from stages.mechanism import tracking_store

READY_TIMEOUT_S = 120.0
"""How long the driver waits for the server to answer /health (a loaded login node)."""


def wanted(cfg: PipelineConfig) -> bool:
    """Whether this run's store goes through a server the driver starts: ``tracking.server``
    (None: on Frontier only), never when ``tracking.uri`` names a store, never locally."""
    if cfg.tracking.uri or cfg.site.name == "local":
        return False
    return cfg.tracking.server if cfg.tracking.server is not None else cfg.site.name == "frontier"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class TrackingServer:
    """``mlflow server`` over ``store_uri`` (a SQLite file in ``runs_dir``), advertised at
    ``host``; ``start`` returns its URI, ``stop`` ends it and its worker."""

    def __init__(self, store_uri: str, runs_dir: Path, host: str, log: Path) -> None:
        self.store_uri, self.runs_dir, self.host, self.log = store_uri, runs_dir, host, log
        self.port = _free_port()
        self.uri = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Start the server and wait until it answers; raise ConfigError with its log's tail
        when it exits or does not answer in time."""
        tracking_store.check_store(self.store_uri)  # the SQLite file's directory is writable
        cmd = tracking_store.server_command(self.store_uri, self.runs_dir, "0.0.0.0", self.port,
                                      allowed_hosts=(self.host, f"{self.host}:{self.port}"))
        # No background job runner: the server only records runs.
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            # Its own process group, so that stop() ends the worker it forks as well.
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise ConfigError(f"the MLflow server for {self.store_uri} exited with "
                                  f"{self.proc.returncode}: {self._tail()}")
            if _answers(self.uri):
                print(f"[tracking] MLflow server at {self.uri} (store {self.store_uri}, log "
                      f"{self.log}), up in {time.monotonic() - started:.1f} s", flush=True)
                return self.uri
            time.sleep(0.5)
        self.stop()
        raise ConfigError(f"the MLflow server for {self.store_uri} did not answer at {self.uri} "
                          f"within {timeout_s:.0f} s: {self._tail()}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after ``timeout_s``) and
        wait until nothing answers on its port (its worker may outlive it briefly), so a
        restart can bind the port again."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, None)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.1)

    def _tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return f"(no log at {self.log})"


def _answers(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def advertised_host(cfg: PipelineConfig) -> str:
    """The address compute nodes reach this host at: ``site.address``, else its name."""
    return cfg.site.address or socket.gethostname()
