"""The final step: dedup across every shard, the selection, and everything it writes.

``curate_corpus`` reads the signal files (one per input shard, in corpus order), applies the
thresholds shard by shard (never holding every signal at once), deduplicates the documents
that pass (``dedup``), and writes atomically into ``out_dir``:

- ``removed.parquet``: one row per removed document: ``id``, ``reason``, ``duplicate_of``
  (the kept document's id for a duplicate, else null), ``source``, ``shard``, ``index``,
  ``bytes``;
- ``keep/shard-00000.npy`` ...: a bool per document of each input shard, in shard order
  (``keep_mask``): what tokenization keeps;
- ``summary.json``: documents and bytes per reason and per source, kept and total;
- ``removed_sample.json``: the first ``curate.sample_per_reason`` removed documents of each
  reason, with their text (cut at ``SAMPLE_CHARS``) when the corpus plan is at hand;

The stage draws the removals chart from the summary beside its MLflow logging
(``stages.curate.report``): the selection itself never imports matplotlib.

Only this step reads the thresholds, so a new threshold reruns it alone.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.atomic import atomic_path, write_json_atomic
from data_prep.config import DataConfig
from data_prep.corpus import CORPUS_INFO, CorpusInfo, shard_records
from data_prep.curate import arrow
from data_prep.curate.config import CurateConfig
from data_prep.curate.dedup import Duplicates, find_duplicates
from data_prep.curate.select import PRESETS, RULES, filter_reasons, preset_name
from data_prep.curate.signals import file_metadata

KEEP_DIR = "keep"
REMOVED = "removed.parquet"
SUMMARY = "summary.json"
SAMPLE = "removed_sample.json"
SAMPLE_CHARS = 2000
"""Characters of each sampled removed document kept in removed_sample.json."""
_FILTER_COLUMNS = sorted({"contamination", "language", *(c for c, _ in RULES.values())})


def resolve_preset(cfg: CurateConfig, data: DataConfig,
                   label: str | None = None) -> dict[str, float | None]:
    """The effective thresholds of one source (``label``; None: the single data.source, or
    the first of data.sources): its preset's, with ``curate.thresholds`` over them."""
    specs = dict(data.labelled_sources())
    spec = specs.get(label, next(iter(specs.values())))
    return {**PRESETS[preset_name(cfg.preset, spec)], **cfg.thresholds}


def keep_path(out_dir: str | Path, shard_index: int) -> Path:
    """Where the keep mask of input shard ``shard_index`` is written."""
    return Path(out_dir) / KEEP_DIR / f"shard-{shard_index:05d}.npy"


def keep_mask(out_dir: str | Path, shard_index: int) -> np.ndarray:
    """The keep mask ``curate_corpus`` wrote for input shard ``shard_index``: a bool per
    document, in the order ``corpus.shard_documents`` yields them."""
    path = keep_path(out_dir, shard_index)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the curate stage's final step")
    return np.load(path, allow_pickle=False)


class _Codes:
    """Reason strings as small integers (0: kept), so a corpus's reasons are 2 bytes a
    document."""

    def __init__(self) -> None:
        self.names: list[str | None] = [None]
        self.index: dict[str | None, int] = {None: 0}

    def encode(self, reasons: list[str | None]) -> np.ndarray:
        for reason in set(reasons) - set(self.index):
            self.index[reason] = len(self.names)
            self.names.append(reason)
        return np.fromiter((self.index[r] for r in reasons), dtype=np.int16, count=len(reasons))


def _shard_filters(paths: Sequence[Path], cfg: CurateConfig, data: DataConfig, codes: _Codes
                   ) -> tuple[list[dict[str, Any]], list[np.ndarray], np.ndarray]:
    """Per signal file (one at a time): its metadata and its documents' filter reason
    codes; and every document's normalized hash (corpus order)."""
    metas, reasons, hashes = [], [], []
    for path in paths:
        meta = file_metadata(path)
        table = arrow.read(path, [*_FILTER_COLUMNS, "norm_hash"])
        columns = {name: table.column(name) for name in _FILTER_COLUMNS}
        thresholds = resolve_preset(cfg, data, meta.get("source"))
        reasons.append(codes.encode(filter_reasons(columns, thresholds, cfg.languages,
                                                   table.num_rows)))
        hashes.append(arrow.numbers(table.column("norm_hash")))
        meta["documents"] = table.num_rows
        metas.append(meta)
        del table, columns
    all_hashes = np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64)
    return metas, reasons, all_hashes


_REMOVED_SCHEMA = [("id", "string"), ("reason", "string"), ("duplicate_of", "string"),
                   ("source", "string"), ("shard", "int32"), ("index", "int64"),
                   ("bytes", "int64")]


class _Tally:
    """Documents and bytes per reason and per source, kept and total, and the first
    removed documents of each reason (the sample), gathered shard by shard."""

    def __init__(self, per_reason: int) -> None:
        self.per_reason = per_reason
        self.by_reason: dict[str, dict[str, int]] = {}
        self.by_source: dict[str, dict[str, Any]] = {}
        self.sample: dict[str, list[dict[str, Any]]] = {}
        self.totals = {"documents": 0, "bytes": 0, "kept_documents": 0, "kept_bytes": 0}

    def add_shard(self, source: str | None, sizes: np.ndarray, mask: np.ndarray) -> None:
        entry = self.by_source.setdefault(str(source), {"removed": {}})
        for key, value in (("documents", len(mask)), ("bytes", int(sizes.sum())),
                           ("kept_documents", int(mask.sum())),
                           ("kept_bytes", int(sizes[mask].sum()))):
            entry[key] = entry.get(key, 0) + value
            self.totals[key] += value

    def add_removed(self, row: dict[str, Any]) -> None:
        for table in (self.by_reason,
                      self.by_source.setdefault(str(row["source"]), {"removed": {}})["removed"]):
            entry = table.setdefault(row["reason"], {"documents": 0, "bytes": 0})
            entry["documents"] += 1
            entry["bytes"] += row["bytes"]
        picked = self.sample.setdefault(row["reason"], [])
        if len(picked) < self.per_reason:
            picked.append({k: row[k] for k in ("id", "duplicate_of", "source", "shard",
                                               "index", "bytes")})

    def summary(self) -> dict[str, Any]:
        t = self.totals
        return {**t, "removed_documents": t["documents"] - t["kept_documents"],
                "removed_bytes": t["bytes"] - t["kept_bytes"],
                "by_reason": dict(sorted(self.by_reason.items())), "by_source": self.by_source}


def _write_selection(paths: Sequence[Path], metas: list[dict[str, Any]],
                     reasons: list[np.ndarray], codes: _Codes, dups: Duplicates,
                     out_dir: Path, tally: _Tally) -> None:
    """removed.parquet and the keep masks, one shard at a time. A keeper precedes its
    duplicates in corpus order, so its id is known when they come."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    removed_dup = dups.removed()
    is_keeper = np.zeros(len(dups.keeper), dtype=bool)
    is_keeper[dups.keeper[removed_dup]] = True
    keeper_ids: dict[int, str] = {}
    schema = pa.schema(_REMOVED_SCHEMA)
    first = 0
    with atomic_path(out_dir / REMOVED) as tmp, \
            pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for path, meta, shard_codes in zip(paths, metas, reasons, strict=True):
            count = meta["documents"]
            table = arrow.read(path, ["id", "bytes"])
            ids = table.column("id").to_pylist()
            sizes = arrow.numbers(table.column("bytes"))
            for local in np.flatnonzero(is_keeper[first:first + count]).tolist():
                keeper_ids[first + local] = ids[local]
            mask = np.ones(count, dtype=bool)
            rows = []
            gone = (shard_codes != 0) | removed_dup[first:first + count]
            for local in np.flatnonzero(gone).tolist():
                reason = codes.names[shard_codes[local]] or dups.reason(first + local)
                mask[local] = False
                dup_of = (keeper_ids[int(dups.keeper[first + local])]
                          if reason.endswith("_duplicate") else None)
                rows.append({"id": ids[local], "reason": reason, "duplicate_of": dup_of,
                             "source": meta.get("source"), "shard": meta["shard"],
                             "index": local, "bytes": int(sizes[local])})
            tally.add_shard(meta.get("source"), sizes, mask)
            for row in rows:
                tally.add_removed(row)
            writer.write_table(arrow.table(rows, schema))
            with atomic_path(keep_path(out_dir, meta["shard"])) as keep_tmp, \
                    open(keep_tmp, "wb") as handle:
                np.save(handle, mask, allow_pickle=False)
            first += count


def _sample_texts(chosen: dict[str, list[dict[str, Any]]], data: DataConfig,
                  info: CorpusInfo | None, id_field: str | None) -> None:
    """Add their texts (cut at ``SAMPLE_CHARS``) to the sampled removed documents, re-read
    from the shards that hold them (only up to the last one wanted in each)."""
    if info is None:
        return
    wanted: dict[int, dict[int, dict[str, Any]]] = {}
    for entries in chosen.values():
        for entry in entries:
            wanted.setdefault(entry["shard"], {})[entry["index"]] = entry
    for shard, entries in sorted(wanted.items()):
        last = max(entries)
        for index, (_, text) in enumerate(shard_records(info, info.shards[shard], data,
                                                        id_field)):
            if index in entries:
                entries[index]["text"] = text[:SAMPLE_CHARS]
            if index >= last:
                break


def curate_corpus(signal_paths: Sequence[str | Path], curate_cfg: CurateConfig,
                  data_cfg: DataConfig, out_dir: str | Path,
                  info: CorpusInfo | None = None) -> dict[str, Any]:
    """Dedup and select over the signal files (every input shard's, in shard order) and
    write the outputs of the module docstring into ``out_dir``; returns the summary with
    "paths". ``info`` (default: ``out_dir``/corpus.json when present) lets the sample
    carry the removed documents' texts."""
    out_dir = Path(out_dir)
    paths = [Path(p) for p in signal_paths]
    if info is None and (out_dir / CORPUS_INFO).is_file():
        info = CorpusInfo.load(out_dir / CORPUS_INFO)
    codes = _Codes()
    metas, reasons, hashes = _shard_filters(paths, curate_cfg, data_cfg, codes)
    shards = [m["shard"] for m in metas]
    if shards != sorted(set(shards)):
        raise ValueError(f"signal files must be one per shard in shard order, got shards "
                         f"{shards}")
    if curate_cfg.enabled:
        passing = np.concatenate(reasons) == 0 if reasons else np.zeros(0, dtype=bool)
        dups = find_duplicates(paths, passing, hashes, curate_cfg.minhash_bands)
        del passing
    else:  # curate.enabled false: every document is kept
        reasons = [np.zeros_like(r) for r in reasons]
        dups = Duplicates(keeper=np.arange(len(hashes), dtype=np.int64),
                          exact=np.zeros(len(hashes), dtype=bool))
    del hashes
    tally = _Tally(curate_cfg.sample_per_reason)
    _write_selection(paths, metas, reasons, codes, dups, out_dir, tally)
    summary = tally.summary()
    _sample_texts(tally.sample, data_cfg, info, curate_cfg.id_field)
    write_json_atomic(out_dir / SAMPLE, tally.sample)
    summary["thresholds"] = {str(m.get("source")): resolve_preset(curate_cfg, data_cfg,
                                                                  m.get("source"))
                             for m in metas}
    summary["paths"] = {"removed": str(out_dir / REMOVED), "keep": str(out_dir / KEEP_DIR),
                        "summary": str(out_dir / SUMMARY), "sample": str(out_dir / SAMPLE)}
    write_json_atomic(out_dir / SUMMARY, summary)
    return json.loads(json.dumps(summary))
