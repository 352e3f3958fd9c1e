"""Parallelism as plain functions applied to a meta-device model in a fixed order.

``parallelize_chunk`` applies: tensor parallelism (DTensor Colwise/Rowwise, vocab-parallel
embedding and head, optional sequence parallelism) -> activation checkpointing ->
torch.compile per block (optional) -> FSDP2 (``fully_shard`` per block, then the chunk). DDP
is applied after the weights are initialised (``apply_ddp``) because it broadcasts
parameters when it is constructed.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from model.config import shards_with_fsdp
from model.gpt import GPT


def apply_tp(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Shard attention/MLP (Megatron column -> row), the embedding and head over vocab.

    With ``sequence_parallel`` the residual stream between blocks is sharded along the
    sequence (dim 1) and norms run on their sequence shard; attention/MLP inputs are
    all-gathered first and their outputs reduce-scattered.

    Tied embeddings stay one weight: the vocabulary-parallel embedding and head both shard
    the [V, D] matrix by rows (Shard(0)), so the head is given the embedding's DTensor and
    both gradients accumulate into it. q/k norms (Qwen3) see this rank's heads only: their
    input is read as sharded over the head dim (2) so the replicated weight's gradient is
    reduced over the tp group.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        # Vocab-parallel embedding: rows (vocabulary) sharded, partial sums reduced.
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        # Vocab-parallel head; logits gathered so any loss function works on full rows.
        top["output"] = ColwiseParallel(
            input_layouts=seq, output_layouts=Replicate(), use_local_output=True
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    model.tie_weights()  # the head's new DTensor replaced by the embedding's (same layout)
    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if block.feed_forward.w3 is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        if block.attention.q_norm is not None:  # input [B, T, local heads, hd]
            for norm in ("attention.q_norm", "attention.k_norm"):
                plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if sequence_parallel:
            plan.update(
                {
                    "attention_norm": SequenceParallel(),
                    "ffn_norm": SequenceParallel(),
                    "attention": PrepareModuleInput(
                        input_layouts=(Shard(1), None, None),
                        desired_input_layouts=(Replicate(), None, None),
                    ),
                    "feed_forward": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                }
            )
        parallelize_module(block, tp_mesh, plan)


def apply_activation_checkpointing(model: GPT, mode: str, layers: int = 0) -> None:
    """Recompute activations in backward.

    ``full``: every block keeps only its input and reruns its forward in backward; with
    ``layers`` N > 0 only the chunk's first N blocks do (partial recompute, the plan's
    ``recompute_layers``), the others keep their activations.
    ``selective`` (Megatron-style): only the attention core (rotary + softmax(QK^T)V) is
    recomputed, dropping the score-sized activations for a small extra cost.
    ``none``: nothing is recomputed.
    """
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {mode!r}")
    blocks = list(model.layers.values())  # the chunk's blocks in layer order
    # The plan's rule for recompute_layers is checked with the plan; this guards the call.
    # (Importing the planner here would make its code, and its cluster files, part of every
    # stage's key.)
    if not 0 <= layers < max(len(blocks), 1) or (layers and mode != "full"):
        raise ValueError(f"recompute_layers={layers} with recompute={mode} on a chunk of "
                         f"{len(blocks)} blocks: it needs recompute=full and 0 <= N < blocks")
    recomputed = layers or len(blocks)
    for i, block in enumerate(blocks):
        block.recompute = mode == "full" and i < recomputed
        block.attention.recompute_core = mode == "selective"


def apply_compile(model: GPT) -> None:
    """torch.compile every block in place (``Module.compile`` keeps parameter names)."""
    for block in model.layers.values():
        block.compile()


def apply_fsdp(
    model: GPT, dp_mesh: DeviceMesh, reshard_after_forward: bool, param_dtype: torch.dtype | None
) -> None:
    """FSDP2: shard every block, then the chunk's remaining parameters (embeddings/head).

    ``reshard_after_forward`` True is ZeRO-3 (parameters re-gathered in backward), False is
    ZeRO-2 (kept gathered between forward and backward). ``param_dtype`` bf16 gives mixed
    precision with float32 master weights and float32 gradient reduction.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Wrap in DistributedDataParallel over the dp group (only for tp == 1 models)."""
    device_ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids)


def parallelize_chunk(
    model: GPT,
    mesh: DeviceMesh,
    tp: int,
    dp: int,
    sharding: str,
    recompute: str,
    sequence_parallel: bool,
    param_dtype: torch.dtype | None,
    compile: bool = False,
    recompute_layers: int = 0,
) -> None:
    """Apply TP -> activation checkpointing -> compile -> FSDP2 to one (meta-device) chunk.

    ``recompute_layers`` > 0 recomputes only the chunk's first blocks under ``recompute``
    full (``apply_activation_checkpointing``)."""
    if tp > 1:
        apply_tp(model, mesh["tp"], sequence_parallel)
    apply_activation_checkpointing(model, recompute, recompute_layers)
    if compile:
        apply_compile(model)
    if shards_with_fsdp(sharding, dp):
        apply_fsdp(model, mesh["dp"], sharding == "zero3", param_dtype)


@torch.no_grad()
def allreduce_gradients(params: list[torch.Tensor], dp_mesh: DeviceMesh,
                        into: torch.Tensor | None = None) -> None:
    """Average plain-tensor gradients over the dp group with one flat all-reduce, of a
    flat copy made for it or, given ``into`` (one element per gradient element), of that.

    Used for sharding 'ddp' under pipeline parallelism, where wrapping each stage in
    DistributedDataParallel breaks (its reducer cannot follow several micro-batch backward
    passes of a pipeline schedule in torch 2.13), and by the rehearsal's stand-in for DDP
    (``model.rehearsal.rehearsed_ddp``) with its bucket.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads], out=into)
    torch.distributed.all_reduce(flat, group=dp_mesh.get_group())
    flat /= dp_mesh.size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def allreduce_tied_gradient(param: torch.Tensor, group: torch.distributed.ProcessGroup) -> None:
    """Sum the gradient of the tied embedding / head weight over its embedding group.

    Under pipelining with tied embeddings the first chunk's ``tok_embeddings.weight`` and
    the last chunk's ``output.weight`` are copies placed alike (vocab-parallel Shard(0) over
    tp, FSDP2 Shard(0) over dp), so the two holders of one (dp, tp) coordinate hold the same
    shard: summing their local gradients gives both the one-weight gradient, and both take
    the same optimizer step. The vocab-parallel embedding's backward leaves a Replicate
    gradient on a Shard(0) weight; it is first cut to the weight's placements (a local
    slice, no communication), so both holders reduce the same shard. A rank whose copy got
    no gradient contributes zeros, so the collective always matches.
    """
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    if local.is_contiguous():
        torch.distributed.all_reduce(local, group=group)
    else:
        flat = local.contiguous()
        torch.distributed.all_reduce(flat, group=group)
        local.copy_(flat)
