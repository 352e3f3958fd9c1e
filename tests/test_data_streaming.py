"""Streaming sources: byte ranges of JSON lines, compressed files, metadata fingerprints,
bounded reader memory, and the same tokens as the whole-file readers gave."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep import readers
from data_prep.config import DataConfig
from data_prep.corpus import prepare_corpus, saved_corpus, shard_documents, source_documents
from data_prep.errors import DataError
from data_prep.sources import describe_source, plan_pieces
from data_prep.store import SplitReader, open_store
from stages.tokenize import work as tokenize
from tests.test_data_common import make_cfg, make_corpus

REPO = Path(__file__).resolve().parents[1]


class NullTracker:
    """A tracker that records nothing (the stage functions only call its methods)."""

    def set_tags(self, *args, **kwargs) -> None: ...
    def log_metrics(self, *args, **kwargs) -> None: ...
    def log_artifact(self, *args, **kwargs) -> None: ...
    def flush(self) -> None: ...


@pytest.fixture(autouse=True)
def _hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def jsonl_lines(n: int, seed: int = 0) -> list[str]:
    """JSON lines of varied length (multi-byte characters, blank lines, an empty text)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        if i % 7 == 3:
            lines.append("\n")
        words = ["ü", "river", "日本", "a", "b\nc"]
        text = " ".join(rng.choice(words) for _ in range(rng.randint(0, 30)))
        lines.append(json.dumps({"text": text, "i": i}, ensure_ascii=i % 2 == 0) + "\n")
    return lines


def test_byte_ranges_read_every_line_once(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    lines = jsonl_lines(60)
    path.write_text("".join(lines), encoding="utf-8")
    whole = list(readers.iter_jsonl(path, "text", "data.source"))
    expected = [json.loads(x)["text"] for x in lines if x.strip()]
    assert whole == expected
    size = path.stat().st_size
    rng = random.Random(1)
    cuts_list = [[0, a, size] for a in range(0, size + 1, 3)]  # cuts mid-line and on boundaries
    cuts_list += [sorted({0, size, *rng.sample(range(1, size), 9)}) for _ in range(30)]
    for cuts in cuts_list:
        got = []
        for a, b in zip(cuts, cuts[1:], strict=False):
            got += readers.iter_jsonl(path, "text", "data.source", a, b)
        assert got == whole, cuts
    # The planner's ranges tile the file; the counted corpus equals the whole-file read.
    files = describe_source(DataConfig(source=str(path)), str(path), "data.source")
    pieces = plan_pieces(files, 300)
    assert len(pieces) > 5 and pieces[0]["start"] == 0 and pieces[-1]["stop"] == size
    assert all(p["stop"] == q["start"] for p, q in zip(pieces, pieces[1:], strict=False))


def test_error_line_numbers_across_ranges(tmp_path: Path) -> None:
    lines = jsonl_lines(80)
    lines[61] = '{"text": oops}\n'
    (tmp_path / "e.jsonl").write_text("".join(lines), encoding="utf-8")
    cfg = DataConfig(source=str(tmp_path / "e.jsonl"), num_shards=7)
    info = prepare_corpus(cfg, tmp_path / "out")  # metadata only: the line is not read yet
    assert len(info.shards) == 7 and info.pieces[-1]["start"] > 0
    # The shard holding line 62 starts inside the file; its error counts the lines before.
    with pytest.raises(DataError, match=r"e\.jsonl:62: malformed JSON line"):
        for shard in info.shards:
            list(shard_documents(info, shard, cfg))


def test_compressed_json_array_and_parquet_row_groups(tmp_path: Path, monkeypatch) -> None:
    lines = jsonl_lines(40, seed=3)
    expected = [json.loads(x)["text"] for x in lines if x.strip()]
    expected = [t for t in expected if t]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.jsonl").write_text("".join(lines), encoding="utf-8")
    (tmp_path / "gz").mkdir()
    with gzip.open(tmp_path / "gz" / "a.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("".join(lines))
    zstandard = pytest.importorskip("zstandard")
    (tmp_path / "zst").mkdir()
    raw = "".join(lines).encode()
    cut = len(raw) // 2  # two frames, as parallel compressors write
    (tmp_path / "zst" / "a.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(raw[:cut])
        + zstandard.ZstdCompressor().compress(raw[cut:]))
    for name in ("plain", "gz", "zst"):
        assert list(source_documents(DataConfig(source=str(tmp_path / name)), tmp_path)) == expected
    # A JSON array streamed through a window far smaller than its records.
    monkeypatch.setattr(readers, "CHUNK_BYTES", 7)
    records = [{"text": "x" * 50 + str(i) + "ü"} for i in range(20)]
    (tmp_path / "arr.json").write_text(" [ " + " ,\n".join(json.dumps(r) for r in records) + " ]\n")
    got = list(source_documents(DataConfig(source=str(tmp_path / "arr.json")), tmp_path))
    assert got == [r["text"] for r in records]
    # Parquet: pieces are whole row groups, planned from the footer.
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(50)]}), tmp_path / "t.parquet",
                   row_group_size=10)
    files = describe_source(DataConfig(), str(tmp_path / "t.parquet"), "data.source")
    assert files[0].rows == [10] * 5
    pieces = plan_pieces(files, 1)
    assert [(p["start"], p["stop"]) for p in pieces] == [(i, i + 1) for i in range(5)]
    cfg = DataConfig(source=str(tmp_path / "t.parquet"), num_shards=3)
    info = prepare_corpus(cfg, tmp_path / "pq")
    # Shards of about a third of the bytes, in whole row groups.
    assert [(info.pieces[s["pieces"][0]]["start"], info.pieces[s["pieces"][-1]]["stop"])
            for s in info.shards] == [(0, 2), (2, 4), (4, 5)]
    assert [len(list(shard_documents(info, s, cfg))) for s in info.shards] == [20, 20, 10]


def test_missing_zstandard_is_named(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "a.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(DataError, match=r"a\.jsonl\.zst: reading \.zst files needs the "
                                        r"'zstandard' package.*pip install zstandard"):
        list(source_documents(DataConfig(source=str(tmp_path / "a.jsonl.zst")), tmp_path))


def test_unknown_extension_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "x.csv.gz").write_bytes(b"")
    with pytest.raises(DataError, match=r"unsupported file type '\.csv\.gz'"):
        list(source_documents(DataConfig(source=str(tmp_path / "x.csv.gz")), tmp_path))
    with pytest.raises(DataError, match=r"data.source .*nope.* does not exist"):
        list(source_documents(DataConfig(source=str(tmp_path / "nope")), tmp_path))


def test_changed_file_changes_the_fingerprint(tmp_path: Path) -> None:
    src = tmp_path / "c"
    make_corpus(src, n_docs=6, seed=2)
    lines = jsonl_lines(3000, seed=4)  # large enough to be sampled, not hashed whole
    big = src / "big.jsonl"
    big.write_text("".join(lines), encoding="utf-8")
    cfg = DataConfig(source=str(src))
    out = tmp_path / "out"
    info = prepare_corpus(cfg, out)
    assert saved_corpus(cfg, out) is not None  # unchanged input: the count is kept
    # Same size, old mtime restored, a byte changed in a sampled block: still seen.
    st = big.stat()
    data = big.read_bytes()
    assert data.index(b"river") < 4096  # inside the first sampled block
    big.write_bytes(data.replace(b"river", b"rover", 1))
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert saved_corpus(cfg, out) is None
    other = prepare_corpus(cfg, tmp_path / "again")
    assert other.fingerprint != info.fingerprint
    # A file edited after prepare is refused by the shard that reads it.
    pcfg = make_cfg(tmp_path, src, "data.num_shards=2")
    stage = tmp_path / "stage"
    stage.mkdir()
    tokenize.prepare(pcfg, {}, stage, NullTracker())
    with open(big, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": "one more"}) + "\n")
    with pytest.raises(DataError, match=r"big\.jsonl changed since the tokenize stage's prepare"):
        tokenize.part(pcfg, stage, 1)


# Digests of the stores built from make_golden_corpus. The tokenizers and documents are the
# ones the whole-file readers (Hugging Face datasets, a saved corpus copy) gave before
# reading streamed; the train/validation tokens are those of the hash split
# (``corpus.validation_flags``), which any change of reader or split rule must keep.
GOLDEN = {
    "multi": {"tokenizer_hash": "0e2da0586850662284ab5855400fcf0b771e0d1cc26f54ac93587808d2003833",
              "documents": 46, "train": [4660, "22df9b32cbb5aafd", "0bbd4a34a82e9e33"],
              "validation": [1615, "8d35f7b5f1144e18", "7e26ad990faae3c4"],
              "sources": [["code", 12, 3798], ["prose", 15, 2023], ["items", 9, 294],
                          ["table", 10, 160]]},
    "single": {"tokenizer_hash": "4b73e1e9b56863ec0f80fb4d3c8d67afa4772827f0b3f033dd814d966f43f117",
               "documents": 9, "train": [205, "46c3739ac6de677d", "a0a577cda7ba93f7"],
               "validation": [98, "5b5d7135c3462f12", "3a7258f36a4477bd"], "sources": []},
    "limits": {"tokenizer_hash": "ee873a687f8d80cbb533425d4ce5ac1f246128ea72b0c65e9d8d71e1644c1583",
               "documents": 4, "train": [353, "da59eba0ef3f17ed", "44b8c4e261866b3b"],
               "validation": [91, "c755dee46bfe42d5", "bb13d97fc949b5b0"], "sources": []},
}


def make_golden_corpus(root: Path) -> None:
    """txt files, two jsonl files (a blank line, an empty text, no final newline), a JSON
    array and a single-object .json, a parquet file of 3 row groups."""
    make_corpus(root / "code", n_docs=12, seed=21)
    rng = random.Random(22)
    words = "the river morning quietly garden a letter she walked over hills".split()
    lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 60))),
                         "id": i}) for i in range(15)]
    lines.insert(3, "")
    lines.insert(7, json.dumps({"text": ""}))
    (root / "prose").mkdir(parents=True)
    (root / "prose" / "a.jsonl").write_text("\n".join(lines[:9]) + "\n")
    (root / "prose" / "b.jsonl").write_text("\n".join(lines[9:]))
    (root / "items").mkdir()
    (root / "items" / "list.json").write_text(
        json.dumps([{"text": f"item {i} ü " * (i + 1)} for i in range(8)]))
    (root / "items" / "one.json").write_text(
        json.dumps({"text": "a single record\nwith two lines"}, indent=2))
    (root / "table").mkdir()
    rows = [f"row {i} " + "x y z " * (i % 5) for i in range(10)] + [""]
    pq.write_table(pa.table({"text": rows}), root / "table" / "t.parquet", row_group_size=4)


def store_digest(out: dict) -> dict:
    info = open_store(out["store"])
    digest = {"tokenizer_hash": out["tokenizer_hash"], "documents": info.documents}
    for split in ("train", "validation"):
        reader = SplitReader(out["store"], split)
        tokens = reader.read(0, reader.num_tokens).tobytes()
        digest[split] = [reader.num_tokens, hashlib.sha256(tokens).hexdigest()[:16],
                         hashlib.sha256(reader.doc_offsets().tobytes()).hexdigest()[:16]]
    digest["sources"] = [[s.label, s.documents, s.tokens] for s in info.sources]
    return digest


def test_same_tokens_as_the_whole_file_readers(tmp_path: Path) -> None:
    make_golden_corpus(tmp_path)
    specs = {name: tmp_path / name for name in ("code", "prose", "items", "table")}
    mapping = ", ".join(f"{k}: '{v}'" for k, v in specs.items())
    runs = {"multi": ("null", [f"data.sources={{{mapping}}}", "data.num_shards=5"]),
            "single": (tmp_path / "prose", ["data.num_shards=2", "data.max_documents=9"]),
            # 4 documents: a seed that holds out one of them.
            "limits": (tmp_path / "code", ["data.max_document_bytes=600", "data.split_seed=2"])}
    for name, (source, extra) in runs.items():
        cfg = make_cfg(tmp_path, source, *extra)
        out = tmp_path / f"out_{name}"
        out.mkdir()
        n = tokenize.prepare(cfg, {}, out, NullTracker())
        results = [tokenize.part(cfg, out, i) for i in range(n)]
        assert store_digest(tokenize.finalize(cfg, out, results, NullTracker())) == GOLDEN[name]


MEASURE = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from data_prep.config import DataConfig
from benchmarks.peak_rss import own_peak_rss_bytes
from data_prep.corpus import prepare_corpus, shard_documents

def read_all(source: Path, out: Path) -> int:
    info = prepare_corpus(DataConfig(source=str(source), num_shards=3), out)
    return sum(len(t) for s in info.shards for t in shard_documents(info, s, DataConfig(
        source=str(source), num_shards=3)))

src, out = Path(sys.argv[1]), Path(sys.argv[2])
read_all(src / "small.jsonl", out / "small")  # warm: imports, allocator pools, buffers
base = own_peak_rss_bytes()
chars = read_all(src / "big.jsonl", out / "big")
peak = own_peak_rss_bytes()
print(json.dumps({"growth_bytes": peak - base, "chars": chars}))
"""


def test_reader_memory_is_bounded_independent_of_file_size(tmp_path: Path) -> None:
    """Counting and then reading back every document of a ~26 MB JSON lines file grows the
    reading process's peak RSS by far less than the file.

    Measured in a fresh subprocess by its own peak RSS (``benchmarks.peak_rss``: a peak that CPU
    load on a busy machine does not change), after the same work on a 1/16-size file has
    paid for imports and allocator pools, so the growth is what scales with the file. A
    reader that loads the file whole holds at least the file (as bytes, then as text: ~2x);
    a line-by-line reader holds one line and one batch of document sizes. The bound,
    a quarter of the file, leaves room for allocator noise and the int64 size per document.
    """
    rng = random.Random(7)
    words = ["river", "garden", "ü", "日本語", "letter", "slowly", "bright"]
    docs = [" ".join(rng.choice(words) for _ in range(400)) for _ in range(64)]
    lines = [json.dumps({"text": f"{docs[i % 64]} {i}"}) + "\n" for i in range(9000)]
    body = "".join(lines)
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.jsonl").write_text(body)
    (src / "small.jsonl").write_text("".join(lines[: len(lines) // 16]))
    size = (src / "big.jsonl").stat().st_size
    assert size > 20_000_000
    done = subprocess.run([sys.executable, "-c", MEASURE, str(src), str(tmp_path), str(REPO)],
                          capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["chars"] > 0
    print(f"reader peak RSS growth {result['growth_bytes'] / 1e6:.1f} MB, file {size / 1e6:.1f} MB")
    assert result["growth_bytes"] < size / 4, (result, size)
