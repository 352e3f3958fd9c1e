"""One source (``data.source`` or one entry of ``data.sources``): its files, described from
metadata, cut into pieces, and read as a stream of documents.

Supported sources:

- ``stdlib``: this interpreter's standard-library ``.py`` files (found at run time under
  ``sysconfig.get_paths()["stdlib"]``, site-/dist-packages excluded), sorted by path, one
  file per document. The few files that are deliberately not UTF-8 (encoding tests) are
  skipped, so the default corpus works on every install.
- a file, a directory (searched recursively) or a glob of ``.txt`` (one file = one
  document), ``.jsonl`` / ``.json`` (records with field ``data.text_field``) or
  ``.parquet`` files, taken in sorted path order; text and JSON files may be compressed
  (``.txt.gz``, ``.jsonl.zst``, ...);
- a directory written by ``Dataset.save_to_disk`` (or a ``DatasetDict`` with a ``train`` split);
- ``hf:<dataset id>``: the ``train`` split of a hub dataset (needs internet), streamed row by
  row and saved once under the stage directory (the first ``data.max_documents`` documents
  when set; on Slurm sites a budget is required, ``stages.tokenize.checks.check_tokenize``).

``describe_source`` looks only at metadata (sizes, mtimes, parquet footers, dataset row
counts) and a few sampled blocks of each file (``SourceFile.sample``, for the fingerprint);
``plan_pieces`` cuts the files into pieces (byte ranges of uncompressed JSON lines, row
groups of parquet, row ranges of datasets, whole files otherwise) of about a given size;
``piece_texts`` streams one piece's documents (``data_prep.readers``).

Empty documents are dropped; documents over ``data.max_document_bytes`` are skipped (the
limit ``data.max_documents`` is applied by the corpus). Bad input raises
``DataError`` naming the file and line and the config key of the source.
"""
from __future__ import annotations

import glob
import hashlib
import os
import shutil
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data_prep.config import DataConfig
from data_prep.errors import DataError
from data_prep.readers import (
    COMPRESSIONS,
    iter_dataset,
    iter_dataset_records,
    iter_json,
    iter_json_records,
    iter_jsonl,
    iter_jsonl_records,
    iter_parquet,
    iter_parquet_records,
    json_line_texts,
    open_saved_dataset,
    parquet_row_groups,
    read_text_document,
    record_text,
)

__all__ = ["SUPPORTED", "SourceFile", "describe_source", "expand_files", "file_kind",
           "is_saved_dataset", "json_line_texts", "piece_records", "piece_texts",
           "plan_pieces", "record_text",
           "stdlib_files", "unchanged"]

KINDS = {".txt": "text", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
SUPPORTED = tuple([*KINDS, *(f"{s}{c}" for s in (".txt", ".jsonl", ".json")
                             for c in COMPRESSIONS)])
"""File name endings a source may hold."""
SAMPLE_BLOCK = 4096
HUB_PROGRESS_S = 30.0  # a progress line while a hub dataset streams
SAMPLE_BLOCKS = 16
"""A file's sample: its first and last ``SAMPLE_BLOCK`` bytes and ``SAMPLE_BLOCKS`` evenly
spaced blocks between (a file up to that size is hashed whole)."""


@dataclass
class SourceFile:
    """One input file (or saved dataset directory) as the metadata describes it."""

    path: str
    kind: str
    """"text", "jsonl", "json", "parquet" or "dataset"."""
    size: int
    """Bytes on disk (compressed size for a compressed file; Arrow files of a dataset)."""
    mtime_ns: int
    sample: str
    """sha256 of the sampled blocks (a dataset: of its state.json)."""
    compressed: bool = False
    rows: list[int] | None = None
    """Rows per row group (parquet) or [rows] (dataset); None for text and JSON."""
    skip_undecodable: bool = False
    """stdlib: a file that is not UTF-8 is skipped rather than refused."""


def stdlib_files() -> list[Path]:
    """The standard library's .py files of the running interpreter, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]  # not walked at all: site-packages is big
        found += (Path(folder) / f for f in files
                  if f.endswith(".py") and os.path.isfile(os.path.join(folder, f)))
    return sorted(found)


def file_kind(path: Path) -> str | None:
    """"text", "jsonl", "json" or "parquet" by the file's name (a compression suffix after
    a text or JSON suffix allowed); None for an unsupported name."""
    name = path.name
    for ending in SUPPORTED:
        if name.endswith(ending) and len(name) > len(ending):
            return KINDS[ending.removesuffix(".gz").removesuffix(".zst")]
    return None


def _ending(path: Path) -> str:
    return "".join(path.suffixes[-2:]) if path.suffix in COMPRESSIONS else path.suffix


def expand_files(source: str, key: str) -> list[Path]:
    """The data files a local source names (file, directory or glob), sorted."""
    path = Path(source).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and file_kind(p))
        if not files:
            raise DataError(
                f"{key} directory {source!r} has no {'/'.join(KINDS)} files (the text kinds "
                f"also {'/'.join(COMPRESSIONS)} compressed): add some, or point {key} at a "
                "directory that has them"
            )
    elif glob.has_magic(source):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True)
                       if Path(p).is_file())
        if not files:
            raise DataError(f"{key} glob {source!r} matched no files: fix the pattern")
    elif path.exists():  # a device, FIFO or socket: no end, or no size to plan by
        raise DataError(
            f"{key} {source!r} is not a regular file or directory: give 'stdlib', a file, "
            "directory or glob of .txt/.jsonl/.json/.parquet files, a save_to_disk "
            "directory, or 'hf:<id>'"
        )
    else:
        raise DataError(
            f"{key} {source!r} does not exist: give 'stdlib', a file, directory or glob "
            "of .txt/.jsonl/.json/.parquet files (.gz/.zst compressed text and JSON too), a "
            "save_to_disk directory, or 'hf:<id>'"
        )
    bad = [p for p in files if file_kind(p) is None]
    if bad:
        raise DataError(
            f"{bad[0]}: unsupported file type {_ending(bad[0])!r}; use one of {SUPPORTED} "
            f"(or remove it from {key})"
        )
    return files


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``Dataset(Dict).save_to_disk``."""
    return path.is_dir() and (
        (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()
    )


def sample_digest(path: Path, size: int) -> str:
    """sha256 of the file's sampled blocks: enough to see most edits without a full read
    (size and mtime catch the rest but a same-size edit with the old mtime restored)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if size <= SAMPLE_BLOCK * (SAMPLE_BLOCKS + 2):
            digest.update(handle.read())
        else:
            step = (size - SAMPLE_BLOCK) // (SAMPLE_BLOCKS + 1)
            for offset in [0, *(step * (i + 1) for i in range(SAMPLE_BLOCKS)),
                           size - SAMPLE_BLOCK]:
                handle.seek(offset)
                digest.update(handle.read(SAMPLE_BLOCK))
    return digest.hexdigest()


def _stat(path: Path, key: str) -> os.stat_result:
    try:
        return path.stat()
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err}): fix it or remove it "
                        f"from {key}") from None


def describe_file(path: Path, key: str, skip_undecodable: bool = False) -> SourceFile:
    """A file's metadata and sample (parquet: its row groups, from the footer)."""
    kind = file_kind(path) or "text"  # stdlib .py files are text
    st = _stat(path, key)
    rows = None
    if kind == "parquet":
        import pyarrow as pa

        try:
            rows = parquet_row_groups(path)
        except (OSError, ValueError, pa.ArrowException) as err:
            raise DataError(f"{path}: not a readable parquet file ({err}): rewrite it or "
                            f"remove it from {key}") from None
    try:
        sample = sample_digest(path, st.st_size)
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err}): fix its permissions "
                        f"or remove it from {key}") from None
    return SourceFile(path=str(path), kind=kind, size=st.st_size, mtime_ns=st.st_mtime_ns,
                      sample=sample, compressed=path.suffix in COMPRESSIONS, rows=rows,
                      skip_undecodable=skip_undecodable)


def describe_dataset(path: Path, key: str) -> SourceFile:
    """A save_to_disk directory: its row count, Arrow file sizes and the state it saved."""
    ds = open_saved_dataset(path, key)
    arrow = [Path(f["filename"]) for f in ds.cache_files]
    size = sum(f.stat().st_size for f in arrow)
    state = hashlib.sha256()
    for f in sorted(arrow):
        st = f.stat()
        state.update(f"{f}:{st.st_size}:{st.st_mtime_ns}:{sample_digest(f, st.st_size)}"
                     .encode())
    mtime = max((f.stat().st_mtime_ns for f in arrow), default=0)
    return SourceFile(path=str(path), kind="dataset", size=size, mtime_ns=mtime,
                      sample=state.hexdigest(), rows=[len(ds)])


def _hub_dataset(source: str, cfg: DataConfig, stage_dir: Path, slot: str, key: str) -> Path:
    """Stream the hub dataset's train split, row by row (the first ``data.max_documents``
    documents when set, else all of it), into ``<stage_dir>/corpus/<slot>``; kept when an
    earlier attempt saved it. Never a whole-split download: memory stays bounded, and a line
    every ``HUB_PROGRESS_S`` seconds gives the documents, the rate and, with a budget, the
    ETA."""
    import datasets

    target = stage_dir / "corpus" / slot
    if is_saved_dataset(target):
        return target
    cache = stage_dir / "hf_cache"  # never the user's home; removed once the copy is saved
    tmp = target.with_name(f".{slot}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    name = source[3:]
    stream = datasets.load_dataset(name, split="train", streaming=True, cache_dir=str(cache))
    budget = cfg.max_documents

    def rows() -> Iterator[dict[str, str]]:
        kept, started, said = 0, time.monotonic(), time.monotonic()
        for row in stream:
            text = row.get(cfg.text_field)
            if not isinstance(text, str):
                raise DataError(f"{key}: hub dataset {name!r}: field {cfg.text_field!r} is "
                                f"{type(text).__name__}, expected a string; set "
                                "data.text_field")
            yield {cfg.text_field: text}
            kept += bool(text)
            if budget is not None and kept >= budget:
                return
            if time.monotonic() - said >= HUB_PROGRESS_S:
                said = time.monotonic()
                rate = kept / (said - started)
                eta = f", ETA {(budget - kept) / rate:.0f} s" if budget and rate else ""
                print(f"[tokenize] {name}: {kept:,} documents streamed ({rate:,.0f}/s{eta})",
                      flush=True)

    features = datasets.Features({cfg.text_field: datasets.Value("string")})
    ds = datasets.Dataset.from_generator(rows, features=features, cache_dir=str(cache))
    ds.save_to_disk(str(tmp))
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, target)
    shutil.rmtree(cache, ignore_errors=True)
    return target


def describe_source(cfg: DataConfig, source: str, key: str, stage_dir: Path | None = None,
                    slot: str = "source") -> list[SourceFile]:
    """The files of one source, in corpus order, from metadata and samples only.

    ``key`` (``data.source`` or ``data.sources.<label>``) names the source in errors. A hub
    source (``hf:``) is first saved under ``stage_dir/corpus/<slot>``.
    """
    if source == "stdlib":
        return [describe_file(p, key, skip_undecodable=True) for p in stdlib_files()]
    if source.startswith("hf:"):
        if stage_dir is None:
            raise DataError(f"{key} {source!r}: a hub dataset is saved under the stage "
                            "directory; give stage_dir")
        return [describe_dataset(_hub_dataset(source, cfg, Path(stage_dir), slot, key), key)]
    if is_saved_dataset(Path(source)):
        return [describe_dataset(Path(source), key)]
    files = expand_files(source, key)
    parquet = [p for p in files if file_kind(p) == "parquet"]
    if parquet and len(parquet) != len(files):
        raise DataError(
            f"{key} {source!r} mixes parquet and text/json files; point it at one kind"
        )
    return [describe_file(p, key) for p in files]


def unchanged(entry: SourceFile | dict[str, Any]) -> bool:
    """Whether the file still has the size and mtime it was described with."""
    entry = entry if isinstance(entry, SourceFile) else SourceFile(**entry)
    path = Path(entry.path)
    if entry.kind == "dataset":
        try:
            return describe_dataset(path, "data.source").sample == entry.sample
        except (DataError, OSError):
            return False
    try:
        st = path.stat()
    except OSError:
        return False
    return (st.st_size, st.st_mtime_ns) == (entry.size, entry.mtime_ns)


def plan_pieces(files: list[SourceFile], piece_bytes: int) -> list[dict[str, Any]]:
    """Cut files into pieces of about ``piece_bytes`` (by metadata, in corpus order).

    Each piece is {"file": index into ``files``, "start", "stop", "bytes"}: a byte range of
    an uncompressed JSON lines file, a row-group range of a parquet file, a row range of a
    dataset; ``start``/``stop`` are None for a whole text, JSON or compressed file.
    """
    pieces: list[dict[str, Any]] = []
    piece_bytes = max(1, piece_bytes)
    for index, f in enumerate(files):
        if f.kind == "jsonl" and not f.compressed and f.size > piece_bytes:
            count = -(-f.size // piece_bytes)
            cuts = [f.size * i // count for i in range(count + 1)]
            pieces += [{"file": index, "start": a, "stop": b, "bytes": b - a}
                       for a, b in zip(cuts, cuts[1:], strict=False)]
        elif f.kind in ("parquet", "dataset") and f.rows:
            total_rows = max(1, sum(f.rows))
            units = f.rows if f.kind == "parquet" else None
            if units is None:  # a dataset: row ranges of about piece_bytes
                count = max(1, min(f.rows[0], -(-f.size // piece_bytes)))
                cuts = [f.rows[0] * i // count for i in range(count + 1)]
                pieces += [{"file": index, "start": a, "stop": b,
                            "bytes": f.size * (b - a) // total_rows}
                           for a, b in zip(cuts, cuts[1:], strict=False)]
                continue
            first, acc = 0, 0
            for group, rows in enumerate(units):  # whole row groups of about piece_bytes
                acc += f.size * rows // total_rows
                if acc >= piece_bytes or group == len(units) - 1:
                    pieces.append({"file": index, "start": first, "stop": group + 1,
                                   "bytes": acc})
                    first, acc = group + 1, 0
        else:
            pieces.append({"file": index, "start": None, "stop": None, "bytes": f.size})
    return pieces


def _kept(texts: Iterator[str], max_bytes: int | None) -> Iterator[str]:
    for text in texts:
        if text and (max_bytes is None or len(text.encode("utf-8")) <= max_bytes):
            yield text


def _kept_records(records: Iterator[tuple[str, str]],
                  max_bytes: int | None) -> Iterator[tuple[str, str]]:
    """``_kept`` on (id, text) pairs: the same documents in the same order."""
    for doc_id, text in records:
        if text and (max_bytes is None or len(text.encode("utf-8")) <= max_bytes):
            yield doc_id, text


def _read_piece(f: SourceFile, piece: dict[str, Any], cfg: DataConfig, key: str,
                id_field: str | None, records: bool) -> Iterator:
    """One piece's raw documents (before the empty/oversized filter): texts, or (id, text)
    pairs when ``records``."""
    path = Path(f.path)
    limit = cfg.max_document_bytes
    if f.kind == "text":
        if limit is not None and not f.compressed and f.size > limit:
            return  # the file is the document, and its size is known: skip it unread
        try:
            text = read_text_document(path, key, limit)
        except DataError:
            if f.skip_undecodable:
                return
            raise
        if text is not None:
            yield (f.path, text) if records else text
    elif f.kind == "jsonl":
        start, stop = piece["start"] or 0, piece["stop"]
        yield from (iter_jsonl_records(path, cfg.text_field, key, start, stop, id_field)
                    if records else iter_jsonl(path, cfg.text_field, key, start, stop))
    elif f.kind == "json":
        yield from (iter_json_records(path, cfg.text_field, key, id_field) if records
                    else iter_json(path, cfg.text_field, key))
    elif f.kind == "parquet":
        groups = None if piece["start"] is None else list(range(piece["start"], piece["stop"]))
        first_row = sum((f.rows or [])[: piece["start"] or 0])
        yield from (iter_parquet_records(path, cfg.text_field, groups, first_row, id_field)
                    if records else iter_parquet(path, cfg.text_field, groups, first_row))
    elif f.kind == "dataset":
        start, stop = piece["start"] or 0, piece["stop"]
        yield from (iter_dataset_records(path, cfg.text_field, key, start, stop, id_field)
                    if records else iter_dataset(path, cfg.text_field, key, start, stop))
    else:
        raise DataError(f"{path}: unknown kind {f.kind!r}")


def piece_texts(files: list[SourceFile], piece: dict[str, Any], cfg: DataConfig,
                key: str) -> Iterator[str]:
    """The documents of one piece, streamed: empty ones dropped, ones over
    ``data.max_document_bytes`` skipped."""
    f = files[piece["file"]]
    return _kept(_read_piece(f, piece, cfg, key, None, False), cfg.max_document_bytes)


def piece_records(files: list[SourceFile], piece: dict[str, Any], cfg: DataConfig, key: str,
                  id_field: str | None = None) -> Iterator[tuple[str, str]]:
    """(document id, text) of the documents ``piece_texts`` yields, in the same order.

    The id is the record's ``id_field`` (JSON, parquet and dataset sources, when set and
    present), else ``<file>:<line>`` (JSON lines, 1-based), ``<file>:<row>`` (parquet and
    datasets, 0-based), ``<file>:<index>`` (a JSON array) or ``<file>`` (a text or stdlib
    file, a single JSON object); ``<file>`` is the path as the source gave it.
    """
    f = files[piece["file"]]
    return _kept_records(_read_piece(f, piece, cfg, key, id_field, True), cfg.max_document_bytes)


def file_record(f: SourceFile) -> dict[str, Any]:
    """A SourceFile as plain JSON values."""
    return asdict(f)
