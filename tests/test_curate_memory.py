"""What keeps a curate task's memory down: no pandas or matplotlib imported by the signals
task or the final step, Arrow columns built and read without them, and py3langid's
model loaded without a second copy, answering as py3langid's own loader does."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_prep.curate import arrow
from data_prep.curate.language import identifier
from tests.curatekit import GERMAN, LEAK, PROSE

ROOT = Path(__file__).resolve().parents[1]

TASKS_SCRIPT = """
import sys
from pathlib import Path
from data_prep.curate import curate_corpus
from tests.curatekit import planted_corpus, signal_files
root = Path(sys.argv[1])
planted = planted_corpus(root)
paths, info = signal_files(planted, root / "out")
summary = curate_corpus(paths, planted.curate, planted.data, root / "out", info)
print(summary["removed_documents"], len(planted.expected))
print(sorted(m for m in ("pandas", "matplotlib") if m in sys.modules))
"""


def test_the_signal_tasks_and_the_final_step_import_neither_pandas_nor_matplotlib(
        tmp_path: Path) -> None:
    """pyarrow imports pandas (48 MB) on its first ``pa.array`` or ``to_numpy`` and the
    chart needs matplotlib (36 MB): a curate task does neither."""
    out = subprocess.run([sys.executable, "-c", TASKS_SCRIPT, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    counts, imported = out.stdout.strip().splitlines()[-2:]
    removed, planted = counts.split()
    assert removed == planted  # the planted documents, each removed
    assert imported == "[]"


def test_columns_round_trip_through_parquet_with_nulls(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.string()), ("source", pa.string()),
                        ("shard", pa.int32()), ("index", pa.int64()),
                        ("score", pa.float32()), ("hash", pa.uint64()),
                        ("tasks", pa.list_(pa.string()))])
    rows = [{"id": "ä-1", "source": None, "shard": 3, "index": 0, "score": 0.5,
             "hash": 2**64 - 1, "tasks": []},
            {"id": "b", "source": "web", "shard": -1, "index": 2**40, "score": -1.25,
             "hash": 7, "tasks": ["riddles", "gsm8k"]},
            {"id": "", "source": "docs", "shard": 0, "index": 5, "score": 3.0, "hash": 0,
             "tasks": ["x"]}]
    columns = arrow.Columns(schema)
    for row in rows[:2]:
        columns.append(row)
    assert len(columns) == 2
    first = columns.take()
    assert len(columns) == 0  # empty again, the first table untouched
    path = tmp_path / "t.parquet"
    with pq.ParquetWriter(path, schema) as writer:
        writer.write_table(first)
        writer.write_table(arrow.table(rows[2:], schema))
    read = pq.read_table(path)  # pyarrow's own reader
    assert read.to_pylist() == rows
    mine = arrow.read(path, ["hash", "score", "id"])
    assert mine.column_names == ["hash", "score", "id"]
    assert arrow.numbers(mine.column("hash")).tolist() == [2**64 - 1, 7, 0]
    assert arrow.numbers(mine.column("hash")).dtype == np.uint64
    assert arrow.numbers(mine.column("score")).tolist() == [0.5, -1.25, 3.0]


def test_numbers_of_a_sliced_column_with_nulls_are_nan_there() -> None:
    chunked = pa.chunked_array([pa.array([1, None, 3, 4], pa.int64()).slice(1),
                                pa.array([], pa.int64()), pa.array([9], pa.int64())])
    values = arrow.numbers(chunked)
    assert math.isnan(values[0]) and values[1:].tolist() == [3.0, 4.0, 9.0]
    assert arrow.numbers(pa.array([2.5], pa.float32())).tolist() == [2.5]
    assert arrow.numbers([1, 2]).tolist() == [1, 2]


def test_the_language_model_is_py3langids_own_and_answers_the_same() -> None:
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    ours, theirs = identifier(), LanguageIdentifier.from_model_file(MODEL_FILE,
                                                                    norm_probs=True)
    assert list(ours.tk_nextmove) == list(theirs.tk_nextmove)
    assert list(ours.tk_row) == list(theirs.tk_row)
    assert list(ours.tk_output) == list(theirs.tk_output)
    assert list(ours._rowbase) == list(theirs._rowbase)
    assert ours.nb_classes == theirs.nb_classes
    assert np.array_equal(ours.nb_ptc, theirs.nb_ptc)
    assert np.array_equal(ours.nb_pc, theirs.nb_pc)
    for text in (GERMAN, LEAK, *PROSE[:20], "", "日本語のテキストです。"):
        assert ours.classify(text) == theirs.classify(text)
    assert ours.classify(GERMAN)[0] == "de"
