"""Per-document quality and repetition values (the numbers only; ``select`` judges them).

The definitions follow the papers and datatrove 0.10.1's filters, with words from
``text.WORD`` (punctuation is never a word; datatrove counts spaCy's punctuation tokens):

- Gopher quality (Rae et al. 2021, table A1): ``words``, ``mean_word_length``,
  ``hash_ratio`` and ``ellipsis_ratio`` ('#' and '...'/'…' per word), ``bullet_lines``
  (lines starting with '•' or '-'), ``ellipsis_lines`` (lines ending with an ellipsis),
  ``alpha_words`` (words with a letter), ``stop_words`` (how many of Gopher's eight stop
  words occur, case-sensitive as in datatrove: "The" is not "the"), and
  ``stop_word_fraction`` (the share of words that are one of them: not in Gopher or
  datatrove; word salad drawn from a real vocabulary has a few distinct stop words but
  under 1 % of its words are, against ~8 % in technical prose);
- Gopher repetition: ``dup_line_frac``/``dup_para_frac`` (repeated lines/paragraphs over
  all) and ``dup_line_char_frac``/``dup_para_char_frac`` (their characters over the text's),
  ``top_{2,3,4}gram`` (characters of the most frequent n-gram times its count, over the
  text's; 0 when no n-gram repeats, where datatrove counts a single occurrence and so
  removes short documents), ``dup_{5..10}gram`` (characters of repeated n-grams, greedy
  left to right);
- C4 (Raffel et al. 2020): ``terminal_punct_lines`` (non-empty lines ending in . ? ! " '
  and not in '...'), ``lorem_ipsum``, ``javascript`` and ``curly_braces`` counts;
- FineWeb (Penedo et al. 2024): ``line_punct`` (non-empty lines ending in terminal
  punctuation), ``short_lines`` (non-empty lines of at most 30 characters),
  ``dup_line_chars`` (characters of repeated non-empty lines over the text's without
  newlines), ``newline_words`` (newlines per word).

All are computed on the first ``MAX_CHARS`` characters of a document, so one huge
document costs bounded time and memory.
"""
from __future__ import annotations

import re

import numpy as np

from data_prep.curate.text import WORD

MAX_CHARS = 1_000_000
"""Characters of a document the quality and repetition values are computed on."""
STOP_WORDS = frozenset(["the", "be", "to", "of", "and", "that", "have", "with"])
"""Gopher's stop words."""
C4_END = (".", "?", "!", '"', "'")
TERMINAL = (".", "!", "?", "…", "。", "！", "？", "．", "؟", "।", "॥", "‼", "⁇", "⁈", "⁉", "‽")
"""Sentence-final punctuation of the common scripts (FineWeb's line punctuation rule)."""
SHORT_LINE = 30
TOP_NGRAMS = (2, 3, 4)
DUP_NGRAMS = (5, 6, 7, 8, 9, 10)
COLUMNS = ("words", "mean_word_length", "hash_ratio", "ellipsis_ratio", "bullet_lines",
           "ellipsis_lines", "alpha_words", "stop_words", "stop_word_fraction",
           "dup_line_frac", "dup_para_frac", "dup_line_char_frac", "dup_para_char_frac",
           *(f"top_{n}gram" for n in TOP_NGRAMS), *(f"dup_{n}gram" for n in DUP_NGRAMS),
           "terminal_punct_lines", "lorem_ipsum", "javascript", "curly_braces", "line_punct",
           "short_lines", "dup_line_chars", "newline_words")
"""The values ``text_values`` returns, in order."""
_PARAGRAPHS = re.compile(r"\n{2,}")
_LINES = re.compile(r"\n+")
_MULT = np.uint64(0x9E3779B97F4A7C15)
_LETTER = re.compile(r"[^\W\d_]")


def _duplicates(items: list[str]) -> tuple[int, int]:
    """(repeated items, their characters): every occurrence after the first counts."""
    seen: set[str] = set()
    count = chars = 0
    for item in items:
        if item in seen:
            count += 1
            chars += len(item)
        else:
            seen.add(item)
    return count, chars


def _ngram_keys(ids: np.ndarray, n: int) -> np.ndarray:
    """A 64-bit key per word n-gram (a polynomial of the word ids; wraps mod 2^64)."""
    keys = ids[: len(ids) - n + 1].copy()
    for k in range(1, n):
        keys = keys * _MULT + ids[k: len(ids) - n + 1 + k]
    return keys


def _repeated_chars(keys: np.ndarray, lengths: np.ndarray, n: int) -> int:
    """Characters of repeated n-grams, left to right: a repeat is counted and skipped whole
    (Gopher's rule, as datatrove's ``find_all_duplicate``). Only n-grams that occur more
    than once can ever be a repeat, so the walk visits just their positions."""
    _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    positions = np.flatnonzero(counts[inverse] > 1).tolist()
    if not positions:
        return 0
    candidates = keys[positions].tolist()
    sizes = lengths[positions].tolist()
    seen: set[int] = set()
    chars = allowed = 0
    for pos, key, size in zip(positions, candidates, sizes, strict=True):
        if pos < allowed:  # inside a repeat already counted
            continue
        if key in seen:
            chars += size
            allowed = pos + n
        else:
            seen.add(key)
            allowed = pos + 1
    return chars


def repetition_values(text: str, words: list[str]) -> dict[str, float]:
    """Gopher's repetition fractions of ``text`` (``words``: its words)."""
    size = max(1, len(text))
    paragraphs = _PARAGRAPHS.split(text.strip())
    dup, chars = _duplicates(paragraphs)
    out = {"dup_para_frac": dup / max(1, len(paragraphs)), "dup_para_char_frac": chars / size}
    lines = _LINES.split(text)
    dup, chars = _duplicates(lines)
    out.update(dup_line_frac=dup / max(1, len(lines)), dup_line_char_frac=chars / size)
    vocab: dict[str, int] = {}
    ids = np.fromiter((vocab.setdefault(w, len(vocab) + 1) for w in words), dtype=np.uint64,
                      count=len(words))
    lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    csum = np.concatenate([[0], np.cumsum(lengths)])
    for n in TOP_NGRAMS:
        top = 0.0
        if len(words) >= n:
            keys = _ngram_keys(ids, n)
            _, first, counts = np.unique(keys, return_index=True, return_counts=True)
            most = counts.max()
            if most > 1:  # an n-gram seen once is no repetition (datatrove counts it)
                start = int(first[counts == most].min())  # ties: the first seen, as Counter
                # a space between the n words, as the n-gram is written
                top = (int(csum[start + n] - csum[start]) + n - 1) * int(most)
        out[f"top_{n}gram"] = top / size
    repeats = True
    for n in DUP_NGRAMS:
        chars = 0
        if repeats and len(words) >= n:  # no repeated n-gram: no longer one repeats either
            span = csum[n:] - csum[:-n]  # characters of each n-gram (no spaces)
            chars = _repeated_chars(_ngram_keys(ids, n), span, n)
            repeats = chars > 0
        out[f"dup_{n}gram"] = chars / size
    return out


def text_values(text: str) -> dict[str, float]:
    """Every value of ``COLUMNS`` for one document (its first ``MAX_CHARS`` characters)."""
    text = text[:MAX_CHARS]
    words = WORD.findall(text)
    count = len(words)
    per_word = max(1, count)
    lines = text.splitlines() or [""]
    lowered = text.lower()
    out: dict[str, float] = {
        "words": count,
        "mean_word_length": sum(map(len, words)) / per_word,
        "hash_ratio": text.count("#") / per_word,
        "ellipsis_ratio": (text.count("...") + text.count("…")) / per_word,
        "bullet_lines": sum(s.lstrip().startswith(("•", "-")) for s in lines) / len(lines),
        "ellipsis_lines": sum(s.rstrip().endswith(("...", "…")) for s in lines) / len(lines),
        "alpha_words": sum(1 for w in words if w.isalpha() or _LETTER.search(w)) / per_word,
    }
    # case-sensitive, as Gopher's rule in datatrove: an all-caps document has no stop word
    out["stop_words"] = len(STOP_WORDS.intersection(words))
    out["stop_word_fraction"] = sum(w in STOP_WORDS for w in words) / per_word
    out.update(repetition_values(text, words))
    stripped = [s.strip() for s in lines]
    filled = [s for s in stripped if s]
    per_line = max(1, len(filled))
    out.update(
        terminal_punct_lines=sum(s.endswith(C4_END) and not s.endswith("...")
                                 for s in filled) / per_line,
        lorem_ipsum=lowered.count("lorem ipsum"),
        javascript=lowered.count("javascript"),
        curly_braces=text.count("{"),
    )
    raw_lines = [s for s in text.split("\n") if s.strip()]
    per_raw = max(1, len(raw_lines))
    out.update(
        line_punct=sum(s.endswith(TERMINAL) for s in raw_lines) / per_raw,
        short_lines=sum(len(s) <= SHORT_LINE for s in raw_lines) / per_raw,
        dup_line_chars=_duplicates(raw_lines)[1] / max(1, len(text) - text.count("\n")),
        newline_words=text.count("\n") / per_word,
    )
    return out
