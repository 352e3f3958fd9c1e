"""Words, normalization and stable hashes shared by the signals, dedup and decontamination.

Words are ``WORD`` matches: runs of letters, digits and '_' (an apostrophe inside a word
kept, as in "don't"). Punctuation is never a word. datatrove's spaCy tokenizer returns
punctuation tokens as words, so on technical prose ("``pip install -e .``", "v1.2.3",
"(see #12)") its "80 % of words contain a letter" rule counts dots, dashes and brackets
as words without letters and removes ordinary READMEs; ``WORD`` does not.
"""
from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable, Iterator

WORD = re.compile(r"\w+(?:['\u2019]\w+)*")
"""A word: letters, digits, '_' (an inner apostrophe kept); punctuation is never a word."""
_SPACE = re.compile(r"\s+")
_NEEDS_FTFY = re.compile(r"[^\t\n\r\x20-\x25\x27-\x7e]")
"""A character ftfy might change (anything but printable ASCII, tab and line breaks, and
'&' for HTML entities)."""
SEGMENT_CHARS = 1 << 20
"""Characters of a document normalized at a time (ftfy, NFKC, lowercase, spaces)."""


def _pieces(text: str, size: int) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, each cut just before a whitespace
    character (a line break when the piece's last quarter has one), so no word is split."""
    start = 0
    while start < len(text):
        stop = start + size
        if stop >= len(text):
            yield text[start:]
            return
        cut = text.rfind("\n", stop - size // 4, stop)
        if cut <= start:
            match = _SPACE.search(text, stop)
            cut = match.start() if match else len(text)
        yield text[start:cut]
        start = cut


def _fixed(piece: str) -> str:
    if _NEEDS_FTFY.search(piece) is None:
        return piece  # printable ASCII without '&': ftfy changes nothing that survives
    import ftfy

    return ftfy.fix_text(piece)


def normalized_segments(text: str, size: int = SEGMENT_CHARS) -> Iterator[str]:
    """The normalized text in non-empty segments of about ``size`` characters: joined with
    single spaces they are ``normalize(text)``. One segment is in memory at a time, so a
    huge document never has a second full-size copy."""
    for piece in _pieces(text, size):
        segment = _SPACE.sub(" ", unicodedata.normalize("NFKC", _fixed(piece)).lower()).strip()
        if segment:
            yield segment


def normalize(text: str) -> str:
    """The text that exact dedup, MinHash and decontamination compare: mojibake and
    similar repaired (ftfy), NFKC, lowercase, every run of whitespace one space."""
    return " ".join(normalized_segments(text))


def hash64(data: str | bytes) -> int:
    """A 64-bit hash that is the same in every process (Python's ``hash`` is salted)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def segments_hash64(segments: Iterable[str]) -> int:
    """``hash64`` of the segments joined by single spaces, without joining them."""
    digest = hashlib.blake2b(digest_size=8)
    for i, segment in enumerate(segments):
        digest.update(segment.encode("utf-8") if i == 0 else b" " + segment.encode("utf-8"))
    return int.from_bytes(digest.digest(), "little")
