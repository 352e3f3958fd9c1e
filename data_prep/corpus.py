"""The document corpus of one tokenization: planned from metadata, counted once, then read
straight from the source files by every shard task.

``prepare_corpus`` describes every source (``data.source``, or each labelled source of
``data.sources`` in the order given, as one contiguous document range per source) from
metadata and sampled blocks, fingerprints that description, cuts the files into pieces and
groups contiguous pieces into input shards by bytes (never across two sources). It then
streams every piece once to count its documents: the train/validation assignment is a
seeded choice among all documents of a source and ``data.max_documents`` a cap in corpus
order, so the document count has to be known before any shard writes. The count also
checks the whole input, so bad input fails before a store exists. What it finds is saved
(``corpus.json``, the document sizes for the tokenizer's sample, the validation document
indices); shard tasks re-read only their own pieces. Concatenating the shards in order
gives the corpus order whatever their number.

A later attempt in the same directory keeps the count when the configuration and the
fingerprint (sizes, mtimes, parquet row groups and sampled content of every file) match:
a changed file changes the fingerprint and the corpus is counted again.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.atomic import atomic_path, write_json_atomic
from data_prep.config import DataConfig
from data_prep.errors import DataError
from data_prep.sources import (
    SourceFile,
    describe_source,
    file_record,
    is_saved_dataset,
    piece_texts,
    plan_pieces,
    unchanged,
)

CORPUS = "corpus"
"""Where hub datasets are saved (the only copy of input the stage makes)."""
CORPUS_INFO = "corpus.json"
DOC_BYTES = "doc_bytes.bin"
"""int64 UTF-8 size of every document in corpus order (the tokenizer's sample needs them)."""
VALIDATION_DOCS = "validation_docs.bin"
"""int64 corpus indices of the validation documents, ascending."""
MAX_PIECE_BYTES = 256 << 20
"""Largest piece a file is cut into (shards are groups of pieces)."""
_FLUSH_DOCS = 1 << 16


@dataclass
class CorpusInfo:
    """What the shard tasks need to know about the corpus (stored as corpus.json)."""

    path: str
    num_documents: int
    num_bytes: int
    fingerprint: str
    num_validation: int
    sources: list[dict[str, Any]] = field(default_factory=list)
    """Labelled sources in corpus order, each {"label", "source", "start", "stop",
    "num_validation"} (its document range [start, stop)); empty for a single data.source."""

    config: dict[str, Any] = field(default_factory=dict)
    """The data configuration the corpus was planned for (``saved_corpus`` compares it)."""
    files: list[dict[str, Any]] = field(default_factory=list)
    """Every input file (``SourceFile`` fields plus "key", the config key of its source)."""
    pieces: list[dict[str, Any]] = field(default_factory=list)
    """Every piece in corpus order: {"file", "start", "stop", "bytes", "docs", "doc_start",
    "text_bytes", "first_line"} (``sources.plan_pieces``, then the count)."""
    shards: list[dict[str, Any]] = field(default_factory=list)
    """Every input shard: {"start", "stop", "source", "pieces": [piece indices]}."""

    def save(self, path: Path) -> None:
        write_json_atomic(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> CorpusInfo:
        if not path.is_file():
            raise DataError(f"{path} is missing: run the tokenize stage's prepare step first")
        return cls(**json.loads(path.read_text()))


def validation_count(num_documents: int, fraction: float) -> int:
    """Documents held out: round(fraction * n), at least 1, leaving at least 1 for training."""
    if num_documents < 2:
        raise DataError(
            f"the corpus has {num_documents} document(s); train and validation splits need at "
            "least 2: add documents to data.source or raise data.max_documents"
        )
    return min(num_documents - 1, max(1, round(fraction * num_documents)))


def validation_mask(num_documents: int, num_validation: int, seed: int | list[int]) -> np.ndarray:
    """Boolean mask over document indices: True for the seeded validation documents."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(num_documents, dtype=bool)
    mask[rng.choice(num_documents, size=num_validation, replace=False)] = True
    return mask


def _label_seed(seed: int, label: str) -> list[int]:
    # Seeded by the label, not its position: adding or reordering sources leaves each
    # source's own validation documents unchanged.
    return [seed, int.from_bytes(hashlib.sha256(label.encode("utf-8")).digest()[:8], "little")]


def source_validation_count(num_documents: int, fraction: float) -> int:
    """Held-out documents of one labelled source: as ``validation_count``, 0 for one document."""
    return 0 if num_documents < 2 else validation_count(num_documents, fraction)


def corpus_validation_mask(info: CorpusInfo, seed: int) -> np.ndarray:
    """Validation mask of the whole corpus; with labelled sources, drawn per source (stratified)."""
    if not info.sources:
        return validation_mask(info.num_documents, info.num_validation, seed)
    mask = np.zeros(info.num_documents, dtype=bool)
    for src in info.sources:
        start, stop = src["start"], src["stop"]
        mask[start:stop] = validation_mask(stop - start, src["num_validation"],
                                           _label_seed(seed, src["label"]))
    return mask


def shard_range(num_documents: int, num_shards: int, index: int) -> tuple[int, int]:
    """Document range [start, stop) of input shard ``index`` (contiguous, balanced)."""
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} out of range for {num_shards} shards")
    return index * num_documents // num_shards, (index + 1) * num_documents // num_shards


def allocate_shards(sizes: list[int], num_shards: int) -> list[int]:
    """Shards per source: one each, the rest in proportion to ``sizes`` (largest remainder).

    The counts sum to ``num_shards``; ties go to the earlier source.
    """
    if num_shards < len(sizes):
        raise DataError(f"data.num_shards={num_shards} is less than the {len(sizes)} sources: "
                        f"set data.num_shards >= {len(sizes)}")
    total = sum(sizes)
    shares = [(num_shards - len(sizes)) * n for n in sizes]
    counts = [1 + share // total for share in shares]
    order = sorted(range(len(sizes)), key=lambda i: (-(shares[i] % total), i))
    for i in order[: num_shards - sum(counts)]:
        counts[i] += 1
    return counts




def shard_plan(info: CorpusInfo, num_shards: int) -> list[dict[str, Any]]:
    """Every input shard as {"start", "stop", "source", "pieces"}: contiguous document ranges
    in corpus order, each inside one labelled source ("source" None for a single
    data.source), as ``prepare_corpus`` planned them for ``num_shards``."""
    if len(info.shards) != num_shards:
        raise DataError(f"the corpus in this directory was planned for {len(info.shards)} "
                        f"shards, not {num_shards}: rerun the tokenize stage's prepare step")
    return [dict(s) for s in info.shards]


def group_pieces(pieces: list[dict[str, Any]], num_shards: int) -> list[list[int]]:
    """Contiguous groups of piece indices, ``num_shards`` of them, balanced by bytes: each
    piece goes to the shard its middle byte falls in (some shards may get none)."""
    total = sum(p["bytes"] for p in pieces)
    groups: list[list[int]] = [[] for _ in range(num_shards)]
    before = 0
    for index, piece in enumerate(pieces):
        middle = before + piece["bytes"] / 2
        shard = min(num_shards - 1, int(middle * num_shards / total)) if total else 0
        groups[shard].append(index)
        before += piece["bytes"]
    return groups


def _described(cfg: DataConfig, out_dir: Path | None) -> list[tuple[str | None, str, str,
                                                                     list[SourceFile]]]:
    """(label, spec, key, files) of every source; errors name ``data.sources.<label>``."""
    out = []
    for i, (label, spec) in enumerate(cfg.labelled_sources()):
        key = "data.source" if label is None else f"data.sources.{label}"
        try:
            files = describe_source(cfg, spec, key, out_dir, slot=f"{i:03d}")
        except DataError as err:
            raise DataError(str(err) if key in str(err) else f"{key}: {err}") from None
        out.append((label, spec, key, files))
    return out


def fingerprint(cfg: DataConfig, described: list) -> str:
    """sha256 of what decides the documents: every source's label, spec and files (path,
    size, mtime, parquet row groups, sampled content) and the document filters."""
    record = {
        "sources": [[label, spec, [file_record(f) for f in files]]
                    for label, spec, _, files in described],
        "text_field": cfg.text_field,
        "max_documents": cfg.max_documents,
        "max_document_bytes": cfg.max_document_bytes,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _plan(cfg: DataConfig, described: list) -> tuple[list[dict], list[dict], list[dict]]:
    """Files, pieces and shards from metadata: the shards are divided among the sources by
    bytes (at least one each), and each source's files cut into pieces of about a shard."""
    sizes = [sum(f.size for f in files) for _, _, _, files in described]
    counts = (allocate_shards([max(1, s) for s in sizes], cfg.num_shards) if len(described) > 1
              else [cfg.num_shards])
    files_out: list[dict] = []
    pieces_out: list[dict] = []
    shards: list[dict] = []
    for (label, _, key, files), size, count in zip(described, sizes, counts, strict=True):
        base = len(files_out)
        files_out += [{**file_record(f), "key": key} for f in files]
        piece_bytes = min(MAX_PIECE_BYTES, -(-size // count))
        pieces = plan_pieces(files, piece_bytes)
        first = len(pieces_out)
        for piece in pieces:
            pieces_out.append({**piece, "file": base + piece["file"], "source": label})
        for group in group_pieces(pieces, count):
            shards.append({"source": label, "pieces": [first + i for i in group]})
    return files_out, pieces_out, shards


def _files(info: CorpusInfo) -> list[SourceFile]:
    return [SourceFile(**{k: v for k, v in f.items() if k != "key"}) for f in info.files]


def _count(cfg: DataConfig, info: CorpusInfo, sizes_out) -> None:
    """Stream every piece once: documents, text bytes and first line of each piece (the
    ``data.max_documents`` cap applied per source, in corpus order); document sizes are
    written to ``sizes_out``. Fills ``info``'s counts, sources and shard ranges."""
    files = _files(info)
    doc_index, line = 0, 1
    per_source: dict[str | None, int] = {}
    sizes: list[int] = []
    previous_file = None
    for piece in info.pieces:
        f = info.files[piece["file"]]
        if piece["file"] != previous_file:
            line, previous_file = 1, piece["file"]
        label = piece["source"]
        kept = per_source.setdefault(label, 0)
        room = None if cfg.max_documents is None else cfg.max_documents - kept
        piece.update(doc_start=doc_index, docs=0, text_bytes=0, first_line=line)
        if room is not None and room <= 0:
            continue
        stats: dict[str, int] = {}
        texts = piece_texts(files, piece, cfg, f["key"], first_line=line, stats=stats)
        try:
            for text in itertools.islice(texts, room):
                size = len(text.encode("utf-8"))
                sizes.append(size)
                piece["docs"] += 1
                piece["text_bytes"] += size
                if len(sizes) >= _FLUSH_DOCS:
                    np.asarray(sizes, dtype=np.int64).tofile(sizes_out)
                    sizes.clear()
        except DataError as err:
            key = f["key"]
            raise DataError(str(err) if key in str(err) else f"{key}: {err}") from None
        line += stats.get("lines", 0)
        doc_index += piece["docs"]
        per_source[label] = kept + piece["docs"]
    np.asarray(sizes, dtype=np.int64).tofile(sizes_out)
    info.num_documents = doc_index
    info.num_bytes = sum(p["text_bytes"] for p in info.pieces)
    for shard in info.shards:
        members = [info.pieces[i] for i in shard["pieces"]]
        start = members[0]["doc_start"] if members else None
        shard["start"], shard["stop"] = start, None if start is None else start + sum(
            p["docs"] for p in members)
    # An empty shard sits where the documents before it end.
    end = 0
    for shard in info.shards:
        if shard["start"] is None:
            shard["start"] = shard["stop"] = end
        end = shard["stop"]


def prepare_corpus(cfg: DataConfig, out_dir: Path) -> CorpusInfo:
    """Plan and count the corpus; write corpus.json (last), the document sizes and the
    validation document indices in ``out_dir``."""
    out_dir = Path(out_dir)
    (out_dir / CORPUS_INFO).unlink(missing_ok=True)  # it describes what is replaced here
    described = _described(cfg, out_dir)
    files, pieces, shards = _plan(cfg, described)
    info = CorpusInfo(path=CORPUS, num_documents=0, num_bytes=0,
                      fingerprint=fingerprint(cfg, described), num_validation=0,
                      config=_config_record(cfg), files=files, pieces=pieces, shards=shards)
    with atomic_path(out_dir / DOC_BYTES) as tmp, open(tmp, "wb") as sizes_out:
        _count(cfg, info, sizes_out)
    labelled = [(label, spec, key) for label, spec, key, _ in described]
    for label, spec, key in labelled:
        n = sum(p["docs"] for p in pieces if p["source"] == label)
        if n == 0:
            raise DataError(
                f"{key} {spec!r} yielded no documents (empty documents are dropped; "
                f"max_document_bytes={cfg.max_document_bytes})"
            )
    if labelled[0][0] is not None:
        start = 0
        for label, spec, _ in labelled:
            n = sum(p["docs"] for p in pieces if p["source"] == label)
            info.sources.append({"label": label, "source": spec, "start": start,
                                 "stop": start + n,
                                 "num_validation": source_validation_count(
                                     n, cfg.validation_fraction)})
            start += n
        info.num_validation = sum(s["num_validation"] for s in info.sources)
        if info.num_validation == 0:
            raise DataError(
                f"every source in data.sources ({', '.join(s['label'] for s in info.sources)}) "
                "has a single document; the validation split needs a source with at least 2"
            )
    else:
        info.num_validation = validation_count(info.num_documents, cfg.validation_fraction)
    chosen = np.flatnonzero(corpus_validation_mask(info, cfg.split_seed)).astype(np.int64)
    with atomic_path(out_dir / VALIDATION_DOCS) as tmp:
        chosen.tofile(tmp)
    info.save(out_dir / CORPUS_INFO)  # last: from here on the corpus is complete
    return info


def _config_record(cfg: DataConfig) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(cfg)))


def saved_corpus(cfg: DataConfig, out_dir: Path) -> CorpusInfo | None:
    """The corpus an earlier ``prepare_corpus`` planned in ``out_dir`` for the same ``cfg``
    and the same input (its fingerprint, from metadata and samples, is taken again), or None.
    corpus.json is written last, so its presence means the rest is complete."""
    out_dir = Path(out_dir)
    try:
        info = CorpusInfo.load(out_dir / CORPUS_INFO)
    except (DataError, OSError, TypeError, ValueError):
        return None
    if info.config != _config_record(cfg) or not all(
            (out_dir / name).is_file() for name in (DOC_BYTES, VALIDATION_DOCS)):
        return None
    for i, (_, spec) in enumerate(cfg.labelled_sources()):
        if spec.startswith("hf:") and not is_saved_dataset(out_dir / CORPUS / f"{i:03d}"):
            return None  # its saved copy is gone: load it again
    try:
        current = fingerprint(cfg, _described(cfg, out_dir))
    except DataError:
        return None
    return info if current == info.fingerprint else None


def drop_corpus(out_dir: Path) -> None:
    """Remove the saved hub datasets (renamed away first, so no half-removed copy is left
    where ``saved_corpus`` would find it)."""
    target = Path(out_dir) / CORPUS
    if not target.exists():
        return
    doomed = target.with_name(f".{CORPUS}.removed-{os.getpid()}")
    os.replace(target, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def load_corpus_info(out_dir: Path) -> CorpusInfo:
    """The corpus.json that ``prepare_corpus`` wrote in ``out_dir``."""
    return CorpusInfo.load(Path(out_dir) / CORPUS_INFO)


def piece_documents(info: CorpusInfo, index: int, cfg: DataConfig) -> Iterator[str]:
    """The counted documents of piece ``index``, streamed from its file (refused when the
    file changed since the count)."""
    piece = info.pieces[index]
    if piece["docs"] == 0:
        return iter(())
    entry = info.files[piece["file"]]
    if not unchanged({k: v for k, v in entry.items() if k != "key"}):
        raise DataError(f"{entry['path']} changed since the tokenize stage's prepare step "
                        "counted it: rerun the tokenize stage (it plans the corpus again)")
    texts = piece_texts(_files(info), piece, cfg, entry["key"], first_line=piece["first_line"])
    return itertools.islice(texts, piece["docs"])


def shard_documents(info: CorpusInfo, shard: dict[str, Any], cfg: DataConfig) -> Iterator[str]:
    """The documents of one input shard in corpus order, streamed piece by piece."""
    for index in shard["pieces"]:
        yield from piece_documents(info, index, cfg)


def validation_indices(out_dir: Path, start: int, stop: int) -> np.ndarray:
    """Corpus indices in ``[start, stop)`` of validation documents, ascending (read from the
    memory-mapped index file: a shard holds only its own)."""
    path = Path(out_dir) / VALIDATION_DOCS
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=np.int64)
    chosen = np.memmap(path, dtype=np.int64, mode="r")
    lo, hi = np.searchsorted(chosen, [start, stop])
    return np.array(chosen[lo:hi])


def training_sample(out_dir: Path, info: CorpusInfo, cfg: DataConfig, max_bytes: int,
                    seed: int) -> list[str]:
    """Whole documents in a seeded random order until ``max_bytes`` (at least one document).

    The order and the cut come from the document sizes saved by the count; one streaming
    pass then collects the chosen documents (pieces without one are not read).
    """
    sizes = np.fromfile(Path(out_dir) / DOC_BYTES, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(sizes))
    total = np.cumsum(sizes[order])
    take = max(1, int(np.searchsorted(total, max_bytes, side="right")))
    chosen = order[:take]
    wanted = set(chosen.tolist())
    found: dict[int, str] = {}
    for index, piece in enumerate(info.pieces):
        first, count = piece["doc_start"], piece["docs"]
        mine = [d for d in range(first, first + count) if d in wanted] if count < len(
            wanted) else sorted(d for d in wanted if first <= d < first + count)
        if not mine:
            continue
        last = mine[-1]
        for doc, text in zip(range(first, last + 1), piece_documents(info, index, cfg),
                             strict=False):
            if doc in wanted:
                found[doc] = text
        if len(found) == len(wanted):
            break
    return [found[d] for d in chosen.tolist()]


def source_documents(cfg: DataConfig, stage_dir: Path, source: str | None = None,
                     key: str = "data.source") -> Iterator[str]:
    """Every document of one source (``cfg.source`` by default) in corpus order, streamed,
    with the ``data.max_documents`` cap; a source without documents is a DataError.
    ``stage_dir`` is where a hub dataset is saved."""
    spec = source or cfg.source or "stdlib"
    files = describe_source(cfg, spec, key, Path(stage_dir))
    count = 0
    for piece in plan_pieces(files, MAX_PIECE_BYTES):
        stats: dict[str, int] = {}
        room = None if cfg.max_documents is None else cfg.max_documents - count
        for text in itertools.islice(piece_texts(files, piece, cfg, key, stats=stats), room):
            count += 1
            yield text
        if cfg.max_documents is not None and count >= cfg.max_documents:
            return
    if count == 0:
        raise DataError(f"{key} {spec!r} yielded no documents (empty documents are dropped; "
                        f"max_document_bytes={cfg.max_document_bytes})")
