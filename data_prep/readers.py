"""Streaming readers of one input file: every reader holds a bounded window of the file.

- plain text (``.txt``, ``.py``): the file is one document, read in ``CHUNK_BYTES`` chunks
  through an incremental UTF-8 decoder; reading stops as soon as the document is known to
  be over ``data.max_document_bytes``, so a skipped giant file costs at most that much;
- JSON lines (``.jsonl``): line by line, optionally over a byte range ``[start, stop)``:
  the range starts at the first line boundary at or after ``start`` (a line that begins
  before ``start`` belongs to the range before) and ends with the line that holds byte
  ``stop - 1``, so ranges that tile a file read every line exactly once;
- ``.json``: a top-level array is streamed record by record (``json.JSONDecoder.raw_decode``
  over a refilled buffer); a single object is one record; anything else is read as JSON lines;
- parquet: only the text column, one row group at a time (``ParquetFile.iter_batches``);
- a ``save_to_disk`` directory: memory-mapped Arrow, read in row batches.

``.gz`` (gzip) and ``.zst`` (the ``zstandard`` package) after a text or JSON suffix are
decompressed as a stream. Errors are ``DataError`` naming the file (and line or record)
and what to fix.
"""
from __future__ import annotations

import codecs
import gzip
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from data_prep.errors import DataError

CHUNK_BYTES = 1 << 20
"""Bytes read per call from a file (text chunks, the JSON window's refill)."""
PARQUET_BATCH_ROWS = 1024
"""Rows per batch read from parquet (batches never cross a row group)."""
DATASET_BATCH_ROWS = 1024
"""Rows per batch read from a saved (Arrow) dataset."""
COMPRESSIONS = (".gz", ".zst")

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def open_binary(path: str | Path) -> IO[bytes]:
    """``path`` opened for buffered binary reading, decompressed when it ends in .gz or .zst."""
    path = Path(path)
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise DataError(
                f"{path}: reading .zst files needs the 'zstandard' package, which is not "
                "installed: pip install zstandard (or conda install -c conda-forge zstandard), "
                "or decompress the file"
            ) from None
        raw = open(path, "rb")  # noqa: SIM115  (closed with the reader: closefd)
        # Concatenated frames (as written by parallel compressors) are one stream.
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True,
                                                            closefd=True)
        return io.BufferedReader(reader, CHUNK_BYTES)
    return open(path, "rb", buffering=CHUNK_BYTES)  # noqa: SIM115


def _utf8_error(path: Path, offset: int, key: str) -> DataError:
    return DataError(f"{path}: not valid UTF-8 (byte {offset}): convert the file to UTF-8 "
                     f"or remove it from {key}")


def read_text_document(path: str | Path, key: str, max_bytes: int | None = None) -> str | None:
    """The whole file as one document, or None when it has more than ``max_bytes`` bytes.

    Read in ``CHUNK_BYTES`` chunks: the bytes are never held beside the whole text, and an
    oversized document is abandoned at the limit. Invalid UTF-8 is a DataError (``key``, the
    config key of the source, names where to remove the file from).
    """
    path = Path(path)
    decoder = codecs.getincrementaldecoder("utf-8")()
    parts: list[str] = []
    consumed = 0
    with open_binary(path) as handle:
        while True:
            chunk = handle.read(CHUNK_BYTES)
            pending = len(decoder.getstate()[0])
            try:
                parts.append(decoder.decode(chunk, final=not chunk))
            except UnicodeDecodeError as err:
                raise _utf8_error(path, consumed - pending + err.start, key) from None
            if not chunk:
                break
            consumed += len(chunk)
            if max_bytes is not None and consumed > max_bytes:
                return None
    return "".join(parts)


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


def _json_record(path: Path, line: str, lineno: int, key: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{lineno}: malformed JSON line ({err.msg} at column "
                        f"{err.colno}): fix the line or remove the file from {key}") from None


def _json_line(path: Path, line: str, lineno: int, field: str, key: str) -> str:
    return record_text(_json_record(path, line, lineno, key), field, f"{path}:{lineno}")


def record_id(record: object, id_field: str | None) -> str | None:
    """The record's ``id_field`` as a string, or None when unset, absent or null."""
    if id_field is None or not isinstance(record, dict):
        return None
    value = record.get(id_field)
    return None if value is None else str(value)


def json_line_texts(path: Path, text: str, field: str, key: str) -> Iterator[str]:
    """The ``field`` of every JSON line of ``text`` (already read from ``path``; blank lines
    skipped); a malformed line or record is a DataError naming its line and the fix."""
    for lineno, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            yield _json_line(path, line, lineno, field, key)


def _jsonl_lines(path: Path, key: str, start: int,
                 stop: int | None) -> Iterator[tuple[int, int, str]]:
    """(line number counted from the range's first line (1-based), the range's first byte,
    line) of every non-blank line whose first byte lies in ``[start, stop)``."""
    lineno = 1
    with open_binary(path) as handle:
        pos = 0
        if start > 0:
            # The line holding byte start - 1 belongs to the range before (it ends at or
            # after start - 1): skip through its newline.
            handle.seek(start - 1)
            pos = start - 1 + len(handle.readline())
        first = pos
        while stop is None or pos < stop:
            raw = handle.readline()
            if not raw:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _utf8_error(path, pos + err.start, key) from None
            pos += len(raw)
            if line.strip():
                yield lineno, first, line
            lineno += 1


def iter_jsonl(path: str | Path, field: str, key: str, start: int = 0,
               stop: int | None = None) -> Iterator[str]:
    """The ``field`` of every JSON line whose first byte lies in ``[start, stop)``.

    Line by line: memory is one line. ``start``/``stop`` are offsets into the (decompressed)
    stream; compressed files are read whole (``start`` 0, ``stop`` None), since they cannot
    be entered in the middle. A bad line's error names its line number in the file: for a
    range that starts inside the file, the lines before it are counted then, on the error
    path only.
    """
    path = Path(path)
    for lineno, first, line in _jsonl_lines(path, key, start, stop):
        try:
            text = _json_line(path, line, lineno, field, key)
        except DataError:
            if first > 0:  # raise again with the line's number in the whole file
                _json_line(path, line, _lines_before(path, first) + lineno, field, key)
            raise
        yield text


def iter_jsonl_records(path: str | Path, field: str, key: str, start: int = 0,
                       stop: int | None = None,
                       id_field: str | None = None) -> Iterator[tuple[str, str]]:
    """(document id, ``field``) of every JSON line of ``[start, stop)``, as ``iter_jsonl``.

    The id is the record's ``id_field`` when set and present, else ``<path>:<line>`` with
    the 1-based line number in the whole file (for a range inside the file, the lines
    before it are counted once, when the first record without an id needs it).
    """
    path = Path(path)
    before: int | None = None

    def absolute(lineno: int, first: int) -> int:
        nonlocal before
        if before is None:
            before = _lines_before(path, first)
        return before + lineno

    for lineno, first, line in _jsonl_lines(path, key, start, stop):
        try:
            record = _json_record(path, line, lineno, key)
        except DataError:
            if first > 0:  # raise again with the line's number in the whole file
                _json_record(path, line, absolute(lineno, first), key)
            raise
        doc_id = record_id(record, id_field)
        where = f"{path}:{absolute(lineno, first)}" if doc_id is None else None
        yield doc_id or where, record_text(record, field, where or f"{path}: record {doc_id}")


def _lines_before(path: Path, offset: int) -> int:
    """Newlines in the first ``offset`` bytes of an uncompressed file."""
    count = 0
    with open(path, "rb") as handle:
        while offset > 0:
            block = handle.read(min(offset, CHUNK_BYTES))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count


class _JsonWindow:
    """A refilled text window over a binary stream, for decoding one JSON value at a time."""

    def __init__(self, handle: IO[bytes], path: Path, key: str) -> None:
        self.handle, self.path, self.key = handle, path, key
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos, self.eof, self.consumed = "", 0, False, 0

    def more(self, size: int = CHUNK_BYTES) -> bool:
        """Append up to ``size`` more bytes; False at the end of the stream."""
        if self.eof:
            return False
        chunk = self.handle.read(size)
        pending = len(self.decoder.getstate()[0])
        try:
            text = self.decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError as err:
            raise _utf8_error(self.path, self.consumed - pending + err.start, self.key) from None
        self.consumed += len(chunk)
        self.buf, self.pos = self.buf[self.pos:] + text, 0  # drop what was decoded already
        self.eof = not chunk
        return bool(chunk)

    def peek(self) -> str | None:
        """The next character that is not JSON whitespace (not consumed); None at the end."""
        while True:
            self.pos = _WHITESPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return None

    def value(self, where: str) -> object:
        """Decode the next JSON value; the window grows (doubling) until the value fits."""
        size = CHUNK_BYTES
        self.peek()  # raw_decode does not skip leading whitespace
        while True:
            try:
                obj, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as err:
                if self.more(size):
                    size *= 2
                    continue
                raise DataError(f"{where}: malformed JSON ({err.msg}): fix the file or remove "
                                f"it from {self.key}") from None
            self.pos = end
            return obj


def iter_json(path: str | Path, field: str, key: str) -> Iterator[str]:
    """The records of a ``.json`` file: a top-level array streamed element by element, a
    single object as one record, and otherwise the file read as JSON lines."""
    for _, text in iter_json_records(path, field, key):
        yield text


def iter_json_records(path: str | Path, field: str, key: str,
                      id_field: str | None = None) -> Iterator[tuple[str, str]]:
    """(document id, ``field``) of the records of a ``.json`` file, as ``iter_json``. The id
    is the record's ``id_field`` when set and present, else ``<path>:<index>`` (0-based) for
    an array element, ``<path>`` for a single object, ``<path>:<line>`` for JSON lines."""
    path = Path(path)
    with open_binary(path) as handle:
        window = _JsonWindow(handle, path, key)
        first = window.peek()
        if first is None:
            return
        if first == "[":
            window.pos += 1
            index = 0
            if window.peek() == "]":
                window.pos += 1
            else:
                while True:
                    where = f"{path}: record [{index}]"
                    record = window.value(where)
                    yield (record_id(record, id_field) or f"{path}:{index}",
                           record_text(record, field, where))
                    index += 1
                    sep = window.peek()
                    window.pos += 1
                    if sep == "]":
                        break
                    if sep != ",":
                        raise DataError(f"{where}: malformed JSON (expected ',' or ']' after the "
                                        f"record): fix the file or remove it from {key}")
            if window.peek() is not None:
                raise DataError(f"{path}: data after the closing ']' of its JSON array: a .json "
                                "file holds one array, one object or JSON lines")
            return
        try:
            whole = window.value(str(path))
            single = window.peek() is None
        except DataError:
            single = False  # not one JSON value: JSON lines (named line by line below)
        if single:
            yield record_id(whole, id_field) or str(path), record_text(whole, field, str(path))
            return
    yield from iter_jsonl_records(path, field, key, id_field=id_field)


def _string_column_error(where: str, field: str, names: list[str], kind: object) -> DataError:
    if kind is None:
        return DataError(f"{where}: no column {field!r} (columns: {', '.join(names[:10])}); "
                         "set data.text_field")
    return DataError(f"{where}: column {field!r} has type {kind}, expected strings")


def _is_string(kind: object) -> bool:
    import pyarrow as pa

    checks = [pa.types.is_string, pa.types.is_large_string]
    if hasattr(pa.types, "is_string_view"):
        checks.append(pa.types.is_string_view)
    return any(check(kind) for check in checks)


def parquet_row_groups(path: str | Path) -> list[int]:
    """Rows per row group, from the file's footer only."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


def _checked_texts(texts: list, where: str, first: int, field: str) -> list[str]:
    for offset, text in enumerate(texts):
        if not isinstance(text, str):
            raise DataError(f"{where}: record {first + offset} field {field!r} is "
                            f"{type(text).__name__}, expected a string")
    return texts


def _parquet_batches(path: Path, field: str, row_groups: list[int] | None, first_row: int,
                     id_field: str | None = None) -> Iterator[tuple[int, list[str], list | None]]:
    """(file row of the batch's first row, texts, ids or None) per batch of ``field`` (and
    ``id_field`` when the file has that column)."""
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(path)
    schema = handle.schema_arrow
    names = list(schema.names)
    kind = schema.field(field).type if field in names else None
    if kind is None or not _is_string(kind):
        raise _string_column_error(str(path), field, names, kind)
    columns = [field, id_field] if id_field in names and id_field != field else [field]
    row = first_row
    for batch in handle.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=row_groups,
                                     columns=columns):
        texts = _checked_texts(batch.column(0).to_pylist(), str(path), row, field)
        yield row, texts, batch.column(1).to_pylist() if len(columns) > 1 else None
        row += len(texts)


def iter_parquet(path: str | Path, field: str, row_groups: list[int] | None = None,
                 first_row: int = 0) -> Iterator[str]:
    """The ``field`` column of row groups ``row_groups`` (all when None), in order.

    One row group's column at most is decoded at a time. ``first_row`` is the file row
    index of the first row read (for error messages); a null is a DataError.
    """
    for _, texts, _ in _parquet_batches(Path(path), field, row_groups, first_row):
        yield from texts


def _with_ids(where: str, row: int, texts: list[str],
              ids: list | None) -> Iterator[tuple[str, str]]:
    """(id, text) of one batch: the id column's value, else ``<where>:<row>``."""
    for offset, text in enumerate(texts):
        value = None if ids is None else ids[offset]
        yield (f"{where}:{row + offset}" if value is None else str(value)), text


def iter_parquet_records(path: str | Path, field: str, row_groups: list[int] | None = None,
                         first_row: int = 0,
                         id_field: str | None = None) -> Iterator[tuple[str, str]]:
    """(document id, ``field``) of the rows ``iter_parquet`` reads: the id is the row's
    ``id_field`` when the file has that column and the value is not null, else
    ``<path>:<row>`` (0-based row of the file)."""
    for row, texts, ids in _parquet_batches(Path(path), field, row_groups, first_row, id_field):
        yield from _with_ids(str(path), row, texts, ids)


def open_saved_dataset(path: str | Path, key: str):
    """A ``save_to_disk`` directory as a memory-mapped Dataset (a DatasetDict's ``train``)."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{key}: {path}: saved DatasetDict has no 'train' split "
                            f"({list(loaded)})")
        loaded = loaded["train"]
    return loaded


def _dataset_batches(path: str | Path, field: str, key: str, start: int, stop: int | None,
                     id_field: str | None = None
                     ) -> Iterator[tuple[int, list[str], list | None]]:
    """(row of the batch's first row, texts, ids or None) per ``DATASET_BATCH_ROWS`` rows."""
    import datasets

    ds = open_saved_dataset(path, key)
    where = f"{key}: {path}"
    if field not in ds.column_names:
        raise _string_column_error(where, field, list(ds.column_names), None)
    feature = ds.features[field]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise _string_column_error(where, field, list(ds.column_names), feature)
    with_id = id_field in ds.column_names and id_field != field
    ds = ds.select_columns([field, id_field] if with_id else [field])
    stop = len(ds) if stop is None else stop
    for begin in range(start, stop, DATASET_BATCH_ROWS):
        rows = ds[begin : min(stop, begin + DATASET_BATCH_ROWS)]
        yield (begin, _checked_texts(rows[field], where, begin, field),
               rows[id_field] if with_id else None)


def iter_dataset(path: str | Path, field: str, key: str, start: int = 0,
                 stop: int | None = None) -> Iterator[str]:
    """The ``field`` of rows ``[start, stop)`` of a saved dataset, ``DATASET_BATCH_ROWS`` at
    a time from the memory-mapped Arrow files."""
    for _, texts, _ in _dataset_batches(path, field, key, start, stop):
        yield from texts


def iter_dataset_records(path: str | Path, field: str, key: str, start: int = 0,
                         stop: int | None = None,
                         id_field: str | None = None) -> Iterator[tuple[str, str]]:
    """(document id, ``field``) of the rows ``iter_dataset`` reads: the row's ``id_field``
    when the dataset has that column and the value is not null, else ``<path>:<row>``."""
    for row, texts, ids in _dataset_batches(path, field, key, start, stop, id_field):
        yield from _with_ids(str(path), row, texts, ids)
