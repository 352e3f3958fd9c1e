"""Open a finished token store and read token ranges from it (see the package docstring)."""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from data_prep.chunk_files import CRC_BYTES, MISSING, ChunkFile, open_chunk_file
from data_prep.errors import StoreError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")


@dataclass
class SplitInfo:
    """One split: its token and document counts and its parts, in logical order."""

    tokens: int
    documents: int
    parts: list[dict[str, Any]]


@dataclass
class SourceInfo:
    """One labelled source of a multi-source store: its counts in total and per split."""

    label: str
    source: str
    tokens: int
    documents: int
    split_tokens: dict[str, int]
    split_documents: dict[str, int]


@dataclass
class StoreInfo:
    """A complete store as described by its manifest."""

    path: str
    vocab_size: int
    eos_id: int
    tokenizer_hash: str
    dtype: str
    chunk_tokens: int
    source_fingerprint: str
    format_version: int
    splits: dict[str, SplitInfo] = field(default_factory=dict)
    sources: list[SourceInfo] = field(default_factory=list)
    """Labelled sources in corpus order (empty for a store built from one data.source)."""
    manifest: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.splits.values())

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.splits.values())

    @property
    def tokenizer_file(self) -> Path:
        return Path(self.path) / self.manifest.get("tokenizer_file", "tokenizer.json")

    def split_spans(self, split: str) -> list[tuple[int, int, str]]:
        """(start, stop, source) token spans of ``split``, from its parts' optional "source"
        label ("all" without one): what a per-source held-out loss breaks down by."""
        spans, pos = [], 0
        for part in self.splits[split].parts:
            spans.append((pos, pos + int(part["tokens"]), str(part.get("source", "all"))))
            pos += int(part["tokens"])
        return spans

    def token_bytes(self) -> np.ndarray:
        """The UTF-8 bytes each token id of this store stands for (its own tokenizer's,
        ``data_prep.tokenizer.token_byte_lengths``): a slice's bytes, for bits per byte."""
        from tokenizers import Tokenizer

        from data_prep.tokenizer import token_byte_lengths

        return token_byte_lengths(Tokenizer.from_file(str(self.tokenizer_file)), self.vocab_size)


def open_store(path: str | Path, expected_tokenizer_hash: str | None = None) -> StoreInfo:
    """Describe the store at ``path``; refuse one that is incomplete or has another tokenizer."""
    root = Path(path)
    manifest_path = root / MANIFEST
    if not root.is_dir():
        raise StoreError(f"token store {str(root)!r} does not exist: run the tokenize stage")
    if not manifest_path.is_file():
        raise StoreError(
            f"token store {root} is incomplete (no {MANIFEST}): its tokenization did not "
            "finish; rerun the tokenize stage"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise StoreError(
            f"{manifest_path} is not valid JSON ({err}); rerun the tokenize stage"
        ) from None
    if not manifest.get("complete") or manifest.get("format_version") != FORMAT_VERSION:
        raise StoreError(
            f"{manifest_path}: format_version {manifest.get('format_version')!r} / complete="
            f"{manifest.get('complete')!r} is not a complete version-{FORMAT_VERSION} store"
        )
    if (
        expected_tokenizer_hash is not None
        and manifest["tokenizer_hash"] != expected_tokenizer_hash
    ):
        raise StoreError(
            f"token store {root} was built with tokenizer {manifest['tokenizer_hash'][:12]}..., "
            f"but the configuration asks for {expected_tokenizer_hash[:12]}...: re-tokenize with "
            "this tokenizer or point at the matching store"
        )
    splits = {}
    for name, split in manifest["splits"].items():
        for part in split["parts"]:
            if not (root / part["path"] / "zarr.json").is_file():
                raise StoreError(
                    f"token store {root}: part {part['path']} listed in {MANIFEST} is missing"
                )
        splits[name] = SplitInfo(split["tokens"], split["documents"], split["parts"])
    sources = [SourceInfo(**src) for src in manifest.get("sources") or []]
    _check_sources(manifest_path, splits, sources)
    return StoreInfo(
        path=str(root.resolve()),
        vocab_size=manifest["vocab_size"],
        eos_id=manifest["eos_id"],
        tokenizer_hash=manifest["tokenizer_hash"],
        dtype=manifest["dtype"],
        chunk_tokens=manifest["chunk_tokens"],
        source_fingerprint=manifest["source_fingerprint"],
        format_version=manifest["format_version"],
        splits=splits,
        sources=sources,
        manifest=manifest,
    )


def _check_sources(
    manifest_path: Path, splits: dict[str, SplitInfo], sources: list[SourceInfo]
) -> None:
    """Every labelled part names a listed source, and the per-source counts add up."""
    labels = {s.label for s in sources}
    for name, split in splits.items():
        for part in split.parts:
            if "source" in part and part["source"] not in labels:
                raise StoreError(f"{manifest_path}: part {part['path']} has source "
                                 f"{part['source']!r}, which the manifest's sources do not list")
        if sources and sum(s.split_tokens.get(name, 0) for s in sources) != split.tokens:
            raise StoreError(f"{manifest_path}: the sources' {name} tokens do not add up to the "
                             f"split's {split.tokens}; rerun the tokenize stage")


class SplitReader:
    """Reads token ranges of one split as one logical 1-D array.

    The split's parts are concatenated in order. Decoded Zarr chunks are kept in an LRU
    cache of ``cache_chunks`` entries, so many reads from one chunk decompress it once.
    """

    def __init__(self, store: StoreInfo | str | Path, split: str, cache_chunks: int = 64) -> None:
        self.info = store if isinstance(store, StoreInfo) else open_store(store)
        if split not in self.info.splits:
            raise StoreError(f"token store {self.info.path} has no split {split!r} "
                             f"(splits: {list(self.info.splits)})")
        self.split = split
        self.parts = self.info.splits[split].parts
        sizes = np.array([p["tokens"] for p in self.parts], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_tokens = int(self.starts[-1])
        self.chunk_tokens = self.info.chunk_tokens
        self.cache_chunks = max(1, cache_chunks)
        self._arrays: dict[int, Any] = {}
        self._cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self.chunk_reads = 0  # decompressions so far (for tests and benchmarks)

    def _array(self, part: int) -> Any:
        """The part's token array: a ``ChunkFile`` where the writer's layout allows direct
        reads (7x faster than Zarr's), else the Zarr array."""
        if part not in self._arrays:
            path = Path(self.info.path) / self.parts[part]["path"] / "tokens"
            arr = open_chunk_file(path) or zarr.open_array(str(path), mode="r")
            shape = (arr.length,) if isinstance(arr, ChunkFile) else arr.shape
            if shape != (self.parts[part]["tokens"],):
                raise StoreError(f"{path}: shape {shape} disagrees with the manifest "
                                 f"({self.parts[part]['tokens']} tokens)")
            self._arrays[part] = arr
        return self._arrays[part]

    def _chunk(self, part: int, index: int) -> np.ndarray:
        key = (part, index)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        start = index * self.chunk_tokens
        stop = min(start + self.chunk_tokens, self.parts[part]["tokens"])
        arr = self._array(part)
        try:
            data = arr.chunk(index) if isinstance(arr, ChunkFile) else arr[start:stop]
        except ValueError as error:  # a CRC32C check failed, or a chunk that does not decode
            where = Path(self.info.path) / self.parts[part]["path"]
            raise StoreError(
                f"{where}/tokens: chunk {index} (tokens {start}-{stop} of the part) is damaged "
                f"({error}); remove {where} and rerun the pipeline: tokenize encodes that part "
                "again and keeps the others") from error
        self.chunk_reads += 1
        self._cache[key] = data
        if len(self._cache) > self.cache_chunks:
            self._cache.popitem(last=False)
        return data

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split (a copy, in the store's dtype)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"range [{start}, {stop}) outside split of {self.num_tokens} tokens")
        pieces = []
        pos = start
        part = int(np.searchsorted(self.starts, start, side="right")) - 1
        while pos < stop:
            while self.starts[part + 1] <= pos:  # skip empty parts
                part += 1
            local = pos - int(self.starts[part])
            index, within = divmod(local, self.chunk_tokens)
            chunk = self._chunk(part, index)
            take = min(len(chunk) - within, stop - pos)
            pieces.append(chunk[within : within + take])
            pos += take
        if len(pieces) == 1:
            return pieces[0].copy()
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=self.info.dtype)

    def doc_offsets(self) -> np.ndarray:
        """Start of every document plus the end (documents + 1 entries), split-global."""
        out = [np.zeros(1, dtype=np.int64)]
        for i, part in enumerate(self.parts):
            path = Path(self.info.path) / part["path"] / "doc_offsets"
            out.append(zarr.open_array(str(path), mode="r")[1:] + self.starts[i])
        return np.concatenate(out)


def content_digest(path: str | Path) -> str:
    """SHA-256 of what a complete store holds, cheaply: its manifest (less the time it was
    written), its tokenizer file and the stored CRC32C of every chunk of every array (read
    from each chunk's tail, so no chunk is decompressed). Two stores with the same digest
    serve the same tokens, whatever run, host or path made them."""
    root = Path(path)
    manifest = json.loads((root / MANIFEST).read_text())
    manifest.pop("created", None)
    for split in manifest.get("splits", {}).values():
        for part in split.get("parts", []):
            part.pop("host", None)  # which node encoded a part does not change its tokens
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode())
    digest.update((root / manifest.get("tokenizer_file", "tokenizer.json")).read_bytes())
    for meta_path in sorted(root.rglob("zarr.json")):
        digest.update(meta_path.relative_to(root).as_posix().encode())
        meta = json.loads(meta_path.read_text())
        if meta.get("node_type") != "array":
            continue
        sharding = meta["codecs"][0]
        per_shard = 1
        if sharding.get("name") == "sharding_indexed":
            outer = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
            per_shard = outer // sharding["configuration"]["chunk_shape"][0]
        for shard_file in sorted((meta_path.parent / "c").rglob("*"),
                                 key=lambda p: p.relative_to(meta_path.parent).parts):
            if not shard_file.is_file():
                continue
            digest.update(shard_file.relative_to(root).as_posix().encode())
            with open(shard_file, "rb") as file:
                if sharding.get("name") != "sharding_indexed":
                    digest.update(file.read())
                    continue
                size = per_shard * 16 + CRC_BYTES
                file.seek(-size, 2)
                index = np.frombuffer(file.read(size)[:-CRC_BYTES], dtype="<u8").reshape(-1, 2)
                for offset, nbytes in index:
                    if offset == MISSING:
                        digest.update(b"missing")
                        continue
                    file.seek(int(offset + nbytes) - CRC_BYTES)
                    digest.update(file.read(CRC_BYTES))
    return digest.hexdigest()[:16]
