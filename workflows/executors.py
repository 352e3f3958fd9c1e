"""The Parsl configuration built from the pipeline config's ``site`` section: its
executors, where each stage's apps run, and starting and stopping Parsl.

The executors:

- ``cpu``: a HighThroughputExecutor on the submitting machine (the login node under
  Slurm) for the light apps: the plan stage and the prepare / finalize apps of train
  (light: checks, the rank spec, summary and plots). Locally every Python app runs here.
- ``compute`` (slurm, frontier): an HTEX whose block is a Slurm job of
  ``site.tokenize_nodes`` nodes, one worker pool of ``site.max_workers`` workers per node
  (``SrunLauncher``), for the stages placed on compute nodes (tokenize: prepare, every
  shard, finalize). Its workers connect back to the interchange on the login node at
  ``site.address``, encrypted.
- the allocations, where the multi-rank apps run. Locally one executor, ``train``: a
  one-worker HTEX whose bash app calls ``stages.mechanism.launch`` for every ranks stage. On Slurm
  sites
  each stage with ranks or placed in an allocation has a block of its own, sized for it and
  labelled with the stage's name: ``train`` (the training ranks; ``parallel.nodes`` nodes,
  ``site.walltime``, Slurm's signal ahead of the end) and ``evaluate`` (its ranks, or its one
  process, and its Python apps: prepare, finalize with generations, export, lm-eval and
  plots; the evaluation's nodes, ``site.compute_walltime``). Each is an ``MPIExecutor`` whose
  block is a Slurm job and whose apps launch the ranks with ``$PARSL_MPI_PREFIX`` (an
  ``srun`` line Parsl composes from the task's resource specification); Python apps run on
  the block's first node, one at a time (``max_workers_per_block=1``; a stage's apps depend
  on each other, so they never wait for a worker they hold). A block is submitted when its
  stage's first app is ready and handed back as soon as the stage is done
  (``hand_back_allocation``), so an evaluation on one node never holds the training's
  nodes. Every stage's ranks are launched by one command builder
  (``workflows.ranks.ranks_command``), so they start the same way on every site.

A stage says where its Python apps run by its shape's ``placement`` (stages.mechanism.shape:
login, compute, allocation); ``executor_label`` is the one place that maps a stage's
placement to an executor for a site, ``allocation_label`` the one that names the executor of
its ranks. Only the driver, the plan stage, train's prepare / finalize and
MLflow's SQLite writes of those stay on the login node.

All site settings come from ``cfg.site`` (stages/config.py SiteConfig), so moving
between a
laptop, a generic Slurm cluster and Frontier is a config change, never a code change.
"""
from __future__ import annotations

import contextlib
import functools
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from parsl.config import Config
from parsl.executors import HighThroughputExecutor, MPIExecutor, ThreadPoolExecutor
from parsl.jobs.states import JobState
from parsl.launchers import SimpleLauncher, SrunLauncher
from parsl.providers import LocalProvider, SlurmProvider

from stages.config import PipelineConfig
from stages.mechanism.shape import ALLOCATION, COMPUTE, LOGIN, PLACEMENTS
from stages.registry import PIPELINE, declaration
from workflows import parsl_seam
from workflows.failures import retry_cost
from workflows.frontier import (
    FRONTIER_MODULES,
    FRONTIER_RCCL_PLUGIN_MODULE,
    NODE_LOCAL_CONSTRAINT,
    SLURM_SITES,
    SiteError,
    allocation_stages,
    check_site,
    node_local_env_lines,
    runs_dir_chars_problem,
    stage_shapes,
    uses_plugin_module,
)
from workflows.ranks import project_pythonpath

BIN_DIR = Path(sys.executable).parent
"""The interpreter's bin/: holds Parsl's interchange.py and process_worker_pool.py."""

LOCAL_RANKS_LABEL = "train"
"""Locally, the one executor that starts every ranks stage's launcher."""

LOGIN_LABELS = ("cpu", LOCAL_RANKS_LABEL)
"""The executors whose workers may be the driver's threads (``site.login_workers``)."""

ALLOCATION_LABELS = tuple(stage.name for stage in PIPELINE if stage.worker)
"""Under slurm/frontier: the executors of the stages that may run ranks or apps in an
allocation, each labelled with its stage's name ("train", "evaluate")."""

EXECUTOR_LABELS = ("cpu", "compute", *dict.fromkeys((LOCAL_RANKS_LABEL, *ALLOCATION_LABELS)))
"""Every executor label a site may have ("compute" and "evaluate" only under slurm/frontier)."""


def make_parsl_config(cfg: PipelineConfig, run_dir: Path, parsl_dir: Path | None = None,
                      running: Collection[str] | None = None) -> Config:
    """Build the Parsl config for ``cfg.site.name``: executor "cpu", locally "train" for
    every stage's ranks, under slurm/frontier "compute" and one block per allocation stage
    ("train", "evaluate").

    ``running`` names the stages this invocation runs (default: all): only the executors
    they use are made, so ``--only evaluate`` asks for the evaluation's block alone.

    Parsl's own logs and submit scripts go under ``parsl_dir`` (default ``run_dir/parsl``);
    every driver passes its own, since two drivers sharing one mix them. Stage reuse is keyed by
    the stage mechanism, so no Parsl app caching is configured; failed apps are retried
    ``cfg.site.retries`` times unless they are user errors (``workflows.failures``);
    training resumes from its last complete checkpoint.
    """
    site = cfg.site.name
    run_dir_parsl = Path(parsl_dir or Path(run_dir) / "parsl")
    check_site(cfg)
    # Parsl writes its directory unquoted into the worker pools' command lines and scripts.
    problem = runs_dir_chars_problem(cfg, run_dir_parsl)
    if problem:
        raise SiteError(problem)
    # Only the executors the running stages use: --only tokenize starts no training
    # executor (no interchange, no local worker pool).
    allocations = allocation_stages(cfg, running)
    if site == "local":
        executors = [cpu_executor(cfg), *([local_train_executor(cfg)] if allocations else [])]
    elif site in SLURM_SITES:
        compute = any(shape.placement == COMPUTE for _, shape in stage_shapes(cfg, running))
        executors = [cpu_executor(cfg), *([compute_executor(cfg)] if compute else []),
                     *(slurm_allocation_executor(cfg, name) for name, _ in allocations)]
    else:  # SiteConfig already restricts the names; kept for a clear message.
        raise SiteError(f"site.name={site!r} is not one of local, slurm, frontier")
    return Config(
        executors=executors,
        run_dir=str(run_dir_parsl),
        retries=cfg.site.retries,
        # User errors fail at once; lost workers and killed ranks are retried, in a new
        # block (``end_blocks``). Ranks out of time cost nothing.
        retry_handler=functools.partial(retry_cost, budget=cfg.site.retries,
                                        stopping=threading.Event(), hand_back=end_blocks),
        # Frequent strategy passes: first app starts sooner, lost blocks are replaced sooner.
        strategy_period=0.5 if site == "local" else 1,
        initialize_logging=True,
    )


def start_parsl(cfg: PipelineConfig, run_dir: Path, parsl_dir: Path,
                running: Collection[str] | None = None) -> Any:
    """Load ``make_parsl_config``'s configuration; return the DataFlowKernel.

    Parsl's interchanges (children of this driver) start with SIGINT ignored: a Ctrl-C in a
    terminal signals the whole process group, and they must live until ``stop_parsl`` stops
    them, not die first and leave the cleanup waiting on them.
    """
    import parsl

    interactive_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return parsl.load(make_parsl_config(cfg, run_dir, parsl_dir, running))
    finally:
        signal.signal(signal.SIGINT, interactive_handler)


def stop_parsl(dfk: Any, interrupted: bool = False, keep: Collection[int] = ()) -> None:
    """Stop Parsl (``dfk.cleanup()``, ``parsl.clear()``) within a deadline, also when its
    interchanges are gone.

    Apps on a ThreadPoolExecutor (``site.login_workers: threads``) run in this process and
    cannot be stopped, but what they wait on can: when ``interrupted``, this process's child
    processes but ``keep`` (the driver's own: its watchdog, its MLflow server) and Parsl's
    interchanges are stopped first (``stop_children``): a launcher and its ranks, a
    microbenchmark's ranks.

    A SIGTERM sent to the driver's whole process group (``timeout``, ``scancel`` of a job
    that runs the driver, a closed terminal) kills the interchanges along with the driver.
    Parsl's job-status poller asks each interchange for its connected blocks over a REQ
    socket with no timeout, and ``cleanup`` joins that poller with no timeout: a poll that
    meets a dead interchange blocks the poller, and the cleanup with it, forever. So:

    1. the poller is told to stop first, before it can start another query;
    2. when ``interrupted``, each interchange gets up to ``INTERCHANGE_EXIT_GRACE_S`` (one
       window for all: one signal hit them together) to be seen gone; an executor whose
       interchange has exited is set to its bad state (cleanup then skips its scale-in) and
       its blocks are cancelled through the provider;
    3. ``cleanup`` runs with a deadline (``CLEANUP_DEADLINE_S``); a cleanup still waiting on
       a dead peer then is left behind (its thread is a daemon), and every executor's
       interchange is killed and its blocks cancelled here instead.
    """
    import parsl

    handler = dfk.config.retry_handler
    if isinstance(handler, functools.partial) and "stopping" in handler.keywords:
        handler.keywords["stopping"].set()  # apps failed by the shutdown are not retried
    if interrupted and any(e.label in LOGIN_LABELS and isinstance(e, ThreadPoolExecutor)
                           for e in dfk.executors.values()):
        interchanges = (parsl_seam.interchange_process(e) for e in dfk.executors.values())
        stop_children({*keep, *(proc.pid for proc in interchanges if proc is not None)})
    parsl_seam.stop_status_poller(dfk)  # no new query to an interchange that may be gone
    deadline = time.monotonic() + (INTERCHANGE_EXIT_GRACE_S if interrupted else 0.0)
    for executor in dfk.executors.values():
        process = parsl_seam.interchange_process(executor)
        if process is None or _alive_until(process, deadline):
            continue
        parsl_seam.fail_executor(executor, RuntimeError(
            f"the {executor.label} executor's interchange exited ({process.returncode})"))
        _cancel_blocks(executor)
    cleanup = threading.Thread(target=dfk.cleanup, name="parsl-cleanup", daemon=True)
    cleanup.start()
    cleanup.join(CLEANUP_DEADLINE_S[interrupted])
    if cleanup.is_alive():
        print(f"[pipeline] Parsl's cleanup did not finish in {CLEANUP_DEADLINE_S[interrupted]:.0f} "
              "s (a peer it waits on is gone): killing its interchanges and cancelling its "
              "blocks", file=sys.stderr, flush=True)
        for executor in dfk.executors.values():
            process = parsl_seam.interchange_process(executor)
            if process is not None and process.poll() is None:
                process.kill()
            _cancel_blocks(executor)
    parsl.clear()


def stop_children(keep: Collection[int] = ()) -> None:
    """SIGTERM this process's children but ``keep``, with their descendants; SIGKILL those
    left after the watchdog's grace (``watchdog.terminate_then_kill``)."""
    import psutil

    from workflows.watchdog import terminate_then_kill

    doomed = []
    for child in psutil.Process().children():
        if child.pid in keep:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            doomed += [child, *child.children(recursive=True)]
    terminate_then_kill(doomed)


INTERCHANGE_EXIT_GRACE_S = 3.0
"""How long an interrupted driver waits to see its interchanges exit (a loaded machine may
take a moment to run a signalled process's exit)."""

CLEANUP_DEADLINE_S = {False: 60.0, True: 3.0}
"""How long ``dfk.cleanup`` may take: after a normal run (HTEX gives a live interchange up
to 10 s to exit) and after an interrupt (the user waits for the prompt)."""


def end_blocks(task_record: dict[str, Any]) -> None:
    """Hand back the Slurm block of the ranks' executor a retried task ran on (its ranks
    ended out of time, or failed: ``workflows.failures``): the rest of its walltime holds no
    further job, and the retry must not start there. Parsl holds the block's workers first
    (no task reaches them) and cancels the job; a new block is submitted for the retry.
    Local blocks, and those of executors shared by many apps, are kept."""
    dfk, label = task_record.get("dfk"), task_record.get("executor")
    _scale_in_running(getattr(dfk, "executors", {}).get(label))


def hand_back_allocation(label: str) -> None:
    """Hand back the Slurm block of allocation ``label`` once its stage is done: nothing
    else runs there, and Parsl would hold it until its idle timeout (two minutes of every
    node of the allocation). Locally nothing is handed back."""
    import parsl
    from parsl.errors import NoDataFlowKernelError

    try:
        dfk = parsl.dfk()
    except NoDataFlowKernelError:  # the driver is shutting Parsl down
        return
    _scale_in_running(dfk.executors.get(label))


def running_blocks(status: dict[str, Any], connected: Collection[str]) -> list[str]:
    """The blocks of an executor that run now: those Slurm last said were running, and those
    whose worker pool is connected to the interchange. The status comes from Parsl's last
    poll (``PolledSlurmProvider``: up to a minute old), so a job that started since still
    reads pending; its connected workers say it runs. A block that is neither is pending: the
    replacement Parsl already asked for. Terminal blocks are never counted."""
    return [block for block, job in status.items()
            if not job.terminal and (job.state == JobState.RUNNING or block in connected)]


def _scale_in_running(executor: Any) -> None:
    """Cancel the running blocks of a Slurm-backed MPIExecutor (others are left alone)."""
    if not isinstance(executor, MPIExecutor) or not isinstance(executor.provider, SlurmProvider):
        return
    status = parsl_seam.block_status(executor)
    # Ask the interchange only where the last poll may be stale, and only a live one: a query
    # to a dead interchange never returns (the driver may be shutting down after a signal).
    process = parsl_seam.interchange_process(executor)
    stale = any(not job.terminal and job.state != JobState.RUNNING for job in status.values())
    ask = stale and process is not None and process.poll() is None
    running = running_blocks(status, set(parsl_seam.connected_blocks(executor)) if ask else set())
    if running:
        parsl_seam.scale_in(executor, len(running))


def _cancel_blocks(executor: Any) -> None:
    """Cancel an executor's blocks through its provider (local worker pools, Slurm jobs)."""
    job_ids = parsl_seam.job_ids(executor)
    if not job_ids or executor.provider is None:
        return
    try:
        executor.provider.cancel(job_ids)
    except Exception as error:  # noqa: BLE001 - cleanup goes on; say what is left
        print(f"[pipeline] could not cancel {executor.label} blocks {job_ids}: {error}",
              file=sys.stderr, flush=True)


def _alive_until(process: Any, deadline: float) -> bool:
    """Whether a child process is still running at ``deadline`` (``time.monotonic``)."""
    try:
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return True
    return False


def _python_path_init() -> str:
    """Shell line making the project importable by workers (apps are pickled by reference)."""
    return f"export PYTHONPATH={project_pythonpath(quote=True)}"


def _path_init() -> str:
    """Shell lines putting this interpreter's bin/ first on PATH (HTEX finds its worker pool
    there) and the project on PYTHONPATH."""
    return f"export PATH={shlex.quote(str(BIN_DIR))}:$PATH\n{_python_path_init()}"


def interchange_command() -> str:
    """HTEX's ``interchange_launch_cmd``: the script beside this interpreter, so Parsl works
    when the venv is not activated (``.venv/bin/python -m ...``)."""
    # A plain string: Popen runs it as one program path, and MPIExecutor accepts only str.
    script = BIN_DIR / "interchange.py"
    return str(script) if script.exists() else "interchange.py"


def _local_htex(label: str, workers: int) -> HighThroughputExecutor:
    """An HTEX of ``workers`` workers on this machine, reached over loopback, its one block
    started at once."""
    return HighThroughputExecutor(
        label=label,
        address="127.0.0.1",
        max_workers_per_node=workers,
        cores_per_worker=1e-6,  # the worker count is max_workers, whatever the core count
        interchange_launch_cmd=interchange_command(),
        provider=LocalProvider(init_blocks=1, min_blocks=0, max_blocks=1, worker_init=_path_init()),
    )


def _login_executor(cfg: PipelineConfig, label: str,
                    workers: int) -> HighThroughputExecutor | ThreadPoolExecutor:
    """``workers`` workers on the submitting machine: worker processes (an HTEX) or threads
    of the driver (``site.login_workers``)."""
    if cfg.site.login_workers == "threads":
        return ThreadPoolExecutor(label=label, max_threads=workers)
    return _local_htex(label, workers)


def cpu_executor(cfg: PipelineConfig) -> HighThroughputExecutor | ThreadPoolExecutor:
    """Light stages: ``site.max_workers`` workers on the submitting machine."""
    return _login_executor(cfg, "cpu", cfg.site.max_workers)


def local_train_executor(cfg: PipelineConfig) -> HighThroughputExecutor | ThreadPoolExecutor:
    """One worker whose bash app runs the launcher, so light stages never queue behind training
    and one launch at a time has this machine's cores."""
    return _login_executor(cfg, "train", 1)


def _heartbeat(cfg: PipelineConfig) -> dict[str, int]:
    """The heartbeat settings of an executor whose workers run on compute nodes: lost after
    ``site.heartbeat_threshold`` seconds, a heartbeat every quarter of that."""
    threshold = cfg.site.heartbeat_threshold
    return {"heartbeat_threshold": threshold, "heartbeat_period": max(1, threshold // 4)}


def _exclusive(cfg: PipelineConfig) -> bool:
    """Whether the blocks take whole nodes: ``site.exclusive``, by default only on Frontier."""
    if cfg.site.exclusive is not None:
        return cfg.site.exclusive
    return cfg.site.name == "frontier"


class PolledSlurmProvider(SlurmProvider):
    """A SlurmProvider that polls job states every ``poll_seconds`` (Parsl's is fixed at 60 s).

    A cancelled or preempted block is only replaced once its end is seen, so polling as
    often as the heartbeat threshold lets a retried training app restart promptly.
    """

    def __init__(self, *args: Any, poll_seconds: int = 60, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.poll_seconds = poll_seconds

    @property
    def status_polling_interval(self) -> int:
        return self.poll_seconds


def scheduler_options(cfg: PipelineConfig, stop_signal: bool = False) -> str:
    """The #SBATCH lines of a block: ``--no-requeue``, on Frontier with OLCF's RCCL plugin
    module ``--network=disable_rdzv_get``, the training block's ``--signal``, then
    ``site.scheduler_options``.

    Parsl owns retries: a block that loses a node must end, so that Parsl submits a new one
    and the retried app resumes from its checkpoint. A job Slurm requeued instead
    (``JobRequeue=1``, the default on many sites) would keep Parsl waiting on a block that
    looks pending, for as long as the site's requeue delay.

    ``stop_signal`` (the training block): ``--signal=USR1@N`` with N =
    ``site.save_before_end()`` (``site.save_before_end_s`` or the site's default),
    sent to every job step (the ranks' srun step; not the batch shell, where Parsl's worker
    runs), so the ranks checkpoint at their next step and end out of time before Slurm kills
    the job (``stages.train.worker``); the driver resumes them in a new job.
    """
    lines = "#SBATCH --no-requeue\n"
    if uses_plugin_module(cfg):
        # OLCF's rccl-net-plugin module selects libfabric's alt_read rendezvous, which
        # needs this allocation flag (docs/frontier.md).
        lines += "#SBATCH --network=disable_rdzv_get\n"
    ahead = cfg.site.save_before_end() if stop_signal else 0
    if ahead:
        lines += f"#SBATCH --signal=USR1@{ahead}\n"
    if cfg.site.scheduler_options.strip():
        lines += cfg.site.scheduler_options.strip() + "\n"
    return lines


def allocation_provider(cfg: PipelineConfig, stage: str) -> SlurmProvider:
    """The SlurmProvider whose blocks (one Slurm job each) are stage ``stage``'s allocation.

    No block is submitted until the stage's first app there is ready (init_blocks=0), so the
    allocation is not held while other stages run. A block spans the stage's nodes; a
    non-exclusive job asks for one CPU per rank on a node (or site.cores_per_node) so srun
    can place the ranks inside it. A resumable stage (training) runs for ``site.walltime``
    and gets Slurm's signal ahead of the end, to checkpoint and go on in the next job;
    others (evaluation) run for ``site.compute_walltime`` when set.
    """
    site = cfg.site
    shape = declaration(stage).shape(cfg)
    cores = site.cores_per_node
    if cores is None and not _exclusive(cfg):
        cores = shape.ranks_per_node
    resumable = declaration(stage).resumable
    walltime = site.walltime if resumable else (site.compute_walltime or site.walltime)
    return _block_provider(cfg, shape.nodes, cores, SimpleLauncher(), stop_signal=resumable,
                           walltime=walltime)


def _block_provider(cfg: PipelineConfig, nodes: int, cores: int | None,
                    launcher: Any, stop_signal: bool = False,
                    walltime: str | None = None) -> SlurmProvider:
    """A block of ``nodes`` nodes (``cores`` CPUs per node when not exclusive) for
    ``walltime`` (default ``site.walltime``), submitted only when an app needs it
    (init_blocks=0), at most one at a time, polled as often as the heartbeat threshold;
    ``stop_signal``: with the training block's ``--signal``."""
    site = cfg.site
    return PolledSlurmProvider(
        poll_seconds=min(60, site.heartbeat_threshold),
        account=site.account,
        partition=site.partition,
        qos=site.qos,
        walltime=walltime or site.walltime,
        nodes_per_block=nodes,
        cores_per_node=cores,
        scheduler_options=scheduler_options(cfg, stop_signal),
        # The packed environment is copied to node-local NVMe, which Frontier gives a job
        # only under this constraint (#SBATCH -C nvme).
        constraint=NODE_LOCAL_CONSTRAINT if site.node_local_env else None,
        worker_init=worker_init(cfg),
        exclusive=_exclusive(cfg),
        launcher=launcher,
        init_blocks=0,
        min_blocks=0,
        max_blocks=1,
        cmd_timeout=30,
    )


def slurm_allocation_executor(cfg: PipelineConfig, stage: str) -> MPIExecutor:
    """Stage ``stage``'s allocation on a Slurm site: one worker in a block of
    ``allocation_provider``, whose apps start the ranks with ``$PARSL_MPI_PREFIX`` (srun)."""
    return MPIExecutor(
        label=stage,
        mpi_launcher="srun",
        max_workers_per_block=1,
        provider=allocation_provider(cfg, stage),
        address=cfg.site.address,
        interchange_launch_cmd=interchange_command(),
        **_heartbeat(cfg),
        # CurveZMQ between the login node's interchange and the compute nodes' worker pool
        # (MPIExecutor defaults to plain text); the keys sit in the run's Parsl directory,
        # which the nodes read over the shared filesystem.
        encrypted=True,
    )


def compute_provider(cfg: PipelineConfig) -> SlurmProvider:
    """The SlurmProvider of the "compute" block: ``site.tokenize_nodes`` nodes, one worker
    pool per node (srun starts one task per node).

    Submitted only when the first app placed on compute nodes is ready (init_blocks=0) and
    handed back once idle, so nothing is held before or after. A non-exclusive job asks for
    ``site.max_workers`` CPUs per node (one per worker); srun gives the pool as many, so its
    workers are not bound to one core.
    """
    cores = cfg.site.max_workers
    launcher = SrunLauncher(overrides=f"--ntasks-per-node=1 --cpus-per-task={cores}")
    return _block_provider(cfg, cfg.site.tokenize_nodes,
                           None if _exclusive(cfg) else cores, launcher,
                           walltime=cfg.site.compute_walltime or cfg.site.walltime)


def compute_executor(cfg: PipelineConfig) -> HighThroughputExecutor:
    """Python apps on compute nodes: ``site.max_workers`` workers on each node of the block."""
    return HighThroughputExecutor(
        label="compute",
        address=cfg.site.address,
        max_workers_per_node=cfg.site.max_workers,
        cores_per_worker=1e-6,  # the worker count is max_workers, whatever the core count
        interchange_launch_cmd=interchange_command(),
        provider=compute_provider(cfg),
        **_heartbeat(cfg),
        # The workers on the compute nodes reach the login node's interchange over the
        # network: CurveZMQ, keys in the run's Parsl directory (shared filesystem).
        encrypted=True,
    )


def executor_label(cfg: PipelineConfig, stage: str, placement: str) -> str:
    """The executor that runs the Python apps of stage ``stage`` placed at ``placement``.

    local: "cpu" for every placement (this machine); slurm/frontier: login -> "cpu",
    compute -> "compute", allocation -> the stage's own allocation (``allocation_label``).
    """
    if placement not in PLACEMENTS:
        raise SiteError(f"unknown stage placement {placement!r}; one of {PLACEMENTS}")
    if cfg.site.name == "local":
        return "cpu"
    if placement == ALLOCATION:
        return allocation_label(cfg, stage)
    return {LOGIN: "cpu", COMPUTE: "compute"}[placement]


def allocation_label(cfg: PipelineConfig, stage: str) -> str:
    """The executor of stage ``stage``'s ranks: locally the one "train" worker that starts
    every launch; under Slurm the stage's own block, labelled with its name."""
    return LOCAL_RANKS_LABEL if cfg.site.name == "local" else stage


def app_resource_spec(cfg: PipelineConfig, label: str) -> dict[str, Any]:
    """The resource specification of a Python app on executor ``label``.

    The MPIExecutor refuses a task without one: a Python app there claims one node of the
    block and runs in the worker on the block's first node. Other executors take none.
    """
    if label in ALLOCATION_LABELS and cfg.site.name != "local":
        return {"num_nodes": 1, "ranks_per_node": 1, "num_ranks": 1}
    return {}


def worker_init(cfg: PipelineConfig) -> str:
    """Shell lines run in the batch job before Parsl's worker pool starts: the modules
    (Frontier: also OLCF's RCCL network plugin module unless site.rccl_plugin_path is set),
    then the Python environment (site.node_local_env copied to each node's NVMe, or
    site.conda_env activated, or this interpreter's bin/ on PATH), then site.worker_init.

    Every config value is shell-quoted; site.worker_init is shell by design and kept as is.
    """
    site = cfg.site
    lines: list[str] = []
    modules = site.modules
    if modules is None:
        modules = list(FRONTIER_MODULES) if site.name == "frontier" else []
    if modules:
        lines.append("module load " + " ".join(shlex.quote(module) for module in modules))
    if uses_plugin_module(cfg):
        # After rocm, as OLCF loads it: the plugin and its recommended Slingshot settings.
        lines.append(f"module load {FRONTIER_RCCL_PLUGIN_MODULE}")
    if site.node_local_env:
        lines.extend(node_local_env_lines(site.node_local_env))
        lines.append(_python_path_init())
    elif site.conda_env:
        lines.append(f"source activate {shlex.quote(site.conda_env)}")
        lines.append(_python_path_init())
    else:
        lines.append(_path_init())
    if site.worker_init.strip():
        lines.append(site.worker_init.strip())
    return "\n".join(lines)
