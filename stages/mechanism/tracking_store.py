"""Where the MLflow store is and whether it can be used, without importing MLflow.

The default URI (SQLite in the runs dir), the commands that serve or show a store, and the
fail-fast check the driver runs before anything else (``check_store``), so an unusable store
costs a second, not MLflow's import.
"""
from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from stages.mechanism.errors import ConfigError


def default_tracking_uri(runs_dir: Path, uri: str | None = None) -> str:
    """The tracking URI: an explicit one, else MLFLOW_TRACKING_URI, else SQLite in runs_dir."""
    if uri:
        return uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(runs_dir).resolve() / 'mlflow.db'}"


def server_command(store_uri: str, runs_dir: Path, host: str, port: int,
                   allowed_hosts: tuple[str, ...] = ()) -> list[str]:
    """``mlflow server`` over ``store_uri`` with artifacts in ``runs_dir/mlartifacts``,
    listening on ``host:port`` with one worker; ``allowed_hosts``: the Host headers it
    answers besides localhost and private addresses (MLflow's guard against DNS
    rebinding)."""
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server",
           "--backend-store-uri", store_uri,
           "--default-artifact-root", str(Path(runs_dir).resolve() / "mlartifacts"),
           "--host", host, "--port", str(port), "--workers", "1"]
    if allowed_hosts:
        cmd += ["--allowed-hosts", ",".join(("localhost", "127.0.0.1", *allowed_hosts))]
    return cmd


def ui_command(uri: str, runs_dir: Path) -> str:
    """The shell command that opens the MLflow UI on this store."""
    if uri.startswith("sqlite:///"):
        artifacts = Path(runs_dir).resolve() / "mlartifacts"
        return (
            f"mlflow ui --backend-store-uri {uri} --default-artifact-root {artifacts} "
            "--host 127.0.0.1 --port 5000"
        )
    return f"open {uri} in a browser"


REACH_TIMEOUT_S = 5.0  # how long the start-up check waits for a tracking server


class TrackingError(ConfigError):
    """The MLflow store cannot be used (server unreachable, SQLite location not writable)."""


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other schemes or in-memory)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


STORE_SCHEMES = ("sqlite", "http", "https", "file", "postgresql", "mysql", "mssql",
                 "databricks")
"""URI schemes of the stores MLflow's tracking client opens (the database ones may carry a
driver: ``postgresql+psycopg2://``)."""


def check_store(uri: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Fail fast, with one line naming ``uri``, when the store cannot be used: a scheme
    MLflow has no store for, an http(s) server that does not answer within ``timeout_s``,
    or a SQLite file whose directory cannot be created or written."""
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower() if ":" in uri else uri
    if scheme not in STORE_SCHEMES:
        raise TrackingError(
            f"tracking URI {uri!r} names no MLflow store: use sqlite:///PATH, http(s)://HOST:PORT "
            f"(an MLflow server), file:///PATH or a database URI ({', '.join(STORE_SCHEMES)}); "
            "without --tracking-uri the store is SQLite in the runs dir")
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
                pass
        except urllib.error.HTTPError:
            pass  # it answered: a server is there (a proxy path may not serve /health)
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise TrackingError(
                f"MLflow tracking server {uri} is not reachable ({reason}); start it, or pass "
                "another --tracking-uri (without one the store is SQLite in the runs dir)"
            ) from None
        return
    db = sqlite_path(uri)
    if db is None:
        return
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        probe = db.parent / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        if db.exists() and not os.access(db, os.W_OK):
            raise PermissionError(f"{db} is read-only")
    except OSError as error:
        raise TrackingError(
            f"MLflow store {uri} cannot be written ({error}); pass a writable --runs-dir "
            "or --tracking-uri"
        ) from None
