"""Packed training windows from a token store, shuffled chunk-aware, sharded by dp rank.

Windows. A split is its parts' token streams (documents separated by eos), each stored in
Zarr chunks of ``chunk_tokens`` tokens. A window holds ``seq_len + 1`` tokens: the inputs
and shifted targets of ``seq_len`` positions. Windows never cross a chunk: each part is cut
into blocks of one chunk (of as many chunks as one window needs when ``seq_len + 1 >
chunk_tokens``), and a block of ``n`` tokens holds ``(n - 1) // seq_len`` windows at
``seq_len`` strides from its start, consecutive windows sharing one boundary token. So
reading a block decompresses its own chunk and never the next one for a last label token.
The price: the tail of each block after its last window (``n - 1 - windows * seq_len``
tokens, under ``seq_len``) is never a target; ``unused_fraction`` gives the share, e.g.
1.6 % for 4,096-token chunks at seq_len 64 and 3.1 % for 65,536-token chunks at 2,048 (a
``chunk_tokens`` of ``k * seq_len + 1`` wastes one token a chunk). The windows depend on the parts'
sizes: two stores of the same corpus with different shard counts hold the same tokens but
not the same windows.

Shuffle (``shuffle=True``). Each epoch permutes the blocks of the whole split (seeded by
seed and epoch) and cuts that order into groups of ``group_blocks`` blocks or one fewer
(``ceil(blocks / group_blocks)`` groups of near-equal size, so an epoch never ends on a
group of a few blocks); each block's windows are permuted and the group's blocks are
interleaved evenly (round robin for equal blocks), so any run of consecutive windows draws
the same share from every block of its group. A group is a uniform random sample of the
store, and every step draws its windows from ``min(global_batch, group size)`` different
blocks of it. Reading a group decompresses each of its chunks once and serves every window
from memory. ``group_blocks`` defaults to as many blocks as ``GROUP_BYTES`` of decoded
tokens hold (``default_group_blocks``: 256 blocks of 65,536 uint16 tokens), so a store of
up to that many blocks is one group an epoch and every step mixes the whole store; a step
that drew from 8 blocks for hundreds of steps (the old default of 8 at 511 windows a block)
trains on a few chunks at a time and its loss jumps when the group changes.

Global order. The window sequence depends only on the store, split, seq_len, seed and
group_blocks, never on dp_size: global batch ``s`` is the windows at positions
``[s*global_batch, (s+1)*global_batch)`` of that sequence. Its rows are ordered by the
block's slot in its group, then sequence position (``batch_windows``), a function of the
global batch alone, and rank ``r`` of ``dp_size`` reads only rows ``[r*b, (r+1)*b)`` with
``b = global_batch // dp_size``. With the even interleave those rows come from about
``group_blocks / dp_size`` blocks, so a rank decompresses its share of the chunks, not all
of them: the decode cost per window stays flat as dp grows while ``dp_size <= group_blocks``
(beyond that each rank still decodes one block per group). The state is the number of
windows consumed globally, so a checkpoint taken with one dp degree resumes with another
(or with another global_batch) and continues the same sequence.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_prep.errors import DataError
from data_prep.store import SplitReader, StoreInfo

STATE_VERSION = 3  # 3: groups of near-equal size, default group_blocks by bytes; 2: windows
# inside chunks (1 ran across them)

GROUP_BYTES = 32 * 2**20
"""Decoded tokens one group of blocks holds by default (the loader's cache keeps up to two
groups' worth, across a rank's slots)."""
MIN_GROUP_BLOCKS, MAX_GROUP_BLOCKS = 8, 1024
"""Bounds of the default ``group_blocks`` (the upper one bounds a group's window sort)."""


def default_group_blocks(block_tokens: int, itemsize: int) -> int:
    """Blocks of ``block_tokens`` tokens of ``itemsize`` bytes that ``GROUP_BYTES`` hold,
    within ``[MIN_GROUP_BLOCKS, MAX_GROUP_BLOCKS]``."""
    return int(np.clip(GROUP_BYTES // max(1, block_tokens * itemsize),
                       MIN_GROUP_BLOCKS, MAX_GROUP_BLOCKS))


def radical_inverse(k: int) -> float:
    """The base-2 van der Corput value of ``k``: its binary digits mirrored behind the point
    (0, 0.5, 0.25, 0.75, 0.125, ...), a sequence that spreads any prefix evenly in [0, 1)."""
    value, scale = 0.0, 0.5
    while k:
        k, bit = divmod(k, 2)
        value += bit * scale
        scale /= 2
    return value


class TokenWindowLoader:
    """Batches of ``[global_batch // dp_size, seq_len + 1]`` token windows for one dp rank."""

    def __init__(self, store: StoreInfo | str | Path, split: str, seq_len: int, global_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, shuffle: bool = True,
                 group_blocks: int | None = None, cache_chunks: int | None = None) -> None:
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len ({seq_len}) and global_batch ({global_batch}) must be >= 1")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if global_batch % dp_size:
            raise ValueError(f"global_batch={global_batch} is not divisible by dp_size={dp_size}")
        if group_blocks is not None and group_blocks < 1:
            raise ValueError(f"group_blocks must be >= 1, got {group_blocks}")
        self.seq_len, self.global_batch = seq_len, global_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.split = split
        # Decoded blocks are cached here; the reader's chunk cache only spans adjacent blocks.
        self.reader = SplitReader(store, split, cache_chunks or 4)
        self._lay_out_blocks()
        self.group_blocks = group_blocks or default_group_blocks(
            self.block_tokens, np.dtype(self.reader.info.dtype).itemsize)
        if self.num_windows < 1:
            raise DataError(
                f"split {split!r} of {self.reader.info.path} has {self.reader.num_tokens} tokens, "
                f"fewer than seq_len + 1 = {seq_len + 1} in any one of its parts' blocks of "
                f"{self.block_tokens} tokens: lower seq_len or add data"
            )
        self.consumed = 0  # windows consumed by the whole dp group
        self._epoch_cache: tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._group_cache: tuple[int, int, np.ndarray] | None = None
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()

    def _lay_out_blocks(self) -> None:
        """Per part: its first token, block and window in the split, its whole blocks and the
        windows of its last, shorter block (the layout is regular inside a part, so memory
        is per part, not per block)."""
        chunk = self.reader.chunk_tokens
        self.block_tokens = -(-(self.seq_len + 1) // chunk) * chunk
        self.block_windows = (self.block_tokens - 1) // self.seq_len  # of a whole block
        tokens = np.diff(self.reader.starts)
        self._part_whole = tokens // self.block_tokens
        tail = tokens - self._part_whole * self.block_tokens
        self._part_tail = np.maximum(tail - 1, 0) // self.seq_len
        blocks = self._part_whole + (self._part_tail > 0)
        windows = self._part_whole * self.block_windows + self._part_tail
        self._part_token0 = self.reader.starts[:-1]
        self._part_block0 = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64)
        self._part_window0 = np.concatenate([[0], np.cumsum(windows)[:-1]]).astype(np.int64)
        self.num_blocks = int(blocks.sum())
        self.num_windows = int(windows.sum())

    @property
    def unused_fraction(self) -> float:
        """Share of the split's tokens that no window predicts (block tails, part ends)."""
        return 1 - self.num_windows * self.seq_len / max(1, self.reader.num_tokens)

    def block_of(self, windows: np.ndarray) -> np.ndarray:
        """The block of each window index."""
        windows = np.asarray(windows, dtype=np.int64)
        part = np.searchsorted(self._part_window0, windows, side="right") - 1
        return self._part_block0[part] + (windows - self._part_window0[part]) // self.block_windows

    def block_windows_of(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first window, window count, first token) of each block."""
        blocks = np.asarray(blocks, dtype=np.int64)
        part = np.searchsorted(self._part_block0, blocks, side="right") - 1
        j = blocks - self._part_block0[part]
        first = self._part_window0[part] + j * self.block_windows
        count = np.where(j < self._part_whole[part], self.block_windows, self._part_tail[part])
        return first, count, self._part_token0[part] + j * self.block_tokens

    def _places(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(block, offset of the first token in the block, the block's first token in the
        split) of each window."""
        windows = np.asarray(windows, dtype=np.int64)
        blocks = self.block_of(windows)
        first, _, token0 = self.block_windows_of(blocks)
        return blocks, (windows - first) * self.seq_len, token0

    def window_starts(self, windows: np.ndarray) -> np.ndarray:
        """The split position of each window's first token."""
        _, offsets, token0 = self._places(windows)
        return token0 + offsets

    @property
    def rows(self) -> int:
        """Rows of this rank's batch."""
        return self.global_batch // self.dp_size

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_windows

    def group_bounds(self) -> np.ndarray:
        """Where each group starts in an epoch's block order, then the block count:
        ``ceil(blocks / group_blocks)`` groups whose sizes differ by at most one block."""
        groups = -(-self.num_blocks // self.group_blocks)
        return np.arange(groups + 1, dtype=np.int64) * self.num_blocks // groups

    def _epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(block order, end position of each group, each block's place in the order, each
        group's first place and the block count: ``group_bounds``) for ``epoch``."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks)
            sizes = self.block_windows_of(order)[1]
            bounds = self.group_bounds()
            per_group = np.add.reduceat(sizes, bounds[:-1])
            place = np.empty(self.num_blocks, dtype=np.int64)
            place[order] = np.arange(self.num_blocks)
            self._epoch_cache = (epoch, order, np.cumsum(per_group), place, bounds)
        return self._epoch_cache[1:]

    def _group_windows(self, epoch: int, group: int, order: np.ndarray,
                       bounds: np.ndarray) -> np.ndarray:
        """The window sequence of one group of blocks: each block's windows permuted, the
        blocks interleaved evenly (window ``i`` of the block in slot ``k``, of ``n``
        windows, sits at fraction ``(i + radical_inverse(k)) / n`` of the group; ties go to
        the slot). The offsets visit the slots of each round in bit-reversed order, so a
        run of ``2**j`` windows of a round draws one window from each of ``2**j`` equal
        slot ranges: sorted by slot, a batch's rows split among the dp ranks by slot range
        also when the group has more blocks than the batch has rows."""
        if self._group_cache is None or self._group_cache[:2] != (epoch, group):
            blocks = order[bounds[group] : bounds[group + 1]]
            firsts, counts, _ = self.block_windows_of(blocks)
            windows, spread, slot = [], [], []
            for k, (first, n) in enumerate(zip(firsts.tolist(), counts.tolist(), strict=True)):
                rng = np.random.default_rng([self.seed, epoch, group + 1, k])
                windows.append(first + rng.permutation(n))
                spread.append((np.arange(n) + radical_inverse(k)) / n)
                slot.append(np.full(n, k))
            sequence = np.lexsort((np.concatenate(slot), np.concatenate(spread)))
            self._group_cache = (epoch, group, np.concatenate(windows)[sequence])
        return self._group_cache[2]

    def window_indices(self, first: int, count: int) -> np.ndarray:
        """Windows served at global positions ``[first, first + count)`` (any dp degree)."""
        positions = np.arange(first, first + count, dtype=np.int64)
        epochs, within = np.divmod(positions, self.num_windows)
        if not self.shuffle:
            return within
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            order, group_ends, _, bounds = self._epoch_order(int(epoch))
            pos = within[mask]
            groups = np.searchsorted(group_ends, pos, side="right")
            starts = np.where(groups > 0, group_ends[np.maximum(groups - 1, 0)], 0)
            result = np.empty(len(pos), dtype=np.int64)
            for group in np.unique(groups):
                sel = groups == group
                group_windows = self._group_windows(int(epoch), int(group), order, bounds)
                result[sel] = group_windows[pos[sel] - starts[sel]]
            out[mask] = result
        return out

    def batch_windows(self, first: int) -> np.ndarray:
        """The windows of the global batch at sequence position ``first``, in row order:
        by the block's slot in its group (its place in the epoch's block order less its
        group's first place), then epoch, group and sequence position. The even interleave
        gives every slot the same share of a batch, so dp rank ``r`` reads the blocks of
        slots near ``r * group_size / dp_size`` of whichever groups the batch spans (one
        batch may end a group and begin the next): each rank keeps to its own blocks."""
        windows = self.window_indices(first, self.global_batch)
        if not self.shuffle:
            return windows
        positions = np.arange(first, first + self.global_batch, dtype=np.int64)
        epochs = positions // self.num_windows
        group = np.empty(self.global_batch, dtype=np.int64)
        slot = np.empty(self.global_batch, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            _, _, place_of, bounds = self._epoch_order(int(epoch))
            place = place_of[self.block_of(windows[mask])]
            group[mask] = np.searchsorted(bounds, place, side="right") - 1
            slot[mask] = place - bounds[group[mask]]
        return windows[np.lexsort((positions, group, epochs, slot))]

    def window_index(self, position: int) -> int:
        """Window served at global sequence ``position``."""
        return int(self.window_indices(position, 1)[0])

    def _block(self, block: int) -> np.ndarray:
        """Tokens of one block's windows (a view of its chunks), LRU-cached."""
        data = self._blocks.get(block)
        if data is None:
            _, count, start = (int(v[0]) for v in self.block_windows_of([block]))
            data = self.reader.read(start, start + count * self.seq_len + 1)
            self._blocks[block] = data
            if len(self._blocks) > 2 * self.group_blocks:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(block)
        return data

    def next_batch(self) -> torch.Tensor:
        """This rank's rows of the next global batch.

        A LongTensor [global_batch // dp_size, seq_len + 1].
        """
        mine = self.batch_windows(self.consumed)[self.dp_rank * self.rows:
                                                 (self.dp_rank + 1) * self.rows]
        self.consumed += self.global_batch
        return self._rows(mine)

    def _rows(self, windows: np.ndarray) -> torch.Tensor:
        """The tokens of ``windows``, one row each: a LongTensor [len, seq_len + 1]."""
        blocks, offsets, _ = self._places(windows)
        rows = [self._block(b)[o : o + self.seq_len + 1]
                for b, o in zip(blocks.tolist(), offsets.tolist(), strict=True)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()

    def iter_sequential(self, max_tokens: int | None = None) -> Iterator[torch.Tensor]:
        """Walk the split once in order (for evaluation), this rank's rows of each global batch.

        Covers ``min(all, max_tokens // seq_len)`` windows (at least one); the last batch may
        have fewer rows. Does not change the loader's state.
        """
        limit = self.num_windows
        if max_tokens is not None:
            limit = min(limit, max(1, max_tokens // self.seq_len))
        for start in range(0, limit, self.global_batch):
            first = start + self.dp_rank * self.rows
            stop = min(first + self.rows, limit)
            if first < stop:
                yield self._rows(np.arange(first, stop, dtype=np.int64))

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the same global sequence."""
        return {
            "version": STATE_VERSION,
            "consumed": self.consumed,
            "split": self.split,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "group_blocks": self.group_blocks,
            "num_tokens": self.reader.num_tokens,
            "tokenizer_hash": self.reader.info.tokenizer_hash,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (dp_size and global_batch may differ from when it was saved)."""
        mine = self.state_dict()
        if state.get("version") != mine["version"]:
            raise ValueError(
                f"loader state version {state.get('version')!r} was saved by a loader that "
                f"orders windows differently (this one writes {mine['version']}): continue "
                "that training with the code that saved it, or start it again")
        for key in ("version", "split", "seq_len", "seed", "shuffle", "group_blocks", "num_tokens",
                    "tokenizer_hash"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"loader state has {key}={state.get(key)!r} but this loader has {mine[key]!r}: "
                    "resume with the same store, split, seq_len and seed"
                )
        self.consumed = int(state["consumed"])
