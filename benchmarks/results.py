"""Where the benchmarks record what they measured: ``benchmarks/results/<name>.json``.

Each benchmark script ends with ``write_results(name, figures)``. The file holds the figures
the script printed as its last line together with what they depend on: the commit, the
date (UTC) and the machine. Documentation cites these files instead of quoting numbers, so
a figure and the conditions it was measured under never drift apart.

    {"figures": {...}, "commit": "<git sha or unknown>", "date": "2026-...+00:00",
     "machine": {"hostname", "cpu_count", "platform", "python", "torch", "gpu",
                 "load_average_1min"},
     "code": {"digest": "<sha256>", "script": "benchmarks/bench_x.py",
              "files": {"benchmarks/bench_x.py": "<sha256>", "model/gpt.py": ...}},
     ...extra}

``code`` is what measured the figures: the benchmark script and every project module it had
imported when it wrote them, each by a digest of its syntax tree (comments, docstrings and
formatting ignored). :func:`code_changes` compares a record with the code as it is now;
``python benchmarks/results.py`` prints, per results file, whether its code is current,
changed (naming the files) or unversioned (written before results recorded their code).
"""
from __future__ import annotations

import ast
import datetime as _dt
import hashlib
import json
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
RESERVED = ("figures", "commit", "date", "machine", "code")
PROJECT_PACKAGES = ("benchmarks", "data_prep", "model", "stages", "workflows")
"""Top-level folders whose modules count as the code a benchmark measured."""
WHOLE_PROJECT = ("data_prep", "model", "stages", "workflows")
"""The folders a benchmark runs when it runs the pipeline in processes of its own."""
BOOKKEEPING = ("benchmarks/results.py",)
"""Files in no code record: they write results down and measure nothing."""


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


def source_digest(path: Path) -> str:
    """sha256 of a Python file's syntax tree without docstrings (so comments, docstrings
    and layout change nothing); of its bytes when it does not parse; "missing" without it."""
    if not path.is_file():
        return "missing"
    data = path.read_bytes()
    try:
        tree = ast.parse(data, filename=str(path))
    except SyntaxError:
        return hashlib.sha256(data).hexdigest()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def script_file(repo: Path = REPO) -> Path | None:
    """The running benchmark script (``__main__``'s file) relative to ``repo``, if inside."""
    name = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        return Path(name).resolve().relative_to(repo) if name else None
    except ValueError:
        return None


def measured_files(repo: Path = REPO) -> list[Path]:
    """The benchmark script and every module of the project's packages imported in this
    process, as paths relative to ``repo``."""
    paths: set[Path] = set()
    script = script_file(repo)
    if script is not None:
        paths.add(script)
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        try:
            rel = Path(name).resolve().relative_to(repo) if name else None
        except ValueError:
            continue
        if rel is not None and rel.parts[0] in PROJECT_PACKAGES and rel.suffix == ".py":
            paths.add(rel)
    return sorted(p for p in paths if p.as_posix() not in BOOKKEEPING)


def project_files(roots: tuple[str, ...], repo: Path = REPO) -> list[Path]:
    """Every Python file under the given project folders, relative to ``repo``: the code of
    a benchmark whose work runs in child processes it does not import."""
    found = (path.relative_to(repo) for root in roots for path in (repo / root).rglob("*.py"))
    return sorted(p for p in found if p.as_posix() not in BOOKKEEPING)


def code_record(files: list[Path], repo: Path = REPO) -> dict[str, Any]:
    """``{"digest", "script", "files"}``: each file's :func:`source_digest`, one digest of
    them all and which file is the benchmark script (None outside one)."""
    digests = {rel.as_posix(): source_digest(repo / rel) for rel in files}
    whole = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()
    script = script_file(repo)
    return {"digest": whole, "script": script.as_posix() if script else None, "files": digests}


def code_changes(record: dict[str, Any], repo: Path = REPO) -> list[str] | None:
    """The files whose code differs from what a results record measured (empty: current),
    or None when the record predates recorded code (unversioned)."""
    code = record.get("code")
    if not isinstance(code, dict) or not isinstance(code.get("files"), dict):
        return None
    return sorted(rel for rel, digest in code["files"].items()
                  if rel not in BOOKKEEPING and source_digest(repo / rel) != digest)


def whole_project_code() -> dict[str, Any]:
    """The code record of a benchmark that runs the whole project in child processes: what
    it imported and every module of :data:`WHOLE_PROJECT`."""
    return code_record(sorted(set(measured_files()) | set(project_files(WHOLE_PROJECT))))


def write_results(name: str, figures: dict, extra: dict | None = None,
                  directory: str | Path | None = None,
                  code: dict[str, Any] | None = None) -> Path:
    """Write ``figures`` (plus ``extra`` keys) to ``<directory>/<name>.json`` atomically.

    ``directory`` defaults to ``benchmarks/results``. The file also records the commit, the
    UTC date, :func:`machine_info` and the code that measured them (:func:`code_record` of
    :func:`measured_files`), or ``code`` when the benchmark computed it (its work ran in
    other processes). Returns the path written.
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
        "code": code if code is not None else code_record(measured_files()),
        **(extra or {}),
    }
    target = Path(directory) if directory is not None else RESULTS_DIR
    return write_json_atomic(target / f"{name}.json", record)


def report(name: str, figures: dict, args: Any) -> None:
    """A benchmark's ending: write ``figures`` with its ``args`` to ``<name>.json`` (in
    ``args.results_dir``), unless ``args.tiny`` (a smoke run of the code path, whose figures
    measure nothing worth keeping); then print them as one JSON line, the script's last."""
    if args.tiny:
        print("[bench] --tiny: figures not recorded", file=sys.stderr, flush=True)
    else:
        path = write_results(name, figures, {"args": vars(args)}, args.results_dir)
        print(f"[bench] figures written to {path}", file=sys.stderr, flush=True)
    print(json.dumps(figures))


def main() -> int:
    """Print, per results file, whether the code that wrote it is current, changed (and
    which files) or unversioned; exit 1 when any file's code changed."""
    changed_any = False
    for path in sorted(RESULTS_DIR.glob("*.json")):
        changes = code_changes(json.loads(path.read_text()))
        if changes is None:
            print(f"{path.name}: unversioned (written before results recorded their code)")
        elif changes:
            changed_any = True
            print(f"{path.name}: code changed since: {', '.join(changes)}")
        else:
            print(f"{path.name}: current")
    return 1 if changed_any else 0


if __name__ == "__main__":
    sys.exit(main())
