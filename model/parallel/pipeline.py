"""Pipeline parallelism with torch.distributed.pipelining.

The model is cut into ``pp * virtual_stages`` chunks of contiguous layers
(``model.parallel.layout.stage_layers``); chunk c runs on pipeline rank ``c % pp`` (looped
placement,
as ScheduleInterleaved1F1B expects). Each chunk is a ``GPT`` with the other layers removed;
the first chunk keeps the embedding, the last the final norm and head, so parameter
names stay those of the full model.

Tied embeddings (``model.tie_embeddings``) over several chunks are kept as Megatron-LM keeps
them: the first chunk (pipeline rank 0) owns ``tok_embeddings.weight`` and the last one
(pipeline rank pp - 1) holds its own copy as ``output.weight``, initialised and loaded with
the same values and placed alike by TP and FSDP. The trainer sums the two gradients over
an embedding group (``model.parallel.dims.ParallelDims.tied_embedding_group``) before
clipping and the optimizer step, so both copies take identical updates and stay equal.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from model.config import ModelConfig
from model.gpt import GPT
from model.parallel.layout import stage_layers


def chunk_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Stage (chunk) indices held by pipeline rank ``pp_rank``: pp_rank, pp_rank+pp, ..."""
    return [pp_rank + k * pp for k in range(virtual_stages)]


def build_chunk(cfg: ModelConfig, chunk: int, n_chunks: int) -> GPT:
    """A meta-device GPT holding only chunk ``chunk``'s layers.

    The first chunk also holds the embedding and the last one the head. With tied
    embeddings and several chunks the last chunk's head is a separate Parameter, the copy
    of the first chunk's embedding (module docstring); with one chunk it is the embedding.
    """
    keep = {str(i) for i in stage_layers(cfg.n_layers, n_chunks)[chunk]}
    with torch.device("meta"):
        model = GPT(cfg)
    for layer_id in list(model.layers.keys()):
        if layer_id not in keep:
            del model.layers[layer_id]
    if chunk != 0:
        model.tok_embeddings = None
    if chunk != n_chunks - 1:
        model.norm = None
        model.output = None
    return model


def build_schedule(
    modules: list[nn.Module],
    stage_ids: list[int],
    n_chunks: int,
    device: torch.device,
    group,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    stage_io: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
):
    """PipelineStage per local chunk and the schedule that drives them.

    The schedule scales gradients by 1/n_microbatches, so ``loss_fn`` returns the mean
    loss of one micro-batch and the step's gradients are those of the batch mean.
    ``stage_io`` optionally gives each local stage an example (input, output) of one
    micro-batch (meta tensors do): the stages then know their shapes without inferring
    them from their neighbours at the first step (the rehearsal in
    ``model/rehearsal/rehearse.py`` uses it).
    """
    # Imported here: torch's pipelining pulls in dynamo (about a CPU second), which a rank
    # without a pipeline never needs.
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    io = stage_io or [(None, None)] * len(modules)
    stages = [
        PipelineStage(m, sid, n_chunks, device, group=group, input_args=x, output_args=y)
        for m, sid, (x, y) in zip(modules, stage_ids, io, strict=True)
    ]
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    if len(stages) != 1:
        raise ValueError(f"schedule {schedule!r} runs one chunk per rank; use interleaved_1f1b")
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(schedule)
    if cls is None:
        raise ValueError(
            f"unknown pipeline schedule {schedule!r}; use gpipe, 1f1b or interleaved_1f1b"
        )
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
