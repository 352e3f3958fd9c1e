"""Parsl site configurations built from the pipeline config's ``site`` section.

The executors:

- ``cpu``: a HighThroughputExecutor on the submitting machine (the login node under
  Slurm) for the light apps: the plan stage and the prepare / finalize apps of train
  (light: checks, the rank spec, summary and plots). Locally every Python app runs here.
- ``compute`` (slurm, frontier): an HTEX whose block is a Slurm job of
  ``site.tokenize_nodes`` nodes, one worker pool of ``site.max_workers`` workers per node
  (``SrunLauncher``), for the stages placed on compute nodes (tokenize: prepare, every
  shard, finalize). Its workers connect back to the interchange on the login node at
  ``site.address``, encrypted.
- ``train``: where the multi-rank apps run (the training ranks, then the evaluation
  ranks when eval.ranks > 1). Locally a one-worker HTEX whose bash app calls ``torchrun``;
  on Slurm sites an ``MPIExecutor`` whose block is a Slurm job and whose apps launch the
  ranks with ``$PARSL_MPI_PREFIX`` (an ``srun`` line Parsl composes from the task's resource
  specification). Under Slurm the stages placed in the allocation (evaluate: prepare,
  ranks, finalize with generations, export, lm-eval and plots) run their Python apps here
  too, on the block's first node, one app at a time (``max_workers_per_block=1``; each
  stage's apps depend on each other, so they never wait for a worker they hold). Both
  stages' ranks are launched by one command builder (``ranks_command``), so they start the
  same way on every site.

A stage says where its Python apps run by its shape's ``placement`` (stages.stage:
login, compute, allocation); ``executor_label`` is the one place that maps a placement to
an executor for a site. Only the driver, the plan stage, train's prepare / finalize and
MLflow's SQLite writes of those stay on the login node.

All site settings come from ``cfg.site`` (stages/config.py SiteConfig), so moving between a
laptop, a generic Slurm cluster and Frontier is a config change, never a code change.
"""
from __future__ import annotations

import functools
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from string import Template
from typing import Any

from parsl.config import Config
from parsl.executors import HighThroughputExecutor, MPIExecutor
from parsl.executors.high_throughput.mpi_prefix_composer import compose_srun_launch_cmd
from parsl.launchers import SimpleLauncher, SrunLauncher
from parsl.providers import LocalProvider, SlurmProvider
from parsl.providers.slurm.template import template_string as SLURM_TEMPLATE
from parsl.utils import wtime_to_minutes

from stages.config import ConfigError, PipelineConfig
from stages.launch import RANK_ERROR_FILE, USER_ERROR_EXIT, RankSpec
from stages.registry import STAGE_ORDER, stage_module
from stages.stage import ALLOCATION, COMPUTE, LOGIN, PLACEMENTS, RANKS, StageShape
from workflows.failures import retry_cost

REPO_ROOT = Path(__file__).resolve().parent.parent
"""Project root: put on PYTHONPATH of the training ranks so ``-m stages.train_worker`` resolves."""

BIN_DIR = Path(sys.executable).parent
"""The interpreter's bin/: holds Parsl's interchange.py and process_worker_pool.py, torchrun."""

FRONTIER_MODULES = ("PrgEnv-gnu", "rocm/6.2.4", "craype-accel-amd-gfx90a", "miniforge3/23.11.0-0")
"""Modules loaded on Frontier compute nodes unless site.modules says otherwise."""

FRONTIER_GCDS_PER_NODE = 8
"""One training rank per MI250X GCD."""

FRONTIER_CORES_PER_NODE = 56
"""Usable cores of a Frontier node (64, 8 of them reserved for the system)."""

SLURM_PLACEMENT_EXECUTORS = {LOGIN: "cpu", COMPUTE: "compute", ALLOCATION: "train"}
"""Under slurm/frontier: a stage's placement -> the executor its Python apps run on."""

EXECUTOR_LABELS = ("cpu", "compute", "train")
"""Every executor label a site may have ("compute" only under slurm/frontier)."""

SITE_SRUN_OPTIONS = {
    # 7 cores per rank (56 usable per node), one GCD each, bound to the nearest NIC/cores.
    "frontier": "-c7 --gpus-per-task=1 --gpu-bind=closest",
    # Explicit: srun inside a job otherwise inherits the job's --cpus-per-task.
    "slurm": "--cpus-per-task=1",
}


class SiteError(ConfigError):
    """A site setting that cannot be used; the message names the key to change."""


# --------------------------------------------------------------------------------------------
# Parsl configuration
# --------------------------------------------------------------------------------------------


def make_parsl_config(cfg: PipelineConfig, run_dir: Path, parsl_dir: Path | None = None,
                      running: Collection[str] | None = None) -> Config:
    """Build the Parsl config for ``cfg.site.name``: executors "cpu" and "train", and under
    slurm/frontier "compute".

    ``running`` names the stages this invocation runs (default: all): the "train" block is
    sized for those of them that use it, so ``--only evaluate`` asks for the evaluation's
    nodes, not the training's.

    Parsl's own logs and submit scripts go under ``parsl_dir`` (default ``run_dir/parsl``);
    every driver passes its own, since two drivers sharing one mix them. Stage reuse is keyed by
    the stage mechanism, so no Parsl app caching is configured; failed apps are retried
    ``cfg.site.retries`` times unless they are user errors (``workflows.failures``);
    training resumes from its last complete checkpoint.
    """
    site = cfg.site.name
    if site == "local":
        executors = [_cpu_executor(cfg), _local_train_executor()]
    elif site in ("slurm", "frontier"):
        _check_slurm_site(cfg)
        executors = [_cpu_executor(cfg), _compute_executor(cfg),
                     _slurm_train_executor(cfg, running)]
    else:  # SiteConfig already restricts the names; kept for a clear message.
        raise SiteError(f"site.name={site!r} is not one of local, slurm, frontier")
    return Config(
        executors=executors,
        run_dir=str(parsl_dir or Path(run_dir) / "parsl"),
        retries=cfg.site.retries,
        # User errors fail at once; lost workers and killed ranks are retried.
        retry_handler=functools.partial(retry_cost, budget=cfg.site.retries,
                                        stopping=threading.Event()),
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


def stop_parsl(dfk: Any, interrupted: bool = False) -> None:
    """Stop Parsl (``dfk.cleanup()``, ``parsl.clear()``) within a deadline, also when its
    interchanges are gone.

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
    dfk.job_status_poller._kill_event.set()  # no new query to an interchange that may be gone
    deadline = time.monotonic() + (INTERCHANGE_EXIT_GRACE_S if interrupted else 0.0)
    for executor in dfk.executors.values():
        process = getattr(executor, "interchange_proc", None)
        if process is None or _alive_until(process, deadline):
            continue
        executor.set_bad_state_and_fail_all(RuntimeError(
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
            process = getattr(executor, "interchange_proc", None)
            if process is not None and process.poll() is None:
                process.kill()
            _cancel_blocks(executor)
    parsl.clear()


INTERCHANGE_EXIT_GRACE_S = 3.0
"""How long an interrupted driver waits to see its interchanges exit (a loaded machine may
take a moment to run a signalled process's exit)."""

CLEANUP_DEADLINE_S = {False: 60.0, True: 3.0}
"""How long ``dfk.cleanup`` may take: after a normal run (HTEX gives a live interchange up
to 10 s to exit) and after an interrupt (the user waits for the prompt)."""


def _cancel_blocks(executor: Any) -> None:
    """Cancel an executor's blocks through its provider (local worker pools, Slurm jobs)."""
    blocks = getattr(executor, "blocks_to_job_id", {})  # Parsl's internal thread pool has none
    job_ids = [job for job in blocks.values() if job]
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
    return f"export PYTHONPATH={shlex.quote(str(REPO_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}"


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


def _cpu_executor(cfg: PipelineConfig) -> HighThroughputExecutor:
    """Light stages: workers on the submitting machine, reached over loopback."""
    return HighThroughputExecutor(
        label="cpu",
        address="127.0.0.1",
        max_workers_per_node=cfg.site.max_workers,
        cores_per_worker=1e-6,  # the worker count is max_workers, whatever the core count
        interchange_launch_cmd=interchange_command(),
        provider=LocalProvider(init_blocks=1, min_blocks=0, max_blocks=1, worker_init=_path_init()),
    )


def _local_train_executor() -> HighThroughputExecutor:
    """One worker whose bash app runs torchrun, so light stages never queue behind training."""
    return HighThroughputExecutor(
        label="train",
        address="127.0.0.1",
        max_workers_per_node=1,
        cores_per_worker=1e-6,
        interchange_launch_cmd=interchange_command(),
        provider=LocalProvider(init_blocks=1, min_blocks=0, max_blocks=1, worker_init=_path_init()),
    )


def check_site(cfg: PipelineConfig) -> None:
    """The site settings' checks, before any work (the driver calls it first)."""
    if cfg.site.name in ("slurm", "frontier"):
        _check_slurm_site(cfg)


def _check_slurm_site(cfg: PipelineConfig) -> None:
    site = cfg.site
    if site.name == "frontier":
        if not site.account:
            raise SiteError(
                "site.account is required on Frontier: add --set site.account=<project id>"
            )
        if cfg.parallel.ranks_per_node > FRONTIER_GCDS_PER_NODE:
            raise SiteError(
                f"parallel.nproc={cfg.parallel.nproc} over parallel.nodes={cfg.parallel.nodes} "
                f"gives {cfg.parallel.ranks_per_node} ranks per node; Frontier has "
                f"{FRONTIER_GCDS_PER_NODE} GCDs per node: raise parallel.nodes"
            )
        if site.max_workers > FRONTIER_CORES_PER_NODE:
            raise SiteError(
                f"site.max_workers={site.max_workers}: each tokenize worker on a Frontier node "
                f"gets a core and a node has {FRONTIER_CORES_PER_NODE}: set site.max_workers <= "
                f"{FRONTIER_CORES_PER_NODE}"
            )
        for name, shape in _ranks_stages(cfg):
            per_node = shape.ranks_per_node
            if per_node > FRONTIER_GCDS_PER_NODE:
                raise SiteError(
                    f"{name} runs {shape.nproc} ranks on {shape.nodes} node(s), {per_node} per "
                    f"node, and a Frontier node has {FRONTIER_GCDS_PER_NODE} GCDs: lower the "
                    f"stage's ranks (e.g. eval.ranks) or spread them over more nodes"
                )


def _exclusive(cfg: PipelineConfig) -> bool:
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


def scheduler_options(cfg: PipelineConfig) -> str:
    """The #SBATCH lines of every block: ``--no-requeue``, then ``site.scheduler_options``.

    Parsl owns retries: a block that loses a node must end, so that Parsl submits a new one
    and the retried app resumes from its checkpoint. A job Slurm requeued instead
    (``JobRequeue=1``, the default on many sites) would keep Parsl waiting on a block that
    looks pending, for as long as the site's requeue delay.
    """
    lines = "#SBATCH --no-requeue\n"
    if cfg.site.scheduler_options.strip():
        lines += cfg.site.scheduler_options.strip() + "\n"
    return lines


def _allocation_stages(cfg: PipelineConfig,
                       running: Collection[str] | None) -> list[StageShape]:
    """Shapes of the stages in ``running`` (None: all) that use the "train" block: ranks
    stages and stages placed in the allocation."""
    shapes = [stage_module(name).shape(cfg) for name in STAGE_ORDER
              if running is None or name in running]
    return [shape for shape in shapes if shape.kind == RANKS or shape.placement == ALLOCATION]


def slurm_provider(cfg: PipelineConfig, running: Collection[str] | None = None) -> SlurmProvider:
    """The SlurmProvider whose blocks (one Slurm job each) host the training worker.

    No block is submitted until the training app is ready (init_blocks=0), so the allocation
    is not held while the light stages run. A block spans the most nodes that any stage of
    ``running`` (None: all) run in it needs. A non-exclusive job asks for one CPU per rank
    (or site.cores_per_node) so srun can place the ranks inside it: per node, the most ranks
    any of those stages (training, evaluation) puts on one node.
    """
    site = cfg.site
    exclusive = _exclusive(cfg)
    shapes = _allocation_stages(cfg, running)
    nodes = max([shape.nodes for shape in shapes], default=1)
    cores = site.cores_per_node
    if cores is None and not exclusive:
        cores = max([shape.ranks_per_node for shape in shapes], default=1)
    return _block_provider(cfg, nodes, cores, SimpleLauncher())


def _block_provider(cfg: PipelineConfig, nodes: int, cores: int | None,
                    launcher: Any) -> SlurmProvider:
    """A block of ``nodes`` nodes (``cores`` CPUs per node when not exclusive), submitted
    only when an app needs it (init_blocks=0), at most one at a time, polled as often as
    the heartbeat threshold."""
    site = cfg.site
    return PolledSlurmProvider(
        poll_seconds=min(60, site.heartbeat_threshold),
        account=site.account,
        partition=site.partition,
        qos=site.qos,
        walltime=site.walltime,
        nodes_per_block=nodes,
        cores_per_node=cores,
        scheduler_options=scheduler_options(cfg),
        worker_init=worker_init(cfg),
        exclusive=_exclusive(cfg),
        launcher=launcher,
        init_blocks=0,
        min_blocks=0,
        max_blocks=1,
        cmd_timeout=30,
    )


def _slurm_train_executor(cfg: PipelineConfig,
                          running: Collection[str] | None = None) -> MPIExecutor:
    threshold = cfg.site.heartbeat_threshold
    return MPIExecutor(
        label="train",
        mpi_launcher="srun",
        max_workers_per_block=1,
        provider=slurm_provider(cfg, running),
        address=cfg.site.address,
        interchange_launch_cmd=interchange_command(),
        heartbeat_threshold=threshold,
        heartbeat_period=max(1, threshold // 4),
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
                           None if _exclusive(cfg) else cores, launcher)


def _compute_executor(cfg: PipelineConfig) -> HighThroughputExecutor:
    """Python apps on compute nodes: ``site.max_workers`` workers on each node of the block."""
    threshold = cfg.site.heartbeat_threshold
    return HighThroughputExecutor(
        label="compute",
        address=cfg.site.address,
        max_workers_per_node=cfg.site.max_workers,
        cores_per_worker=1e-6,  # the worker count is max_workers, whatever the core count
        interchange_launch_cmd=interchange_command(),
        provider=compute_provider(cfg),
        heartbeat_threshold=threshold,
        heartbeat_period=max(1, threshold // 4),
        # The workers on the compute nodes reach the login node's interchange over the
        # network: CurveZMQ, keys in the run's Parsl directory (shared filesystem).
        encrypted=True,
    )


def executor_label(cfg: PipelineConfig, placement: str) -> str:
    """The executor that runs the Python apps of a stage placed at ``placement``.

    local: "cpu" for every placement (this machine); slurm/frontier: login -> "cpu",
    compute -> "compute", allocation -> "train" (``SLURM_PLACEMENT_EXECUTORS``).
    """
    if placement not in PLACEMENTS:
        raise SiteError(f"unknown stage placement {placement!r}; one of {PLACEMENTS}")
    if cfg.site.name == "local":
        return "cpu"
    return SLURM_PLACEMENT_EXECUTORS[placement]


def app_resource_spec(cfg: PipelineConfig, label: str) -> dict[str, Any]:
    """The resource specification of a Python app on executor ``label``.

    The MPIExecutor refuses a task without one: a Python app there claims one node of the
    block and runs in the worker on the block's first node. Other executors take none.
    """
    if label == "train" and cfg.site.name != "local":
        return {"num_nodes": 1, "ranks_per_node": 1, "num_ranks": 1}
    return {}


def worker_init(cfg: PipelineConfig) -> str:
    """Shell lines run in the batch job before Parsl's worker pool starts."""
    site = cfg.site
    lines: list[str] = []
    modules = site.modules
    if modules is None:
        modules = list(FRONTIER_MODULES) if site.name == "frontier" else []
    if modules:
        lines.append("module load " + " ".join(modules))
    if site.conda_env:
        lines.append(f"source activate {shlex.quote(site.conda_env)}")
        lines.append(_python_path_init())
    else:
        lines.append(_path_init())
    if site.worker_init.strip():
        lines.append(site.worker_init.strip())
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The training launch
# --------------------------------------------------------------------------------------------


def ranks_layout(shape: StageShape) -> tuple[int, int]:
    """(nodes, ranks_per_node) of a ranks stage; the ranks must divide over the nodes."""
    if shape.nproc % shape.nodes:
        raise SiteError(
            f"{shape.nproc} ranks do not divide over {shape.nodes} nodes: make parallel.nproc "
            "a multiple of parallel.nodes"
        )
    return shape.nodes, shape.nproc // shape.nodes


def _srun_options(cfg: PipelineConfig) -> str:
    if cfg.site.srun_options is not None:
        return cfg.site.srun_options
    return SITE_SRUN_OPTIONS.get(cfg.site.name, "")


def ranks_resource_spec(cfg: PipelineConfig, shape: StageShape) -> dict | None:
    """The MPIExecutor resource specification of a stage's ranks app (None for local)."""
    if cfg.site.name == "local":
        return None
    nodes, per_node = ranks_layout(shape)
    spec: dict[str, Any] = {"num_nodes": nodes, "ranks_per_node": per_node,
                            "num_ranks": nodes * per_node}
    options = _srun_options(cfg)
    if options:
        spec["launcher_options"] = options
    return spec


def rank_env(cfg: PipelineConfig) -> dict[str, str]:
    """Environment exported before the ranks start (values may use shell expansions).

    The rendezvous address and port are not set here: every rank derives them from the
    Slurm job (model/parallel/dist_env.py: first node of the job, port from the job id).
    """
    env: dict[str, str] = {"PYTHONPATH": f"{REPO_ROOT}${{PYTHONPATH:+:$PYTHONPATH}}"}
    if cfg.site.name == "frontier":
        env.update({
            "OMP_NUM_THREADS": "7",
            # RCCL over Slingshot through the libfabric (aws-ofi-rccl) plugin.
            "LD_LIBRARY_PATH": (
                f"{cfg.site.rccl_plugin_path}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
            ),
            "NCCL_SOCKET_IFNAME": "hsn0",
            "NCCL_NET_GDR_LEVEL": "3",
            "NCCL_CROSS_NIC": "1",
            "FI_CXI_ATS": "0",
            "FI_MR_CACHE_MONITOR": "userfaultfd",
            "FI_CXI_DEFAULT_CQ_SIZE": "131072",
            "FI_CXI_DISABLE_HOST_REGISTER": "1",
            # MIOpen's kernel database on node-local /tmp: Lustre locking stalls many ranks.
            "MIOPEN_USER_DB_PATH": "/tmp/$USER-miopen-$SLURM_JOB_ID",
            "MIOPEN_CUSTOM_CACHE_DIR": "/tmp/$USER-miopen-$SLURM_JOB_ID",
        })
    else:
        env["OMP_NUM_THREADS"] = "1"
    for item in cfg.site.env:
        key, value = item.split("=", 1)
        env[key.strip()] = value
    return env


def _worker_python(cfg: PipelineConfig) -> str:
    # With a conda env the compute nodes use that env's python; else this interpreter.
    return "python" if cfg.site.name != "local" and cfg.site.conda_env else sys.executable


def ranks_command(cfg: PipelineConfig, spec: RankSpec, spec_path: str | Path) -> str:
    """The shell command that starts every rank of a rank spec (the ranks app's command).

    local: ``python -m stages.launch`` (torchrun on this machine, dying with its Parsl
    worker); slurm/frontier: ``$PARSL_MPI_PREFIX`` (the srun line Parsl composes from
    ``ranks_resource_spec``) runs one worker per rank. Either way the command exits
    ``USER_ERROR_EXIT`` when a rank refused its input, so the workflow does not retry it.
    """
    exports = [f"export {key}={value}" for key, value in rank_env(cfg).items()]
    path = shlex.quote(str(spec_path))
    python = shlex.quote(_worker_python(cfg))
    if cfg.site.name == "local":
        if spec.nodes != 1:
            raise SiteError(
                f"site.name=local runs on one node but the stage asks for {spec.nodes}: "
                "set parallel.nodes=1 or use site.name=slurm"
            )
        return "\n".join([*exports, f"exec {python} -m stages.launch --spec {path}"])
    worker = f"{python} -m {spec.worker} --spec {path}"
    if cfg.site.name == "frontier":
        # Each node creates its own MIOpen cache directory before the rank starts.
        worker = "bash -c " + shlex.quote(f'mkdir -p "$MIOPEN_USER_DB_PATH" && exec {worker}')
    error_file = shlex.quote(str(Path(spec.out_dir) / RANK_ERROR_FILE))
    return "\n".join([
        *exports,
        f"rm -f {error_file}",
        f"$PARSL_MPI_PREFIX {worker}",
        "code=$?",
        f'if [ "$code" -ne 0 ] && [ -f {error_file} ]; then exit {USER_ERROR_EXIT}; fi',
        'exit "$code"',
    ])


# --------------------------------------------------------------------------------------------
# Dry run
# --------------------------------------------------------------------------------------------


class _Placeholders(dict):
    """format_map mapping that renders values known only at run time as <name>."""

    def __missing__(self, key: str) -> str:
        return f"<{key}>"


def _worker_pool_command(executor: HighThroughputExecutor) -> str:
    """The executor's worker-pool launch line with run-time values (ports...) as <name>."""
    known = _Placeholders(
        debug="",
        max_workers_per_node=f"--max_workers_per_node={executor.max_workers_per_node}",
        prefetch_capacity=executor.prefetch_capacity,
        address_probe_timeout_string="",
        cores_per_worker=executor.cores_per_worker,
        mem_per_worker=executor.mem_per_worker,
        poll_period=executor.poll_period,
        heartbeat_period=executor.heartbeat_period,
        heartbeat_threshold=executor.heartbeat_threshold,
        drain_period=executor.drain_period,
        cpu_affinity=executor.cpu_affinity,
        enable_mpi_mode="--enable_mpi_mode" if executor.enable_mpi_mode else "",
        mpi_launcher=executor.mpi_launcher,
        accelerators="",
    )
    line = executor.launch_cmd.format_map(known).replace("{block_id}", "0")
    return " ".join(line.split())


def batch_script(cfg: PipelineConfig, run_dir: Path, label: str = "train") -> str:
    """The sbatch script Parsl's SlurmProvider writes for a block (not submitted): the
    "train" block (the ranks' allocation) or the "compute" block.

    Rendered from the provider's own template, #SBATCH options, worker_init and launcher,
    exactly as ``SlurmProvider.submit`` fills them, with the job name's timestamp left out.
    """
    executor = _slurm_train_executor(cfg) if label == "train" else _compute_executor(cfg)
    provider = executor.provider
    assert isinstance(provider, SlurmProvider)
    # One worker pool per node: the train block's on its first node (ranks come from srun
    # inside it), the compute block's on every node (srun starts one per node).
    tasks_per_node = 1
    scheduler_options = provider.scheduler_options
    init = provider.worker_init
    if provider.cores_per_node is not None:
        cpus = provider.cores_per_node // tasks_per_node
        scheduler_options += f"#SBATCH --cpus-per-task={cpus}"
        init += f"export PARSL_CORES={cpus}\n"
    job_name = f"parsl.{label}.block-0"
    script_dir = Path(run_dir) / "parsl" / "<NNN>" / "submit_scripts"
    script_path = script_dir / job_name
    command = provider.launcher(
        _worker_pool_command(executor), tasks_per_node, provider.nodes_per_block, str(script_dir)
    )
    return Template(SLURM_TEMPLATE).substitute(
        jobname=job_name,
        job_stdout_path=f"{script_path}.stdout",
        job_stderr_path=f"{script_path}.stderr",
        nodes=provider.nodes_per_block,
        walltime=wtime_to_minutes(provider.walltime),
        tasks_per_node=tasks_per_node,
        scheduler_options=scheduler_options,
        worker_init=init,
        user_script=command,
    )


def _ranks_stages(cfg: PipelineConfig) -> list[tuple[str, StageShape]]:
    """(name, shape) of every stage that runs as ranks under this config."""
    shapes = [(name, stage_module(name).shape(cfg)) for name in STAGE_ORDER]
    return [(name, shape) for name, shape in shapes if shape.kind == RANKS]


def _placeholder_spec(cfg: PipelineConfig, run_dir: Path, name: str, shape: StageShape) -> RankSpec:
    return RankSpec(worker=shape.worker, nproc=shape.nproc, nodes=shape.nodes,
                    out_dir=f"{run_dir}/{name}", config={})


def srun_line(cfg: PipelineConfig, run_dir: Path, name: str, shape: StageShape) -> str:
    """The rank launch Parsl composes for a stage's ranks app (node names known at run time)."""
    resources = ranks_resource_spec(cfg, shape)
    assert resources is not None
    hosts = [f"<node{i}>" for i in range(resources["num_nodes"])]
    _, prefix = compose_srun_launch_cmd({k: str(v) for k, v in resources.items()}, hosts)
    spec = _placeholder_spec(cfg, run_dir, name, shape)
    command = ranks_command(cfg, spec, f"{run_dir}/{name}/spec.json")
    return command.replace("$PARSL_MPI_PREFIX", " ".join(prefix.split()))


def _where(cfg: PipelineConfig, label: str) -> str:
    """Words for where an executor's apps run (dry run)."""
    if label == "compute":
        return (f"compute block ('compute' executor, {cfg.site.tokenize_nodes} node(s) x "
                f"{cfg.site.max_workers} workers)")
    if label == "train":
        return "allocation ('train' executor, first node of the ranks' block)"
    return "login node ('cpu' executor)"


def placement_lines(cfg: PipelineConfig) -> list[str]:
    """Where each stage's apps run under ``cfg``'s site, one line per stage."""
    lines = []
    for name in STAGE_ORDER:
        shape = stage_module(name).shape(cfg)
        where = _where(cfg, executor_label(cfg, shape.placement))
        if shape.kind == RANKS:
            nodes, per_node = ranks_layout(shape)
            line = (f"prepare, finalize: {where}; ranks: {nodes} node(s) x {per_node}, "
                    "allocation ('train' executor)")
        elif shape.parts:
            line = f"prepare, {shape.parts} parts, finalize: {where}"
        else:
            line = f"one app: {where}"
        lines.append(f"#   {name:<9} {line}")
    return lines


def dry_run_text(cfg: PipelineConfig, run_dir: Path) -> str:
    """Where each stage would run: locally the launch line; on slurm/frontier where each
    stage's apps run, the batch script of each block (the allocation and the compute block)
    and each ranks app's srun line."""
    stages = _ranks_stages(cfg)
    if cfg.site.name == "local":
        launches = "; ".join(
            f"{name} runs torchrun --nproc-per-node {shape.nproc} on this machine"
            for name, shape in stages
        )
        return (
            f"site local: light stages on {cfg.site.max_workers} local Parsl workers; "
            f"{launches}; outputs in {run_dir}"
        )
    _check_slurm_site(cfg)
    site = cfg.site
    parts = [
        "# --- where each stage's apps run ---",
        *placement_lines(cfg),
        f"# --- batch script for the allocation, the ranks block (sbatch, {cfg.parallel.nodes} "
        f"node(s)) ---\n{batch_script(cfg, run_dir, 'train')}",
        f"# --- batch script for the compute block (sbatch, {site.tokenize_nodes} node(s) x "
        f"{site.max_workers} workers) ---\n{batch_script(cfg, run_dir, 'compute')}",
    ]
    for name, shape in stages:
        nodes, per_node = ranks_layout(shape)
        parts.append(
            f"# --- {name} app: {nodes} node(s) x {per_node} ranks: environment and launch "
            f"(run by the Parsl worker) ---\n{srun_line(cfg, run_dir, name, shape)}"
        )
    return "\n".join(parts) + "\n"
