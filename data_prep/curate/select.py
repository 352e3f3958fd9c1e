"""Selection: thresholds over the stored signals, and the reason each removed document has.

Reasons, checked in this order (the first that applies is the document's reason):
``contamination:<task>``, ``language``, ``quality:<rule>`` (rules in ``RULES`` order), then,
among the documents left, ``exact_duplicate`` and ``near_duplicate`` (``dedup``).

A rule is (signal column, "min" or "max"): "min" removes a document whose value is below
the threshold, "max" one whose value is above it; a threshold of None switches the rule
off. ``min_language_score`` is the language rule: a document is removed when py3langid's
top language is not one of ``curate.languages`` and has at least that probability. A
document no language is sure of (menus, symbol runs, terse technical notes) is left to the
quality rules; datatrove's LanguageFilter instead removes every document whose allowed
language scores under its threshold, so also every document the model is unsure of.

The presets were read off measurements (docs/data.md, "Curation"): PROSE keeps real
technical prose (READMEs, changelogs, package docs) and removes navigation menus, word
salad, symbol runs and spam; CODE keeps every ordinary Python file and removes only
duplicates, contamination and blobs no Python source looks like.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from data_prep.curate import arrow

RULES: dict[str, tuple[str, str]] = {
    # Gopher repetition
    "max_dup_para_frac": ("dup_para_frac", "max"),
    "max_dup_para_char_frac": ("dup_para_char_frac", "max"),
    "max_dup_line_frac": ("dup_line_frac", "max"),
    "max_dup_line_char_frac": ("dup_line_char_frac", "max"),
    **{f"max_top_{n}gram": (f"top_{n}gram", "max") for n in (2, 3, 4)},
    **{f"max_dup_{n}gram": (f"dup_{n}gram", "max") for n in range(5, 11)},
    # Gopher quality
    "min_words": ("words", "min"),
    "max_words": ("words", "max"),
    "min_mean_word_length": ("mean_word_length", "min"),
    "max_mean_word_length": ("mean_word_length", "max"),
    "max_hash_ratio": ("hash_ratio", "max"),
    "max_ellipsis_ratio": ("ellipsis_ratio", "max"),
    "max_bullet_lines": ("bullet_lines", "max"),
    "max_ellipsis_lines": ("ellipsis_lines", "max"),
    "min_alpha_words": ("alpha_words", "min"),
    "min_stop_words": ("stop_words", "min"),
    "min_stop_word_fraction": ("stop_word_fraction", "min"),
    # C4
    "min_terminal_punct_lines": ("terminal_punct_lines", "min"),
    "max_lorem_ipsum": ("lorem_ipsum", "max"),
    "max_javascript": ("javascript", "max"),
    "max_curly_braces": ("curly_braces", "max"),
    # FineWeb
    "min_line_punct": ("line_punct", "min"),
    "max_short_lines": ("short_lines", "max"),
    "max_dup_line_chars": ("dup_line_chars", "max"),
    "max_newline_words": ("newline_words", "max"),
    # language (its own reason, "language")
    "min_language_score": ("language_score", "min"),
}
"""Threshold name -> (signal column, direction)."""
LANGUAGE_RULE = "min_language_score"

_OFF = dict.fromkeys(RULES)
PROSE: dict[str, float | None] = {
    **_OFF,
    "max_dup_para_frac": 0.5, "max_dup_para_char_frac": 0.4,
    "max_dup_line_frac": 0.5, "max_dup_line_char_frac": 0.4,
    "max_top_2gram": 0.2, "max_top_3gram": 0.25, "max_top_4gram": 0.25,
    **{f"max_dup_{n}gram": 0.45 for n in range(5, 11)},
    "min_words": 20, "max_words": 100_000,
    "min_mean_word_length": 3, "max_mean_word_length": 12,
    "max_hash_ratio": 0.3, "max_ellipsis_ratio": 0.3, "max_ellipsis_lines": 0.3,
    "min_alpha_words": 0.5, "min_stop_words": 2, "min_stop_word_fraction": 0.01,
    "max_lorem_ipsum": 0,
    "min_language_score": 0.5,
}
"""Technical prose (see the module docstring and docs/data.md)."""
CODE: dict[str, float | None] = {
    **_OFF,
    "min_words": 1,
    "max_mean_word_length": 40,
    "min_alpha_words": 0.2,
}
"""Source code: no language, repetition or prose rule (code repeats lines and braces)."""
PRESETS = {"prose": PROSE, "code": CODE}


def preset_name(preset: str, source_spec: str) -> str:
    """The preset a source gets: ``auto`` is code for 'stdlib', prose otherwise."""
    if preset != "auto":
        return preset
    return "code" if source_spec == "stdlib" else "prose"


def filter_reasons(columns: dict[str, Any], thresholds: dict[str, float | None],
                   languages: list[str], count: int) -> list[str | None]:
    """The contamination, language or quality reason of each of ``count`` documents (None:
    it passes). ``columns`` maps signal names to arrays (numpy or Arrow) of ``count``."""
    reasons: list[str | None] = [None] * count
    open_ = np.ones(count, dtype=bool)  # no reason yet

    def mark(hit: np.ndarray, reason: str) -> None:
        for i in np.flatnonzero(hit & open_).tolist():
            reasons[i] = reason
        open_[hit] = False

    contaminated = columns.get("contamination")
    if contaminated is not None:
        for i, tasks in enumerate(_pylist(contaminated)):
            if tasks:
                reasons[i] = f"contamination:{tasks[0]}"
                open_[i] = False
    score = thresholds.get(LANGUAGE_RULE)
    if score is not None:  # confidently in a language not allowed
        allowed = np.isin(np.asarray(_pylist(columns["language"]), dtype=object),
                          np.asarray(languages, dtype=object))
        mark(~allowed & (_numbers(columns["language_score"]) >= score), "language")
    for name, (column, direction) in RULES.items():
        value = thresholds.get(name)
        if value is None or name == LANGUAGE_RULE:
            continue
        data = _numbers(columns[column])
        mark(data < value if direction == "min" else data > value, f"quality:{name}")
    return reasons


def select(table: Any, dedup: Any, thresholds: dict[str, float | None],
           languages: list[str]) -> list[str | None]:
    """The reason of every document of ``table`` (signals of the whole corpus in corpus
    order, e.g. ``pyarrow.concat_tables`` of the shard files), None for a kept one.

    ``dedup`` is a ``dedup.Duplicates`` over the same rows, found among the documents the
    filters pass (``dedup.find_duplicates``); None: no dedup.
    """
    names = set(table.column_names)
    columns = {name: table.column(name) for name in names}
    reasons = filter_reasons(columns, thresholds, languages, table.num_rows)
    if dedup is not None:
        for i in np.flatnonzero(dedup.removed()).tolist():
            if reasons[i] is None:
                reasons[i] = dedup.reason(i)
    return reasons


def _numbers(column: Any) -> np.ndarray:
    return np.asarray(arrow.numbers(column), dtype=np.float64)


def _pylist(column: Any) -> list:
    return column.to_pylist() if hasattr(column, "to_pylist") else list(column)
