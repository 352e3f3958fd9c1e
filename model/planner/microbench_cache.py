"""Where this machine's microbenchmark figures are kept, and when a kept file is trusted.

A measured cluster (``configs/clusters/local.yaml``) is priced with figures the
microbenchmark (``model.planner.microbench``) measures on this machine. Measured twice, they
differ with the load of the moment, and so may the plan. So they are measured once per
machine and kept in a per-user cache:

    <cache dir>/microbench-<host>-n<ranks>-<fingerprint>.json

The cache dir is ``$FRONTIER_LLM_CACHE``, else ``$XDG_CACHE_HOME/frontier-llm``, else
``~/.cache/frontier-llm``. The fingerprint hashes what the figures depend on besides the
load (``fingerprint``): the CPU model, the cores this process may run on, the installed torch
version and the file format's version (``FORMAT_VERSION``). A file is trusted only when it
parses, has this format version, this fingerprint and this rank count, and holds cluster
fields; anything else is measured again and replaced (``read_cached`` says why). Files are
written atomically, and a lock per file makes two planners on a cold cache measure once.

Nothing here imports torch: the torch version is read from the installed distribution.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import socket
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from data_prep.atomic import write_json_atomic

FORMAT_VERSION = 2
"""Raised whenever the measurement or its fields change meaning: older files are measured
again, never trusted."""

CACHE_VARIABLE = "FRONTIER_LLM_CACHE"
"""Environment variable naming the cache dir (tests point it at a temporary one)."""


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def core_count() -> int:
    """The cores this process may run on (its affinity), which the ranks share."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def torch_version() -> str:
    """The installed torch version, read without importing torch."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def fingerprint() -> dict[str, Any]:
    """What the figures depend on besides the load: format version, CPU, cores, torch."""
    return {"format": FORMAT_VERSION, "cpu": cpu_model(), "cores": core_count(),
            "torch": torch_version()}


def fingerprint_digest(print_: dict[str, Any]) -> str:
    """12 hex digits of the fingerprint's SHA-256 (for the file name)."""
    return hashlib.sha256(json.dumps(print_, sort_keys=True).encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$FRONTIER_LLM_CACHE``, else ``$XDG_CACHE_HOME/frontier-llm``, else
    ``~/.cache/frontier-llm``."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "frontier-llm"


def cache_file(nproc: int, cache_dir: str | Path | None = None,
               host: str | None = None) -> Path:
    """The cache file of this machine's figures for ``nproc`` ranks in ``cache_dir``
    (default: ``default_cache_dir()``), as the planner on ``host`` (default: this one) names
    it."""
    host = (host or socket.gethostname()).replace("/", "_")
    name = f"microbench-{host}-n{nproc}-{fingerprint_digest(fingerprint())}.json"
    return Path(cache_dir or default_cache_dir()) / name


def read_cached(path: str | Path, nproc: int) -> tuple[dict[str, Any] | None, str]:
    """(the file's contents, "") when ``path`` is a trusted measurement of this machine for
    ``nproc`` ranks, else (None, why not)."""
    path = Path(path)
    if not path.exists():
        return None, "no such file"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"unreadable ({exc.__class__.__name__})"
    if not isinstance(data, dict):
        return None, "not a JSON object"
    if data.get("format") != FORMAT_VERSION:
        return None, f"format {data.get('format')!r}, not {FORMAT_VERSION}"
    if data.get("fingerprint") != fingerprint():
        return None, "measured on another CPU, core count or torch version"
    if data.get("nproc") != nproc:
        return None, f"measured with {data.get('nproc')!r} ranks, not {nproc}"
    if not isinstance(data.get("fields"), dict) or not data["fields"].get("measured"):
        return None, "holds no cluster fields"
    return data, ""


def write_cached(path: str | Path, nproc: int, fields: dict[str, Any], raw: dict[str, Any],
                 seconds: float) -> Path:
    """Write a measurement of this machine for ``nproc`` ranks to ``path`` atomically."""
    data = {"format": FORMAT_VERSION, "fingerprint": fingerprint(), "nproc": nproc,
            "host": socket.gethostname(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": seconds,
            "fields": fields, "raw": raw}
    return write_json_atomic(path, data)


@contextlib.contextmanager
def locked(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` (one measurement of a file at a time)."""
    lock = Path(f"{path}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
