"""Global dedup across shards and sources: exact (same normalized hash) and near (a shared
MinHash LSH band key), clusters by union-find, the first member in corpus order kept.

Corpus order is the order of the signal files (source order, then shard) and, inside one,
the document's index. Only candidates take part (the documents the filters pass), so a
cluster whose first member is junk still keeps a good one. Memory at corpus scale: the
normalized hashes of all documents (8 bytes each), then one band column at a time read
from every signal file (Arrow column projection), sorted with numpy; equal neighbours are
joined. The union-find is one int64 array over the candidates. Pairs are not verified (see
``minhash`` for the LSH threshold and its false positives).

A removed member's ``duplicate_of`` is its cluster's keeper; its reason is
``exact_duplicate`` when an earlier member of its cluster has the same normalized text,
else ``near_duplicate``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.curate import arrow
from data_prep.curate.signals import band_column


@dataclass
class Duplicates:
    """Per document of the corpus: its cluster's keeper (global index; itself when kept or
    not a candidate) and whether it repeats an earlier member's exact normalized text."""

    keeper: np.ndarray
    exact: np.ndarray

    def removed(self) -> np.ndarray:
        """True for each document removed as a duplicate."""
        return self.keeper != np.arange(len(self.keeper))

    def reason(self, index: int) -> str | None:
        if self.keeper[index] == index:
            return None
        return "exact_duplicate" if self.exact[index] else "near_duplicate"


class UnionFind:
    """Disjoint sets over 0..n-1 in one int64 array (8 bytes a document): path halving,
    and union under the smaller root, so every set's root is its smallest member."""

    def __init__(self, n: int) -> None:
        self.parent = np.arange(n, dtype=np.int64)

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = int(parent[x])
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def roots(self) -> np.ndarray:
        """Every element's root, by pointer jumping over the whole array (vectorized)."""
        parent = self.parent
        while True:
            jumped = parent[parent]
            if np.array_equal(jumped, parent):
                return parent
            parent = jumped


def _join_equal(keys: np.ndarray, sets: UnionFind) -> int:
    """Join every run of equal ``keys`` (positions into ``sets``); returns pairs joined."""
    order = np.argsort(keys, kind="stable")
    ranked = keys[order]
    same = np.flatnonzero(ranked[1:] == ranked[:-1])
    for a, b in zip(order[same].tolist(), order[same + 1].tolist(), strict=True):
        sets.union(a, b)
    return len(same)


def read_column(paths: Sequence[str | Path], column: str) -> np.ndarray:
    """One column of every signal file, concatenated in corpus order."""
    parts = [arrow.numbers(arrow.read(p, [column]).column(0)) for p in paths]
    return np.concatenate(parts) if parts else np.zeros(0)


def find_duplicates(paths: Sequence[str | Path], candidates: np.ndarray,
                    norm_hash: np.ndarray, bands: int, near: bool = True) -> Duplicates:
    """Cluster the ``candidates`` (bool per document, corpus order) by equal
    ``norm_hash`` and, when ``near``, by any equal band key of the signal files ``paths``."""
    total = len(candidates)
    members = np.flatnonzero(candidates)
    sets = UnionFind(len(members))
    hashes = np.asarray(norm_hash, dtype=np.uint64)[members]
    _join_equal(hashes, sets)
    if near:
        for band in range(bands):
            keys = read_column(paths, band_column(band)).astype(np.uint64)[members]
            _join_equal(keys, sets)
            del keys
    roots = sets.roots()
    # members are in corpus order and each root is its set's smallest position
    keeper = np.arange(total, dtype=np.int64)
    keeper[members] = members[roots]
    exact = np.zeros(total, dtype=bool)
    pairs = np.rec.fromarrays([roots, hashes], names="root,hash")
    _, first = np.unique(pairs, return_index=True)
    repeats = np.ones(len(members), dtype=bool)
    repeats[first] = False
    exact[members[repeats]] = True
    return Duplicates(keeper=keeper, exact=exact)
