"""AdamW, the warm-up + cosine learning-rate schedule, and mesh-aware gradient clipping."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from model.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig, has_dtensor: bool) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms, biases).

    ``foreach=False`` when parameters are DTensors from tensor parallelism: the foreach
    kernels refuse lists mixing meshes/placements. Plain CUDA parameters use the fused kernel.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_cuda = any(p.is_cuda for p in decay + no_decay)
    kernel = {"foreach": False} if has_dtensor else ({"fused": True} if on_cuda else {})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, **kernel)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr after ``step`` completed steps.

    Linear warm-up, then cosine decay to min_lr_ratio at ``decay_steps`` (default: ``steps``),
    constant after it.
    """
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    horizon = cfg.decay_steps if cfg.decay_steps is not None else cfg.steps
    span = max(1, horizon - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(
    opt: torch.optim.Optimizer, cfg: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over ``lr_factor`` (its state_dict is the step count, safe to checkpoint)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg))


@torch.no_grad()
def clip_grad_norm_(
    params: list[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None,
    uncounted: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip gradients by the global L2 norm over every mesh dimension; return the norm.

    DTensor gradients are grouped by (mesh, placements) and reduced with DTensor ops, so
    shards over dp/tp are summed and replicas are not; plain tensors are local (replicated
    over dp by DDP or unsharded). Pipeline stages hold disjoint parameters, so their
    squared norms are summed over ``pp_group``. ``uncounted`` parameters (of ``params``)
    are clipped but left out of the norm: the last stage's copy of a tied embedding, whose
    gradient the first stage's weight already counts. ``max_norm <= 0`` only measures.
    """
    grads = [p.grad for p in params if p.grad is not None]
    skip = {id(p) for p in uncounted}
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in (p.grad for p in params if p.grad is not None and id(p) not in skip):
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
        groups[key].append(g)
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for key, members in groups.items():
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in members]
        sq = torch.stack(norms).pow(2).sum() if key is None else _dtensor_sq(norms)
        total_sq = total_sq + sq
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return total


def _dtensor_sq(norms: list[DTensor]) -> torch.Tensor:
    """Sum of squares of per-parameter DTensor norms (same mesh/placements) as a local scalar."""
    sq = norms[0].pow(2)
    for n in norms[1:]:
        sq = sq + n.pow(2)
    return sq.full_tensor()
