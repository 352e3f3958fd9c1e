"""Validation in the training loop: the held-out loss of a fixed slice, under the training layout.

Every ``train.eval_every`` steps (and after the last) the trainer scores the same
``train.eval_tokens`` predicted tokens of the validation split: the windows
``model.training.heldout.plan_windows`` chooses for that many tokens (spread evenly over the
split), which is the very slice the evaluate stage scores again for the final checkpoint
(``train_slice_val_loss`` / ``train_slice_val_bpb`` there). The windows are dealt over the
data-parallel replicas; each replica runs them through its own chunks (``LoopModel``), tensor
and pipeline parallel as it trains, with no gradient, no optimizer and no draw from the data
stream or any random generator, so a run with validation has bitwise the training losses of
one without.

The figures are ``val_loss`` (nats per token) and, where the store knows the bytes its tokens
stand for, ``val_bpb`` (bits per byte), overall and per source (``val_loss.<source>``) when the
store has several.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model.parallel.pipeline import chunk_ids
from model.training.heldout import heldout_loss, plan_windows

if TYPE_CHECKING:
    from model.training.trainer import Trainer


class SplitTokens:
    """A token array in memory with the reader interface ``heldout_loss`` reads
    (``num_tokens``, ``read(start, stop)``)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens
        self.num_tokens = len(tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop].copy()


@dataclass
class ValidationSet:
    """What a trainer validates on: a reader of the split, its (start, stop, source) spans
    (None: one source) and the bytes of each token id (None: no bits per byte)."""

    reader: Any
    sources: list[tuple[int, int, str]] | None = None
    token_bytes: np.ndarray | None = None

    @classmethod
    def from_store(cls, store: str, split: str = "validation") -> ValidationSet:
        """The ``split`` of the token store at ``store``; a ValueError naming the fix when it
        holds nothing to score."""
        from data_prep.store import SplitReader, open_store

        info = open_store(store)
        reader = SplitReader(info, split)
        if reader.num_tokens < 2:
            raise ValueError(f"train.eval_every asks for validation, but the {split} split of "
                             f"{store} has {reader.num_tokens} tokens: raise "
                             "data.validation_fraction, or set train.eval_every=0")
        spans = info.split_spans(split)
        several = len({name for _, _, name in spans}) > 1
        return cls(reader, spans if several else None, info.token_bytes())

    @classmethod
    def synthetic(cls, vocab_size: int, seq_len: int, tokens: int, seed: int) -> ValidationSet:
        """Held-out synthetic sequences (``model.training.batches.SyntheticBatches`` under
        another seed), for a training on synthetic tokens: no bytes, no bits per byte."""
        from model.training.batches import SyntheticBatches

        rows = max(1, -(-tokens // seq_len))
        stream = SyntheticBatches(vocab_size, seq_len, rows, 0, 1, seed + 7919)
        return cls(SplitTokens(stream.next_batch().flatten().numpy()))


class LoopModel:
    """A trainer's own chunks as ``heldout_loss`` wants a model spread over ranks:
    ``token_losses(tokens [B, T+1]) -> [B, T]`` float64 on CPU, the same on every rank of a
    replica, with the replicas (dp) splitting the windows (``loss_rank_world``, ``dp_group``).

    Without pipelining the chunk runs whole (its FSDP or TP forward included; a DDP wrapper is
    bypassed: a forward needs no gradient sync). Under pipelining the chunks run in order,
    chunk c on pipeline rank c % pp, each sending its hidden state (shape first: sequence
    parallelism shards it) to the next; the last stage's losses are broadcast over the
    pipeline group. ``lockstep``: FSDP's forward gathers over dp, so every replica runs the
    same number of batches."""

    lockstep = True

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer
        self.dp_group = trainer.dp_group
        self.ids = chunk_ids(trainer.pp_rank, trainer.plan.pp, trainer.plan.virtual_stages)

    def loss_rank_world(self) -> tuple[int, int]:
        return self.t.dp_rank, self.t.plan.dp

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(self.t.params)

    def eval(self) -> LoopModel:
        for chunk in self.t.chunks:
            chunk.eval()
        return self

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.t.pp_group, pp_rank % self.t.plan.pp)

    def _hidden(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """inputs [B, T] through every chunk; the logits [B, T, V] on the last stage."""
        t = self.t
        if t.plan.pp == 1:
            return t.chunks[0](inputs)
        n_chunks, h = t.plan.pp * t.plan.virtual_stages, None
        for c in range(n_chunks):
            if c % t.plan.pp != t.pp_rank:
                continue
            if c == 0:
                h = t.chunks[self.ids.index(c)](inputs)
            else:
                shape = torch.zeros(3, dtype=torch.int64, device=t.device)  # NCCL: on device
                dist.recv(shape, src=self._peer(c - 1), group=t.pp_group)
                h = torch.empty(*shape.tolist(), dtype=torch.float32, device=t.device)
                dist.recv(h, src=self._peer(c - 1), group=t.pp_group)
                h = t.chunks[self.ids.index(c)](h)
            if c < n_chunks - 1:
                dist.send(torch.tensor(h.shape, dtype=torch.int64, device=t.device),
                          dst=self._peer(c + 1), group=t.pp_group)
                dist.send(h.float().contiguous(), dst=self._peer(c + 1), group=t.pp_group)
        return h if t.has_last else None

    @torch.no_grad()
    def token_losses(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T+1] -> per-token cross-entropy [B, T] (float64, CPU) on every rank."""
        t = self.t
        with t._autocast():
            logits = self._hidden(tokens[:, :-1])
        losses = None
        if logits is not None:
            targets = tokens[:, 1:].to(logits.device)
            losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                     reduction="none").view(targets.shape).double()
        if t.plan.pp > 1:
            out = (losses if losses is not None else torch.empty(
                tokens.shape[0], tokens.shape[1] - 1, dtype=torch.float64, device=t.device))
            dist.broadcast(out, src=self._peer(t.plan.pp - 1), group=t.pp_group)
            losses = out
        return losses.cpu()


def _reshard(chunks: list[nn.Module]) -> None:
    """Put FSDP2 parameters back in their shards: a forward without a backward leaves a
    zero2 chunk (no reshard after forward) holding its gathered parameters."""
    from torch.distributed.fsdp import FSDPModule

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


@contextlib.contextmanager
def _untouched_rng(device: torch.device) -> Iterator[None]:
    """Restore the CPU (and this GPU's) random state afterwards: validation draws nothing,
    and should any module draw, the training's random stream stays its own."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def validate(trainer: Trainer, data: ValidationSet) -> dict[str, Any]:
    """Score the fixed slice (``train.eval_tokens``) with the trainer's model as it is now
    (collective over every rank). Returns ``heldout_loss``'s figures plus "seconds"."""
    cfg = trainer.cfg
    started = time.perf_counter()
    batch = max(1, trainer.plan.micro_batch)  # the activations training already fits
    try:
        with _untouched_rng(trainer.device):
            result = heldout_loss(LoopModel(trainer), data.reader, cfg.seq_len, cfg.slice_tokens,
                                  batch, sources=data.sources, progress_seconds=0,
                                  token_bytes=data.token_bytes)
    finally:
        _reshard(trainer.chunks)
        for chunk in trainer.chunks:
            chunk.train()
    result.pop("local_windows", None)
    return {**result, "seconds": time.perf_counter() - started}


def validation_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The MLflow metrics of one validation: ``val_loss``, ``val_bpb`` and, with several
    sources, ``val_loss.<source>`` / ``val_bpb.<source>``."""
    metrics = {k: float(result[k]) for k in ("val_loss", "val_bpb") if k in result}
    per_source = result.get("per_source") or {}
    if len(per_source) > 1:
        for name, figures in per_source.items():
            for k in ("val_loss", "val_bpb"):
                if k in figures:
                    metrics[f"{k}.{name}"] = float(figures[k])
    return metrics


def slice_windows(num_tokens: int, seq_len: int, eval_tokens: int) -> int:
    """How many windows the fixed slice holds (for messages and the summary)."""
    return plan_windows(num_tokens, seq_len, eval_tokens, "validation split").windows
