"""Test-session isolation and the shared, measured-once microbenchmark.

Every test session runs in an environment of its own (set before any test module is
imported, since Hugging Face libraries read their cache paths at import):

- no MLflow tracking URI, experiment or run from the caller's shell: the project then
  stores runs in ``sqlite:///<runs dir>/mlflow.db`` of the runs dir each test passes;
  telemetry off;
- Hugging Face, XDG and frontier-llm caches under one temporary directory, Hugging Face
  offline (nothing may download);
- one thread per process, and no torch.distributed rank variables leaking in from a
  surrounding launcher.

The session fails if anything wrote MLflow's cwd defaults (``mlflow.db``, ``mlruns/``,
``mlartifacts/``) into the repository root.

The plan stage measures this machine (``model.planner.microbench``) and caches the result
under ``<runs dir>/cache/microbench/``. That measurement is made once per session
(``microbench_cache``) and copied into each test's runs dir (``seed_microbench``,
``runs_dir``), so no test measures it again.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MICROBENCH_NPROC = 2  # the rank count of the micro and tiny presets
# MLflow's defaults when no tracking URI is given: files in the current directory.
REPO_ROOT_STORES = ("mlflow.db", "mlruns", "mlartifacts")
DIST_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
MLFLOW_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME",
                    "MLFLOW_RUN_ID", "MLFLOW_REGISTRY_URI")

_state: dict = {}


def isolated_environment(session_dir: Path) -> dict[str, str]:
    """The variables every test process runs with; caches live under ``session_dir``."""
    hf_home = session_dir / "hf_home"
    return {
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HOME": str(hf_home),
        "HF_DATASETS_CACHE": str(hf_home / "datasets"),
        "XDG_CACHE_HOME": str(session_dir / "xdg_cache"),
        "FRONTIER_LLM_CACHE": str(session_dir / "frontier_llm_cache"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


def _apply(session_dir: Path) -> None:
    os.environ.update(isolated_environment(session_dir))
    for name in MLFLOW_VARIABLES + DIST_VARIABLES:
        os.environ.pop(name, None)


def _repo_root_stores() -> dict[str, int]:
    """Every file of MLflow's cwd defaults in the repository root -> its mtime (ns)."""
    found: dict[str, int] = {}
    for name in REPO_ROOT_STORES:
        top = REPO / name
        paths = [top] if top.is_file() else (p for p in top.rglob("*") if p.is_file())
        for path in paths:
            try:
                found[str(path.relative_to(REPO))] = path.stat().st_mtime_ns
            except OSError:
                pass
    return found


def pytest_configure(config: pytest.Config) -> None:
    """Isolate the environment before test modules (and the libraries they import) load."""
    session_dir = Path(tempfile.mkdtemp(prefix="frontier-llm-tests-"))
    _state.update(session_dir=session_dir, saved_env=dict(os.environ),
                  stores_before=_repo_root_stores())
    _apply(session_dir)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session if a test wrote an MLflow store into the repository root."""
    if "stores_before" not in _state:
        return
    before, after = _state["stores_before"], _repo_root_stores()
    written = sorted(p for p, mtime in after.items() if before.get(p) != mtime)
    if written:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = ("tests wrote MLflow's default store into the repository root "
                   f"({REPO}): {', '.join(written[:10])}; give every tracker a runs dir "
                   "or an explicit sqlite URI under tmp_path")
        if reporter is not None:
            reporter.write("\n")
            reporter.write_line(f"ERROR: {message}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    """Give the caller's environment back and remove the session's caches."""
    if "saved_env" in _state:
        os.environ.clear()
        os.environ.update(_state["saved_env"])
    if "session_dir" in _state:
        shutil.rmtree(_state["session_dir"], ignore_errors=True)
    _state.clear()


@pytest.fixture(scope="session", autouse=True)
def isolated_session() -> Path:
    """The session's private directory (caches); the isolated environment applied again.

    Applying it again after collection undoes any variable a test module set at import."""
    session_dir = _state["session_dir"]
    _apply(session_dir)
    return session_dir


@pytest.fixture(scope="session")
def microbench_cache(isolated_session: Path) -> Path:
    """This machine's microbenchmark for MICROBENCH_NPROC ranks, measured once; its JSON file."""
    from model.planner.microbench import cache_file, measured_cluster_fields

    cache_dir = isolated_session / "microbench"
    measured_cluster_fields(MICROBENCH_NPROC, cache_dir=cache_dir)
    path = cache_file(MICROBENCH_NPROC, cache_dir)
    assert path.is_file(), f"the microbenchmark left no cache file at {path}"
    return path


@pytest.fixture(scope="session")
def seed_microbench(microbench_cache: Path) -> Callable[[Path], Path]:
    """A function that puts the session's measurement where the plan stage of a runs dir
    looks first (``<runs dir>/cache/microbench/``); it returns the copied file."""

    def seed(runs_dir: Path) -> Path:
        target = Path(runs_dir) / "cache" / "microbench" / microbench_cache.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(microbench_cache, target)
        return target

    return seed


@pytest.fixture
def runs_dir(tmp_path: Path, seed_microbench: Callable[[Path], Path]) -> Path:
    """A fresh runs dir for one test, the session's microbenchmark already cached in it."""
    path = tmp_path / "runs"
    path.mkdir()
    seed_microbench(path)
    return path
