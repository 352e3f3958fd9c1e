"""DistributedDataParallel as a rehearsal sees it: what DDP keeps and sends, without its C++.

DDP's constructor and reducer read parameter storage, which fake tensors do not have, so
a rehearsal (``model.training.rehearse``) builds the trainer with ``RehearsedDDP`` in its
place. It keeps what DDP keeps in torch's default setting (``gradient_as_bucket_view``
off): a float32 bucket copy of every gradient, made with the wrapper, beside the
gradients themselves. It sends what DDP sends: on a step's last micro-batch (outside
``no_sync``), once the backward has made every gradient, the buckets are all-reduced over
the dp group and the averaged gradients copied back, in place, as the reducer does bucket
by bucket; one call carries the bytes of DDP's 25 MB buckets together.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


class RehearsedDDP(nn.Module):
    """A stand-in for ``DistributedDataParallel(module, process_group=dp_mesh.get_group())``
    with its memory and its gradient traffic (see the module docstring)."""

    def __init__(self, module: nn.Module, dp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.module = module
        self.group, self.dp = dp_mesh.get_group(), dp_mesh.size()
        self.synced = [p for p in module.parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, int] = {}
        for p in self.synced:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
        device = self.synced[0].device if self.synced else torch.device("cpu")
        for i, (dtype, numel) in enumerate(by_dtype.items()):
            self.register_buffer(f"bucket{i}", torch.empty(numel, dtype=dtype, device=device),
                                 persistent=False)
        self.syncing, self.ready = True, 0
        for p in self.synced:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, as ``DistributedDataParallel.no_sync`` does."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def _gradient_ready(self, _param: torch.Tensor) -> None:
        if not self.syncing:
            return
        self.ready += 1
        if self.ready == len(self.synced):
            self.ready = 0
            self._all_reduce()

    @torch.no_grad()
    def _all_reduce(self) -> None:
        """Copy the gradients into their buckets, average the buckets over dp, copy back."""
        buckets = dict(self.named_buffers(recurse=False))
        for i, dtype in enumerate(dict.fromkeys(p.dtype for p in self.synced)):
            bucket, grads = buckets[f"bucket{i}"], [p.grad for p in self.synced if p.dtype == dtype]
            offset = 0
            for g in grads:
                bucket[offset:offset + g.numel()].copy_(g.reshape(-1))
                offset += g.numel()
            bucket.div_(self.dp)
            dist.all_reduce(bucket, group=self.group)
            offset = 0
            for g in grads:
                g.copy_(bucket[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
