"""Decoded chunks of a token array, read straight from its Zarr v3 shard files.

Zarr's own read path costs about 1.7 ms per 65,536-token chunk on this machine; reading the
chunk's bytes from its shard file, checking their CRC32C and Blosc-decoding them costs
0.23 ms. The training loader decodes a chunk for every block of windows it serves, so this
is most of its cost at long sequences (``benchmarks/bench_data.py``, ``loader_ratio_2048``).

Only the layout ``data_prep.writer`` writes is read here, checked from the array's
``zarr.json``: one dimension, the ``sharding_indexed`` codec with its index at the end
(``bytes`` little-endian + ``crc32c``), inner codecs ``bytes`` little-endian, ``blosc``,
``crc32c``, the default chunk key encoding. ``open_chunk_file`` returns None for any other
array, and the caller reads it through Zarr. The format is Zarr's sharding specification
(https://zarr-specs.readthedocs.io/en/latest/v3/codecs/sharding-indexed/v1.0.html): a shard
file ends with one (offset, nbytes) pair of uint64 per inner chunk and the CRC32C of those
pairs; a chunk never written (all fill value) has both set to 2**64 - 1.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
from numcodecs import Blosc

MISSING = 2**64 - 1
CRC_BYTES = 4
_BLOSC = Blosc()  # decoding reads the codec's settings from each chunk's own header


class CorruptChunk(ValueError):
    """A chunk or shard index whose bytes fail their CRC32C or do not decode."""


def _expected_layout(meta: dict[str, Any]) -> tuple[int, int, np.dtype] | None:
    """(shard tokens, chunk tokens, dtype) when ``meta`` is the writer's layout, else None."""
    try:
        (codec,) = meta["codecs"]
        config = codec["configuration"]
        inner = [c["name"] for c in config["codecs"]]
        index = [c["name"] for c in config["index_codecs"]]
        ok = (meta["zarr_format"] == 3 and len(meta["shape"]) == 1
              and codec["name"] == "sharding_indexed" and config["index_location"] == "end"
              and inner == ["bytes", "blosc", "crc32c"] and index == ["bytes", "crc32c"]
              and config["codecs"][0]["configuration"]["endian"] == "little"
              and config["index_codecs"][0]["configuration"]["endian"] == "little"
              and meta["chunk_key_encoding"] == {"name": "default",
                                                 "configuration": {"separator": "/"}}
              and not meta.get("storage_transformers"))
        if not ok:
            return None
        shard = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
        chunk = int(config["chunk_shape"][0])
        dtype = np.dtype(meta["data_type"]).newbyteorder("<")
    except (KeyError, TypeError, ValueError):
        return None
    if shard % chunk:
        return None
    return shard, chunk, dtype


class ChunkFile:
    """The chunks of one sharded token array, by chunk index along the array."""

    def __init__(self, path: Path, length: int, shard_tokens: int, chunk_tokens: int,
                 dtype: np.dtype, fill_value: int) -> None:
        self.path, self.length = path, length
        self.chunk_tokens, self.dtype, self.fill_value = chunk_tokens, dtype, fill_value
        self.per_shard = shard_tokens // chunk_tokens
        self._indexes: dict[int, np.ndarray] = {}

    def _index(self, shard: int) -> np.ndarray:
        """The (offset, nbytes) pairs of one shard file's chunks (read once)."""
        index = self._indexes.get(shard)
        if index is None:
            size = self.per_shard * 16 + CRC_BYTES
            with open(self.path / "c" / str(shard), "rb") as file:
                file.seek(-size, os.SEEK_END)
                raw = file.read(size)
            body, crc = raw[:-CRC_BYTES], raw[-CRC_BYTES:]
            if google_crc32c.value(body) != int.from_bytes(crc, "little"):
                raise CorruptChunk(f"the index of shard file c/{shard} fails its CRC32C")
            index = np.frombuffer(body, dtype="<u8").reshape(self.per_shard, 2)
            self._indexes[shard] = index
        return index

    def chunk(self, index: int) -> np.ndarray:
        """Tokens of chunk ``index`` (the last one cut to the array's length)."""
        start = index * self.chunk_tokens
        count = min(self.chunk_tokens, self.length - start)
        if count <= 0:
            raise IndexError(f"chunk {index} is outside an array of {self.length} tokens")
        shard, within = divmod(index, self.per_shard)
        offset, nbytes = (int(v) for v in self._index(shard)[within])
        if offset == MISSING and nbytes == MISSING:
            return np.full(count, self.fill_value, dtype=self.dtype)
        with open(self.path / "c" / str(shard), "rb") as file:
            file.seek(offset)
            raw = file.read(nbytes)
        body, crc = raw[:-CRC_BYTES], raw[-CRC_BYTES:]
        if len(raw) != nbytes or google_crc32c.value(body) != int.from_bytes(crc, "little"):
            raise CorruptChunk(f"chunk {within} of shard file c/{shard} fails its CRC32C")
        try:
            tokens = np.frombuffer(_BLOSC.decode(body), dtype=self.dtype)
        except RuntimeError as error:  # Blosc's "error during blosc decompression"
            raise CorruptChunk(f"chunk {within} of shard file c/{shard}: {error}") from error
        if len(tokens) < count:
            raise CorruptChunk(f"chunk {within} of shard file c/{shard} decodes to "
                               f"{len(tokens)} tokens, not {count}")
        return tokens[:count]


def open_chunk_file(path: Path) -> ChunkFile | None:
    """A direct reader of the token array at ``path`` (its directory, holding zarr.json), or
    None when the array is not in the layout ``data_prep.writer`` writes."""
    try:
        meta = json.loads((Path(path) / "zarr.json").read_text())
    except (OSError, ValueError):
        return None
    layout = _expected_layout(meta)
    if layout is None:
        return None
    shard, chunk, dtype = layout
    return ChunkFile(Path(path), int(meta["shape"][0]), shard, chunk, dtype,
                     int(meta.get("fill_value") or 0))
