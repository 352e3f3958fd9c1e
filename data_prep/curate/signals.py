"""Per-document signals of one input shard, written once to a parquet file.

Every value is computed on the document as read (never on a text a filter rewrote), so
thresholds chosen later judge what tokenization will see. One row per document, in the
order ``corpus.shard_documents`` yields them:

- ``id``, ``source`` (label, null for a single data.source), ``shard``, ``index`` (in the
  shard), ``bytes`` (UTF-8), ``chars``;
- ``language``, ``language_score``: py3langid (its model ships in the wheel; nothing is
  downloaded) on the first ``LANGUAGE_CHARS`` characters, probabilities normalized;
- the quality and repetition values of ``quality.COLUMNS``;
- ``norm_hash``: 64-bit blake2b of ``text.normalize`` (exact dedup); a huge document is
  normalized segment by segment, once for each of the hash, MinHash and decontamination,
  so no full-size normalized copy is ever held;
- ``band_00`` .. : the MinHash LSH band keys (``minhash``), one uint64 column per band;
- ``contamination``: the eval tasks the document shares an n-gram with (``decontaminate``).

The file is written under a temporary name and renamed when complete; its schema metadata
(``curate``) records the shard, the source and ``config.signal_config``.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from data_prep.atomic import atomic_path
from data_prep.config import DataConfig
from data_prep.corpus import CorpusInfo, shard_records
from data_prep.curate import arrow
from data_prep.curate.config import CurateConfig, signal_config
from data_prep.curate.decontaminate import EvalIndex, contamination
from data_prep.curate.language import identifier
from data_prep.curate.minhash import band_keys
from data_prep.curate.quality import COLUMNS, text_values
from data_prep.curate.text import SEGMENT_CHARS, normalized_segments, segments_hash64
from data_prep.progress import Progress

LANGUAGE_CHARS = 1500
"""Characters of a document its language is identified from (py3langid's time grows with
the text: at 4,000 it was a quarter of all signal time)."""
ROW_GROUP_DOCS = 8192
"""Documents per parquet row group (what is held before a write)."""
DICTIONARY_COLUMNS = ["source", "language"]
"""The columns of few distinct values, dictionary-encoded. Hashes and measures are not: a
dictionary of distinct values costs a hash table a column while writing (4 MB of the
task's peak) and makes the file larger, not smaller."""
METADATA_KEY = b"curate"
_COUNTS = frozenset(["words", "stop_words", "lorem_ipsum", "javascript", "curly_braces"])


def band_column(band: int) -> str:
    """The parquet column of LSH band ``band``."""
    return f"band_{band:02d}"


def schema(bands: int, metadata: dict[str, Any] | None = None):
    """The signal file's Arrow schema (``bands`` band-key columns)."""
    import pyarrow as pa

    fields = [pa.field("id", pa.string()), pa.field("source", pa.string()),
              pa.field("shard", pa.int32()), pa.field("index", pa.int64()),
              pa.field("bytes", pa.int64()), pa.field("chars", pa.int64()),
              pa.field("language", pa.string()), pa.field("language_score", pa.float32())]
    fields += [pa.field(name, pa.int64() if name in _COUNTS else pa.float32())
               for name in COLUMNS]
    fields += [pa.field("norm_hash", pa.uint64())]
    fields += [pa.field(band_column(b), pa.uint64()) for b in range(bands)]
    fields += [pa.field("contamination", pa.list_(pa.string()))]
    meta = {METADATA_KEY: json.dumps(metadata).encode()} if metadata else None
    return pa.schema(fields, metadata=meta)


def document_signals(text: str, cfg: CurateConfig,
                     eval_index: EvalIndex | None = None) -> dict[str, Any]:
    """Every signal of one document but its place (id, source, shard, index)."""
    language, score = identifier().classify(text[:LANGUAGE_CHARS])
    out: dict[str, Any] = {"bytes": _utf8_size(text), "chars": len(text),
                           "language": language, "language_score": float(score)}
    out.update(text_values(text))
    if len(text) <= SEGMENT_CHARS:  # one segment: normalized once
        segments: Iterable[str] = list(normalized_segments(text))
        out["norm_hash"] = segments_hash64(segments)
        keys = band_keys(segments, cfg.shingle_words, cfg.minhash_bands, cfg.minhash_rows)
        out["contamination"] = contamination(segments, eval_index)
    else:  # a huge document: each pass streams its own segments (never a full copy)
        out["norm_hash"] = segments_hash64(normalized_segments(text))
        keys = band_keys(normalized_segments(text), cfg.shingle_words, cfg.minhash_bands,
                         cfg.minhash_rows)
        out["contamination"] = contamination(normalized_segments(text), eval_index)
    out.update((band_column(band), key) for band, key in enumerate(keys))
    return out


def _utf8_size(text: str) -> int:
    """UTF-8 bytes of ``text``, counted a piece at a time (no full encoded copy)."""
    if text.isascii():
        return len(text)
    step = SEGMENT_CHARS
    return sum(len(text[i:i + step].encode("utf-8", "surrogatepass"))
               for i in range(0, len(text), step))


def compute_shard_signals(info: CorpusInfo, shard_index: int, shard: dict[str, Any],
                          data_cfg: DataConfig, curate_cfg: CurateConfig,
                          eval_index: EvalIndex | None, out_path: str | Path,
                          progress: Progress | None = None) -> dict[str, Any]:
    """Compute the signals of input shard ``shard_index`` (``shard``, an entry of
    ``info.shards``) and write them to ``out_path`` (parquet, atomically).

    Returns {"shard", "source", "documents", "bytes", "contaminated", "path", "seconds"}.
    ``progress`` prints periodic lines (a default one every 10 s when None).
    """
    import pyarrow.parquet as pq

    started = time.perf_counter()
    source = shard.get("source")
    progress = progress or Progress(f"[curate] signals of shard {shard_index}",
                                    int(shard.get("bytes") or 0), tokens=False)
    meta = {"shard": shard_index, "source": source, "signal_config": signal_config(curate_cfg)}
    table_schema = schema(curate_cfg.minhash_bands, meta)
    counts = {"documents": 0, "bytes": 0, "contaminated": 0}
    records = shard_records(info, shard, data_cfg, curate_cfg.id_field)
    columns = arrow.Columns(table_schema)
    with atomic_path(out_path) as tmp:
        with pq.ParquetWriter(tmp, table_schema, compression="zstd",
                              use_dictionary=DICTIONARY_COLUMNS) as writer:
            for index, (doc_id, text) in enumerate(records):
                row = {"id": doc_id, "source": source, "shard": shard_index, "index": index}
                row.update(document_signals(text, curate_cfg, eval_index))
                columns.append(row)
                counts["documents"] += 1
                counts["bytes"] += row["bytes"]
                counts["contaminated"] += bool(row["contamination"])
                progress.update(1, 0, row["bytes"])
                if len(columns) >= ROW_GROUP_DOCS:
                    writer.write_table(columns.take())
            if len(columns):
                writer.write_table(columns.take())
    progress.emit(done=True)
    return {"shard": shard_index, "source": source, **counts, "path": str(out_path),
            "seconds": round(time.perf_counter() - started, 3)}


def file_metadata(path: str | Path) -> dict[str, Any]:
    """The ``curate`` metadata of a signal file (shard, source, signal_config)."""
    import pyarrow.parquet as pq

    meta = pq.read_schema(path).metadata or {}
    if METADATA_KEY not in meta:
        raise ValueError(f"{path}: not a signal file written by compute_shard_signals")
    return json.loads(meta[METADATA_KEY])
