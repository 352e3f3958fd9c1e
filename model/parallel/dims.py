"""The (pp, dp, tp) factorisation of the world, its DeviceMesh and the embedding groups."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class LayoutError(ValueError):
    """A parallel layout that does not fit the world size; the message names every factor."""


@dataclass(frozen=True)
class ParallelDims:
    """Pipeline x data x tensor parallel degrees; tp varies fastest across ranks."""

    pp: int
    dp: int
    tp: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "world_size"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pp * self.dp * self.tp != self.world_size:
            raise LayoutError(
                f"pp*dp*tp = {self.pp}*{self.dp}*{self.tp} = {self.pp * self.dp * self.tp} "
                f"does not equal the world size {self.world_size}: change pp, dp or tp "
                f"(or the number of ranks) so that the product matches"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A 3-D mesh with dims ("pp", "dp", "tp") over all ranks."""
        return init_device_mesh(
            device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp")
        )

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return pp_rank, dp_rank, tp_rank

    def embedding_group_ranks(self) -> list[list[int]]:
        """Global ranks of each embedding group: for every (dp, tp) coordinate the rank on
        pipeline rank 0 (the first chunk: the input embedding) and the one on pp - 1 (the
        last chunk: the tied head's copy); none without pipelining."""
        if self.pp == 1:
            return []
        block = self.dp * self.tp  # ranks per pipeline rank
        return [[j, (self.pp - 1) * block + j] for j in range(block)]

    def tied_embedding_group(self, mesh: DeviceMesh) -> dist.ProcessGroup | None:
        """This rank's embedding group (over which the tied weight's two gradients are
        summed), or None on a rank in no group. Collective over all ranks (every group is
        created everywhere, in one order); call it once, after ``build_mesh``. With pp = 2
        the groups are the mesh's pp groups themselves, which are reused."""
        if self.pp == 1:
            return None
        if self.pp == 2:
            return mesh["pp"].get_group()
        rank, mine = dist.get_rank(), None
        for ranks in self.embedding_group_ranks():
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        return mine
