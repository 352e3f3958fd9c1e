"""MinHash LSH band keys of a document: one uint64 per band.

Shingles are ``curate.shingle_words``-word n-grams of the normalized text's words (a text
with fewer words is one shingle; one without words is its normalized text). The signature
is rensa's ``RMinHash`` (Rust) with ``bands x rows`` permutations; rensa was ~60x faster than
datasketch's ``MinHash.update_batch`` on the same shingles (1,000 documents of 300 words,
112 permutations: 0.006 vs 0.36 CPU-s on this machine) and updates by running minima, so
shingles are fed one segment of normalized text (``text.SEGMENT_CHARS``) at a time: a
10 MB document never holds its 1.7 million shingles at once (about 170k at a time). Each
band's ``rows`` hashes are hashed (blake2b, 8 bytes) to its key.

Two documents are near-duplicate candidates when any band key matches: the probability
for a pair of Jaccard similarity s is 1 - (1 - s^r)^b; even odds at about (1/b)^(1/r)
(0.72 for 14 x 8). Candidates are not verified: a pair of true similarity 0.5 is still
joined ~5 % of the time at 14 x 8 (false positives), one of 0.8 missed ~8 %.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from data_prep.curate.text import WORD

SEED = 1


def band_keys(segments: Iterable[str], shingle_words: int, bands: int,
              rows: int) -> list[int]:
    """The ``bands`` LSH keys of a normalized text given as segments (``text.normalized_
    segments``; a plain string is one segment): each segment's shingles are hashed in one
    update, the last words carried into the next."""
    from rensa import RMinHash

    sketch = RMinHash(bands * rows, SEED)
    carry: list[str] = []  # the last shingle_words - 1 words of the previous segment
    count = 0
    first = ""
    for segment in [segments] if isinstance(segments, str) else segments:
        first = first or segment
        words = carry + WORD.findall(segment)
        count += len(words) - len(carry)
        if len(words) >= shingle_words:
            sketch.update([" ".join(words[i:i + shingle_words])
                           for i in range(len(words) - shingle_words + 1)])
        carry = words[max(0, len(words) - shingle_words + 1):] if shingle_words > 1 else []
    if count < shingle_words:  # too short for one shingle: the words (or text) whole
        sketch.update([" ".join(carry[len(carry) - count:]) if count else first])
    digest = np.asarray(sketch.digest(), dtype="<u4").reshape(bands, rows)
    return [int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little")
            for row in digest]


def candidate_probability(similarity: float, bands: int, rows: int) -> float:
    """Probability that a pair of this Jaccard similarity shares a band key."""
    return 1.0 - (1.0 - similarity ** rows) ** bands

