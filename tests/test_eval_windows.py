"""Which windows the held-out loss evaluates: spread over the split, every source sampled."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.gpt import GPT
from model.training.heldout import heldout_loss, plan_windows


class ArrayReader:
    """A split held in memory, with the reader interface of data_prep.store.SplitReader."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens
        self.num_tokens = len(tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop]


def test_budget_bound_windows_are_spread_over_the_whole_split():
    plan = plan_windows(10_000, 64, 2048)
    assert (plan.windows, plan.available) == (32, (10_000 - 1) // 64)
    starts = [plan.window_index(k) for k in range(plan.windows)]
    assert starts == sorted(set(starts))  # distinct, in order: no token predicted twice
    assert starts[0] == 0 and starts[-1] > 0.95 * plan.available  # not just the prefix
    assert (starts[-1] + 1) * 64 + 1 <= 10_000  # the last window lies inside the split
    # A budget covering the split evaluates every window, consecutively.
    whole = plan_windows(10_000, 64, 10**9)
    assert [whole.window_index(k) for k in range(whole.windows)] == list(range(whole.available))


def test_small_budget_reaches_every_source_and_matches_direct_computation():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=1, d_model=32, n_heads=2, vocab_size=64, max_seq_len=16)
    model = GPT(cfg).eval()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, 4001).astype(np.uint16)
    reader = ArrayReader(tokens)
    spans = [(0, 2000, "first"), (2000, 4001, "second")]  # two sources, one after the other
    seq, budget = 16, 16 * 20  # 20 of the split's 250 windows
    result = heldout_loss(model, reader, seq, budget, batch_size=6, sources=spans)
    assert set(result["per_source"]) == {"first", "second"}
    assert sum(s["tokens"] for s in result["per_source"].values()) == result["tokens"] == budget

    plan = plan_windows(reader.num_tokens, seq, budget)
    total = 0.0
    with torch.no_grad():
        for k in range(plan.windows):
            w = plan.window_index(k)
            x = torch.from_numpy(tokens[w * seq : w * seq + seq + 1].astype(np.int64))
            total += F.cross_entropy(model(x[None, :-1])[0], x[1:], reduction="sum").item()
    assert result["val_loss"] == pytest.approx(total / budget, rel=1e-6)
