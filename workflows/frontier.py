"""Frontier's constants and the site rules checked before any work.

A Frontier node has 8 MI250X GCDs, one training rank each, and 56 usable cores (64, 8 of
them reserved for the system): 7 per rank. Its compute nodes load ``FRONTIER_MODULES``
unless ``site.modules`` says otherwise, then OLCF's RCCL network plugin module
(``FRONTIER_RCCL_PLUGIN_MODULE``) unless ``site.rccl_plugin_path`` names a build of one's
own; with ``site.node_local_env`` each job copies the packed environment to its nodes'
NVMe and runs from there (``node_local_env_lines``).

``check_site`` holds every rule a site's settings must meet (Slurm sites: a runs dir whose
characters survive Parsl's unquoted scripts; Frontier: an account, a runs dir on Lustre,
at most 8 ranks of any stage per node, at most one tokenize worker per core, one of
site.conda_env and site.node_local_env, an evaluation that fits a node's memory); the
driver calls it before any run is opened, and
the Parsl configuration and the dry run call it too. Every site rule raises ``SiteError``.
Nothing here imports Parsl, so a pre-flight error costs only the configuration.

The sources of the Frontier settings (OLCF's user guide) are listed in docs/frontier.md.
"""
from __future__ import annotations

import re
import shlex
from collections.abc import Collection
from pathlib import PurePosixPath

from stages.mechanism.checks import evaluation_memory_problem
from stages.mechanism.config import ConfigError, PipelineConfig
from stages.mechanism.registry import STAGE_ORDER, declaration
from stages.mechanism.shape import ALLOCATION, RANKS, StageShape

SLURM_SITES = ("slurm", "frontier")
"""The sites whose stages run in Slurm jobs Parsl submits (the other one: local)."""

FRONTIER_MODULES = ("PrgEnv-gnu", "rocm/6.4.1", "craype-accel-amd-gfx90a", "miniforge3/23.11.0-0")
"""Modules loaded on Frontier compute nodes unless site.modules says otherwise (the rocm
module matches the torch ROCm 6.4 wheel of docs/frontier.md; it is not the site default)."""

FRONTIER_RCCL_PLUGIN_MODULE = "rccl-net-plugin"
"""OLCF's module of the libfabric network plugin for RCCL (aws-ofi-nccl built for ROCm) and
of the Slingshot settings recommended with it; OLCF loads it after rocm. Loaded after
FRONTIER_MODULES unless site.rccl_plugin_path names a build of one's own."""

FRONTIER_NCCL_NET = "AWS Libfabric"
"""NCCL_NET of a multi-node ranks step: the plugin's network name, so a plugin that did not
load fails the first communicator instead of RCCL falling back to TCP sockets. aws-ofi-nccl
answers to it (and to "OFI", OLCF's spelling); aws-ofi-rccl builds register only it."""

FRONTIER_NCCL_NET_SINGLE_NODE = "Socket"
"""NCCL_NET of a one-node ranks step: OLCF notes that the plugin does not initialise in a
single-node job, so forcing it there would stop RCCL; inside a node RCCL does not use the
network for data anyway."""

FRONTIER_LUSTRE = PurePosixPath("/lustre/orion")
"""Orion, Frontier's Lustre filesystem: the one the compute nodes write at scale."""

NODE_LOCAL_ENV_DIR = "/mnt/bb/$USER/frontier-llm-env"
"""Where site.node_local_env is unpacked on each node's NVMe (a shell word: $USER expands)."""

NODE_LOCAL_ENV_TAR = "/mnt/bb/$USER/frontier-llm-env.tar"
"""The tarball's copy on each node's NVMe (sbcast's destination), removed once unpacked."""

NODE_LOCAL_CONSTRAINT = "nvme"
"""The Slurm constraint that gives a Frontier job its nodes' NVMe (#SBATCH -C nvme)."""

SCRIPT_SAFE_PATH = re.compile(r"[A-Za-z0-9/._+,=@:-]+")
"""The characters a runs dir may hold on a Slurm site: Parsl writes it unquoted into the
batch script (#SBATCH --output, where sbatch also expands %), an unquoted here-document and
the worker's command line."""

FRONTIER_GCDS_PER_NODE = 8
"""One training rank per MI250X GCD."""

FRONTIER_CORES_PER_NODE = 56
"""Usable cores of a Frontier node (64, 8 of them reserved for the system)."""

FRONTIER_CORES_PER_RANK = FRONTIER_CORES_PER_NODE // FRONTIER_GCDS_PER_NODE
"""Cores (and OpenMP threads) of one Frontier rank: 7."""

FRONTIER_NODE_MEMORY_GB = 512
"""Host (DDR4) memory of a Frontier compute node."""

FRONTIER_WALLTIME_BINS = ((1, 5645, 12.0), (2, 1882, 12.0), (3, 184, 12.0), (4, 92, 6.0),
                          (5, 1, 2.0))
"""Frontier's job-size bins: (bin, fewest nodes, longest walltime in hours), largest first.
A job of N nodes falls in the first bin whose fewest nodes is at most N."""


def walltime_bin(nodes: int) -> tuple[int, int, float]:
    """The Frontier job-size bin (bin, fewest nodes, longest walltime h) of a job of
    ``nodes`` nodes."""
    return next(b for b in FRONTIER_WALLTIME_BINS if nodes >= b[1])


def uses_plugin_module(cfg: PipelineConfig) -> bool:
    """Whether the site loads OLCF's RCCL plugin module (FRONTIER_RCCL_PLUGIN_MODULE):
    Frontier, unless site.rccl_plugin_path names a build of one's own."""
    return cfg.site.name == "frontier" and not cfg.site.rccl_plugin_path


class SiteError(ConfigError):
    """A site setting that cannot be used; the message names the key to change."""


def stage_shapes(cfg: PipelineConfig,
                 running: Collection[str] | None = None) -> list[tuple[str, StageShape]]:
    """(name, shape) of every stage in ``running`` (None: all), in pipeline order."""
    return [(name, declaration(name).shape(cfg)) for name in STAGE_ORDER
            if running is None or name in running]


def ranks_stages(cfg: PipelineConfig) -> list[tuple[str, StageShape]]:
    """(name, shape) of every stage that runs as ranks under this config."""
    return [(name, shape) for name, shape in stage_shapes(cfg) if shape.kind == RANKS]


def allocation_stages(cfg: PipelineConfig,
                      running: Collection[str] | None = None) -> list[tuple[str, StageShape]]:
    """(name, shape) of the stages in ``running`` (None: all) that need an allocation of
    their own under Slurm: ranks stages and stages placed in one."""
    return [(name, shape) for name, shape in stage_shapes(cfg, running)
            if shape.kind == RANKS or shape.placement == ALLOCATION]


def check_site(cfg: PipelineConfig, *, readiness_rules: bool = True) -> None:
    """The site settings' checks, before any work (the driver calls it first).

    ``readiness_rules``: also the Frontier rules the dry run's readiness report shows as
    its rows instead of refusing at the first (``workflows.readiness``): where the runs dir
    lives (on Lustre: ``runs_dir_problem``) and the evaluation's host memory
    (``evaluation_memory_problem``). The dry run, which may run on a laptop, passes False.
    """
    site = cfg.site
    if site.node_local_env and site.name != "frontier":
        raise SiteError(
            f"site.node_local_env is set but site.name={site.name}: copying a packed environment "
            "to node-local NVMe (/mnt/bb, #SBATCH -C nvme) is a Frontier option; elsewhere "
            "unpack it in site.worker_init"
        )
    if site.name in SLURM_SITES:
        _check_slurm_site(cfg, readiness_rules)


def runs_dir_problem(cfg: PipelineConfig) -> str | None:
    """Why a Frontier run refuses ``cfg``'s runs dir, with the fix; None when it is usable
    (or the site is not Frontier).

    It must be absolute (a relative one lands wherever the driver starts, usually the NFS
    home) and on Orion, /lustre/orion, where the compute nodes write stage outputs,
    checkpoints and logs: the NFS home and project areas hold 50 GB each and OLCF recommends
    running jobs from Orion.
    """
    if cfg.site.name != "frontier":
        return None
    given = cfg.tracking.runs_dir
    fix = ("pass --runs-dir /lustre/orion/<project>/scratch/$USER/runs (or a proj-shared "
           "directory: /lustre/orion/<project>/proj-shared/...)")
    if not PurePosixPath(given).is_absolute():
        return (f"site.name=frontier: the runs dir {given!r} (--runs-dir, tracking.runs_dir) "
                "is relative: on Frontier it would land wherever the driver starts, usually "
                "your NFS home directory (50 GB, and slow for many ranks); " + fix)
    parts = PurePosixPath(cfg.runs_dir).parts
    lustre = FRONTIER_LUSTRE.parts
    if parts[:len(lustre)] != lustre or len(parts) <= len(lustre):
        return (f"site.name=frontier: the runs dir {str(cfg.runs_dir)!r} (--runs-dir, "
                f"tracking.runs_dir) is not on Frontier's Lustre filesystem "
                f"({FRONTIER_LUSTRE}): the compute nodes write the stage outputs, checkpoints "
                "and logs there, and the home and project (NFS) areas hold 50 GB each and are "
                "slow for many ranks; " + fix)
    return None


def runs_dir_chars_problem(cfg: PipelineConfig) -> str | None:
    """Why a Slurm site refuses the runs dir's characters (None: they are safe)."""
    path = str(cfg.runs_dir)
    if cfg.site.name not in SLURM_SITES or SCRIPT_SAFE_PATH.fullmatch(path):
        return None
    bad = "".join(sorted({ch for ch in path if not SCRIPT_SAFE_PATH.fullmatch(ch)}))
    return (f"the runs dir {path!r} (--runs-dir, tracking.runs_dir) holds {bad!r}: Parsl writes "
            "it unquoted into the batch scripts and the worker's command line, where such "
            "characters split or expand; choose a path of letters, digits and / . _ + , = @ : -")


def node_local_env_lines(tarball: str) -> list[str]:
    """Batch-script lines that copy the packed environment ``tarball`` to every node's NVMe
    (sbcast), unpack it there (conda-unpack when it is a conda-pack tarball) and put its
    bin/ first on PATH, so the worker pools and the ranks import from node-local storage
    rather than from a shared filesystem. A failed copy or unpack ends the job at once."""
    source = shlex.quote(tarball)
    unpack = (f'mkdir -p "{NODE_LOCAL_ENV_DIR}" && tar -xf "{NODE_LOCAL_ENV_TAR}" -C '
              f'"{NODE_LOCAL_ENV_DIR}" && rm -f "{NODE_LOCAL_ENV_TAR}" && '
              f'if [ -x "{NODE_LOCAL_ENV_DIR}/bin/conda-unpack" ]; then '
              f'"{NODE_LOCAL_ENV_DIR}/bin/python" "{NODE_LOCAL_ENV_DIR}/bin/conda-unpack"; fi')
    return [
        f'sbcast --preserve --force {source} "{NODE_LOCAL_ENV_TAR}" || '
        f'{{ echo "sbcast of site.node_local_env failed:" {source} >&2; exit 1; }}',
        f'srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 bash -c {shlex.quote(unpack)} || '
        '{ echo "unpacking site.node_local_env on the nodes\' NVMe failed" >&2; exit 1; }',
        f'export PATH="{NODE_LOCAL_ENV_DIR}/bin:$PATH"',
    ]


def _check_slurm_site(cfg: PipelineConfig, readiness_rules: bool) -> None:
    if cfg.site.name == "frontier":
        _check_frontier(cfg, readiness_rules)
    problem = runs_dir_chars_problem(cfg)
    if problem:
        raise SiteError(problem)


def _check_frontier(cfg: PipelineConfig, readiness_rules: bool) -> None:
    site = cfg.site
    if not site.account:
        raise SiteError(
            "site.account is required on Frontier: add --set site.account=<project id>"
        )
    problem = runs_dir_problem(cfg) if readiness_rules else None
    if problem:
        raise SiteError(problem)
    if site.conda_env and site.node_local_env:
        raise SiteError(
            "site.conda_env and site.node_local_env are both set: the packed environment "
            "replaces the conda environment on the compute nodes; unset one of them"
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
    problem = evaluation_memory_problem(cfg, FRONTIER_NODE_MEMORY_GB) if readiness_rules else None
    if problem:
        raise SiteError(problem)
    for name, shape in ranks_stages(cfg):
        per_node = shape.ranks_per_node
        if per_node > FRONTIER_GCDS_PER_NODE:
            raise SiteError(
                f"{name} runs {shape.nproc} ranks on {shape.nodes} node(s), {per_node} per "
                f"node, and a Frontier node has {FRONTIER_GCDS_PER_NODE} GCDs: lower the "
                f"stage's ranks (e.g. eval.ranks) or spread them over more nodes"
            )
