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

The plan stage measures this machine (``model.planner.microbench``) once per machine and
reads a runs dir's own copy under ``<runs dir>/cache/microbench/`` before the per-user cache.
That measurement is made once per test run,
shared by the pytest-xdist workers (``microbench_cache``, ``made_once``), and copied into
each test's runs dir (``seed_microbench``, ``runs_dir``), so no test measures it again.

A new MLflow SQLite store costs seconds of schema migration. One store is created and
migrated per test run (``migrated_store``); ``seed_store`` copies it to where a test's
tracker or driver will look (``<dir>/mlflow.db``), and ``runs_dir`` comes with a copy. The
project takes an existing, migrated store as is, so a copy behaves as a new store would.
Stores made from nothing are still tested: ``tests/reliability/test_tracking_start.py``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


# The suite runs on N workers (``pytest -n N``, the README's test command) in groups that a
# worker runs in turn, each group a module, except that the Slurm tests, which share the
# test cluster's two nodes and assert on its job accounting, are one group (the modules
# with "slurm" in their name), and the modules that share a session fixture that runs a
# pipeline (``SHARED_SESSIONS``) are one group per fixture.
SLURM_GROUP = "slurm-cluster"
SHARED_SESSIONS = {"micro_cli_history": "micro-cli", "micro_pipeline": "micro-pipeline"}
"""Session fixture -> its group: each runs a whole pipeline (a minute or more), which a module
on another worker would run again there."""
SHARED_SESSION_MODULES = {
    "test_pipeline.py": "micro-cli", "test_mlflow_ui.py": "micro-cli",
    "test_run_names.py": "micro-cli",
    "test_evaluate.py": "micro-pipeline", "test_evaluate_dp.py": "micro-pipeline",
    "test_evaluate_fallback.py": "micro-pipeline", "test_evaluate_ranks.py": "micro-pipeline",
    "test_lm_eval.py": "micro-pipeline",
}
"""Module -> group, for every module that uses a ``SHARED_SESSIONS`` fixture (checked at
collection)."""
SLURM_LAST_MODULE = "test_slurm_launch.py"  # seconds: the lane's worker then takes other work


def xdist_group_of(nodeid: str) -> str:
    """The group of a test, by its node id: the scheduler sees ids only."""
    module = nodeid.split("::", 1)[0]
    name = Path(module).name
    if "slurm" in name:
        return SLURM_GROUP
    return SHARED_SESSION_MODULES.get(name, module)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is installed
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 - xdist's type
    """Schedule groups (``xdist_group_of``) in collection order: the Slurm lane first."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    config.option.loadscopereorder = False  # keep the order below
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Check the Slurm marker against the Slurm group and the users of the shared CLI session
    against its group; put the Slurm lane first, its quick launch checks last, since the
    lane takes longest."""
    for item in items:
        marked = item.get_closest_marker("slurm") is not None
        if marked != (xdist_group_of(item.nodeid) == SLURM_GROUP):
            raise pytest.UsageError(
                f"{item.nodeid}: tests marked slurm, and only they, belong in a module with "
                "'slurm' in its name (they run in turn on one worker)")
        module = Path(item.nodeid.split("::", 1)[0]).name
        for fixture, group in SHARED_SESSIONS.items():
            if (fixture in getattr(item, "fixturenames", ())
                    and SHARED_SESSION_MODULES.get(module) != group):
                raise pytest.UsageError(
                    f"{item.nodeid}: a module that uses {fixture} belongs in group {group!r} "
                    "of SHARED_SESSION_MODULES (tests/conftest.py), so that it shares the "
                    "session")

    def order(item: pytest.Item) -> int:
        if xdist_group_of(item.nodeid) != SLURM_GROUP:
            return 2
        return 1 if Path(item.nodeid.split("::", 1)[0]).name == SLURM_LAST_MODULE else 0

    items.sort(key=order)


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


@pytest.fixture(scope="session", autouse=True)
def forked_local_launches() -> Iterator[None]:
    """Local launches made in a test's own process (``stages.mechanism.launch.run_local``: the
    inline executor, the stages a fixture runs) fork their rank 0 from a warm interpreter
    that has imported torch and the trainer (``tests.rank_zygote.ForkedLocalRanks``) instead
    of starting a fresh one: seconds of imports a launch. The ranks, their rendezvous and
    files are a real launch's. For the whole session, so that module- and session-scoped
    fixtures' launches fork too. Launchers and drivers started as processes of their own
    (``python -m stages.mechanism.launch``, ``python -m workflows.pipeline``) start theirs as
    always, unless a test asks for forked ones (``tests.warm_cli``, ``forked_launches``)."""
    import stages.mechanism.launch
    from tests.rank_zygote import ForkedLocalRanks

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stages.mechanism.launch, "LocalRanks", ForkedLocalRanks)
        yield


@pytest.fixture(scope="session")
def made_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """A function ``made_once(name, make)``: the directory ``name`` that ``make(directory)``
    filled, made once per test run. The pytest-xdist workers of one run share it (they are
    processes of one run, with one temporary root): the first to ask makes it while holding
    a file lock, the others wait for it and read it. A make that failed is made again by the
    next to ask. Only for what tests read and never change."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "made-once"
    root.mkdir(exist_ok=True)

    def made(name: str, make: Callable[[Path], None]) -> Path:
        target, done = root / name, root / f"{name}.done"
        with FileLock(str(root / f"{name}.lock")):
            if not done.exists():
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir()
                make(target)
                done.touch()
        return target

    return made


@pytest.fixture(scope="session")
def microbench_cache(made_once: Callable[..., Path]) -> Path:
    """This machine's microbenchmark for MICROBENCH_NPROC ranks, measured once per test run
    (``made_once``); its JSON file."""
    from model.planner.microbench import cache_file, measured_cluster_fields

    cache_dir = made_once("microbench",
                          lambda d: measured_cluster_fields(MICROBENCH_NPROC, cache_dir=d))
    path = cache_file(MICROBENCH_NPROC, cache_dir)
    assert path.is_file(), f"the microbenchmark left no cache file at {path}"
    return path


@pytest.fixture(scope="session")
def seed_microbench(microbench_cache: Path) -> Callable[..., Path]:
    """A function that puts the session's measurement where the plan stage of a runs dir
    looks first (``<runs dir>/cache/microbench/``); it returns the copied file.

    ``seed(runs_dir, 3, 4)`` also files it as the measurement of 3 and 4 ranks, so a test
    planning other rank counts measures nothing (a minute each); the plans it picks may
    differ from a fresh measurement's, which no test depends on. ``hosts``: the names of
    other machines that plan in this runs dir (the Slurm test cluster's nodes, one CPU with
    this machine's), under which it is filed too."""

    from model.planner.microbench import cache_file

    def seed(runs_dir: Path, *rank_counts: int, hosts: tuple[str, ...] = ()) -> Path:
        target = Path(runs_dir) / "cache" / "microbench" / microbench_cache.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(microbench_cache, target)
        measured = json.loads(microbench_cache.read_text())
        for host in (None, *hosts):
            for nproc in sorted({measured["nproc"], *rank_counts}):
                path = cache_file(nproc, target.parent, host)
                if path != target:  # the copy itself stays byte for byte the measurement
                    path.write_text(json.dumps(measured | {"nproc": nproc}))
        return target

    return seed


@pytest.fixture(scope="session")
def migrated_store(made_once: Callable[..., Path]) -> Path:
    """An MLflow SQLite store created and migrated once per test run (``made_once``); its
    database file.

    It holds only what MLflow puts in every new store (its ``Default`` experiment, whose
    artifact root MLflow resolves against the current directory: the repository root, the
    directory the tests start drivers in)."""
    from stages.mechanism import tracking

    def make(directory: Path) -> None:
        with contextlib.chdir(REPO):
            tracking.MlflowClient(f"sqlite:///{directory / 'mlflow.db'}").search_experiments()

    path = made_once("migrated-store", make) / "mlflow.db"
    assert path.is_file(), f"MLflow made no store at {path}"
    return path


@pytest.fixture(scope="session")
def seed_store(migrated_store: Path) -> Callable[[Path], str]:
    """A function that copies the session's migrated store to ``<directory>/mlflow.db``, the
    default store of a runs dir
    (``stages.mechanism.tracking_store.default_tracking_uri``), and returns
    its
    ``sqlite:///`` URI. The directory must not have a store yet."""

    def seed(directory: Path) -> str:
        target = Path(directory) / "mlflow.db"
        assert not target.exists(), f"{target} exists: seed a store only into a new directory"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(migrated_store, target)
        return f"sqlite:///{target.resolve()}"

    return seed


@pytest.fixture
def runs_dir(tmp_path: Path, seed_microbench: Callable[[Path], Path],
             seed_store: Callable[[Path], str]) -> Path:
    """A fresh runs dir for one test: the session's microbenchmark cached in it and a copy of
    the session's migrated MLflow store as its store."""
    path = tmp_path / "runs"
    path.mkdir()
    seed_microbench(path)
    seed_store(path)
    return path


@pytest.fixture(scope="session")
def micro_tokenize_output(made_once: Callable[..., Path], seed_microbench: Callable[..., Path],
                          seed_store: Callable[[Path], str]) -> Path:
    """The micro preset's published tokenize output, made once per test run (``made_once``)
    by the pipeline's command line (``--only curate``, then ``--only tokenize``); its stage
    directory (the curate output beside it, under ``stages/curate``)."""
    from tests import warm_cli

    def make(directory: Path) -> None:
        runs = directory / "runs"
        seed_microbench(runs)
        seed_store(runs)
        for stage in ("curate", "tokenize"):
            proc = warm_cli.run("workflows.pipeline", ["--config", "micro", "--runs-dir",
                                                       str(runs), "--only", stage], timeout=600)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    runs = made_once("micro-tokenized", make) / "runs"
    (published,) = [p for p in (runs / "stages" / "tokenize").iterdir()
                    if p.is_dir() and "." not in p.name]
    return published


@pytest.fixture
def tokenized_runs_dir(runs_dir: Path, micro_tokenize_output: Path) -> Path:
    """``runs_dir`` holding a copy of the micro preset's curate and tokenize outputs (their
    paths rewritten to the copy), which a micro pipeline reuses: for tests about the stages
    after them, which then reach training sooner. Tokenizing itself is tested where it is
    asserted."""
    from stages.mechanism.outputs import OUTPUTS_FILE, relocate, write_outputs

    made = micro_tokenize_output.parent.parent  # runs/stages of the made-once run
    for stage in ("curate", "tokenize"):
        for source in (made / stage).iterdir():
            if not source.is_dir() or "." in source.name:
                continue
            target = runs_dir / "stages" / stage / source.name
            shutil.copytree(source, target)
            outputs = json.loads((target / OUTPUTS_FILE).read_text())
            write_outputs(target, relocate(outputs, str(source), str(target)))
    return runs_dir


@pytest.fixture(scope="session")
def micro_cli_history(tmp_path_factory: pytest.TempPathFactory,
                      seed_microbench: Callable[[Path], Path],
                      seed_store: Callable[[Path], str]):
    """A user's session with the pipeline's command line, once per test session: the micro
    preset's first run, the same run again, ``--only evaluate`` and ``--dry-run`` on one new
    runs dir (``tests.micro_cli.user_session``). Tests only read its records and runs dir."""
    from tests.micro_cli import user_session

    runs_dir = tmp_path_factory.mktemp("micro-cli") / "runs"
    runs_dir.mkdir()
    seed_microbench(runs_dir)
    seed_store(runs_dir)
    return user_session(runs_dir)


@pytest.fixture
def plan_search_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's search (``model.planner.choose.choose``), run once per distinct input in
    this test process and answered from that run afterwards (a copy each time).

    For modules about what the readiness report makes of a plan, which ask for the same
    Frontier preset's plan dozens of times (seconds each); the search itself is tested in
    ``test_plan_search.py``."""
    import copy
    import pickle

    import model.planner.choose as module

    search = module.choose
    answers = _state.setdefault("plan_search_answers", {})

    def choose_once(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - choose's own
        key = pickle.dumps((args, sorted(kwargs.items())))
        if key not in answers:
            answers[key] = search(*args, **kwargs)
        return copy.deepcopy(answers[key])

    monkeypatch.setattr(module, "choose", choose_once)


@dataclass(frozen=True)
class Console:
    """A command's exit status and what it printed (the fields of a CompletedProcess)."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def pipeline_main(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
                  ) -> Iterator[Callable[..., Console]]:
    """A function that runs the pipeline command line in this process:
    ``workflows.pipeline.main(argv)`` from the repository root, as ``python -m
    workflows.pipeline ARGV`` runs it there. It returns the exit status (argparse's
    ``SystemExit`` included) and the console. The environment is restored afterwards.

    An exception main lets out fails the test, as a traceback on the real console would; a
    few cases also run as real processes (``tests/reliability/test_bad_inputs.py``)."""
    from workflows import pipeline

    monkeypatch.chdir(REPO)
    saved = dict(os.environ)

    def run(*argv: str) -> Console:
        capsys.readouterr()  # drop what the test printed before
        try:
            code = pipeline.main(list(argv))
        except SystemExit as exit_:
            code = 0 if exit_.code is None else exit_.code
        printed = capsys.readouterr()
        return Console(code, printed.out, printed.err)

    yield run
    os.environ.clear()
    os.environ.update(saved)
