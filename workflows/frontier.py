"""Frontier's constants and the site rules checked before any work.

A Frontier node has 8 MI250X GCDs, one training rank each, and 56 usable cores (64, 8 of
them reserved for the system): 7 per rank. Its compute nodes load ``FRONTIER_MODULES``
unless ``site.modules`` says otherwise, then OLCF's RCCL network plugin module
(``FRONTIER_RCCL_PLUGIN_MODULE``) unless ``site.rccl_plugin_path`` names a build of one's
own; with ``site.node_local_env`` each job copies the packed environment to its nodes'
NVMe and runs from there (``node_local_env_lines``).

``check_site`` holds every rule a site's settings must meet (a runs dir whose characters
survive Parsl's unquoted scripts and command lines, wherever Parsl writes them; Slurm sites,
for the driver: a controller that answers; Frontier: an account, a runs dir on Lustre,
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
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path, PurePosixPath

from stages.config import ConfigError, PipelineConfig, unquoted_shell_problem
from stages.evaluate.checks import evaluation_memory_problem
from stages.mechanism.shape import ALLOCATION, RANKS, StageShape
from stages.registry import STAGE_ORDER, declaration

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

NODE_LOCAL_ENV_NODES = 64
"""Above this many nodes in one job a Frontier run needs site.node_local_env: every rank
(8 a node) imports torch's thousands of files and ~1.5 GB of ROCm libraries from the shared
file system at once, a start-up that grows with the node count and holds the whole
allocation, where sbcast's copy to each node's NVMe costs about the same at any size
(docs/frontier.md#the-python-environment-at-scale)."""

FRONTIER_PROXY = "http://proxy.ccs.ornl.gov:3128/"
"""OLCF's proxy, the compute nodes' only way out to the internet."""

_PROXY_EXPORT = re.compile(r"\b(https_proxy|HTTPS_PROXY|all_proxy|ALL_PROXY)=\S")

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


def check_site(cfg: PipelineConfig, *, readiness_rules: bool = True,
               controller: bool = False) -> None:
    """The site settings' checks, before any work (the driver calls it first).

    ``controller``: on a Slurm site also that a Slurm controller answers here
    (``slurm_controller_problem``); the driver asks, the Parsl configuration and the dry
    run (which may run on a laptop) do not.

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
    problem = runs_dir_chars_problem(cfg)
    if problem:
        raise SiteError(problem)
    if controller and site.name in SLURM_SITES:
        problem = slurm_controller_problem(site.name)
        if problem:
            raise SiteError(problem)


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


def parsl_writes_paths_unquoted(cfg: PipelineConfig) -> bool:
    """Whether Parsl writes the runs dir (its own directory under it) unquoted into a shell
    line: on Slurm sites (batch scripts, #SBATCH --output, the worker pool's command line)
    and locally with worker processes (the HTEX worker pool's command line and its local
    submit script). Threads of the driver (``site.login_workers=threads``) start no shell
    with it; the ranks' command quotes every path (``workflows.ranks``)."""
    return cfg.site.name in SLURM_SITES or cfg.site.login_workers == "processes"


def runs_dir_chars_problem(cfg: PipelineConfig, path: str | Path | None = None) -> str | None:
    """Why the site refuses the characters of the runs dir (or of ``path``, a directory
    under it that Parsl writes); None where they are safe or nothing writes them unquoted.
    The rule is ``unquoted_shell_problem``; on Slurm sites ``%`` is refused too (sbatch
    expands it in #SBATCH --output)."""
    if not parsl_writes_paths_unquoted(cfg):
        return None
    where = ("Parsl writes it unquoted into the batch scripts and the worker pool's command "
             "line" if cfg.site.name in SLURM_SITES else "with site.login_workers=processes "
             "Parsl writes it unquoted into the worker pool's command line (or use "
             "site.login_workers=threads)")
    return unquoted_shell_problem("tracking.runs_dir (--runs-dir)",
                                  str(path or cfg.runs_dir), where,
                                  also_refuse="%" if cfg.site.name in SLURM_SITES else "")


SLURM_PING = ("scontrol", "ping")
"""The command that asks whether a Slurm controller answers from this machine."""

SLURM_PING_TIMEOUT_S = 30.0


def slurm_controller_problem(site: str, timeout_s: float = SLURM_PING_TIMEOUT_S) -> str | None:
    """Why no Slurm job can be submitted from here (one line: the command that failed, what
    it said, the fix); None when ``scontrol ping`` finds a controller up.

    Without it the first sbatch of the run fails deep inside Parsl with Slurm's raw error
    (a DNS lookup of the configuration, a refused connection) after the run was opened.
    """
    command = " ".join(SLURM_PING)
    fix = (f"run the pipeline on a login node of the cluster (with SLURM_CONF set where the "
           f"cluster needs it), or use --site local instead of site.name={site}")
    try:
        proc = subprocess.run(SLURM_PING, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except FileNotFoundError:
        return (f"no Slurm controller reachable: {SLURM_PING[0]!r} is not on PATH (no Slurm "
                f"client here; `{command}` failed): {fix}")
    except subprocess.TimeoutExpired:
        return (f"no Slurm controller reachable: `{command}` did not answer in "
                f"{timeout_s:g} s: {fix}")
    said = [line.strip() for line in (proc.stdout + "\n" + proc.stderr).splitlines()
            if line.strip()]
    down = [line for line in said if "DOWN" in line]
    if proc.returncode == 0 and not any("primary" in line for line in down):
        return None
    errors = [line for line in said if "error" in line.lower() or "fatal" in line.lower()]
    detail = (down or errors or said or [f"exit {proc.returncode}"])[0]
    return f"no Slurm controller reachable: `{command}` failed ({detail}): {fix}"


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


def largest_job_nodes(cfg: PipelineConfig) -> int:
    """Nodes of the run's largest job: the tokenize block, a stage's allocation."""
    return max([cfg.site.tokenize_nodes] + [shape.nodes for _, shape in allocation_stages(cfg)])


def node_local_env_problem(cfg: PipelineConfig) -> str | None:
    """Why a Frontier run of more than ``NODE_LOCAL_ENV_NODES`` nodes in one job must not
    import its Python environment from the shared file system, with the fix; None where
    site.node_local_env is set, the jobs are small enough, or the site is not Frontier."""
    site = cfg.site
    nodes = largest_job_nodes(cfg)
    if site.name != "frontier" or site.node_local_env or nodes <= NODE_LOCAL_ENV_NODES:
        return None
    where = (f"site.conda_env={site.conda_env}" if site.conda_env
             else f"the submitting interpreter's {sys.prefix}")
    unset = " and unset site.conda_env" if site.conda_env else ""
    return (f"a job of {nodes} nodes runs {nodes * FRONTIER_GCDS_PER_NODE} ranks that all "
            f"import torch from the shared file system ({where}); above "
            f"{NODE_LOCAL_ENV_NODES} nodes that start-up storm holds the whole allocation: "
            "pack the environment once (conda pack -p <env> -o "
            "/lustre/orion/<project>/scratch/$USER/env.tar.gz, or venv-pack for a venv) and "
            f"set site.node_local_env=<that tarball>{unset}; each job then copies it to its "
            "nodes' NVMe with sbcast (#SBATCH -C nvme) and runs from there")


def hub_sources(cfg: PipelineConfig) -> list[str]:
    """The corpus's hub sources (``hf:<id>``)."""
    data = cfg.data
    sources = [data.source] if data.source else list(data.sources.values())
    return [s for s in sources if s.startswith("hf:")]


def proxy_configured(cfg: PipelineConfig) -> bool:
    """Whether site.worker_init, the shell lines the compute nodes run before their workers
    start, exports an https (or all) proxy, the way OLCF documents the compute nodes'
    internet access."""
    return bool(_PROXY_EXPORT.search(cfg.site.worker_init))


def hub_fetch_problem(cfg: PipelineConfig) -> str | None:
    """Why a Frontier run cannot fetch its hub corpus, with the fix; None without one, on
    another site, or with a proxy configured. Tokenize streams a hub dataset in its prepare
    step, on a compute node of the tokenize block, and Frontier's compute nodes reach the
    internet only through OLCF's proxy."""
    hub = hub_sources(cfg)
    if cfg.site.name != "frontier" or not hub or proxy_configured(cfg):
        return None
    name = hub[0].removeprefix("hf:")
    return (f"data.source {', '.join(hub)}: tokenize streams a hub dataset on a Frontier "
            "compute node, which reaches the internet only through OLCF's proxy: fetch it "
            "where the network is, on a login node or a data-transfer node (e.g. "
            f"huggingface-cli download --repo-type dataset {name} --local-dir "
            f"/lustre/orion/<project>/scratch/$USER/{name.split('/')[-1]}) and point "
            "data.source at the downloaded files, or send the compute nodes through the "
            f"proxy: --set \"site.worker_init=export https_proxy={FRONTIER_PROXY} "
            f"http_proxy={FRONTIER_PROXY}\"")


def _check_slurm_site(cfg: PipelineConfig, readiness_rules: bool) -> None:
    if cfg.site.name == "frontier":
        _check_frontier(cfg, readiness_rules)


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
