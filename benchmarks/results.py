"""Where the benchmarks record what they measured: ``benchmarks/results/<name>.json``.

Each benchmark script ends with ``write_results(name, figures)``. The file holds the figures
the script printed as its last line together with what they depend on: the commit, the
date (UTC) and the machine. Documentation cites these files instead of quoting numbers, so
a figure and the conditions it was measured under never drift apart.

    {"figures": {...}, "commit": "<git sha or unknown>", "date": "2026-...+00:00",
     "machine": {"hostname", "cpu_count", "platform", "python", "torch", "gpu",
                 "load_average_1min"}, ...extra}
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from data_prep.atomic import write_json_atomic

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESERVED = ("figures", "commit", "date", "machine")


def git_commit(repo: Path = REPO) -> str:
    """``git rev-parse HEAD`` of ``repo``, or ``"unknown"`` outside a git checkout."""
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    sha = proc.stdout.strip()
    return sha if proc.returncode == 0 and sha else "unknown"


def machine_info() -> dict[str, Any]:
    """Hostname, CPU count, platform, Python and torch versions, GPU name (None without one)."""
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": None,
        "gpu": None,
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch
    except ImportError:
        return info
    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_results(name: str, figures: dict, extra: dict | None = None,
                  directory: str | Path | None = None) -> Path:
    """Write ``figures`` (plus ``extra`` keys) to ``<directory>/<name>.json`` atomically.

    ``directory`` defaults to ``benchmarks/results``. The file also records the commit, the
    UTC date and :func:`machine_info`. Returns the path written.
    """
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise ValueError(f"results name {name!r}: use letters, digits, '_' and '-' only")
    if not isinstance(figures, dict) or not figures:
        raise ValueError(f"results {name!r}: figures must be a non-empty dict, got {figures!r}")
    clash = sorted(set(extra or {}) & set(RESERVED))
    if clash:
        raise ValueError(f"results {name!r}: extra may not set {clash}; they are written here")
    record: dict[str, Any] = {
        "figures": figures,
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        **(extra or {}),
    }
    target = Path(directory) if directory is not None else RESULTS_DIR
    return write_json_atomic(target / f"{name}.json", record)


def report(name: str, figures: dict, args: Any) -> None:
    """A benchmark's ending: write ``figures`` with its ``args`` to ``<name>.json`` (in
    ``args.results_dir``), unless ``args.tiny`` (a smoke run of the code path, whose figures
    measure nothing worth keeping); then print them as one JSON line, the script's last."""
    import json
    import sys

    if args.tiny:
        print("[bench] --tiny: figures not recorded", file=sys.stderr, flush=True)
    else:
        path = write_results(name, figures, {"args": vars(args)}, args.results_dir)
        print(f"[bench] figures written to {path}", file=sys.stderr, flush=True)
    print(json.dumps(figures))
