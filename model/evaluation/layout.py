"""Inference with the training layout: a model too big for one process, on tp x pp (x dp) ranks.

``LayoutModel`` holds this rank's pipeline stage of the model (``build_chunk``), tensor-parallel
like training (``apply_tp``), with the checkpoint's weights loaded straight into the shards
(a collective DCP load: no rank ever holds the whole model). A forward pass runs the stages in
order, each sending its hidden state [B, T, D] to the next pipeline rank; the last stage's
result is broadcast over the pipeline group, so every rank of a model replica returns the same
answer and callers stay rank-agnostic:

- ``token_losses(tokens [B, T+1]) -> [B, T]`` float64 per-token losses (what
  ``model.training.heldout.heldout_loss`` sums; only [B, T] crosses ranks, not the logits);
- ``last_logits(tokens [B, T]) -> [B, V]`` the next-token logits (what
  ``model.evaluation.generate.generate_tokens`` picks from).

With dp > 1 the replicas split the windows (``loss_rank_world``) and the loss sums are
all-reduced over the dp group (``dp_group``). Forward only: no pipeline schedule is needed.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from model.config import ModelConfig
from model.gpt import rope_tables
from model.parallel.dims import ParallelDims
from model.parallel.parallelize import apply_tp
from model.parallel.pipeline import build_chunk
from model.training.checkpoint import CheckpointError, check_model_shape, checkpoint_problem


class LayoutModel(nn.Module):
    """This rank's tp shard of its pipeline stage, loaded from a checkpoint (see module doc)."""

    def __init__(self, ckpt_dir: str | Path, cfg: ModelConfig, tp: int, pp: int,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        problem = checkpoint_problem(ckpt_dir)
        if problem is not None:
            raise CheckpointError(f"checkpoint {ckpt_dir} cannot be loaded: {problem}")
        check_model_shape(ckpt_dir, cfg)
        if cfg.n_layers < pp:
            raise ValueError(f"pp={pp} pipeline stages need at least as many layers "
                             f"(model.n_layers={cfg.n_layers})")
        world = dist.get_world_size()
        if world % (tp * pp):
            raise ValueError(f"{world} ranks are not a multiple of tp*pp = {tp}*{pp}")
        self.cfg, self.device = cfg, torch.device(device)
        dims = ParallelDims(pp, world // (tp * pp), tp, world)
        mesh = dims.build_mesh(self.device.type)
        self.pp, self.pp_rank = pp, mesh["pp"].get_local_rank()
        self.dp, self.dp_rank = dims.dp, mesh["dp"].get_local_rank()
        self.pp_group, self.dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        self.stage = build_chunk(cfg, self.pp_rank, pp)
        if tp > 1:
            apply_tp(self.stage, mesh["tp"])
        self.stage.to_empty(device=self.device)
        cos, sin = rope_tables(cfg)  # with cfg's rope scaling, as GPT.init_weights
        self.stage.rope_cos.copy_(cos)
        self.stage.rope_sin.copy_(sin)
        state = {"model": get_model_state_dict(self.stage)}
        dcp.load(state, checkpoint_id=str(ckpt_dir))  # each rank reads only its shards
        set_model_state_dict(self.stage, state["model"])
        self.stage.eval()

    def loss_rank_world(self) -> tuple[int, int]:
        """(this replica's index, replicas): how the held-out windows are dealt."""
        return self.dp_rank, self.dp

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.pp_group, pp_rank)

    @torch.no_grad()
    def _stages(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """tokens [B, T] through all stages; the last stage's output [B, T, V], else None."""
        bsz, seqlen = tokens.shape
        if self.pp_rank == 0:
            h = self.stage(tokens.to(self.device))
        else:
            h = torch.empty(bsz, seqlen, self.cfg.d_model, device=self.device)
            dist.recv(h, src=self._peer(self.pp_rank - 1), group=self.pp_group)
            h = self.stage(h)
        if self.pp_rank < self.pp - 1:
            dist.send(h.float().contiguous(), dst=self._peer(self.pp_rank + 1),
                      group=self.pp_group)
            return None
        return h

    def _from_last(self, value: torch.Tensor | None, shape: tuple[int, ...],
                   dtype: torch.dtype) -> torch.Tensor:
        """The last stage's ``value`` on every rank of the pipeline group."""
        out = value.to(dtype).contiguous() if value is not None else torch.empty(
            shape, dtype=dtype, device=self.device)
        if self.pp > 1:
            dist.broadcast(out, src=self._peer(self.pp - 1), group=self.pp_group)
        return out

    def token_losses(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T+1] -> per-token cross-entropy [B, T] (float64, CPU) on every rank."""
        logits = self._stages(tokens[:, :-1])
        losses = None
        if logits is not None:
            targets = tokens[:, 1:].to(logits.device)
            losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                     reduction="none").view(targets.shape)
        bsz, seqlen = tokens.shape
        return self._from_last(losses, (bsz, seqlen - 1), torch.float64).cpu()

    def last_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> the last position's logits [B, V] (float32, CPU) on every rank."""
        logits = self._stages(tokens)
        last = logits[:, -1] if logits is not None else None
        return self._from_last(last, (tokens.shape[0], self.cfg.vocab_size), torch.float32).cpu()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Refused: a whole-logits forward would gather [B, T, V] on every rank."""
        raise TypeError("LayoutModel has no full forward: use token_losses or last_logits")
