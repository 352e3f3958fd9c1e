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

WORD = re.compile(r"\w+(?:['\u2019]\w+)*")
"""A word: letters, digits, '_' (an inner apostrophe kept); punctuation is never a word."""
_SPACE = re.compile(r"\s+")
FTFY_MAX_CHARS = 1 << 20
"""ftfy repairs the text in pieces of at most this many characters (bounded memory)."""


def normalize(text: str) -> str:
    """The text that exact dedup, MinHash and decontamination compare: mojibake and
    similar repaired (ftfy), NFKC, lowercase, every run of whitespace one space."""
    import ftfy

    if len(text) > FTFY_MAX_CHARS:  # repaired piece by piece at line ends
        parts, start = [], 0
        while start < len(text):
            cut = text.rfind("\n", start, start + FTFY_MAX_CHARS)
            stop = len(text) if start + FTFY_MAX_CHARS >= len(text) else (
                cut + 1 if cut > start else start + FTFY_MAX_CHARS)
            parts.append(ftfy.fix_text(text[start:stop]))
            start = stop
        fixed = "".join(parts)
    else:
        fixed = ftfy.fix_text(text)
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", fixed).lower()).strip()


def hash64(data: str | bytes) -> int:
    """A 64-bit hash that is the same in every process (Python's ``hash`` is salted)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
