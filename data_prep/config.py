"""Typed configuration for the corpus and the tokenizer."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

LABEL_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class DataConfig:
    """Where the text comes from and how the token store is laid out."""

    KEYLESS = ("progress_seconds", "encode_batch_bytes")
    """Fields that enter no stage key: how often progress is printed, and how many bytes go
    to one encode call (whole documents either way, so the tokens are the same)."""

    source: str | None = None
    """'stdlib' (this interpreter's standard-library .py files), a local path, directory or glob
    of .txt/.jsonl/.json/.parquet files (text and JSON also .gz or .zst compressed), a
    directory written by datasets' save_to_disk, or 'hf:<dataset id>' for a hub dataset (needs
    internet). None: 'stdlib', unless data.sources is given (then it must be None: set exactly
    one of the two)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Several labelled sources, label -> source (same syntax as data.source), concatenated in
    the order given. Labels ([A-Za-z0-9_.-], unique ignoring case) tag the store parts, so
    evaluation reports a loss per source. Empty: the single data.source."""
    text_field: str = "text"
    """Field holding the document text in jsonl/json/parquet/hub records."""
    max_documents: int | None = None
    """Use at most this many documents (None: all); with data.sources, per source."""
    max_document_bytes: int | None = None
    """Skip documents larger than this many bytes (None: keep all)."""
    validation_fraction: float = 0.05
    """Fraction of documents held out for the validation split (per document, by a keyed
    hash of its text: the share is this fraction up to sampling noise)."""
    split_seed: int = 1234
    """Key of the document-level train/validation split's hash."""
    num_shards: int = 2
    """Input shards: one tokenization task per shard, fanned out in parallel, each a run of
    file pieces of about equal bytes. With data.sources the shards are divided among the
    sources in proportion to their bytes (at least one
    each, so it must be >= the number of sources); a shard never spans two sources."""
    chunk_tokens: int = 65536
    """Tokens per Zarr chunk (the unit of compression and of loader reads)."""
    chunks_per_shard: int = 16
    """Zarr chunks per storage shard (file) so a parallel file system sees few large files."""
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    """Integer type of stored tokens; 'auto' picks uint16 when every id fits, else uint32."""
    encode_batch_bytes: int = 4_000_000
    """Bytes of text per encode_batch call (whole documents; bounds memory, and large batches
    keep the encoder threads balanced). The next batch is encoded while the previous one is
    written; progress is reported between calls."""
    progress_seconds: float = 10.0
    """Seconds between progress lines (documents/s, tokens/s, ETA) while tokenizing."""

    def __post_init__(self) -> None:
        _require(self.source is None or bool(self.source),
                 "data.source must not be empty (null: the standard library, or data.sources)")
        self._check_sources()
        _require(bool(self.text_field), "data.text_field must not be empty")
        _require(
            0 < self.validation_fraction < 1,
            f"data.validation_fraction must be in (0, 1), got {self.validation_fraction}",
        )
        _require(self.num_shards > 0, f"data.num_shards must be > 0, got {self.num_shards}")
        _require(self.chunk_tokens >= 1024, "data.chunk_tokens must be >= 1024")
        _require(self.chunks_per_shard > 0, "data.chunks_per_shard must be > 0")
        _require(
            self.token_dtype in ("auto", "uint16", "uint32"),
            f"data.token_dtype must be auto, uint16 or uint32, got {self.token_dtype!r}",
        )
        _require(self.encode_batch_bytes > 0, "data.encode_batch_bytes must be > 0")
        _require(self.progress_seconds >= 0, "data.progress_seconds must be >= 0")
        for name in ("max_documents", "max_document_bytes"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"data.{name} must be > 0 or null, got {value}")

    def _check_sources(self) -> None:
        if not self.sources:
            return
        _require(
            self.source is None,
            f"data.source={self.source!r} and data.sources are both set: set exactly one "
            "(data.source=null to use data.sources, or data.sources={} to use data.source)",
        )
        seen: dict[str, str] = {}
        for label, spec in self.sources.items():
            _require(
                isinstance(label, str) and LABEL_PATTERN.fullmatch(label) is not None,
                f"data.sources label {label!r} is not allowed: use letters, digits, '_', '.' or "
                "'-' (labels become metric names such as val_loss.<label>)",
            )
            _require(isinstance(spec, str) and bool(spec),
                     f"data.sources.{label} must be a non-empty source string, got {spec!r}")
            _require(label.lower() not in seen,
                     f"data.sources labels {seen.get(label.lower())!r} and {label!r} differ only "
                     "in case: give every source a distinct label")
            seen[label.lower()] = label
        _require(
            self.num_shards >= len(self.sources),
            f"data.num_shards={self.num_shards} is less than the {len(self.sources)} data.sources: "
            f"every source needs its own input shard; set data.num_shards >= {len(self.sources)}",
        )

    def labelled_sources(self) -> list[tuple[str | None, str]]:
        """(label, source) of every source in corpus order; data.source alone has label None."""
        if self.sources:
            return list(self.sources.items())
        return [(None, self.source or "stdlib")]


@dataclass
class TokenizerConfig:
    """Byte-level BPE: trained on a sample of the corpus, or loaded from a file."""

    path: str | None = None
    """An existing tokenizer.json to load instead of training one."""
    vocab_size: int = 2048
    """Vocabulary size to train (including special tokens)."""
    train_sample_bytes: int = 8_000_000
    """Train the tokenizer on at most this many bytes of the corpus."""
    eos_token: str = "<|endoftext|>"
    """End-of-document token appended after every document."""
    min_frequency: int = 2
    """Minimum pair frequency for a BPE merge."""

    def __post_init__(self) -> None:
        _require(
            257 <= self.vocab_size <= 2**32 - 1,
            f"tokenizer.vocab_size must be in [257, 2**32-1], got {self.vocab_size}",
        )
        _require(self.train_sample_bytes > 0, "tokenizer.train_sample_bytes must be > 0")
        _require(bool(self.eos_token), "tokenizer.eos_token must not be empty")
        _require(self.min_frequency >= 1, "tokenizer.min_frequency must be >= 1")
