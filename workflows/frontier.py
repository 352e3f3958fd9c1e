"""Frontier's constants and the site rules checked before any work.

A Frontier node has 8 MI250X GCDs, one training rank each, and 56 usable cores (64, 8 of
them reserved for the system): 7 per rank. Its compute nodes load ``FRONTIER_MODULES``
unless ``site.modules`` says otherwise.

``check_site`` holds every rule a site's settings must meet (Frontier: an account, at most
8 ranks of any stage per node, at most one tokenize worker per core); the driver calls it
before any run is opened, and the Parsl configuration and the dry run call it too. Every
site rule raises ``SiteError``. Nothing here imports Parsl, so a pre-flight error costs
only the configuration.
"""
from __future__ import annotations

from collections.abc import Collection

from stages.config import ConfigError, PipelineConfig
from stages.registry import STAGE_ORDER, declaration
from stages.shape import RANKS, StageShape

SLURM_SITES = ("slurm", "frontier")
"""The sites whose stages run in Slurm jobs Parsl submits (the other one: local)."""

FRONTIER_MODULES = ("PrgEnv-gnu", "rocm/6.2.4", "craype-accel-amd-gfx90a", "miniforge3/23.11.0-0")
"""Modules loaded on Frontier compute nodes unless site.modules says otherwise."""

FRONTIER_GCDS_PER_NODE = 8
"""One training rank per MI250X GCD."""

FRONTIER_CORES_PER_NODE = 56
"""Usable cores of a Frontier node (64, 8 of them reserved for the system)."""

FRONTIER_CORES_PER_RANK = FRONTIER_CORES_PER_NODE // FRONTIER_GCDS_PER_NODE
"""Cores (and OpenMP threads) of one Frontier rank: 7."""


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


def check_site(cfg: PipelineConfig) -> None:
    """The site settings' checks, before any work (the driver calls it first)."""
    if cfg.site.name in SLURM_SITES:
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
        for name, shape in ranks_stages(cfg):
            per_node = shape.ranks_per_node
            if per_node > FRONTIER_GCDS_PER_NODE:
                raise SiteError(
                    f"{name} runs {shape.nproc} ranks on {shape.nodes} node(s), {per_node} per "
                    f"node, and a Frontier node has {FRONTIER_GCDS_PER_NODE} GCDs: lower the "
                    f"stage's ranks (e.g. eval.ranks) or spread them over more nodes"
                )
