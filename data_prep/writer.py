"""Write one part (one split of one input shard) of a token store (``build`` drives it).

A part is a Zarr group ``<store>/<split>/<shard:05d>`` with arrays ``tokens`` (1-D, chunked,
Blosc-zstd with byte shuffle, Zarr-sharded) and ``doc_offsets`` (int64, documents + 1
entries). Every chunk carries a CRC32C of its compressed bytes, which Zarr checks on each
read, so a damaged chunk is an error, never silently wrong tokens. Each part has exactly
one writer, which writes it under a temporary name and renames it into place when
complete, so parallel shard tasks never touch each other's files (Zarr loses updates when
two processes write chunks of the same shard file).
Tokens are buffered and written one whole storage shard at a time, so each shard file is
written once.
"""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BloscShuffle, Crc32cCodec

COMPRESSOR = BloscCodec(cname="zstd", clevel=3, shuffle=BloscShuffle.shuffle)
CODECS = (COMPRESSOR, Crc32cCodec())
"""Compressed, then checksummed: the checksum covers the bytes on disk."""
OFFSETS_CHUNK = 65536


def part_name(split: str, shard_index: int) -> str:
    """Path of a part relative to the store root."""
    return f"{split}/{shard_index:05d}"


class PartWriter:
    """Appends documents' tokens to one part; ``close()`` publishes it atomically."""

    def __init__(self, store: Path, split: str, shard_index: int, dtype: np.dtype,
                 chunk_tokens: int, chunks_per_shard: int) -> None:
        self.final = store / part_name(split, shard_index)
        # Unique per writer process (host and pid): a retried shard never shares a temp dir.
        self.tmp = self.final.with_name(
            f".{self.final.name}.tmp-{socket.gethostname()}-{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.dtype = np.dtype(dtype)
        self.shard_tokens = chunk_tokens * chunks_per_shard
        group = zarr.open_group(str(self.tmp), mode="w", zarr_format=3)
        self.tokens = group.create_array(
            "tokens", shape=(0,), chunks=(chunk_tokens,), shards=(self.shard_tokens,),
            dtype=self.dtype, compressors=CODECS, fill_value=0,
        )
        self.group = group
        self.written = 0  # tokens already in the array (a multiple of shard_tokens until close)
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.doc_lengths: list[int] = []

    def add(self, documents: list[np.ndarray]) -> None:
        """Append documents (each already ending with eos), in order."""
        for doc in documents:
            self.doc_lengths.append(len(doc))
            self.pending.append(doc)
            self.pending_tokens += len(doc)
        if self.pending_tokens >= self.shard_tokens:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        if not self.pending:
            return
        data = np.concatenate(self.pending).astype(self.dtype, copy=False)
        keep = len(data) if final else (len(data) // self.shard_tokens) * self.shard_tokens
        if keep:
            end = self.written + keep
            self.tokens.resize((end,))
            self.tokens[self.written : end] = data[:keep]
            self.written = end
        rest = data[keep:]
        self.pending = [rest] if len(rest) else []
        self.pending_tokens = len(rest)

    def close(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Write the remaining tokens and offsets, publish the part; return its summary."""
        self._flush(final=True)
        offsets = np.zeros(len(self.doc_lengths) + 1, dtype=np.int64)
        np.cumsum(self.doc_lengths, out=offsets[1:])
        arr = self.group.create_array(
            "doc_offsets", shape=offsets.shape, chunks=(OFFSETS_CHUNK,), dtype="int64",
            compressors=CODECS, fill_value=0,
        )
        arr[:] = offsets
        summary = {"tokens": int(self.written), "documents": len(self.doc_lengths),
                   "bytes": directory_bytes(self.tmp / "tokens")}
        # One metadata write (attrs.update would rewrite zarr.json once per key).
        self.group.update_attributes({**attrs, "tokens": summary["tokens"],
                                      "documents": summary["documents"]})
        shutil.rmtree(self.final, ignore_errors=True)  # an earlier attempt of this shard
        self.final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.tmp, self.final)
        return summary


def directory_bytes(path: Path) -> int:
    """Total size of the files under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
