"""The training loader mixes every step across the whole store: consecutive steps draw their
windows from chunks spread over all of it (not from one small group of chunks for hundreds of
steps), while each chunk is still decompressed once an epoch, the order is fixed by the seed,
a resumed loader continues bitwise and dp ranks read disjoint rows. And the loss curve of a
short real training shows no jump when the loader moves on."""
from __future__ import annotations

import random
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.loader import TokenWindowLoader, default_group_blocks
from stages.mechanism.launch import RankSpec
from stages.mechanism.walk import run_work
from stages.registry import declaration
from tests.test_data_common import make_cfg, make_tracker
from tests.train_helpers import run_ranks, tiny_config

TOKENIZE = declaration("tokenize")
SEQ, BATCH = 32, 8
TOPICS, DOCS_PER_TOPIC = 16, 12


def write_topic_corpus(directory: Path, seed: int = 3) -> None:
    """Documents in topic order (sorted file names), each topic its own made-up words: the
    store's chunks differ by region, as a real corpus's do (code, then prose, ...)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    letters = "abcdefghijklmnopqrstuvwxyz"
    for topic in range(TOPICS):
        words = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 6)))
                 for _ in range(10)]
        for doc in range(DOCS_PER_TOPIC):
            lines = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14)))
                     for _ in range(rng.randint(20, 40))]
            (directory / f"doc_{topic:02d}_{doc:03d}.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, seed_store) -> str:
    tmp = tmp_path_factory.mktemp("mixing")
    write_topic_corpus(tmp / "corpus")
    cfg = make_cfg(tmp, tmp / "corpus", "data.validation_fraction=0.05", "data.num_shards=1",
                   "data.chunks_per_shard=64", "tokenizer.vocab_size=384")
    out = tmp / "out"
    out.mkdir()
    return run_work(TOKENIZE, cfg, {}, out, make_tracker(tmp / "ml", seed_store)[0])["store"]


def blocks_seen(loader: TokenWindowLoader, steps: int) -> set[int]:
    """The blocks (chunks) the first ``steps`` global batches draw windows from."""
    return {int(b) for s in range(steps)
            for b in loader.block_of(loader.batch_windows(s * loader.global_batch))}


def test_consecutive_steps_draw_from_chunks_across_the_whole_store(store: str) -> None:
    loader = TokenWindowLoader(store, "train", SEQ, BATCH, seed=0)
    n = loader.num_blocks
    assert n >= 40 and loader.group_blocks >= n, (n, loader.group_blocks)
    # Each step: one window from each of BATCH different chunks.
    assert len(blocks_seen(loader, 1)) == BATCH
    # Within the steps that hold one window per chunk, windows from >= 90 % of all chunks,
    # spread over the store (both halves of its chunk order).
    k = -(-n // BATCH)
    seen = blocks_seen(loader, k)
    assert len(seen) >= 0.9 * n, (len(seen), n)
    assert min(seen) < n // 4 and max(seen) >= 3 * n // 4
    # A loader that takes 8 chunks at a time serves them for group x windows / batch steps.
    grouped = TokenWindowLoader(store, "train", SEQ, BATCH, seed=0, group_blocks=8)
    assert len(blocks_seen(grouped, k)) <= 8 < 0.25 * n


def test_groups_of_a_large_store_are_near_equal(store: str) -> None:
    """Where the store outgrows one group, an epoch's groups differ by at most one chunk:
    no short last group makes steps draw from a few chunks."""
    loader = TokenWindowLoader(store, "train", SEQ, BATCH, seed=0, group_blocks=16)
    sizes = np.diff(loader.group_bounds())
    assert sizes.sum() == loader.num_blocks and sizes.max() - sizes.min() <= 1
    assert sizes.max() <= 16
    assert default_group_blocks(65536, 2) == 256 and default_group_blocks(1024, 2) == 1024
    assert default_group_blocks(10**7, 4) == 8


def test_each_chunk_decoded_once_an_epoch_and_the_cache_is_bounded(store: str) -> None:
    loader = TokenWindowLoader(store, "train", SEQ, BATCH, seed=1)
    steps = loader.num_windows // BATCH
    for _ in range(steps):
        loader.next_batch()
    assert loader.reader.chunk_reads <= loader.num_blocks
    assert len(loader._blocks) <= 2 * loader.group_blocks


def test_seeded_resumable_and_disjoint_across_dp_ranks(store: str) -> None:
    straight = TokenWindowLoader(store, "train", SEQ, BATCH, seed=7)
    batches = [straight.next_batch() for _ in range(12)]
    again = TokenWindowLoader(store, "train", SEQ, BATCH, seed=7)
    assert all(torch.equal(a, again.next_batch()) for a in batches)
    other = TokenWindowLoader(store, "train", SEQ, BATCH, seed=8)
    assert not torch.equal(other.next_batch(), batches[0])
    half = TokenWindowLoader(store, "train", SEQ, BATCH, seed=7)
    for _ in range(5):
        half.next_batch()
    resumed = TokenWindowLoader(store, "train", SEQ, BATCH, seed=7)
    resumed.load_state_dict(half.state_dict())
    assert all(torch.equal(batches[s], resumed.next_batch()) for s in range(5, 12))
    ranks = [TokenWindowLoader(store, "train", SEQ, BATCH, dp_rank=r, dp_size=4, seed=7)
             for r in range(4)]
    for step in range(12):
        parts = [rank.next_batch() for rank in ranks]
        assert torch.equal(torch.cat(parts), batches[step])
    windows = [ranks[r].batch_windows(s * BATCH)[r * 2 : (r + 1) * 2]
               for s in range(12) for r in range(4)]
    flat = np.concatenate(windows)
    assert len(set(flat.tolist())) == len(flat)


LOSS_MARGIN = 1.0
"""Nats a step's loss may stand above the median of the steps before it, after warm-up."""
WARMUP, WINDOW = 20, 10


def test_training_loss_has_no_jump_after_warmup(store: str, tmp_path: Path) -> None:
    """A real training (one rank, the trainer's own loader) on the topic store: after
    warm-up no step's loss exceeds the running median of the previous WINDOW steps by more
    than LOSS_MARGIN nats. A loader that served 8 chunks at a time (31 steps a group here)
    jumped by more than that where each group began."""
    steps = 96
    cfg = tiny_config(f"train.steps={steps}", f"train.seq_len={SEQ}",
                      f"train.global_batch={BATCH}", "train.warmup_steps=5", "train.lr=0.01")
    spec = RankSpec(worker="stages.train.worker", nproc=1, nodes=1,
                    out_dir=str(tmp_path.resolve()), config=cfg.to_dict(),
                    plan={"micro_batch": BATCH, "grad_accum": 1, "sharding": "none"},
                    store=store)
    code, stdout, stderr = run_ranks(spec.worker, spec.write(tmp_path / "spec.json"), 1, 240)
    assert code == 0, stdout[-2000:] + stderr[-4000:]
    import json

    losses = json.loads((tmp_path / "summary.json").read_text())["losses"]
    assert len(losses) == steps
    excess = [(s, losses[s] - statistics.median(losses[s - WINDOW : s]))
              for s in range(WARMUP, steps)]
    worst = max(excess, key=lambda e: e[1])
    assert worst[1] <= LOSS_MARGIN, (worst, [round(x, 2) for x in losses])
    assert statistics.mean(losses[-10:]) < statistics.mean(losses[:5]) - 1.0
