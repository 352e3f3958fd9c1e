"""TokenWindowLoader: windows, chunk-aware shuffle, dp slicing, resume, dp change."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data_prep.errors import DataError
from data_prep.loader import TokenWindowLoader
from data_prep.store import SplitReader
from stages.mechanism.walk import run_work
from stages.registry import declaration
from tests.test_data_common import make_cfg, make_corpus, make_tracker

TOKENIZE = declaration("tokenize")

SEQ = 16


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, seed_store) -> str:
    tmp = tmp_path_factory.mktemp("loader")
    make_corpus(tmp / "corpus", n_docs=60, seed=11)
    cfg = make_cfg(tmp, tmp / "corpus", "data.validation_fraction=0.1")
    out = tmp / "out"
    out.mkdir()
    return run_work(TOKENIZE, cfg, {}, out, make_tracker(tmp / "ml", seed_store)[0])["store"]


def run_steps(loader: TokenWindowLoader, steps: int) -> list[torch.Tensor]:
    return [loader.next_batch() for _ in range(steps)]


def test_batches_are_packed_windows_inside_chunks(store: str) -> None:
    reader = SplitReader(store, "train")
    tokens = reader.read(0, reader.num_tokens)
    loader = TokenWindowLoader(store, "train", SEQ, global_batch=8, seed=0)
    assert loader.num_blocks > 4 and len(reader.parts) > 1
    # Each part is cut into chunk-sized blocks of (tokens - 1) // SEQ windows each.
    chunk = reader.chunk_tokens
    sizes = [min(chunk, p["tokens"] - start) for p in reader.parts
             for start in range(0, p["tokens"], chunk)]
    assert loader.num_windows == sum((n - 1) // SEQ for n in sizes if n > SEQ)
    assert loader.block_windows == (chunk - 1) // SEQ
    assert 0 < loader.unused_fraction < (SEQ + 1) * len(sizes) / len(tokens)
    # No window crosses a chunk: its first and last token lie in one chunk of one part.
    starts = loader.window_starts(np.arange(loader.num_windows))
    part = np.searchsorted(reader.starts, starts, side="right") - 1
    local = starts - reader.starts[part]
    assert np.array_equal(local // chunk, (local + SEQ) // chunk)
    assert np.all(local + SEQ < reader.starts[part + 1] - reader.starts[part])
    assert np.all(np.diff(starts) >= SEQ)  # targets never overlap
    rows = loader.batch_windows(0)
    # The batch holds the sequence's first 8 windows, its rows grouped by block slot.
    assert sorted(rows.tolist()) == sorted(loader.window_indices(0, 8).tolist())
    places = loader._epoch_order(0)[2][loader.block_of(rows)]
    assert np.all(np.diff(places % loader.group_blocks) >= 0)
    batch = loader.next_batch()
    assert batch.dtype == torch.long and batch.shape == (8, SEQ + 1)
    for start, row in zip(loader.window_starts(rows).tolist(), batch, strict=True):
        assert np.array_equal(row.numpy(), tokens[start : start + SEQ + 1])
    assert (tokens == 0).sum() > 10  # eos (id 0) separates the packed documents


def test_shuffle_covers_each_window_once_per_epoch_and_reads_chunks_once(store: str) -> None:
    loader = TokenWindowLoader(store, "train", SEQ, global_batch=8, seed=5)
    n = loader.num_windows
    first = loader.window_indices(0, n)
    assert sorted(first.tolist()) == list(range(n))
    assert not np.array_equal(first, np.arange(n))  # actually shuffled
    second = loader.window_indices(n, n)
    assert sorted(second.tolist()) == list(range(n)) and not np.array_equal(first, second)
    other_seed = TokenWindowLoader(store, "train", SEQ, global_batch=8, seed=6)
    assert not np.array_equal(other_seed.window_indices(0, n), first)
    loader.consumed = 0
    for _ in range(n // 8):
        loader.next_batch()
    # Every chunk is decompressed at most once per epoch (a block is one chunk: a window's
    # label token never reads the next one), not once per window.
    assert loader.reader.chunk_reads <= loader.num_blocks < n // 8


def test_ranks_read_disjoint_slices_covering_the_global_batch(store: str) -> None:
    whole = run_steps(TokenWindowLoader(store, "train", SEQ, 8, seed=2), 6)
    for dp in (2, 4):
        ranks = [TokenWindowLoader(store, "train", SEQ, 8, dp_rank=r, dp_size=dp, seed=2)
                 for r in range(dp)]
        for step in range(6):
            parts = [rank.next_batch() for rank in ranks]
            assert all(p.shape == (8 // dp, SEQ + 1) for p in parts)
            assert torch.equal(torch.cat(parts), whole[step])
    # Over one epoch the ranks' windows are disjoint and cover every window.
    dp = 2
    ranks = [TokenWindowLoader(store, "train", SEQ, 8, dp_rank=r, dp_size=dp, seed=2)
             for r in range(dp)]
    n = ranks[0].num_windows
    seen = [ranks[r].window_indices(r * 4 + 8 * s, 4) for s in range(n // 8) for r in range(dp)]
    seen = np.concatenate(seen)
    assert len(set(seen.tolist())) == len(seen) == (n // 8) * 8


def test_every_run_of_windows_draws_evenly_from_its_group(store: str) -> None:
    loader = TokenWindowLoader(store, "train", SEQ, 8, seed=3, group_blocks=4)
    bw = loader.block_windows
    ends = np.concatenate([[0], loader._epoch_order(0)[1]])
    g = next(g for g in range(len(ends) - 1) if ends[g + 1] - ends[g] == 4 * bw)  # 4 whole blocks
    group = loader.block_of(loader.window_indices(int(ends[g]), 4 * bw))
    assert len(set(group.tolist())) == 4
    for start in range(0, 4 * bw - 8, 8):  # any 8 consecutive windows: 2 from each block
        assert np.bincount(group[start : start + 8], minlength=loader.num_blocks).max() == 2


def test_a_rank_decodes_its_share_of_the_chunks_whatever_the_dp_degree(
        tmp_path_factory: pytest.TempPathFactory, seed_store) -> None:
    """Chunks decompressed per window by one rank at dp=8 over dp=1: 1.14 here (the bound is
    1.2), where a rank that decoded its whole group would read 8 times as many."""
    tmp = tmp_path_factory.mktemp("dp_reads")
    make_corpus(tmp / "corpus", n_docs=240, seed=5)
    cfg = make_cfg(tmp, tmp / "corpus", "data.validation_fraction=0.05", "data.num_shards=1",
                   "data.chunks_per_shard=64")
    out = tmp / "out"
    out.mkdir()
    big = run_work(TOKENIZE, cfg, {}, out, make_tracker(tmp / "ml", seed_store)[0])["store"]
    reads = {}
    for dp in (1, 8):
        loader = TokenWindowLoader(big, "train", SEQ, 64, dp_rank=dp - 1, dp_size=dp, seed=1)
        assert loader.num_blocks >= 16, loader.num_blocks
        # two whole groups, or the first epoch where one group holds the whole store
        steps = min(2 * loader.group_blocks * loader.block_windows, loader.num_windows) // 64
        run_steps(loader, steps)
        reads[dp] = loader.reader.chunk_reads / (steps * loader.rows)
    ratio = reads[8] / reads[1]
    print(f"dp8_over_dp1_chunk_reads {ratio:.3f} ({reads})")
    assert ratio <= 1.2, reads


def test_resume_continues_exactly(store: str) -> None:
    straight = run_steps(TokenWindowLoader(store, "train", SEQ, 8, seed=9), 10)
    first = TokenWindowLoader(store, "train", SEQ, 8, seed=9)
    run_steps(first, 4)
    state = first.state_dict()
    resumed = TokenWindowLoader(store, "train", SEQ, 8, seed=9)
    resumed.load_state_dict(state)
    for expected, got in zip(straight[4:], run_steps(resumed, 6)):
        assert torch.equal(expected, got)
    # Resuming across an epoch boundary as well.
    n = first.num_windows
    a = TokenWindowLoader(store, "train", SEQ, 8, seed=9)
    a.consumed = n - 4
    b = TokenWindowLoader(store, "train", SEQ, 8, seed=9)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next_batch(), b.next_batch()) and a.epoch == 1


def test_resume_with_another_dp_degree(store: str) -> None:
    whole = run_steps(TokenWindowLoader(store, "train", SEQ, 8, seed=4), 8)
    old = [TokenWindowLoader(store, "train", SEQ, 8, dp_rank=r, dp_size=2, seed=4)
           for r in range(2)]
    for step in range(3):
        assert torch.equal(torch.cat([rank.next_batch() for rank in old]), whole[step])
    state = old[0].state_dict()
    new = [TokenWindowLoader(store, "train", SEQ, 8, dp_rank=r, dp_size=4, seed=4)
           for r in range(4)]
    for rank in new:
        rank.load_state_dict(state)
    for step in range(3, 8):
        assert torch.equal(torch.cat([rank.next_batch() for rank in new]), whole[step])


def test_state_mismatch_and_bad_arguments(store: str) -> None:
    state = TokenWindowLoader(store, "train", SEQ, 8, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 but this loader has 2"):
        TokenWindowLoader(store, "train", SEQ, 8, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="split='train' but this loader has 'validation'"):
        TokenWindowLoader(store, "validation", SEQ, 8, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="not divisible by dp_size=3"):
        TokenWindowLoader(store, "train", SEQ, 8, dp_rank=0, dp_size=3)
    with pytest.raises(ValueError, match=r"dp_rank=2 must be in \[0, dp_size=2\)"):
        TokenWindowLoader(store, "train", SEQ, 8, dp_rank=2, dp_size=2)
    with pytest.raises(DataError, match="fewer than seq_len"):
        TokenWindowLoader(store, "validation", 10**7, 8)
    with pytest.raises(DataError, match="no split 'test'"):
        TokenWindowLoader(store, "test", SEQ, 8)


def test_sequential_iteration(store: str) -> None:
    reader = SplitReader(store, "validation")
    tokens = reader.read(0, reader.num_tokens)
    loader = TokenWindowLoader(store, "validation", SEQ, global_batch=4, shuffle=False)
    batches = list(loader.iter_sequential())
    rows = torch.cat(batches)
    assert len(rows) == loader.num_windows
    for start, row in zip(loader.window_starts(np.arange(len(rows))).tolist(), rows, strict=True):
        assert np.array_equal(row.numpy(), tokens[start : start + SEQ + 1])
    limited = torch.cat(list(loader.iter_sequential(max_tokens=5 * SEQ)))
    assert torch.equal(limited, rows[:5])
    # dp ranks split each sequential batch; next_batch walks the same windows in order.
    halves = [torch.cat(list(TokenWindowLoader(store, "validation", SEQ, 4, dp_rank=r, dp_size=2,
                                               shuffle=False).iter_sequential())) for r in range(2)]
    assert sorted(map(tuple, torch.cat(halves).tolist())) == sorted(map(tuple, rows.tolist()))
    assert torch.equal(torch.cat(run_steps(loader, 2)), rows[:8])
    assert loader.consumed == 8


def test_never_reads_the_whole_store(store: str) -> None:
    loader = TokenWindowLoader(store, "train", SEQ, 8, seed=0, group_blocks=1)
    run_steps(loader, 3)
    cached = sum(b.nbytes for b in loader._blocks.values())
    cached += sum(c.nbytes for c in loader.reader._cache.values())
    assert cached < loader.reader.num_tokens * 2 / 2
