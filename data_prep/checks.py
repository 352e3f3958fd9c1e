"""Cheap checks of the tokenize inputs, made before any work is started.

``check_sources`` looks at every local source of ``data.source`` / ``data.sources`` without
loading it: the path exists, a directory holds supported files, not every file is empty
(0 bytes), text and JSON files start as UTF-8 (the first ``SNIFF_BYTES`` of each of the
first ``SNIFF_FILES`` files), the first record of a JSON file is an object with
``data.text_field``, and a parquet file's schema has that column. ``check_tokenizer`` loads
``tokenizer.path`` (when set) and checks that its ids fit ``data.token_dtype``.

Each check raises ``DataError`` naming the file, the config key and the fix. They read only
the start of each file, so the tokenize stage keeps its own checks of the whole input.
'stdlib', hub datasets (``hf:``) and ``save_to_disk`` directories are left to the stage.
"""
from __future__ import annotations

import codecs
import json
from pathlib import Path

from data_prep.config import DataConfig, TokenizerConfig
from data_prep.errors import DataError
from data_prep.readers import open_binary
from data_prep.sources import (
    expand_files,
    file_kind,
    is_saved_dataset,
    json_line_texts,
    record_text,
)
from data_prep.tokenizer import load_tokenizer, token_dtype

SNIFF_BYTES = 64 * 1024
"""Bytes read from the start of each file (UTF-8 check and first JSON record)."""
SNIFF_FILES = 256
"""Files of one source sniffed (in sorted path order); all are stat-ed."""


def check_sources(cfg: DataConfig) -> None:
    """Check every source of ``cfg`` (``data.source`` or each of ``data.sources``)."""
    for label, spec in cfg.labelled_sources():
        check_source(cfg, spec, "data.source" if label is None else f"data.sources.{label}")


def check_source(cfg: DataConfig, source: str, key: str) -> None:
    """Check one source, named in errors by its config key ``key``."""
    if source == "stdlib" or source.startswith("hf:") or is_saved_dataset(Path(source)):
        return
    files = expand_files(source, key)
    parquet = [p for p in files if file_kind(p) == "parquet"]
    if parquet and len(parquet) != len(files):
        raise DataError(f"{key} {source!r} mixes parquet and text/json files; point it at one "
                        "kind")
    sizes = [_size(p, key) for p in files]
    if not any(sizes):
        what = "is empty (0 bytes)" if len(files) == 1 else f"has only empty (0-byte) files " \
               f"({len(files)}, first {files[0]})"
        raise DataError(f"{key} {source!r} {what}: there is no text to tokenize; point {key} "
                        "at files with documents in them")
    for path, size in list(zip(files, sizes, strict=True))[:SNIFF_FILES]:
        kind = file_kind(path)
        if kind == "parquet":
            _check_parquet(path, cfg.text_field, key)
        elif size:
            head, complete = _head(path, size, key)
            _check_utf8(path, head, complete, key)
            if kind in ("json", "jsonl"):
                _check_first_record(path, head.decode("utf-8", errors="ignore"), complete,
                                    cfg.text_field, key)


def check_tokenizer(cfg: TokenizerConfig, data: DataConfig) -> int:
    """Load ``tokenizer.path`` (when set) and check its ids fit ``data.token_dtype``; return
    the vocabulary size the store will have (``tokenizer.vocab_size`` when one is trained)."""
    vocab = cfg.vocab_size
    if cfg.path:
        vocab = load_tokenizer(cfg.path, cfg.eos_token).get_vocab_size()
    token_dtype(vocab, data.token_dtype)
    return vocab


def _size(path: Path, key: str) -> int:
    try:
        return path.stat().st_size
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err}): fix it or remove it "
                        f"from {key}") from None


def _head(path: Path, size: int, key: str) -> tuple[bytes, bool]:
    """The first SNIFF_BYTES (decompressed) and whether that is the whole file."""
    try:
        with open_binary(path) as handle:
            head = handle.read(SNIFF_BYTES + 1)
        return head[:SNIFF_BYTES], len(head) <= SNIFF_BYTES
    except (OSError, EOFError) as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err}): fix its permissions "
                        f"or remove it from {key}") from None


def _check_parquet(path: Path, field: str, key: str) -> None:
    """The file is parquet (its footer reads) and has the text column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except (OSError, ValueError, pa.ArrowException) as err:
        raise DataError(f"{path}: not a readable parquet file ({err}): rewrite it or remove it "
                        f"from {key}") from None
    if field not in names:
        raise DataError(f"{path}: no column {field!r} (columns: {', '.join(names[:10])}); set "
                        "data.text_field")


def _check_utf8(path: Path, head: bytes, complete: bool, key: str) -> None:
    """The sniffed bytes decode as UTF-8 (a character cut off at the end is allowed)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=complete)
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path}: not UTF-8 text (invalid byte at offset {err.start}; a binary or "
            f"differently encoded file?): convert it to UTF-8 or remove it from {key}"
        ) from None


def _check_first_record(path: Path, text: str, complete: bool, field: str, key: str) -> None:
    """The first record is an object with ``field``, read as the stage reads the file: a
    .json file as one document (a list of records or one record) and otherwise, like every
    .jsonl file, as JSON lines. A first record longer than the sniffed text is not judged."""
    if file_kind(path) == "json":
        if complete:
            try:
                whole = json.loads(text)
            except json.JSONDecodeError:
                whole = None  # the stage then reads it as JSON lines, as below
            if isinstance(whole, list):
                if whole:
                    record_text(whole[0], field, f"{path}: record [0]")
                return
            if whole is not None:
                record_text(whole, field, str(path))
                return
        else:
            body = text.lstrip()
            listed = body.startswith("[")
            try:
                record, _ = json.JSONDecoder().raw_decode(body[1:].lstrip() if listed else body)
            except json.JSONDecodeError:
                return  # the first record goes on past the sniffed bytes
            record_text(record, field, f"{path}: record [0]" if listed else str(path))
            return
    if not complete:
        text = text[: text.rfind("\n") + 1]  # whole lines only
    next(json_line_texts(path, text, field, key), None)  # the first record only
