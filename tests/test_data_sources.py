"""Sources: every supported kind of data.source, the limits, and each bad input."""
from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.config import DataConfig
from data_prep.corpus import source_documents
from data_prep.errors import DataError
from data_prep.sources import stdlib_files


@pytest.fixture(autouse=True)
def _hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def texts(source: str | Path, tmp: Path, **kw) -> list[str]:
    return list(source_documents(DataConfig(source=str(source), **kw), tmp / "stage"))


def test_txt_directory_one_file_per_document_sorted(tmp_path: Path) -> None:
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("second\nfile\n")
    (d / "a.txt").write_text("first file")
    (d / "sub" / "c.txt").write_text("third ü")
    (d / "empty.txt").write_text("")
    (d / "notes.md").write_text("ignored: not a supported suffix")
    assert texts(d, tmp_path) == ["first file", "second\nfile\n", "third ü"]
    assert texts(d / "b.txt", tmp_path) == ["second\nfile\n"]
    assert texts(f"{d}/**/*.txt", tmp_path) == ["first file", "second\nfile\n", "third ü"]


def test_jsonl_json_and_text_field(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"body": "one", "id": 1}\n\n{"body": "two"}\n')
    (tmp_path / "b.json").write_text(json.dumps([{"body": "three"}, {"body": "four"}]))
    got = texts(tmp_path / "*.json*", tmp_path, text_field="body")
    assert got == ["one", "two", "three", "four"]


def test_parquet_and_saved_dataset(tmp_path: Path) -> None:
    pq.write_table(pa.table({"content": ["p1", "p2", ""], "n": [1, 2, 3]}), tmp_path / "x.parquet")
    assert texts(tmp_path / "x.parquet", tmp_path, text_field="content") == ["p1", "p2"]
    datasets.Dataset.from_dict({"text": ["s1", "s2", "s3"]}).save_to_disk(str(tmp_path / "saved"))
    assert texts(tmp_path / "saved", tmp_path) == ["s1", "s2", "s3"]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["d1"]})}).save_to_disk(
        str(tmp_path / "saved_dict"))
    assert texts(tmp_path / "saved_dict", tmp_path) == ["d1"]


def test_stdlib_corpus_is_sorted_and_limited(tmp_path: Path) -> None:
    files = stdlib_files()
    assert len(files) > 500 and files == sorted(files)
    assert not any("site-packages" in p.parts for p in files)
    got = texts("stdlib", tmp_path, max_documents=5)
    expected = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if text:
            expected.append(text)
        if len(expected) == 5:
            break
    assert got == expected
    assert texts("stdlib", tmp_path / "again", max_documents=5) == got


def test_limits(tmp_path: Path) -> None:
    d = tmp_path / "c"
    d.mkdir()
    for i, size in enumerate([10, 500, 20, 30, 40]):
        (d / f"{i}.txt").write_text("x" * size)
    assert [len(t) for t in texts(d, tmp_path, max_document_bytes=100)] == [10, 20, 30, 40]
    assert [len(t) for t in texts(d, tmp_path, max_document_bytes=100, max_documents=2)] == [10, 20]
    pq.write_table(pa.table({"text": ["a" * 10, "b" * 500, "c" * 5]}), tmp_path / "p.parquet")
    got = texts(tmp_path / "p.parquet", tmp_path, max_document_bytes=100, max_documents=1)
    assert got == ["a" * 10]


def test_empty_corpus(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    (d / "a.txt").write_text("")
    with pytest.raises(DataError, match="no documents"):
        texts(d, tmp_path)
    (d / "b.txt").write_text("x" * 50)
    with pytest.raises(DataError, match="no documents"):
        texts(d, tmp_path, max_document_bytes=10)
    (tmp_path / "nothing_here").mkdir()
    with pytest.raises(DataError, match="has no .txt"):
        texts(tmp_path / "nothing_here", tmp_path)


def test_non_utf8_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 latin-1")
    with pytest.raises(DataError, match=r"bad\.txt.*not valid UTF-8"):
        texts(tmp_path, tmp_path)


def test_malformed_json_line_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"c\.jsonl:3: malformed JSON"):
        texts(tmp_path / "c.jsonl", tmp_path)


def test_missing_text_field_and_non_string(tmp_path: Path) -> None:
    (tmp_path / "m.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError,
                       match=r"m\.jsonl:2: record has no field 'text'.*data\.text_field"):
        texts(tmp_path / "m.jsonl", tmp_path)
    (tmp_path / "n.jsonl").write_text('{"text": "ok"}\n{"text": ["a", "list"]}\n')
    with pytest.raises(DataError, match=r"n\.jsonl:2: field 'text' is list, expected a string"):
        texts(tmp_path / "n.jsonl", tmp_path)
    (tmp_path / "r.json").write_text(json.dumps([{"text": "a"}, {"text": 7}]))
    with pytest.raises(DataError, match=r"r\.json: record \[1\]: field 'text' is int"):
        texts(tmp_path / "r.json", tmp_path)
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"no column 'text' \(columns: body\)"):
        texts(tmp_path / "p.parquet", tmp_path)
    (tmp_path / "q").mkdir()
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "q" / "q.parquet")
    with pytest.raises(DataError, match=r"record 1 field 'text' is NoneType"):
        texts(tmp_path / "q" / "q.parquet", tmp_path)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "i.parquet")
    with pytest.raises(DataError, match=r"column 'text' has type .*int64.*expected strings"):
        texts(tmp_path / "i.parquet", tmp_path)


def test_unusable_sources(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        texts(tmp_path / "missing", tmp_path)
    with pytest.raises(DataError, match="matched no files"):
        texts(tmp_path / "*.nothing", tmp_path)
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        texts(tmp_path / "x.csv", tmp_path)


def test_a_hub_source_streams_only_its_budget(tmp_path: Path, monkeypatch) -> None:
    """``hf:`` sources are always streamed, never downloaded whole: with
    ``data.max_documents`` only that many documents are read from the stream (the hub, which
    tests cannot reach, is stood in for by a local stream of 1,000 rows)."""
    from data_prep import sources

    pulled = []

    def rows():
        for i in range(1000):
            pulled.append(i)
            yield {"text": f"document {i}", "other": i}

    def load_dataset(name, split, streaming=False, cache_dir=None):
        assert (name, split, streaming) == ("org/corpus", "train", True)
        return datasets.IterableDataset.from_generator(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    saved = sources._hub_dataset("hf:org/corpus", DataConfig(max_documents=5), tmp_path,
                                 "source", "data.source")
    ds = datasets.load_from_disk(str(saved))
    assert ds["text"] == [f"document {i}" for i in range(5)] and ds.column_names == ["text"]
    assert len(pulled) < 50  # the stream stopped at the budget (plus its read-ahead)
    assert not (tmp_path / "hf_cache").exists()
