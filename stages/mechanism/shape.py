"""How a stage runs: its shape (one app, a fan-out of parts, a set of ranks), where its apps
run, and the three small protocols a stage's work module follows, one per shape.

Pure arithmetic on the configuration: importing this module costs nothing, so the registry,
``--dry-run`` and the pre-flight checks can use it without torch, datasets or MLflow.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

SINGLE, FAN_OUT, RANKS = "single", "fan-out", "ranks"
KINDS = (SINGLE, FAN_OUT, RANKS)
LOGIN, COMPUTE, ALLOCATION = "login", "compute", "allocation"
PLACEMENTS = (LOGIN, COMPUTE, ALLOCATION)


def ceil_div(count: int, parts: int) -> int:
    """``count`` things spread over ``parts`` holders: the most one holder gets."""
    return -(-count // parts)


@dataclass(frozen=True)
class StageShape:
    """How the workflow runs a stage; its declaration's ``shape(cfg)`` returns one.

    ``kind`` picks the protocol its work module follows (``SingleWork``, ``FanOutWork``,
    ``RanksWork``); ``parts`` is a fan-out's part count; ``nproc`` ranks of ``worker``
    (``python -m <worker> --spec PATH``) on ``nodes`` nodes for a ranks stage.

    ``placement`` says where the stage's Python apps (the single app; prepare, parts and
    finalize) run on a Slurm site; locally they all run on this machine. ``login``: the
    submitting node, for light work; ``compute``: a block of compute nodes of their own
    (``site.tokenize_nodes``), for work that spreads over nodes; ``allocation``: the stage's
    own allocation, the block sized for its ranks (or its one process), for work that needs
    a compute node. A ranks stage's ranks always run in its allocation, wherever its prepare
    and finalize run; the allocation is handed back once the stage is done.
    """

    kind: str
    parts: int = 0
    nproc: int = 1
    nodes: int = 1
    worker: str = ""
    note: str = ""  # what --dry-run prints after the stage, e.g. "x2 shards"
    placement: str = LOGIN

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown stage shape {self.kind!r}; one of {KINDS}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown stage placement {self.placement!r}; one of {PLACEMENTS}")
        if self.kind == RANKS and not self.worker:
            raise ValueError("a ranks stage names its worker module")

    @property
    def ranks_per_node(self) -> int:
        """The most ranks the stage puts on one node (its processes spread over its nodes)."""
        return ceil_div(self.nproc, self.nodes)


class SingleWork(Protocol):
    """A stage that is one function: ``run`` computes the outputs into ``out_dir``."""

    def run(self, cfg: Any, inputs: dict[str, dict], out_dir: Path,
            tracker: Any) -> dict[str, Any]: ...


class FanOutWork(Protocol):
    """``prepare`` returns the part count, each ``part`` runs anywhere (its own process),
    ``finalize`` gets every part's result, in order, and returns the outputs."""

    def prepare(self, cfg: Any, inputs: dict[str, dict], out_dir: Path, tracker: Any) -> int: ...

    def part(self, cfg: Any, out_dir: Path, index: int) -> dict[str, Any]: ...

    def finalize(self, cfg: Any, out_dir: Path, parts: list[dict[str, Any]],
                 tracker: Any) -> dict[str, Any]: ...


class RanksWork(Protocol):
    """``prepare`` writes a ``stages.mechanism.launch.RankSpec`` and returns its path; the launcher
    starts the ranks from it; ``finalize`` reads what they wrote and returns the outputs."""

    def prepare(self, cfg: Any, inputs: dict[str, dict], out_dir: Path, tracker: Any) -> str: ...

    def finalize(self, cfg: Any, out_dir: Path, parts: list[Any],
                 tracker: Any) -> dict[str, Any]: ...
