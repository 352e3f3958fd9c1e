"""Typed configuration for the corpus and the tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class DataConfig:
    """Where the text comes from and how the token store is laid out."""

    source: str = "stdlib"
    """'stdlib' (this interpreter's standard-library .py files), a local path, directory or glob
    of .txt/.jsonl/.json/.parquet files, a directory written by datasets' save_to_disk, or
    'hf:<dataset id>' for a hub dataset (needs internet)."""
    text_field: str = "text"
    """Field holding the document text in jsonl/json/parquet/hub records."""
    max_documents: int | None = None
    """Use at most this many documents (None: all)."""
    max_document_bytes: int | None = None
    """Skip documents larger than this many bytes (None: keep all)."""
    validation_fraction: float = 0.05
    """Fraction of documents held out for the validation split."""
    split_seed: int = 1234
    """Seed of the document-level train/validation split."""
    num_shards: int = 2
    """Input shards: one tokenization task per shard, fanned out in parallel."""
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
        _require(bool(self.source), "data.source must not be empty")
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
