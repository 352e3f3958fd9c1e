"""The document corpus of one tokenization: planned from metadata, read straight from the
source files by every shard task, with no pass over the corpus before the shards start.

``prepare_corpus`` describes every source (``data.source``, or each labelled source of
``data.sources`` in the order given) from metadata and sampled blocks, fingerprints that
description, cuts the files into pieces (byte ranges of JSON lines, parquet row groups,
dataset row ranges, whole files) and groups contiguous pieces into input shards by bytes
(never across two sources). Concatenating the shards in order gives the corpus order
whatever their number.

The train/validation split is decided document by document where the document is encoded
(``validation_flags``): a document is held out when a keyed hash of its text (the key made
from ``data.split_seed`` and the source's label) falls under ``data.validation_fraction``.
No shard needs to know how many documents come before it, so nothing counts the corpus
first; the held-out share is the fraction up to sampling noise (about ``sqrt(f * n)``
documents), identical copies of a document always land in the same split (no leak of a
duplicate between train and validation), and a source's validation documents do not change
when other sources are added or shards are cut otherwise. ``build.finish_store`` refuses a
split left empty, with the fix.

``data.max_documents`` keeps the first documents of each source in corpus order. Where the
metadata shows the cap cannot bind (a source's text files, parquet rows or dataset rows are
no more than the cap; hub datasets are saved with it) nothing is read. Otherwise the cap is
a prefix of the source: ``prepare_corpus`` streams each source up to its cap, never further
(a capped corpus is as large as the cap, not as the input), and records each piece's
document count. With several sources, a cap that binds for one has every source read up to
its cap.

The tokenizer's training sample (``training_sample``) reads whole documents from an even
spread of the corpus: ``SAMPLE_PIECES`` pieces cut independently of the shard count, taken
in a seeded order; a capped corpus draws seeded random documents of the capped prefix.

A later attempt in the same directory keeps the plan when the configuration and the
fingerprint (sizes, mtimes, parquet row groups and sampled content of every file) match.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Iterable, Iterator
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
    piece_records,
    piece_texts,
    plan_pieces,
    unchanged,
)

CORPUS = "corpus"
"""Where hub datasets are saved (the only copy of input the stage makes)."""
CORPUS_INFO = "corpus.json"
DOC_BYTES = "doc_bytes.bin"
"""A capped corpus only: int64 UTF-8 size of every kept document in corpus order."""
MAX_PIECE_BYTES = 256 << 20
"""Largest piece a file is cut into (shards are groups of pieces)."""
SAMPLE_PIECES = 64
"""The tokenizer's sample is read from about this many pieces spread over the corpus."""
_FLUSH_DOCS = 1 << 16


@dataclass
class CorpusInfo:
    """What the shard tasks need to know about the corpus (stored as corpus.json)."""

    path: str
    num_bytes: int
    """Bytes of the input files (on disk: compressed files count compressed)."""
    fingerprint: str
    sources: list[dict[str, Any]] = field(default_factory=list)
    """Labelled sources in corpus order, each {"label", "source"}; empty for a single
    data.source."""
    capped: bool = False
    """Whether ``data.max_documents`` binds: then every piece's "docs" is counted and
    ``num_documents`` known here; otherwise the shards find the counts."""
    num_documents: int | None = None
    config: dict[str, Any] = field(default_factory=dict)
    """The data configuration the corpus was planned for (``saved_corpus`` compares it)."""
    files: list[dict[str, Any]] = field(default_factory=list)
    """Every input file (``SourceFile`` fields plus "key", the config key of its source)."""
    pieces: list[dict[str, Any]] = field(default_factory=list)
    """Every piece in corpus order: {"file", "start", "stop", "bytes", "source", "docs"}
    (``sources.plan_pieces``; "docs" is the counted documents of a capped corpus, else None:
    all of the piece; a capped corpus's pieces also have "text_bytes")."""
    shards: list[dict[str, Any]] = field(default_factory=list)
    """Every input shard: {"source", "pieces": [piece indices], "bytes"}."""

    @functools.cached_property
    def source_files(self) -> list[SourceFile]:
        """``files`` as SourceFiles, made once (every piece read uses them; not saved)."""
        return [SourceFile(**{k: v for k, v in f.items() if k != "key"}) for f in self.files]

    def save(self, path: Path) -> None:
        write_json_atomic(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> CorpusInfo:
        if not path.is_file():
            raise DataError(f"{path} is missing: run the tokenize stage's prepare step first")
        return cls(**json.loads(path.read_text()))


def split_key(seed: int, label: str | None) -> bytes:
    """The hash key of one source's train/validation split: ``data.split_seed`` and the
    source's label (none for ``data.source``)."""
    return hashlib.sha256(f"{seed}\0{label or ''}".encode()).digest()


def validation_flags(texts: Iterable[str], key: bytes, fraction: float) -> np.ndarray:
    """True for each document held out for validation: its keyed 64-bit hash under
    ``fraction`` of the range (the split rule; see the module docstring)."""
    threshold = int(fraction * (1 << 64))
    return np.array([int.from_bytes(hashlib.blake2b(t.encode("utf-8"), digest_size=8,
                                                    key=key).digest(), "little") < threshold
                     for t in texts], dtype=bool)


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
    """Every input shard as {"source", "pieces", "bytes"}: contiguous pieces in corpus order,
    each inside one labelled source ("source" None for a single data.source), as
    ``prepare_corpus`` planned them for ``num_shards``."""
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
            pieces_out.append({**piece, "file": base + piece["file"], "source": label,
                               "docs": None})
        for group in group_pieces(pieces, count):
            shards.append({"source": label, "pieces": [first + i for i in group],
                           "bytes": sum(pieces[i]["bytes"] for i in group)})
    return files_out, pieces_out, shards


def _records_at_most(files: list[SourceFile]) -> int | None:
    """How many documents the metadata says ``files`` can hold at most (a text file is one,
    parquet and datasets count rows), or None when only reading can tell (JSON)."""
    total = 0
    for f in files:
        if f.kind == "text":
            total += 1
        elif f.kind in ("parquet", "dataset") and f.rows is not None:
            total += sum(f.rows)
        else:
            return None
    return total


def cap_binds(cfg: DataConfig, described: list) -> bool:
    """Whether ``data.max_documents`` may drop documents of some source (then the capped
    prefix is counted; see the module docstring)."""
    if cfg.max_documents is None:
        return False
    for _, _, _, files in described:
        bound = _records_at_most(files)
        if bound is None or bound > cfg.max_documents:
            return True
    return False


def _count_capped(cfg: DataConfig, info: CorpusInfo, sizes_out) -> None:
    """Stream each source's pieces in order up to ``data.max_documents`` documents (never
    beyond): every piece's "docs" and "text_bytes" and, in ``sizes_out``, every kept
    document's size. Then each source's shards are cut again over its kept pieces
    (``_regroup_capped``)."""
    files = info.source_files
    kept_per_source: dict[str | None, int] = {}
    sizes: list[int] = []
    for piece in info.pieces:
        label = piece["source"]
        kept = kept_per_source.setdefault(label, 0)
        room = cfg.max_documents - kept
        piece["docs"] = piece["text_bytes"] = 0
        if room <= 0:
            continue
        key = info.files[piece["file"]]["key"]
        try:
            for text in itertools.islice(piece_texts(files, piece, cfg, key), room):
                sizes.append(len(text.encode("utf-8")))
                piece["docs"] += 1
                piece["text_bytes"] += sizes[-1]
                if len(sizes) >= _FLUSH_DOCS:
                    np.asarray(sizes, dtype=np.int64).tofile(sizes_out)
                    sizes.clear()
        except DataError as err:
            raise DataError(str(err) if key in str(err) else f"{key}: {err}") from None
        kept_per_source[label] = kept + piece["docs"]
    np.asarray(sizes, dtype=np.int64).tofile(sizes_out)
    info.num_documents = sum(kept_per_source.values())
    for label, kept in kept_per_source.items():
        if kept == 0:
            raise no_documents_error(cfg, label)
    info.shards = _regroup_capped(info)


def _regroup_capped(info: CorpusInfo) -> list[dict[str, Any]]:
    """The shards of a capped corpus: each source's shard count, cut again over the pieces
    that hold its kept documents and balanced by their text. (Cut by input bytes, the
    first 150 of 1,800 files would all fall in the first shard.) A shard's "bytes" is then
    its kept text."""
    shards: list[dict[str, Any]] = []
    for label in dict.fromkeys(s["source"] for s in info.shards):
        count = sum(1 for s in info.shards if s["source"] == label)
        kept = [i for i, p in enumerate(info.pieces) if p["source"] == label and p["docs"]]
        weights = [{"bytes": info.pieces[i]["text_bytes"]} for i in kept]
        for group in group_pieces(weights, count):
            members = [kept[j] for j in group]
            shards.append({"source": label, "pieces": members,
                           "bytes": sum(info.pieces[i]["text_bytes"] for i in members)})
    return shards


def no_documents_error(cfg: DataConfig, label: str | None) -> DataError:
    """The error for a source that yields no document."""
    key = "data.source" if label is None else f"data.sources.{label}"
    return _no_documents(key, dict(cfg.labelled_sources())[label], cfg)


def _no_documents(key: str, spec: str, cfg: DataConfig) -> DataError:
    return DataError(f"{key} {spec!r} yielded no documents (empty documents are dropped; "
                     f"max_document_bytes={cfg.max_document_bytes})")


def prepare_corpus(cfg: DataConfig, out_dir: Path) -> CorpusInfo:
    """Plan the corpus from metadata (and count a binding cap's prefix); write corpus.json
    last in ``out_dir``."""
    out_dir = Path(out_dir)
    (out_dir / CORPUS_INFO).unlink(missing_ok=True)  # it describes what is replaced here
    (out_dir / DOC_BYTES).unlink(missing_ok=True)
    described = _described(cfg, out_dir)
    for label, _, _, files in described:
        if sum(f.size for f in files) == 0:
            raise no_documents_error(cfg, label)
    files, pieces, shards = _plan(cfg, described)
    info = CorpusInfo(path=CORPUS, num_bytes=sum(f["size"] for f in files),
                      fingerprint=fingerprint(cfg, described),
                      sources=[{"label": label, "source": spec}
                               for label, spec, _, _ in described if label is not None],
                      capped=cap_binds(cfg, described), config=_config_record(cfg),
                      files=files, pieces=pieces, shards=shards)
    if info.capped:
        with atomic_path(out_dir / DOC_BYTES) as tmp, open(tmp, "wb") as sizes_out:
            _count_capped(cfg, info, sizes_out)
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
    if info.config != _config_record(cfg) or (info.capped
                                              and not (out_dir / DOC_BYTES).is_file()):
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


def _check_unchanged(entry: dict[str, Any]) -> None:
    """Refuse a file that changed since the corpus was planned."""
    if not unchanged({k: v for k, v in entry.items() if k != "key"}):
        raise DataError(f"{entry['path']} changed since the tokenize stage's prepare step "
                        "planned it: rerun the tokenize stage (it plans the corpus again)")


def _piece_texts(info: CorpusInfo, piece: dict[str, Any], cfg: DataConfig) -> Iterator[str]:
    """The documents of ``piece`` (a piece of ``info`` or one cut like them), streamed from
    its file (refused when the file changed since it was described); errors name the
    source's config key."""
    entry = info.files[piece["file"]]
    _check_unchanged(entry)
    key = entry["key"]
    try:
        yield from piece_texts(info.source_files, piece, cfg, key)
    except DataError as err:
        raise DataError(str(err) if key in str(err) else f"{key}: {err}") from None


def piece_documents(info: CorpusInfo, index: int, cfg: DataConfig) -> Iterator[str]:
    """The documents of piece ``index`` (a capped corpus: its counted ones)."""
    piece = info.pieces[index]
    if piece["docs"] == 0:
        return iter(())
    return itertools.islice(_piece_texts(info, piece, cfg), piece["docs"])


def shard_documents(info: CorpusInfo, shard: dict[str, Any], cfg: DataConfig) -> Iterator[str]:
    """The documents of one input shard in corpus order, streamed piece by piece."""
    for index in shard["pieces"]:
        yield from piece_documents(info, index, cfg)


def shard_records(info: CorpusInfo, shard: dict[str, Any], cfg: DataConfig,
                  id_field: str | None = None) -> Iterator[tuple[str, str]]:
    """(document id, text) of the documents ``shard_documents`` yields, in the same order
    and number (``sources.piece_records`` says how the id is made)."""
    for index in shard["pieces"]:
        piece = info.pieces[index]
        if piece["docs"] == 0:
            continue
        entry = info.files[piece["file"]]
        _check_unchanged(entry)
        key = entry["key"]
        try:
            yield from itertools.islice(
                piece_records(info.source_files, piece, cfg, key, id_field), piece["docs"])
        except DataError as err:
            raise DataError(str(err) if key in str(err) else f"{key}: {err}") from None


def training_sample(out_dir: Path, info: CorpusInfo, cfg: DataConfig, max_bytes: int,
                    seed: int) -> list[str]:
    """Whole documents for the tokenizer, about ``max_bytes`` of them (at least one).

    Uncapped: ``SAMPLE_PIECES`` pieces cut over each source's files by bytes (not by the
    shard plan, so the tokenizer does not depend on ``data.num_shards``), visited in a
    seeded order; each gives its leading documents up to its share of ``max_bytes``.
    Capped: seeded random documents of the counted prefix (their sizes were saved).
    """
    if info.capped:
        return _capped_sample(out_dir, info, cfg, max_bytes, seed)
    files = info.source_files
    pieces = []
    base = 0
    for source_files in _files_by_source(info, files):
        size = sum(f.size for f in source_files)
        for piece in plan_pieces(source_files, max(1, -(-size // SAMPLE_PIECES))):
            pieces.append({**piece, "file": base + piece["file"]})
        base += len(source_files)
    share = max(1, max_bytes // min(SAMPLE_PIECES, len(pieces)))
    order = np.random.default_rng(seed).permutation(len(pieces))
    sample: list[str] = []
    total = 0
    for index in order.tolist():
        taken = 0
        for text in _piece_texts(info, pieces[index], cfg):
            size = len(text.encode("utf-8"))
            sample.append(text)
            taken += size
            total += size
            if taken >= share or total >= max_bytes:
                break
        if total >= max_bytes:
            break
    if not sample:
        raise DataError("the corpus yielded no documents (empty documents are dropped; "
                        f"max_document_bytes={cfg.max_document_bytes})")
    return sample


def _files_by_source(info: CorpusInfo, files: list[SourceFile]) -> list[list[SourceFile]]:
    """``files`` grouped by source (contiguous in corpus order)."""
    groups: list[list[SourceFile]] = []
    previous = None
    for entry, f in zip(info.files, files, strict=True):
        if entry["key"] != previous:
            groups.append([])
            previous = entry["key"]
        groups[-1].append(f)
    return groups


def _capped_sample(out_dir: Path, info: CorpusInfo, cfg: DataConfig, max_bytes: int,
                   seed: int) -> list[str]:
    """Seeded random documents of a capped corpus until ``max_bytes``: the order and the
    cut come from the saved sizes; one streaming pass collects the chosen documents."""
    sizes = np.fromfile(Path(out_dir) / DOC_BYTES, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(sizes))
    total = np.cumsum(sizes[order])
    take = max(1, int(np.searchsorted(total, max_bytes, side="right")))
    chosen = order[:take]
    wanted = set(chosen.tolist())
    ordered = np.sort(chosen)
    found: dict[int, str] = {}
    first = 0
    for index, piece in enumerate(info.pieces):
        count = piece["docs"]
        lo, hi = np.searchsorted(ordered, [first, first + count])
        if hi > lo:  # the piece holds a chosen document
            for doc, text in zip(range(first, first + count),
                                 piece_documents(info, index, cfg), strict=False):
                if doc in wanted:
                    found[doc] = text
            if len(found) == len(wanted):
                break
        first += count
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
        room = None if cfg.max_documents is None else cfg.max_documents - count
        for text in itertools.islice(piece_texts(files, piece, cfg, key), room):
            count += 1
            yield text
        if cfg.max_documents is not None and count >= cfg.max_documents:
            return
    if count == 0:
        raise _no_documents(key, spec, cfg)
