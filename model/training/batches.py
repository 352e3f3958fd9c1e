"""Deterministic synthetic token batches with the TokenWindowLoader interface.

Used when no token store is given (benchmarks, layout tests). Each sequence is a
learnable pattern (an arithmetic progression modulo the vocabulary with a random start
and stride), drawn from a generator seeded by (seed, step) over the whole global batch,
so every data-parallel layout sees the same global batch at every step.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model.config import TrainConfig


class SyntheticBatches:
    """``next_batch()`` -> LongTensor [global_batch // dp_size, seq_len + 1] for this dp rank."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        if global_batch % dp_size:
            raise ValueError(f"train.global_batch={global_batch} is not divisible by dp={dp_size}")
        self.vocab_size, self.seq_len, self.global_batch = vocab_size, seq_len, global_batch
        self.rows = global_batch // dp_size
        self.dp_rank, self.seed, self.step = dp_rank, seed, 0

    def next_batch(self) -> torch.Tensor:
        """The next batch: rows [dp_rank*b, (dp_rank+1)*b) of the step's global batch."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step)
        start = torch.randint(0, self.vocab_size, (self.global_batch, 1), generator=gen)
        stride = torch.randint(1, 8, (self.global_batch, 1), generator=gen)
        pos = torch.arange(self.seq_len + 1).unsqueeze(0)
        tokens = (start + stride * pos) % self.vocab_size  # [global_batch, seq_len + 1]
        self.step += 1
        lo = self.dp_rank * self.rows
        return tokens[lo : lo + self.rows].contiguous()

    def state_dict(self) -> dict:
        """Position in the stream (the number of batches served)."""
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream after ``state['step']`` batches."""
        self.step = int(state["step"])


def synthetic_batch_factory(vocab_size: int,
                            train: TrainConfig) -> Callable[[int, int], SyntheticBatches]:
    """(dp_rank, dp_size) -> this rank's SyntheticBatches for ``train`` (its seq_len,
    global_batch and seed): the trainer's batch source where no token store is given."""

    def factory(dp_rank: int, dp_size: int) -> SyntheticBatches:
        return SyntheticBatches(vocab_size, train.seq_len, train.global_batch, dp_rank, dp_size,
                                train.seed)

    return factory
