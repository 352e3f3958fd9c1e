"""torch.compile per block trains like eager (inductor C++ on CPU; ~1-2 min of compile)."""
from __future__ import annotations

import pytest

from tests.train_helpers import run_worker

EAGER = {"micro_batch": 4, "grad_accum": 2, "sharding": "none"}


@pytest.mark.slow
def test_compiled_blocks_match_eager(tmp_path) -> None:
    """Same losses as eager within 1e-4, and a checkpoint with the usual parameter names."""
    eager = run_worker(tmp_path / "eager", EAGER, 1)
    summary = run_worker(tmp_path / "compiled", EAGER, 1, "train.compile=true", timeout=500)
    for got, want in zip(summary["losses"], eager["losses"], strict=True):
        assert abs(got - want) < 1e-4
    assert summary["checkpoint"].endswith("step-00000004")
