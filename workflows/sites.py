"""Parsl site configurations built from the pipeline config's ``site`` section.

Every pipeline has two executors:

- ``cpu``: a HighThroughputExecutor on the submitting machine for the light stages
  (tokenize fan-out, plan, the driver-side parts of train and evaluate);
- ``train``: where the multi-rank apps run (the training ranks, then the evaluation
  ranks when eval.ranks > 1; one evaluation rank runs inside its "cpu" app). Locally a one-worker HTEX whose bash app calls ``torchrun``; on Slurm sites an
  ``MPIExecutor`` whose block is a Slurm job and whose apps launch the ranks with
  ``$PARSL_MPI_PREFIX`` (an ``srun`` line Parsl composes from the task's resource
  specification). Both stages' ranks are launched by one command builder
  (``ranks_command``), so they start the same way on every site.

All site settings come from ``cfg.site`` (stages/config.py SiteConfig), so moving between a
laptop, a generic Slurm cluster and Frontier is a config change, never a code change.
"""
from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from string import Template
from typing import Any

from parsl.config import Config
from parsl.executors import HighThroughputExecutor, MPIExecutor
from parsl.executors.high_throughput.mpi_prefix_composer import compose_srun_launch_cmd
from parsl.launchers import SimpleLauncher
from parsl.providers import LocalProvider, SlurmProvider
from parsl.providers.slurm.template import template_string as SLURM_TEMPLATE
from parsl.utils import wtime_to_minutes

from stages.config import ConfigError, PipelineConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
"""Project root: put on PYTHONPATH of the training ranks so ``-m stages.train_worker`` resolves."""

BIN_DIR = Path(sys.executable).parent
"""The interpreter's bin/: holds Parsl's interchange.py and process_worker_pool.py, torchrun."""

FRONTIER_MODULES = ("PrgEnv-gnu", "rocm/6.2.4", "craype-accel-amd-gfx90a", "miniforge3/23.11.0-0")
"""Modules loaded on Frontier compute nodes unless site.modules says otherwise."""

FRONTIER_GCDS_PER_NODE = 8
"""One training rank per MI250X GCD."""

WORKER_MODULES = {"train": "stages.train_worker", "evaluate": "stages.eval_worker"}
"""The per-rank entry (``python -m MODULE --spec SPEC``) of each multi-rank stage."""

EVAL_IN_PROCESS = (
    "evaluation (eval.ranks=1) runs in one process inside its Parsl app on the cpu executor "
    "(set eval.ranks > 1 to launch evaluation ranks like the training ranks)"
)

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


def make_parsl_config(cfg: PipelineConfig, run_dir: Path) -> Config:
    """Build the Parsl config for ``cfg.site.name`` with executors "cpu" and "train".

    Parsl's own logs and submit scripts go under ``run_dir/parsl``. Stage reuse is keyed by
    the stage mechanism, so no Parsl app caching is configured; failed apps are retried
    ``cfg.site.retries`` times (training resumes from its last complete checkpoint).
    """
    site = cfg.site.name
    if site == "local":
        executors = [_cpu_executor(cfg), _local_train_executor()]
    elif site in ("slurm", "frontier"):
        _check_slurm_site(cfg)
        executors = [_cpu_executor(cfg), _slurm_train_executor(cfg)]
    else:  # SiteConfig already restricts the names; kept for a clear message.
        raise SiteError(f"site.name={site!r} is not one of local, slurm, frontier")
    return Config(
        executors=executors,
        run_dir=str(Path(run_dir) / "parsl"),
        retries=cfg.site.retries,
        # Frequent strategy passes: first app starts sooner, lost blocks are replaced sooner.
        strategy_period=0.5 if site == "local" else 1,
        initialize_logging=True,
    )


def _python_path_init() -> str:
    """Shell line making the project importable by workers (apps are pickled by reference)."""
    return f"export PYTHONPATH={shlex.quote(str(REPO_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}"


def _path_init() -> str:
    """Shell lines putting this interpreter's bin/ first on PATH (HTEX finds its worker pool
    there) and the project on PYTHONPATH."""
    return f"export PATH={shlex.quote(str(BIN_DIR))}:$PATH\n{_python_path_init()}"


def _interchange_cmd() -> str:
    # The interchange is started by the submitting process; use the script beside the
    # interpreter so it works even when the venv is not activated. (A plain string: Popen
    # runs it as one program path, and MPIExecutor's signature accepts only str.)
    script = BIN_DIR / "interchange.py"
    return str(script) if script.exists() else "interchange.py"


def _cpu_executor(cfg: PipelineConfig) -> HighThroughputExecutor:
    """Light stages: workers on the submitting machine, reached over loopback."""
    return HighThroughputExecutor(
        label="cpu",
        address="127.0.0.1",
        max_workers_per_node=cfg.site.max_workers,
        cores_per_worker=1e-6,  # the worker count is max_workers, whatever the core count
        interchange_launch_cmd=_interchange_cmd(),
        provider=LocalProvider(init_blocks=1, min_blocks=0, max_blocks=1, worker_init=_path_init()),
    )


def _local_train_executor() -> HighThroughputExecutor:
    """One worker whose bash app runs torchrun, so light stages never queue behind training."""
    return HighThroughputExecutor(
        label="train",
        address="127.0.0.1",
        max_workers_per_node=1,
        cores_per_worker=1e-6,
        interchange_launch_cmd=_interchange_cmd(),
        provider=LocalProvider(init_blocks=1, min_blocks=0, max_blocks=1, worker_init=_path_init()),
    )


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
        if cfg.eval.ranks > FRONTIER_GCDS_PER_NODE:
            raise SiteError(
                f"eval.ranks={cfg.eval.ranks}: the evaluation ranks run on one node, and a "
                f"Frontier node has {FRONTIER_GCDS_PER_NODE} GCDs: set eval.ranks <= "
                f"{FRONTIER_GCDS_PER_NODE}"
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


def slurm_provider(cfg: PipelineConfig) -> SlurmProvider:
    """The SlurmProvider whose blocks (one Slurm job each) host the training worker.

    No block is submitted until the training app is ready (init_blocks=0), so the allocation
    is not held while the light stages run. A non-exclusive job asks for one CPU per rank
    (or site.cores_per_node) so srun can place the ranks inside it: per node, the training
    ranks or the evaluation ranks (all on one node), whichever are more.
    """
    site = cfg.site
    exclusive = _exclusive(cfg)
    cores = site.cores_per_node
    if cores is None and not exclusive:
        cores = max(cfg.parallel.ranks_per_node, cfg.eval.ranks)
    return PolledSlurmProvider(
        poll_seconds=min(60, site.heartbeat_threshold),
        account=site.account,
        partition=site.partition,
        qos=site.qos,
        walltime=site.walltime,
        nodes_per_block=cfg.parallel.nodes,
        cores_per_node=cores,
        scheduler_options=site.scheduler_options,
        worker_init=worker_init(cfg),
        exclusive=exclusive,
        launcher=SimpleLauncher(),
        init_blocks=0,
        min_blocks=0,
        max_blocks=1,
        cmd_timeout=30,
    )


def _slurm_train_executor(cfg: PipelineConfig) -> MPIExecutor:
    threshold = cfg.site.heartbeat_threshold
    return MPIExecutor(
        label="train",
        mpi_launcher="srun",
        max_workers_per_block=1,
        provider=slurm_provider(cfg),
        address=cfg.site.address,
        interchange_launch_cmd=_interchange_cmd(),
        heartbeat_threshold=threshold,
        heartbeat_period=max(1, threshold // 4),
    )


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


def _get(plan: Any, key: str) -> Any:
    if isinstance(plan, Mapping):
        return plan.get(key)
    return getattr(plan, key, None)


def train_layout(cfg: PipelineConfig, plan: Any = None) -> tuple[int, int]:
    """(nodes, ranks_per_node) for the training job.

    ``plan`` is the train stage's prepared launch info ({"nproc", "nodes", ...}), a Plan /
    plan dict (world size tp*pp*dp), or None (parallel.nproc over parallel.nodes).
    """
    nodes = _get(plan, "nodes") if plan is not None else None
    nodes = int(nodes or cfg.parallel.nodes)
    world = _get(plan, "nproc") if plan is not None else None
    if world is None and plan is not None and _get(plan, "tp") is not None:
        world = int(_get(plan, "tp")) * int(_get(plan, "pp")) * int(_get(plan, "dp"))
    world = int(world or cfg.parallel.nproc)
    if world % nodes:
        raise SiteError(
            f"{world} training ranks do not divide over parallel.nodes={nodes}: "
            "make parallel.nproc a multiple of parallel.nodes"
        )
    return nodes, world // nodes


def eval_layout(cfg: PipelineConfig, prepared: Any = None) -> tuple[int, int]:
    """(nodes, ranks_per_node) for the evaluation ranks: all on one node (EvalConfig.ranks).

    ``prepared`` is the evaluate stage's prepared launch info ({"nproc", ...}) or None
    (eval.ranks).
    """
    ranks = _get(prepared, "nproc") if prepared is not None else None
    return 1, int(ranks or cfg.eval.ranks)


def stage_layout(stage: str, cfg: PipelineConfig, prepared: Any = None) -> tuple[int, int]:
    """(nodes, ranks_per_node) of a multi-rank stage ("train" or "evaluate")."""
    if stage == "train":
        return train_layout(cfg, prepared)
    if stage == "evaluate":
        return eval_layout(cfg, prepared)
    raise _no_ranks(stage)


def _no_ranks(stage: str) -> ValueError:
    return ValueError(f"stage {stage!r} has no ranks; choose one of {sorted(WORKER_MODULES)}")


def _srun_options(cfg: PipelineConfig) -> str:
    if cfg.site.srun_options is not None:
        return cfg.site.srun_options
    return SITE_SRUN_OPTIONS.get(cfg.site.name, "")


def train_resource_spec(cfg: PipelineConfig, plan: Any = None) -> dict | None:
    """The MPIExecutor resource specification of the training app (None for local)."""
    return ranks_resource_spec("train", cfg, plan)


def ranks_resource_spec(stage: str, cfg: PipelineConfig, prepared: Any = None) -> dict | None:
    """The MPIExecutor resource specification of a stage's ranks app (None for local)."""
    if cfg.site.name == "local":
        return None
    nodes, per_node = stage_layout(stage, cfg, prepared)
    spec: dict[str, Any] = {
        "num_nodes": nodes,
        "ranks_per_node": per_node,
        "num_ranks": nodes * per_node,
    }
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
            "LD_LIBRARY_PATH": f"{cfg.site.rccl_plugin_path}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}",
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


def train_command(cfg: PipelineConfig, spec_path: str, plan: Any = None) -> str:
    """The shell command the training bash app returns (see ``ranks_command``)."""
    return ranks_command("train", cfg, spec_path, plan)


def eval_command(cfg: PipelineConfig, spec_path: str, prepared: Any = None) -> str:
    """The shell command the evaluation bash app returns (see ``ranks_command``)."""
    return ranks_command("evaluate", cfg, spec_path, prepared)


def ranks_command(stage: str, cfg: PipelineConfig, spec_path: str, prepared: Any = None) -> str:
    """The shell command that starts every rank of ``stage`` ("train" or "evaluate").

    local: torchrun on this machine; slurm/frontier: ``$PARSL_MPI_PREFIX`` (the srun line
    Parsl composes from ``ranks_resource_spec``) runs one worker per rank.
    """
    if stage not in WORKER_MODULES:
        raise _no_ranks(stage)
    module = WORKER_MODULES[stage]
    exports = [f"export {key}={value}" for key, value in rank_env(cfg).items()]
    spec = shlex.quote(str(spec_path))
    if cfg.site.name == "local":
        nodes, per_node = stage_layout(stage, cfg, prepared)
        if nodes != 1:
            raise SiteError(
                f"site.name=local runs on one node but parallel.nodes={nodes}: "
                "set parallel.nodes=1 or use site.name=slurm"
            )
        torchrun = BIN_DIR / "torchrun"
        launch = (
            f"{shlex.quote(str(torchrun))} --standalone --nnodes 1 --nproc-per-node {per_node} "
            f"-m {module} --spec {spec}"
        )
    else:
        worker = f"{shlex.quote(_worker_python(cfg))} -m {module} --spec {spec}"
        if cfg.site.name == "frontier":
            # Each node creates its own MIOpen cache directory before the rank starts.
            worker = (
                "bash -c " + shlex.quote(f'mkdir -p "$MIOPEN_USER_DB_PATH" && exec {worker}')
            )
        launch = f"$PARSL_MPI_PREFIX {worker}"
    return "\n".join([*exports, launch])


# --------------------------------------------------------------------------------------------
# Dry run
# --------------------------------------------------------------------------------------------


class _Placeholders(dict):
    """format_map mapping that renders values known only at run time as <name>."""

    def __missing__(self, key: str) -> str:
        return f"<{key}>"


def _worker_pool_command(executor: MPIExecutor) -> str:
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
        enable_mpi_mode="--enable_mpi_mode",
        mpi_launcher=executor.mpi_launcher,
        accelerators="",
    )
    line = executor.launch_cmd.format_map(known).replace("{block_id}", "0")
    return " ".join(line.split())


def batch_script(cfg: PipelineConfig, run_dir: Path) -> str:
    """The sbatch script Parsl's SlurmProvider writes for the training block (not submitted).

    Rendered from the provider's own template, #SBATCH options and worker_init, exactly as
    ``SlurmProvider.submit`` fills them, with the job name's timestamp left out.
    """
    executor = _slurm_train_executor(cfg)
    provider = executor.provider
    assert isinstance(provider, SlurmProvider)
    tasks_per_node = 1  # one worker pool per block; ranks come from srun inside it
    scheduler_options = provider.scheduler_options
    init = provider.worker_init
    if provider.cores_per_node is not None:
        cpus = provider.cores_per_node // tasks_per_node
        scheduler_options += f"#SBATCH --cpus-per-task={cpus}"
        init += f"export PARSL_CORES={cpus}\n"
    job_name = "parsl.train.block-0"
    script_path = Path(run_dir) / "parsl" / "<NNN>" / "submit_scripts" / job_name
    command = provider.launcher(
        _worker_pool_command(executor), tasks_per_node, provider.nodes_per_block
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


def srun_line(cfg: PipelineConfig, run_dir: Path, plan: Any = None, stage: str = "train") -> str:
    """The rank launch Parsl composes for a stage's ranks app (node names known at run time)."""
    spec = ranks_resource_spec(stage, cfg, plan)
    assert spec is not None
    hosts = [f"<node{i}>" for i in range(spec["num_nodes"])]
    _, prefix = compose_srun_launch_cmd(
        {k: str(v) for k, v in spec.items()}, hosts
    )
    command = ranks_command(stage, cfg, f"{run_dir}/{stage}/spec.json", plan)
    return command.replace("$PARSL_MPI_PREFIX", " ".join(prefix.split()))


def dry_run_text(cfg: PipelineConfig, run_dir: Path) -> str:
    """What would be submitted: the batch script and both rank launches (slurm/frontier)."""
    if cfg.site.name == "local":
        _, per_node = train_layout(cfg, None)
        if cfg.eval.ranks > 1:
            launch = ranks_command("evaluate", cfg, f"{run_dir}/evaluate/spec.json")
            evaluation = f"evaluation runs {launch.splitlines()[-1]}"
        else:
            evaluation = EVAL_IN_PROCESS
        return (
            f"site local: light stages on {cfg.site.max_workers} local Parsl workers; training "
            f"runs torchrun --nproc-per-node {per_node} on this machine; {evaluation}; "
            f"outputs in {run_dir}"
        )
    _check_slurm_site(cfg)
    if cfg.eval.ranks > 1:
        evaluation = (
            f"# --- evaluation app: the same block, after training; {cfg.eval.ranks} ranks on "
            f"one node ---\n{srun_line(cfg, run_dir, stage='evaluate')}\n"
        )
    else:
        evaluation = f"# --- {EVAL_IN_PROCESS} ---\n"
    return (
        f"# --- batch script for the training block (sbatch) ---\n"
        f"{batch_script(cfg, run_dir)}\n"
        f"# --- training app: environment and rank launch (run by the Parsl worker) ---\n"
        f"{srun_line(cfg, run_dir)}\n"
        f"{evaluation}"
    )
