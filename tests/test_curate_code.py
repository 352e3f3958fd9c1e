"""The code preset on real standard-library files: it removes nothing but true duplicates."""
from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq

from data_prep.config import DataConfig
from data_prep.corpus import prepare_corpus
from data_prep.curate import (
    CODE,
    PROSE,
    CurateConfig,
    compute_shard_signals,
    curate_corpus,
    resolve_preset,
)
from data_prep.curate.text import WORD, normalize
from data_prep.sources import stdlib_files

MAX_BYTES = 40_000


def sample_files() -> list[Path]:
    """Every 20th standard-library file under MAX_BYTES, and the cp125x codecs (a family of
    generated near-copies)."""
    files = stdlib_files()
    small = [p for p in files if p.stat().st_size <= MAX_BYTES]
    codecs = [p for p in files if p.parent.name == "encodings" and p.stem.startswith("cp125")]
    return sorted(set(small[::20]) | set(codecs))


def shingles(text: str) -> set[str]:
    words = WORD.findall(normalize(text))
    return {" ".join(words[i:i + 5]) for i in range(max(1, len(words) - 4))}


def test_auto_preset_is_code_for_stdlib_and_prose_otherwise() -> None:
    assert resolve_preset(CurateConfig(), DataConfig(source="stdlib")) == CODE
    mixed = DataConfig(sources={"py": "stdlib", "web": "/data/web"}, num_shards=2)
    assert resolve_preset(CurateConfig(), mixed, "py") == CODE
    assert resolve_preset(CurateConfig(thresholds={"min_words": 5}), mixed, "web") == {
        **PROSE, "min_words": 5}


def test_code_preset_removes_only_true_duplicates(tmp_path: Path) -> None:
    folder = tmp_path / "code"
    folder.mkdir()
    texts = {}
    for path in sample_files():
        name = "__".join(path.parts[-2:]).replace(".py", ".txt")
        shutil.copy(path, folder / name)
        texts[str(folder / name)] = path.read_text(encoding="utf-8")
    planted = folder / "zz_copy_of_first.txt"  # sorts last: the copy, not the original
    first = sorted(texts)[0]
    shutil.copy(first, planted)
    texts[str(planted)] = texts[first]
    data = DataConfig(source=str(folder), num_shards=2)
    cfg = CurateConfig(preset="code")
    info = prepare_corpus(data, tmp_path / "out")
    paths = []
    for i, shard in enumerate(info.shards):
        paths.append(tmp_path / "out" / f"shard-{i}.parquet")
        compute_shard_signals(info, i, shard, data, cfg, None, paths[-1])
    summary = curate_corpus(paths, cfg, data, tmp_path / "out")
    removed = pq.read_table(tmp_path / "out" / "removed.parquet").to_pylist()
    by_id = {r["id"]: r for r in removed}
    assert by_id[str(planted)]["reason"] == "exact_duplicate"
    assert by_id[str(planted)]["duplicate_of"] == first
    for row in removed:
        assert row["reason"] in ("exact_duplicate", "near_duplicate"), row
        text, kept = texts[row["id"]], texts[row["duplicate_of"]]
        if row["reason"] == "exact_duplicate":
            assert normalize(text) == normalize(kept)
        else:  # a real near copy: most of its 5-word shingles are shared
            a, b = shingles(text), shingles(kept)
            assert len(a & b) / len(a | b) >= 0.5, (row["id"], row["duplicate_of"])
    assert summary["kept_documents"] == len(texts) - len(removed)
    assert len(removed) < len(texts) // 4
