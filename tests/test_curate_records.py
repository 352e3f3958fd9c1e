"""Documents with ids: ``shard_records`` yields exactly the documents ``shard_documents``
yields, in the same order and number, for every kind of source, with the ids it promises."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.config import DataConfig
from data_prep.corpus import prepare_corpus, shard_documents, shard_records
from data_prep.sources import stdlib_files


def check_same(cfg: DataConfig, out: Path, id_field: str | None = None) -> list[str]:
    """Assert shard_records matches shard_documents shard by shard; return every id."""
    info = prepare_corpus(cfg, out)
    ids = []
    for shard in info.shards:
        texts = list(shard_documents(info, shard, cfg))
        records = list(shard_records(info, shard, cfg, id_field))
        assert [t for _, t in records] == texts
        ids += [i for i, _ in records]
    return ids


def test_jsonl_byte_ranges_ids_and_lines(tmp_path: Path) -> None:
    lines = []
    for i in range(300):
        record = {"text": f"document {i} " + "word " * (i % 17)}
        if i % 3 == 0:
            record["id"] = f"rec-{i}"
        if i % 50 == 7:
            record["text"] = ""  # dropped by both
        lines.append(json.dumps(record))
        if i % 40 == 5:
            lines.append("")  # a blank line: skipped, but counted in line numbers
    path = tmp_path / "src" / "a.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(lines) + "\n")
    cfg = DataConfig(source=str(path.parent), num_shards=4, max_document_bytes=60)
    ids = check_same(cfg, tmp_path / "out", id_field="id")
    assert len(prepare_corpus(cfg, tmp_path / "out2").pieces) == 4  # byte ranges of one file
    numbered = {i: n for n, i in enumerate(lines, start=1)}
    for doc_id in ids:
        if doc_id.startswith("rec-"):
            continue
        file, line = doc_id.rsplit(":", 1)
        assert file == str(path)
        assert "id" not in json.loads(lines[int(line) - 1])
    assert "rec-0" in ids and f"{path}:2" in ids and f"{path}:{numbered[lines[1]]}" in ids
    # without an id field every document is named by its line
    assert all(":" in i for i in check_same(cfg, tmp_path / "out3"))


def test_parquet_row_groups_and_null_ids(tmp_path: Path) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    for f in range(2):
        texts = [f"file {f} row {r} " + "x" * (r % 5) for r in range(120)]
        ids = [None if r % 4 == 0 else f"f{f}-r{r}" for r in range(120)]
        pq.write_table(pa.table({"text": texts, "uid": ids}), folder / f"part-{f}.parquet",
                       row_group_size=25)
    cfg = DataConfig(source=str(folder), num_shards=3)
    ids = check_same(cfg, tmp_path / "out", id_field="uid")
    assert ids[:2] == [f"{folder / 'part-0.parquet'}:0", "f0-r1"]
    assert f"{folder / 'part-1.parquet'}:100" in ids and len(ids) == 240


def test_text_files_and_json_arrays(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("a text file is one document")
    (folder / "b.txt").write_text("")  # empty: dropped
    (folder / "c.json").write_text(json.dumps([{"text": "first", "id": 7}, {"text": "second"}]))
    (folder / "d.json").write_text(json.dumps({"text": "one object"}))
    ids = check_same(DataConfig(source=str(folder), num_shards=2), tmp_path / "out", "id")
    assert ids == [str(folder / "a.txt"), "7", f"{folder / 'c.json'}:1", str(folder / "d.json")]


def test_stdlib_like_python_files(tmp_path: Path) -> None:
    folder = tmp_path / "py"
    folder.mkdir()
    for source in stdlib_files()[:12]:
        shutil.copy(source, folder / f"{source.stem}.txt")
    cfg = DataConfig(source=str(folder), num_shards=3, max_documents=10)
    ids = check_same(cfg, tmp_path / "out")
    assert len(ids) == 10 and ids == sorted(ids) and all(i.endswith(".txt") for i in ids)


def test_the_stdlib_source_itself(tmp_path: Path) -> None:
    cfg = DataConfig(source="stdlib", num_shards=2, max_documents=15)
    ids = check_same(cfg, tmp_path / "out")
    assert ids == [str(p) for p in stdlib_files()][: len(ids)] and len(ids) == 15


def test_saved_dataset_rows(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(30)],
                                     "key": [f"k{i}" if i % 2 else None for i in range(30)]})
    ds.save_to_disk(str(tmp_path / "ds"))
    ids = check_same(DataConfig(source=str(tmp_path / "ds"), num_shards=2), tmp_path / "out",
                     "key")
    assert ids[:3] == [f"{tmp_path / 'ds'}:0", "k1", f"{tmp_path / 'ds'}:2"]
