"""DistributedDataParallel as a rehearsal sees it: what DDP keeps and sends, without its C++.

DDP's constructor and reducer read parameter storage, which fake tensors do not have, so
a rehearsal (``model.rehearsal.rehearse``) builds the trainer with ``RehearsedDDP`` in its
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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from model.parallel.parallelize import allreduce_gradients


class RehearsedDDP(nn.Module):
    """A stand-in for ``DistributedDataParallel(module, process_group=dp_mesh.get_group())``
    with its memory and its gradient traffic (see the module docstring)."""

    def __init__(self, module: nn.Module, dp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.module, self.dp_mesh = module, dp_mesh
        self.synced = [p for p in module.parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self.synced:
            by_dtype.setdefault(p.dtype, []).append(p)
        self.buckets: list[tuple[str, list[nn.Parameter]]] = []  # buffer name, its params
        for i, (dtype, params) in enumerate(by_dtype.items()):
            self.register_buffer(f"bucket{i}", torch.empty(
                sum(p.numel() for p in params), dtype=dtype, device=params[0].device),
                persistent=False)
            self.buckets.append((f"bucket{i}", params))
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
        if self.ready == len(self.synced):  # the backward has made every gradient
            self.ready = 0
            for name, params in self.buckets:
                allreduce_gradients(params, self.dp_mesh, into=getattr(self, name))
