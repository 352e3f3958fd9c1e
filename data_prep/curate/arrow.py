"""Arrow columns to and from Python and numpy values, without pyarrow's pandas shim.

pyarrow imports pandas (about 48 MB resident) the first time ``pa.array``,
``Array.to_numpy`` or ``pq.read_table`` runs, to ask whether its input is a pandas object,
and no setting turns that off (pyarrow 15-25). The curate tasks run one per core on a
node and their peak memory is the stage's budget (benchmarks/bench_curate.py), so they
build their columns from buffers, read files through ``ParquetFile`` and view numeric
columns as numpy arrays here. ``tests/test_curate_memory.py`` checks that a signals task
and the final step leave pandas unimported.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_TYPECODES = {"float": "f", "double": "d", "int32": "i", "int64": "q", "uint64": "Q"}
"""``array`` typecodes of the numeric Arrow types the curate files use (the sizes match
on Linux and macOS; ``Columns`` checks)."""


def _validity(values: Sequence[Any]) -> tuple[Any, int]:
    """(validity bitmap buffer or None, null count) of ``values`` (None is null)."""
    import pyarrow as pa

    valid = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
    nulls = len(values) - int(valid.sum())
    if not nulls:
        return None, 0
    return pa.py_buffer(np.packbits(valid, bitorder="little")), nulls


def _numpy_dtype(type_: Any) -> np.dtype:
    """The numpy dtype of an Arrow integer or floating type."""
    import pyarrow as pa

    for test, kind in ((pa.types.is_floating, "f"), (pa.types.is_signed_integer, "i"),
                       (pa.types.is_unsigned_integer, "u")):
        if test(type_):
            return np.dtype(f"{kind}{type_.bit_width // 8}")
    raise TypeError(f"not a numeric Arrow type: {type_}")


def _text_column(values: Sequence[Any], type_: Any) -> Any:
    """An Arrow string, or list of string, array of ``values`` (None: null)."""
    import pyarrow as pa

    validity, nulls = _validity(values)
    count = len(values)
    offsets = np.zeros(count + 1, dtype=np.int32)
    if pa.types.is_string(type_):
        encoded = [b"" if v is None else v.encode("utf-8", "surrogatepass") for v in values]
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        return pa.Array.from_buffers(type_, count, [validity, pa.py_buffer(offsets),
                                                    pa.py_buffer(b"".join(encoded))], nulls)
    if pa.types.is_list(type_) and pa.types.is_string(type_.value_type):
        items = [[] if v is None else v for v in values]
        np.cumsum([len(v) for v in items], out=offsets[1:])
        child = _text_column([x for v in items for x in v], type_.value_type)
        return pa.Array.from_buffers(type_, count, [validity, pa.py_buffer(offsets)], nulls,
                                     children=[child])
    raise TypeError(f"no column of Arrow type {type_} here")


class Columns:
    """Rows of a schema appended one at a time and held a column at a time: numbers in
    typed arrays (their size a value, not a Python object each), strings and lists of
    strings in lists. Numeric values may not be None."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema
        self._numeric = {f.name: _TYPECODES.get(str(f.type)) for f in schema}
        for field in schema:
            code = self._numeric[field.name]
            if code is not None and array(code).itemsize * 8 != field.type.bit_width:
                raise TypeError(f"array({code!r}) does not hold {field.type} here")
        self._stores: dict[str, Any] = {}
        self._reset()

    def _reset(self) -> None:
        self._stores = {name: array(code) if code else [] for name, code
                        in self._numeric.items()}

    def __len__(self) -> int:
        return len(next(iter(self._stores.values()), ()))

    def append(self, row: dict[str, Any]) -> None:
        """Add one row (every field of the schema a key)."""
        for name, store in self._stores.items():
            store.append(row[name])

    def take(self) -> Any:
        """The rows held, as an Arrow table; the columns start empty again."""
        import pyarrow as pa

        count, arrays = len(self), []
        for field in self.schema:
            store = self._stores[field.name]
            if self._numeric[field.name]:  # the Arrow array shares the store's memory
                arrays.append(pa.Array.from_buffers(field.type, count,
                                                    [None, pa.py_buffer(store)]))
            else:
                arrays.append(_text_column(store, field.type))
        self._reset()
        return pa.Table.from_arrays(arrays, schema=self.schema)


def table(rows: Sequence[dict[str, Any]], schema: Any) -> Any:
    """An Arrow table of ``schema`` from row dicts (every field a key of every row)."""
    columns = Columns(schema)
    for row in rows:
        columns.append(row)
    return columns.take()


def read(path: str | Path, columns: Sequence[str]) -> Any:
    """The ``columns`` of the parquet file ``path`` as an Arrow table."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as handle:
        return handle.read(columns=list(columns))


def numbers(values: Any) -> np.ndarray:
    """A numeric Arrow column (Array or ChunkedArray) as a numpy array of its own type;
    a column with nulls as float64 with NaN for them. Anything else goes through
    ``np.asarray``."""
    chunks = getattr(values, "chunks", None)
    if chunks is None:
        if not hasattr(values, "buffers"):
            return np.asarray(values)
        chunks = [values]
    dtype = _numpy_dtype(values.type)
    parts = []
    for chunk in chunks:
        if not len(chunk):
            continue
        end = chunk.offset + len(chunk)
        validity, data = chunk.buffers()[:2]
        part = np.frombuffer(data, dtype=dtype, count=end)[chunk.offset:]
        if chunk.null_count:
            valid = np.unpackbits(np.frombuffer(validity, dtype=np.uint8), count=end,
                                  bitorder="little")[chunk.offset:].astype(bool)
            part = np.where(valid, part.astype(np.float64), np.nan)
        parts.append(part)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
