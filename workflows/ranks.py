"""How the ranks of a ranks stage start on each site: their layout over the nodes, their
environment, and the one command that starts them.

Both ranks stages (training, and evaluation when eval.ranks > 1) start through
``ranks_command``, so they start the same way on every site: locally ``python -m
stages.mechanism.launch`` (its ranks started on this machine); on slurm/frontier
``$PARSL_MPI_PREFIX``, the
``srun`` line Parsl's MPIExecutor composes from ``ranks_resource_spec`` (nodes, ranks per
node, ``SITE_SRUN_OPTIONS``), one worker per rank. ``rank_env`` is what every rank gets
exported first: the project on PYTHONPATH, its OpenMP threads (``rank_cores``) and, on
Frontier, RCCL over Slingshot (the libfabric plugin, forced by NCCL_NET when the ranks span
nodes) and MIOpen's cache on node-local /tmp; on Frontier the command then sets MASTER_ADDR
to the address of the step's first node (``master_addr_lines``).

Every value from the config reaches the command shell-quoted: site.env values are literal
(no expansion), site.srun_options is split into words and each is quoted.

Nothing here imports Parsl.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from model.parallel.threads import rank_threads_env
from stages.config import PipelineConfig
from stages.mechanism.launch import (
    OUT_OF_TIME_EXIT,
    OUT_OF_TIME_FILE,
    RANK_ERROR_FILE,
    REPO_ROOT,
    USER_ERROR_EXIT,
    RankSpec,
)
from stages.mechanism.shape import StageShape
from workflows.frontier import (
    FRONTIER_CORES_PER_RANK,
    FRONTIER_NCCL_NET,
    FRONTIER_NCCL_NET_SINGLE_NODE,
    SiteError,
)


def rank_cores(site: str) -> int:
    """CPU cores, and OpenMP threads, of one rank on ``site``: 7 on Frontier (56 usable cores
    over 8 GCDs), one elsewhere."""
    return FRONTIER_CORES_PER_RANK if site == "frontier" else 1


SITE_SRUN_OPTIONS = {
    # 7 cores per rank (56 usable per node), one GCD each, bound to the nearest NIC/cores.
    "frontier": f"-c{rank_cores('frontier')} --gpus-per-task=1 --gpu-bind=closest",
    # Explicit: srun inside a job otherwise inherits the job's --cpus-per-task.
    "slurm": f"--cpus-per-task={rank_cores('slurm')}",
}
"""srun options of every rank launch on a Slurm site unless site.srun_options says otherwise."""


def project_pythonpath(quote: bool = False) -> str:
    """A PYTHONPATH value with the project root first, then any value already set (a shell
    word: it expands ``$PYTHONPATH``); ``quote``: the root shell-quoted."""
    root = shlex.quote(str(REPO_ROOT)) if quote else str(REPO_ROOT)
    return f"{root}${{PYTHONPATH:+:$PYTHONPATH}}"


def ranks_layout(shape: StageShape) -> tuple[int, int]:
    """(nodes, ranks_per_node) of a ranks stage; the ranks must divide over the nodes."""
    if shape.nproc % shape.nodes:
        raise SiteError(
            f"{shape.nproc} ranks do not divide over {shape.nodes} nodes: make parallel.nproc "
            "a multiple of parallel.nodes"
        )
    return shape.nodes, shape.nproc // shape.nodes


def _srun_options(cfg: PipelineConfig) -> str:
    """The ranks' srun options, each word shell-quoted: Parsl pastes them into the srun line."""
    options = cfg.site.srun_options
    if options is None:
        options = SITE_SRUN_OPTIONS.get(cfg.site.name, "")
    return " ".join(shlex.quote(word) for word in shlex.split(options))


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


def rank_env(cfg: PipelineConfig, nodes: int) -> dict[str, str]:
    """Environment exported before the ranks start on ``nodes`` nodes: variable name -> a
    shell word.

    The site's own values may expand variables ($USER, $SLURM_JOB_ID, the previous
    LD_LIBRARY_PATH); config values are quoted, so site.env values are taken literally.
    The rendezvous port is not set here: every rank derives it from the Slurm job
    (model/parallel/dist_env.py); on Frontier the address comes from ``master_addr_lines``.
    """
    threads = rank_threads_env(rank_cores(cfg.site.name))
    env: dict[str, str] = {"PYTHONPATH": project_pythonpath(quote=True),
                           **{key: shlex.quote(value) for key, value in threads.items()}}
    if cfg.site.name == "frontier":
        env.update(_frontier_rank_env(cfg, nodes))
    for item in cfg.site.env:
        key, value = item.split("=", 1)
        env[key.strip()] = shlex.quote(value)
    return env


def _frontier_rank_env(cfg: PipelineConfig, nodes: int) -> dict[str, str]:
    """RCCL over Slingshot and MIOpen on node-local storage (sources: docs/frontier.md).

    NCCL_NET forces the libfabric plugin only when the ranks span nodes: in a one-node job
    the plugin does not initialise on Frontier, so there it names RCCL's socket transport."""
    env: dict[str, str] = {}
    if cfg.site.rccl_plugin_path:
        # A plugin build of one's own instead of OLCF's rccl-net-plugin module.
        env["LD_LIBRARY_PATH"] = (shlex.quote(cfg.site.rccl_plugin_path)
                                  + "${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
    env.update({
        # Across nodes only the libfabric plugin: without it RCCL fails at start instead of
        # running on TCP sockets. One node: sockets, as the plugin does not start there.
        "NCCL_NET": shlex.quote(FRONTIER_NCCL_NET if nodes > 1
                                else FRONTIER_NCCL_NET_SINGLE_NODE),
        "NCCL_SOCKET_IFNAME": "hsn0",  # bootstrap over the Slingshot interface
        "NCCL_NET_GDR_LEVEL": "3",  # NCCL's legacy integer for PHB
        "NCCL_CROSS_NIC": "1",
        "FI_CXI_ATS": "0",
        "FI_CXI_DEFAULT_CQ_SIZE": "131072",
        "FI_CXI_DISABLE_HOST_REGISTER": "1",
        # FI_MR_CACHE_MONITOR is left to the site default (kdreg2 since Slingshot 2.3).
        # MIOpen's databases on node-local /tmp (OLCF: avoids MIOpen's disk I/O errors).
        "MIOPEN_USER_DB_PATH": '"/tmp/$USER-miopen-$SLURM_JOB_ID"',
        "MIOPEN_CUSTOM_CACHE_DIR": '"/tmp/$USER-miopen-$SLURM_JOB_ID"',
    })
    return env


def master_addr_lines() -> list[str]:
    """Shell lines (Frontier) exporting MASTER_ADDR as the address of the first node of the
    ranks' step, by ``hostname -i`` on that node as OLCF's recipes do, not its hostname.

    The step's nodes are the ones Parsl hands the app (PARSL_MPI_NODELIST); rank 0, which
    holds the rendezvous store, runs on the first of them in Slurm's order. That is mostly
    this node (the block's first, where the Parsl worker runs); otherwise a one-task step
    asks that node.
    """
    return [
        'first=$(scontrol show hostnames "$PARSL_MPI_NODELIST" | sort | head -n 1)',
        'if [ "$first" = "$(hostname -s)" ]; then addr=$(hostname -i); else '
        'addr=$(srun --overlap --nodes=1 --ntasks=1 --nodelist="$first" hostname -i); fi',
        'export MASTER_ADDR="${addr%% *}"',
        'if [ -z "$MASTER_ADDR" ]; then echo "hostname -i gave no address for the first node '
        '($first)" >&2; exit 1; fi',
    ]


def _worker_python(cfg: PipelineConfig) -> str:
    # With a conda or packed env the compute nodes use that env's python (first on PATH
    # after the batch script's activation); else this interpreter.
    packaged = cfg.site.conda_env or cfg.site.node_local_env
    return "python" if cfg.site.name != "local" and packaged else sys.executable


def ranks_command(cfg: PipelineConfig, spec: RankSpec, spec_path: str | Path) -> str:
    """The shell command that starts every rank of a rank spec (the ranks app's command).

    local: ``python -m stages.mechanism.launch`` (the ranks started on this machine, dying with
    its Parsl
    worker); slurm/frontier: ``$PARSL_MPI_PREFIX`` (the srun line Parsl composes from
    ``ranks_resource_spec``) runs one worker per rank. Either way the command exits
    ``USER_ERROR_EXIT`` when a rank refused its input, so the workflow does not retry it,
    and ``OUT_OF_TIME_EXIT`` when the ranks stopped out of time at a checkpoint (their
    ``out-of-time.json``), so it resumes them in a new job. A series spec (measured
    refinement) runs its launches one after another in the same allocation, each step
    killed after its ``timeout_s``; a failed launch is reported and the next starts, and
    the command exits 0 (the stage's ``finalize`` reads what each left).
    """
    exports = [f"export {key}={value}" for key, value in rank_env(cfg, spec.nodes).items()]
    path = shlex.quote(str(spec_path))
    python = shlex.quote(_worker_python(cfg))
    if cfg.site.name == "local":
        if spec.nodes != 1:
            raise SiteError(
                f"site.name=local runs on one node but the stage asks for {spec.nodes}: "
                "set parallel.nodes=1 or use site.name=slurm"
            )
        return "\n".join([*exports, f"exec {python} -m stages.mechanism.launch --spec {path}"])
    address = master_addr_lines() if cfg.site.name == "frontier" else []
    if spec.series:
        return "\n".join([*exports, *address, *_series_lines(cfg, spec, python), "exit 0"])
    error_file = shlex.quote(str(Path(spec.out_dir) / RANK_ERROR_FILE))
    stopped_file = shlex.quote(str(Path(spec.out_dir) / OUT_OF_TIME_FILE))
    return "\n".join([
        *exports,
        *address,
        f"rm -f {error_file} {stopped_file}",
        f"$PARSL_MPI_PREFIX {_worker_line(cfg, spec.worker, path, python)}",
        "code=$?",
        f'if [ "$code" -ne 0 ] && [ -f {error_file} ]; then exit {USER_ERROR_EXIT}; fi',
        f"if [ -f {stopped_file} ]; then exit {OUT_OF_TIME_EXIT}; fi",
        'exit "$code"',
    ])


def _worker_line(cfg: PipelineConfig, worker: str, path: str, python: str) -> str:
    """What srun starts on every rank: ``python -m <worker> --spec <path>`` (Frontier:
    after making the node's MIOpen cache directory)."""
    line = f"{python} -m {shlex.quote(worker)} --spec {path}"
    if cfg.site.name == "frontier":
        line = "bash -c " + shlex.quote(f'mkdir -p "$MIOPEN_USER_DB_PATH" && exec {line}')
    return line


def _series_lines(cfg: PipelineConfig, spec: RankSpec, python: str) -> list[str]:
    """One srun step per launch of a series spec, in order, each on the series' ranks and
    nodes (the prefix Parsl composed for them) and killed after its ``timeout_s``."""
    lines = []
    for index, launch_path in enumerate(spec.series):
        launch = RankSpec.read(launch_path)
        if (launch.nproc, launch.nodes) != (spec.nproc, spec.nodes):
            raise SiteError(
                f"{launch_path} asks for {launch.nproc} ranks on {launch.nodes} nodes; its "
                f"series runs on {spec.nproc} ranks on {spec.nodes}: every launch of a series "
                "spans the same ranks")
        path = shlex.quote(str(launch_path))
        limit = f"timeout {int(launch.timeout_s)} " if launch.timeout_s else ""
        error_file = shlex.quote(str(Path(launch.out_dir) / RANK_ERROR_FILE))
        lines += [f"rm -f {error_file}",
                  f"{limit}$PARSL_MPI_PREFIX {_worker_line(cfg, launch.worker, path, python)}"
                  f' || echo "[launch] launch {index + 1} of {len(spec.series)} failed: '
                  'exit $?" >&2']
    return lines
