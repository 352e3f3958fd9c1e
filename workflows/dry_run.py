"""What ``--dry-run`` prints about the site: where each stage's apps would run, and for a
Slurm site the batch script of each block and each ranks app's srun line, all rendered by
the code that runs them, nothing submitted.

The batch scripts are filled from Parsl's own Slurm template (``SlurmProvider.submit``'s)
and the srun lines by Parsl's MPIExecutor prefix composer (both through
``workflows.parsl_seam``), so
what the dry run shows is what a run submits; values known only at run time (ports, node
names, the run's Parsl directory number) are shown as ``<name>``.
"""
from __future__ import annotations

from pathlib import Path
from string import Template

from parsl.executors import HighThroughputExecutor
from parsl.providers import SlurmProvider
from parsl.utils import wtime_to_minutes

from stages.config import PipelineConfig
from stages.mechanism.launch import RankSpec
from stages.mechanism.shape import RANKS, StageShape
from workflows import parsl_seam
from workflows.executors import (
    allocation_label,
    compute_executor,
    executor_label,
    slurm_allocation_executor,
)
from workflows.frontier import (
    allocation_stages,
    check_site,
    ranks_stages,
    runs_dir_problem,
    stage_shapes,
)
from workflows.ranks import ranks_command, ranks_layout, ranks_resource_spec


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
    """The sbatch script Parsl's SlurmProvider writes for a block (not submitted): a stage's
    allocation ("train", "evaluate") or the "compute" block.

    Rendered from the provider's own template, #SBATCH options, worker_init and launcher,
    exactly as ``SlurmProvider.submit`` fills them, with the job name's timestamp left out.
    """
    if label == "compute":
        executor = compute_executor(cfg)
    else:
        executor = slurm_allocation_executor(cfg, label)
    provider = executor.provider
    assert isinstance(provider, SlurmProvider)
    # One worker pool per node: an allocation's on its first node (ranks come from srun
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
    return Template(parsl_seam.slurm_script_template()).substitute(
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


def srun_line(cfg: PipelineConfig, run_dir: Path, name: str, shape: StageShape) -> str:
    """The rank launch Parsl composes for a stage's ranks app (node names known at run time)."""
    resources = ranks_resource_spec(cfg, shape)
    assert resources is not None
    hosts = [f"<node{i}>" for i in range(resources["num_nodes"])]
    prefix = parsl_seam.srun_prefix({k: str(v) for k, v in resources.items()}, hosts)
    # The command reads only the spec's worker, node count and output directory.
    spec = RankSpec.for_shape(shape, out_dir=f"{run_dir}/{name}", config={})
    command = ranks_command(cfg, spec, f"{run_dir}/{name}/spec.json")
    return command.replace("$PARSL_MPI_PREFIX", " ".join(prefix.split()))


def _where(cfg: PipelineConfig, label: str) -> str:
    """Words for where an executor's apps run (dry run)."""
    if label == "compute":
        return (f"compute block ('compute' executor, {cfg.site.tokenize_nodes} node(s) x "
                f"{cfg.site.max_workers} workers)")
    if label != "cpu":
        return f"its allocation ('{label}' executor, the block's first node)"
    return "login node ('cpu' executor)"


def placement_lines(cfg: PipelineConfig) -> list[str]:
    """Where each stage's apps run under ``cfg``'s site, one line per stage."""
    lines = []
    for name, shape in stage_shapes(cfg):
        where = _where(cfg, executor_label(cfg, name, shape.placement))
        if shape.kind == RANKS:
            nodes, per_node = ranks_layout(shape)
            line = (f"prepare, finalize: {where}; ranks: {nodes} node(s) x {per_node}, "
                    f"its allocation ('{allocation_label(cfg, name)}' executor)")
        elif shape.parts:
            line = f"prepare, {shape.parts} parts, finalize: {where}"
        else:
            line = f"one app: {where}"
        lines.append(f"#   {name:<9} {line}")
    return lines


def dry_run_text(cfg: PipelineConfig, run_dir: Path) -> str:
    """Where each stage would run: locally the launch line; on slurm/frontier where each
    stage's apps run, the batch script of each block (the allocation and the compute block)
    and each ranks app's srun line.

    A Frontier runs dir that a run would refuse (not on Lustre: a dry run on a laptop) is
    shown as a warning at the top, not refused (the readiness report after it counts it as an
    error); every other site rule refuses as a run does.
    """
    stages = ranks_stages(cfg)
    if cfg.site.name == "local":
        launches = "; ".join(
            f"{name} runs {shape.nproc} ranks on this machine (python -m stages.mechanism.launch)"
            for name, shape in stages
        )
        return (
            f"site local: light stages on {cfg.site.max_workers} local Parsl workers; "
            f"{launches}; outputs in {run_dir}"
        )
    check_site(cfg, readiness_rules=False)
    site = cfg.site
    problem = runs_dir_problem(cfg)
    parts = [f"# warning: a run refuses this: {problem}"] if problem else []
    parts += ["# --- where each stage's apps run ---", *placement_lines(cfg)]
    for name, shape in allocation_stages(cfg):
        parts.append(f"# --- batch script for the {name} allocation (sbatch, {shape.nodes} "
                     f"node(s)) ---\n{batch_script(cfg, run_dir, name)}")
    parts.append(f"# --- batch script for the compute block (sbatch, {site.tokenize_nodes} "
                 f"node(s) x {site.max_workers} workers) ---\n"
                 f"{batch_script(cfg, run_dir, 'compute')}")
    for name, shape in stages:
        nodes, per_node = ranks_layout(shape)
        parts.append(
            f"# --- {name} app: {nodes} node(s) x {per_node} ranks: environment and launch "
            f"(run by the Parsl worker) ---\n{srun_line(cfg, run_dir, name, shape)}"
        )
    return "\n".join(parts) + "\n"
