"""Turn one source (``data.source`` or one entry of ``data.sources``) into a Hugging Face
``datasets.Dataset`` with one document per row.

Supported sources (the result always has a single string column ``text``):

- ``stdlib``: this interpreter's standard-library ``.py`` files (found at run time under
  ``sysconfig.get_paths()["stdlib"]``, site-/dist-packages excluded), sorted by path, one
  file per document. The few files that are deliberately not UTF-8 (encoding tests) are
  skipped, so the default corpus works on every install.
- a file, a directory (searched recursively) or a glob of ``.txt`` (one file = one
  document), ``.jsonl`` / ``.json`` (records with field ``data.text_field``) or
  ``.parquet`` files, taken in sorted path order;
- a directory written by ``Dataset.save_to_disk`` (or a ``DatasetDict`` with a ``train`` split);
- ``hf:<dataset id>``: the ``train`` split of a hub dataset (needs internet).

Empty documents are dropped; documents over ``data.max_document_bytes`` are skipped; at most
``data.max_documents`` are kept. Bad input raises ``DataError`` naming the file and line and
the config key of the source (``data.source`` or ``data.sources.<label>``).
"""
from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from data_prep.config import DataConfig
from data_prep.errors import DataError

if TYPE_CHECKING:  # datasets loads in ~1 s: only the functions that load data import it
    import datasets

TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES


def text_features() -> datasets.Features:
    """The one schema every loaded source has: a string column ``text``."""
    import datasets

    return datasets.Features({"text": datasets.Value("string")})


def stdlib_files() -> list[Path]:
    """The standard library's .py files of the running interpreter, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(
        p for p in root.rglob("*.py")
        if p.is_file() and not skip.intersection(p.relative_to(root).parts)
    )


def _decode(path: Path, data: bytes, key: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path}: not valid UTF-8 (byte {err.start}): convert the file to UTF-8 "
            f"or remove it from {key}"
        ) from None


def record_text(record: object, field: str, where: str) -> str:
    """The text field ``field`` of one JSON record; ``where`` (file:line) starts every error."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with field {field!r}, got "
                        f"{type(record).__name__}: write one object per record")
    if field not in record:
        keys = ", ".join(sorted(map(str, record))[:10])
        raise DataError(
            f"{where}: record has no field {field!r} (fields: {keys}); set data.text_field"
        )
    text = record[field]
    if not isinstance(text, str):
        raise DataError(
            f"{where}: field {field!r} is {type(text).__name__}, expected a string"
        )
    return text


def _json_texts(path: Path, field: str, key: str) -> Iterator[str]:
    raw = _decode(path, path.read_bytes(), key)
    if path.suffix == ".json":
        try:
            whole = json.loads(raw)
        except json.JSONDecodeError:
            whole = None  # not one JSON document: read it as JSON lines below
        if isinstance(whole, list):
            for i, record in enumerate(whole):
                yield record_text(record, field, f"{path}: record [{i}]")
            return
        if whole is not None:
            yield record_text(whole, field, f"{path}")
            return
    yield from json_line_texts(path, raw, field, key)


def json_line_texts(path: Path, text: str, field: str, key: str) -> Iterator[str]:
    """The ``field`` of every JSON line of ``text`` (read from ``path``; blank lines skipped);
    a malformed line or record is a DataError naming its line and the fix."""
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: malformed JSON line ({err.msg} at column "
                            f"{err.colno}): fix the line or remove the file from {key}") from None
        yield record_text(record, field, f"{path}:{lineno}")


def _generate(files: tuple[str, ...], field: str, skip_undecodable: bool, max_bytes: int | None,
              max_docs: int | None, stamp: tuple, key: str) -> Iterator[dict[str, str]]:
    """Rows of text/json files. ``stamp`` (sizes, mtimes) only keys the datasets cache."""
    del stamp
    count = 0
    for name in files:
        path = Path(name)
        if path.suffix in TEXT_SUFFIXES or path.suffix == ".py":
            try:
                texts: Iterator[str] = iter([_decode(path, path.read_bytes(), key)])
            except DataError:
                if skip_undecodable:
                    continue
                raise
        else:
            texts = _json_texts(path, field, key)
        for text in texts:
            if not text or (max_bytes is not None and len(text.encode("utf-8")) > max_bytes):
                continue
            yield {"text": text}
            count += 1
            if max_docs is not None and count >= max_docs:
                return
    if count == 0:
        raise DataError(
            f"{key} files ({len(files)}, first {files[0] if files else None}) yielded no "
            f"documents (empty documents are dropped; max_document_bytes={max_bytes})"
        )


def _from_files(files: list[Path], cfg: DataConfig, cache_dir: Path, skip_undecodable: bool,
                source: str, key: str) -> datasets.Dataset:
    import datasets
    from datasets.exceptions import DatasetGenerationError

    # Tuples, not lists: datasets splits list-valued gen_kwargs into separate generator calls.
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    try:
        return datasets.Dataset.from_generator(
            _generate,
            features=text_features(),
            cache_dir=str(cache_dir),
            gen_kwargs={
                "files": tuple(str(p) for p in files),
                "field": cfg.text_field,
                "skip_undecodable": skip_undecodable,
                "max_bytes": cfg.max_document_bytes,
                "max_docs": cfg.max_documents,
                "stamp": stamp,
                "key": key,
            },
        )
    except DatasetGenerationError as err:
        cause = err.__cause__
        while cause is not None and not isinstance(cause, DataError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        if "empty" in str(err).lower() or "no data" in str(err).lower():
            raise DataError(f"{key} {source!r} yielded no documents") from None
        raise


def _select_text(ds: datasets.Dataset, cfg: DataConfig, where: str) -> datasets.Dataset:
    """Keep the text field (as 'text'), drop empty/oversized rows, cap the count."""
    import datasets

    if cfg.text_field not in ds.column_names:
        raise DataError(
            f"{where}: no column {cfg.text_field!r} (columns: {', '.join(ds.column_names)}); "
            "set data.text_field"
        )
    feature = ds.features[cfg.text_field]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise DataError(f"{where}: column {cfg.text_field!r} has type {feature}, expected strings")
    ds = ds.select_columns([cfg.text_field])
    if cfg.text_field != "text":
        ds = ds.rename_column(cfg.text_field, "text")
    for start in range(0, len(ds), 10_000):  # nulls would become None documents
        batch = ds[start : start + 10_000]["text"]
        for offset, text in enumerate(batch):
            if not isinstance(text, str):
                raise DataError(
                    f"{where}: record {start + offset} field {cfg.text_field!r} is "
                    f"{type(text).__name__}, expected a string"
                )
    limit = cfg.max_document_bytes

    def keep(batch: dict[str, list[str]]) -> list[bool]:
        return [
            bool(t) and (limit is None or len(t.encode("utf-8")) <= limit) for t in batch["text"]
        ]

    ds = ds.filter(keep, batched=True)
    if cfg.max_documents is not None and len(ds) > cfg.max_documents:
        ds = ds.select(range(cfg.max_documents))
    return ds


def expand_files(source: str, key: str) -> list[Path]:
    """The data files a local source names (file, directory or glob), sorted."""
    path = Path(source).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUPPORTED)
        if not files:
            raise DataError(
                f"{key} directory {source!r} has no {'/'.join(SUPPORTED)} files: add some, "
                f"or point {key} at a directory that has them"
            )
    elif glob.has_magic(source):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True)
                       if Path(p).is_file())
        if not files:
            raise DataError(f"{key} glob {source!r} matched no files: fix the pattern")
    else:
        raise DataError(
            f"{key} {source!r} does not exist: give 'stdlib', a file, directory or glob "
            "of .txt/.jsonl/.json/.parquet files, a save_to_disk directory, or 'hf:<id>'"
        )
    bad = [p for p in files if p.suffix not in SUPPORTED]
    if bad:
        raise DataError(
            f"{bad[0]}: unsupported file type {bad[0].suffix!r}; use one of {SUPPORTED}"
        )
    return files


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``Dataset(Dict).save_to_disk``."""
    return path.is_dir() and (
        (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()
    )


def load_source(cfg: DataConfig, cache_dir: str | Path, source: str | None = None,
                key: str = "data.source") -> datasets.Dataset:
    """Load one source as a Dataset with one non-empty document per row in column 'text'.

    ``source`` defaults to ``cfg.source`` ('stdlib' when None); ``key`` is the config key that
    named it, used in error messages (``data.sources.<label>`` for a labelled source). The
    other ``cfg`` fields (text_field, limits) apply to it. ``cache_dir`` holds the datasets
    cache (keep it under the stage's directory or the runs directory, never the user's home).
    """
    import datasets

    datasets.disable_progress_bars()  # tokenization prints its own progress lines
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    if source is None:
        if cfg.sources:
            raise DataError("data.sources is set: load each source by name "
                            "(data_prep.corpus.load_corpus loads them all)")
        source = cfg.source or "stdlib"
    if source == "stdlib":
        ds = _from_files(
            stdlib_files(), cfg, cache_dir, skip_undecodable=True, source=source, key=key
        )
    elif source.startswith("hf:"):
        where = f"{key}: hub dataset {source[3:]!r}"
        ds = _select_text(
            datasets.load_dataset(source[3:], split="train", cache_dir=str(cache_dir)), cfg, where
        )
    elif is_saved_dataset(Path(source)):
        loaded = datasets.load_from_disk(source)
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DataError(f"{key}: {source}: saved DatasetDict has no 'train' split "
                                f"({list(loaded)})")
            loaded = loaded["train"]
        ds = _select_text(loaded, cfg, f"{key}: {source}")
    else:
        files = expand_files(source, key)
        parquet = [p for p in files if p.suffix in PARQUET_SUFFIXES]
        if parquet and len(parquet) != len(files):
            raise DataError(
                f"{key} {source!r} mixes parquet and text/json files; point it at one kind"
            )
        if parquet:
            loaded = datasets.load_dataset(
                "parquet",
                data_files=[str(p) for p in parquet],
                split="train",
                cache_dir=str(cache_dir),
            )
            ds = _select_text(loaded, cfg, f"parquet files of {key} {source!r}")
        else:
            ds = _from_files(files, cfg, cache_dir, skip_undecodable=False, source=source, key=key)
    if len(ds) == 0:
        raise DataError(
            f"{key} {source!r} yielded no documents (empty files are dropped; "
            f"max_document_bytes={cfg.max_document_bytes})"
        )
    return ds
