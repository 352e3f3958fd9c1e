"""Typed configuration of data curation (the ``curate`` section).

Two kinds of fields. SIGNAL fields decide the per-document signals a shard task computes
and stores (``SIGNAL_FIELDS``; ``signal_config`` is what the stage hashes to find signals it
can reuse). SELECTION fields only decide which documents the final step keeps
(``SELECTION_FIELDS``): changing one reruns the selection over the stored signals and
recomputes no signal.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from data_prep.curate.select import PRESETS, RULES

SIGNAL_FIELDS = ("shingle_words", "minhash_bands", "minhash_rows", "decontamination_ngram",
                 "decontamination_min_words", "id_field")
"""Fields that change the stored signals (a change recomputes every shard's signals)."""
SELECTION_FIELDS = ("enabled", "preset", "thresholds", "languages", "sample_per_reason")
"""Fields that change only the selection (a change reruns the final step alone)."""
SIGNAL_VERSION = 1
"""Bumped when the signal code changes what it stores (part of ``signal_config``)."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class CurateConfig:
    """Which documents of the corpus are kept for tokenization, and why the others are not."""

    KEYLESS = SELECTION_FIELDS
    """In no section hash: the curate stage hashes them as its extent, so a new value reuses
    the signals of an output that differs only there (``stages.curate.reuse``)."""

    enabled: bool = True
    """SELECTION. False: every document is kept (no signals are needed)."""
    preset: Literal["auto", "prose", "code"] = "auto"
    """SELECTION. Threshold preset: 'prose' (technical prose: READMEs, docs, changelogs;
    language filter on), 'code' (source files: duplicates, contamination and junk rules that
    never fire on ordinary Python; no language filter), or 'auto': 'code' for the 'stdlib'
    source and 'prose' for every other source (decided per source)."""
    thresholds: dict[str, float | None] = field(default_factory=dict)
    """SELECTION. Overrides of the preset's thresholds, name -> value (null switches a rule
    off); ``data_prep.curate.select.RULES`` lists the names and what each compares."""
    languages: list[str] = field(default_factory=lambda: ["en"])
    """SELECTION. Languages (ISO 639-1, as py3langid names them) a prose document may be in;
    a document confidently in another language is removed (rule ``min_language_score``)."""
    sample_per_reason: int = 20
    """SELECTION. Removed documents kept per reason in removed_sample.json for inspection."""
    id_field: str | None = None
    """SIGNAL. Record field holding a document id (JSON, parquet, datasets); documents
    without it are named by file and line or row."""
    shingle_words: int = 5
    """SIGNAL. Words per MinHash shingle (word n-grams of the normalized text)."""
    minhash_bands: int = 14
    """SIGNAL. LSH bands b. Two documents are near-duplicate candidates when any band's key
    matches; the similarity where that has even odds is about (1/b)^(1/r): 0.72 for the
    default 14 x 8 (datatrove's default), with a pair of Jaccard 0.8 caught 92 % of the time
    and one of 0.5 about 5 %."""
    minhash_rows: int = 8
    """SIGNAL. Rows (hashes) per band r; the signature has b x r hashes."""
    decontamination_ngram: int = 13
    """SIGNAL. A document is contaminated by an eval task when they share a word n-gram of
    this length (normalized words; 13 as in GPT-3 and lm-eval)."""
    decontamination_min_words: int = 8
    """SIGNAL. Eval texts shorter than decontamination_ngram words are one n-gram as a whole
    (as lm-eval does), but texts under this many words are ignored: a 2-word generation
    prompt such as 'def main(' would otherwise match most of the corpus."""

    def __post_init__(self) -> None:
        _require(self.preset in ("auto", *PRESETS),
                 f"curate.preset must be auto, prose or code, got {self.preset!r}")
        unknown = sorted(set(self.thresholds) - set(RULES))
        _require(not unknown,
                 f"curate.thresholds has unknown names {unknown}: use some of {sorted(RULES)}")
        for name, value in self.thresholds.items():
            _require(value is None or isinstance(value, int | float),
                     f"curate.thresholds.{name} must be a number or null (rule off), "
                     f"got {value!r}")
        _require(isinstance(self.languages, list) and all(
            isinstance(x, str) and x for x in self.languages),
            f"curate.languages must be a list of language codes such as ['en'], "
            f"got {self.languages!r}")
        _require(self.sample_per_reason >= 0,
                 f"curate.sample_per_reason must be >= 0, got {self.sample_per_reason}")
        _require(self.id_field is None or bool(self.id_field),
                 "curate.id_field must be a field name or null (ids from file and line)")
        _require(self.shingle_words >= 1,
                 f"curate.shingle_words must be >= 1, got {self.shingle_words}")
        _require(self.minhash_bands >= 1 and self.minhash_rows >= 1,
                 f"curate.minhash_bands and curate.minhash_rows must be >= 1, got "
                 f"{self.minhash_bands} x {self.minhash_rows}")
        _require(self.minhash_bands * self.minhash_rows <= 1024,
                 f"curate.minhash_bands x curate.minhash_rows = "
                 f"{self.minhash_bands * self.minhash_rows} hashes per document is over 1024: "
                 "lower one of them")
        _require(self.decontamination_ngram >= 1,
                 f"curate.decontamination_ngram must be >= 1, got {self.decontamination_ngram}")
        _require(1 <= self.decontamination_min_words <= self.decontamination_ngram,
                 f"curate.decontamination_min_words must be in [1, decontamination_ngram="
                 f"{self.decontamination_ngram}], got {self.decontamination_min_words}")

    @property
    def lsh_threshold(self) -> float:
        """Jaccard similarity at which a pair becomes a candidate with even odds."""
        return (1 / self.minhash_bands) ** (1 / self.minhash_rows)


def signal_config(cfg: CurateConfig) -> dict[str, Any]:
    """What decides the stored signals: the SIGNAL fields and the signal code's version
    (the stage hashes it, with the corpus fingerprint and the eval texts, to reuse signals)."""
    return {"signal_version": SIGNAL_VERSION, **{name: getattr(cfg, name)
                                                 for name in SIGNAL_FIELDS}}
