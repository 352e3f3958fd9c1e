"""The torch release the rehearsal was checked on, readable without importing torch.

``model.rehearsal.rehearse`` refuses any other release (its private pipelining and
memory-tracker hooks were checked on this one); the readiness report compares the torch
installed where the plan stage runs against it before any job is submitted, and so must not
import torch itself.
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

CHECKED_TORCH = (2, 13)
"""The torch release (major, minor) whose pipelining internals the bypass was checked on."""
REHEARSAL_PYTHON = "FRONTIER_LLM_REHEARSAL_PYTHON"
"""Environment variable naming the interpreter that rehearses ranks on the fake GPU: one
with the CPU build of the checked torch and this project's requirements, for a machine
whose own torch is another release (the ROCm build on Frontier). Unset: this interpreter."""


def torch_release(version: str) -> tuple[int, ...]:
    """(major, minor) of a torch version string: ``"2.13.0+cpu"`` -> ``(2, 13)``."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def installed_torch() -> str | None:
    """The installed torch's version (package metadata: torch is not imported), or None."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def rehearsal_python() -> str:
    """The interpreter that rehearses ranks on the fake GPU (:data:`REHEARSAL_PYTHON`, else
    this one)."""
    return os.environ.get(REHEARSAL_PYTHON) or sys.executable


def torch_of(python: str, timeout_s: float = 60.0) -> str | None:
    """The torch version another interpreter has installed (its package metadata: torch is
    not imported), or None when it has none or cannot be run."""
    if python == sys.executable:
        return installed_torch()
    code = "import importlib.metadata as m; print(m.version('torch'))"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    version = proc.stdout.strip()
    return version if proc.returncode == 0 and version else None
