"""Held-out loss and perplexity over a token stream, token-weighted, data-parallel.

The split is cut into consecutive windows of ``seq_len + 1`` tokens that overlap by one
token (window w covers tokens [w*T, w*T + T + 1)), so every evaluated token is predicted
exactly once, from the window's own context. When ``max_tokens`` allows fewer windows than
the split holds, the evaluated windows are spread evenly over the whole split (not its
prefix), so every part of it, and every source of a multi-source store, is sampled.
Windows are dealt round-robin to ranks; each
rank sums per-token losses (float64) and counts, and the sums are all-reduced when
``torch.distributed`` is initialised, so the result does not depend on the number of ranks.

The reader is any object with ``num_tokens`` and ``read(start, stop) -> np.ndarray`` (e.g.
``data_prep.store.SplitReader``); sources are optional (start, stop, name) spans of the split
for a per-source breakdown (each token counts for the span that contains it).

Bits per byte: given the bytes each token id stands for (``StoreInfo.token_bytes``), the
result also holds ``val_bpb`` = the summed loss in bits over the summed bytes of the predicted
tokens (an eos predicts no bytes but its loss counts: ending a document is information).
Unlike the loss per token, it compares models with different tokenizers.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class EmptySplitError(ValueError):
    """A split with too few tokens to evaluate anything."""


@dataclass
class WindowPlan:
    """How a split is cut: ``windows`` windows of ``seq_len`` predicted tokens each."""

    seq_len: int
    windows: int
    available: int = 0
    """Windows the split holds (0: same as ``windows``)."""

    @property
    def tokens(self) -> int:
        return self.seq_len * self.windows

    def window_index(self, k: int) -> int:
        """Position (in windows) of the k-th evaluated window: evenly spaced over the split."""
        available = self.available or self.windows
        return k * available // self.windows


def plan_windows(num_tokens: int, seq_len: int, max_tokens: int, what: str = "split") -> WindowPlan:
    """Windows covering at most ``max_tokens`` predicted tokens of a ``num_tokens`` split.

    A split shorter than one window is evaluated as one shorter window; a split of fewer
    than 2 tokens raises EmptySplitError.
    """
    if num_tokens < 2:
        raise EmptySplitError(
            f"the {what} has {num_tokens} tokens; evaluation needs at least 2: "
            "add documents (data.source, data.max_documents) or raise data.validation_fraction"
        )
    seq_len = min(seq_len, num_tokens - 1)
    available = (num_tokens - 1) // seq_len
    windows = min(available, max(1, max_tokens // seq_len))
    return WindowPlan(seq_len, windows, available)


def _rank_world(rank: int | None, world: int | None) -> tuple[int, int]:
    if rank is not None and world is not None:
        return rank, world
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _source_index(
    sources: list[tuple[int, int, str]] | None,
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Sorted source names, span starts and each span's name index (for searchsorted)."""
    if not sources:
        return ["all"], np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    names = sorted({name for _, _, name in sources})
    spans = sorted(sources)
    starts = np.array([s for s, _, _ in spans], dtype=np.int64)
    ids = np.array([names.index(n) for _, _, n in spans], dtype=np.int64)
    return names, starts, ids


def _bits_per_byte(loss_nats: float, nbytes: float,
                   token_bytes: np.ndarray | None) -> dict[str, float]:
    """{"val_bpb", "bytes"} of a summed loss over the bytes its tokens stand for ({} without
    ``token_bytes``; a bpb of NaN when the tokens stand for no bytes)."""
    if token_bytes is None:
        return {}
    bpb = loss_nats / math.log(2) / nbytes if nbytes > 0 else float("nan")
    return {"val_bpb": float(bpb), "bytes": round(nbytes)}


@torch.no_grad()
def heldout_loss(
    model: nn.Module,
    reader,
    seq_len: int,
    max_tokens: int,
    batch_size: int,
    rank: int | None = None,
    world: int | None = None,
    sources: list[tuple[int, int, str]] | None = None,
    progress_seconds: float = 10.0,
    token_bytes: np.ndarray | None = None,
) -> dict:
    """Token-weighted loss over ``max_tokens`` predicted tokens spread over ``reader``.

    Returns {"val_loss", "perplexity", "tokens", "windows", "local_windows", "seq_len",
    "per_source": {name: {"val_loss", "perplexity", "tokens"}}}; identical on every rank
    except ``local_windows`` (the windows this rank evaluated). With ``token_bytes`` (the
    UTF-8 bytes of each token id), also "val_bpb" and "bytes", overall and per source.

    A ``model.evaluation.layout.LayoutModel`` (the model spread over tp x pp ranks) supplies
    the per-token losses itself; its replicas (dp) split the windows and reduce over dp. A
    model whose ``lockstep`` is true (the trainer's own chunks, whose FSDP forward gathers
    over dp) gets the same number of batches on every replica: a short one runs a repeat of
    a window of its own and discards it.
    """
    group = None
    if hasattr(model, "token_losses"):
        rank, world = model.loss_rank_world()
        group = model.dp_group
    rank, world = _rank_world(rank, world)
    plan = plan_windows(reader.num_tokens, seq_len, max_tokens)
    names, span_starts, span_ids = _source_index(sources)
    loss_sums = np.zeros(len(names), dtype=np.float64)
    counts = np.zeros(len(names), dtype=np.float64)
    byte_sums = np.zeros(len(names), dtype=np.float64)
    mine = list(range(rank, plan.windows, world))
    device = next(model.parameters()).device  # batches go where the model is (CPU or a GPU)
    t0 = last = time.monotonic()
    model.eval()
    batches = math.ceil(len(mine) / batch_size)
    if getattr(model, "lockstep", False):
        batches = math.ceil(math.ceil(plan.windows / world) / batch_size)
    for b in range(0, batches * batch_size, batch_size):
        batch = [plan.window_index(k) for k in mine[b : b + batch_size]]
        if not batch:  # lockstep: keep the other replicas company, count nothing
            rows = np.stack([reader.read(0, plan.seq_len + 1)]).astype(np.int64)
            model.token_losses(torch.from_numpy(rows).to(device))
            continue
        rows = np.stack([reader.read(w * plan.seq_len, w * plan.seq_len + plan.seq_len + 1)
                         for w in batch]).astype(np.int64)  # [B, T+1]
        tokens = torch.from_numpy(rows).to(device)
        if group is not None:
            losses = model.token_losses(tokens).numpy()  # [B, T], the same on every rank
        else:
            logits = model(tokens[:, :-1])  # [B, T, V]
            losses = F.cross_entropy(
                logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none"
            ).view(len(batch), plan.seq_len).double().cpu().numpy()  # [B, T]
        # Position of each predicted token in the split -> its source.
        starts = np.array(batch, dtype=np.int64)[:, None] * plan.seq_len
        pos = starts + np.arange(1, plan.seq_len + 1)
        which = span_ids[np.searchsorted(span_starts, pos, side="right") - 1]
        np.add.at(loss_sums, which.ravel(), losses.ravel())
        np.add.at(counts, which.ravel(), 1.0)
        if token_bytes is not None:
            np.add.at(byte_sums, which.ravel(), token_bytes[rows[:, 1:]].ravel())
        now = time.monotonic()
        if progress_seconds and now - last > progress_seconds:
            done = b + len(batch)
            rate = done * plan.seq_len / (now - t0)
            eta = (len(mine) - done) * plan.seq_len / max(rate, 1e-9)
            print(f"[eval rank {rank}] {done}/{len(mine)} windows, {rate:,.0f} tokens/s, "
                  f"ETA {eta:.0f}s", file=sys.stderr, flush=True)
            last = now
    totals = torch.from_numpy(np.concatenate([loss_sums, counts, byte_sums]))
    if world > 1 and dist.is_available() and dist.is_initialized():
        # a NCCL group (the trainer's own, on GPUs) reduces device tensors only
        on_device = dist.get_backend(group) == "nccl"
        reduced = totals.to(device) if on_device else totals
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
        totals = reduced.cpu()
    loss_sums, counts, byte_sums = (part.numpy() for part in totals.split(len(names)))
    total_loss, total_tokens = float(loss_sums.sum()), round(counts.sum())
    val_loss = total_loss / total_tokens
    per_source = {
        name: {"val_loss": float(ls / n), "perplexity": math.exp(ls / n), "tokens": round(n),
               **_bits_per_byte(ls, nb, token_bytes)}
        for name, ls, n, nb in zip(names, loss_sums, counts, byte_sums) if n > 0
    }
    return {
        **_bits_per_byte(total_loss, float(byte_sums.sum()), token_bytes),
        "val_loss": val_loss,
        "perplexity": math.exp(val_loss),
        "tokens": total_tokens,
        "windows": plan.windows,
        "local_windows": len(mine),  # evaluated by this rank
        "seq_len": plan.seq_len,
        "per_source": per_source,
    }
