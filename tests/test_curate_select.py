"""Curation end to end on a planted corpus: every planted document removed for its reason,
one member per duplicate cluster kept (the first), nothing else removed, and a changed
threshold reselecting from the same signal files without recomputing them."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.corpus import shard_documents
from data_prep.curate import (
    CurateConfig,
    curate_corpus,
    find_duplicates,
    keep_mask,
    resolve_preset,
    select,
    signal_config,
)
from data_prep.curate.config import SELECTION_FIELDS, SIGNAL_FIELDS
from stages.curate.report import removals_chart
from tests.curatekit import planted_corpus, signal_files


@pytest.fixture(scope="module")
def curated(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("curate")
    planted = planted_corpus(root / "input")
    out = root / "out"
    paths, info = signal_files(planted, out)
    summary = curate_corpus(paths, planted.curate, planted.data, out)
    return planted, out, paths, info, summary


def removed_rows(out: Path) -> dict[str, dict]:
    return {r["id"]: r for r in pq.read_table(out / "removed.parquet").to_pylist()}


def test_each_planted_document_is_removed_for_its_reason(curated) -> None:
    planted, out, _, _, _ = curated
    removed = removed_rows(out)
    for doc_id, (reason, duplicate_of) in planted.expected.items():
        assert doc_id in removed, f"{doc_id} was kept"
        got = removed[doc_id]
        if reason == "quality":
            assert got["reason"].startswith("quality:"), (doc_id, got["reason"])
        else:
            assert got["reason"] == reason, (doc_id, got["reason"])
        assert got["duplicate_of"] == duplicate_of, doc_id
    assert sorted(removed) == sorted(planted.expected), "something else was removed"


def test_junk_reasons_name_the_rule_that_fired(curated) -> None:
    _, out, _, _, _ = curated
    removed = removed_rows(out)
    assert removed["nav"]["reason"] == "quality:max_dup_line_frac"
    assert removed["spam"]["reason"] == "quality:max_top_2gram"
    assert removed["salad"]["reason"] in ("quality:min_stop_words",
                                          "quality:min_stop_word_fraction")


def test_keep_masks_follow_shard_order(curated) -> None:
    planted, out, _, info, summary = curated
    kept, total = [], 0
    for i, shard in enumerate(info.shards):
        mask = keep_mask(out, i)
        texts = list(shard_documents(info, shard, planted.data))
        assert mask.dtype == bool and len(mask) == len(texts)
        total += len(mask)
        kept += [t for t, keep in zip(texts, mask, strict=True) if keep]
    assert total == summary["documents"] == len(planted.kept_ids) + len(planted.expected)
    assert len(kept) == summary["kept_documents"] == len(planted.kept_ids)


def test_outputs_and_summary(curated) -> None:
    planted, out, _, _, summary = curated
    assert summary["by_reason"]["exact_duplicate"]["documents"] == 5
    assert summary["by_reason"]["near_duplicate"]["documents"] == 2
    assert summary["by_source"]["docs"]["removed"]["exact_duplicate"]["documents"] == 2
    assert summary["kept_bytes"] + summary["removed_bytes"] == summary["bytes"]
    sample = json.loads((out / "removed_sample.json").read_text())
    assert sample["language"][0]["id"] == "german"
    assert sample["language"][0]["text"].startswith("Die Bibliothek")
    assert not (out / "removals.png").exists()  # the stage draws it, beside its logging
    chart = removals_chart(summary, out / "removals.png")
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.rglob(".*.tmp-*")), "a temporary file was left"
    table = pq.read_table(out / "removed.parquet")
    assert table.column_names == ["id", "reason", "duplicate_of", "source", "shard", "index",
                                  "bytes"]


def test_changing_a_threshold_reselects_without_touching_signals(curated,
                                                                 tmp_path: Path) -> None:
    planted, _, paths, info, _ = curated
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in paths}
    # the German document's language rule off: it is then judged by quality rules only
    strict = CurateConfig(id_field="id", thresholds={"min_language_score": None,
                                                     "min_words": 70})
    assert signal_config(strict) == signal_config(planted.curate)
    summary = curate_corpus(paths, strict, planted.data, tmp_path, info)
    removed = removed_rows(tmp_path)
    assert "german" not in removed or removed["german"]["reason"] != "language"
    assert removed["p01"]["reason"] == "quality:min_words"  # 48 words
    assert summary["removed_documents"] > len(planted.expected)
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in paths} == before


def test_select_on_one_table_matches_curate_corpus(curated) -> None:
    planted, out, paths, _, _ = curated
    table = pa.concat_tables([pq.read_table(p) for p in paths])
    thresholds = resolve_preset(planted.curate, planted.data, "web")
    passing = np.array([r is None for r in select(table, None, thresholds,
                                                  planted.curate.languages)])
    dups = find_duplicates(paths, passing, table.column("norm_hash").to_numpy(),
                           planted.curate.minhash_bands)
    reasons = select(table, dups, thresholds, planted.curate.languages)
    ids = table.column("id").to_pylist()
    removed = removed_rows(out)
    assert {i: r for i, r in zip(ids, reasons, strict=True) if r} == {
        i: row["reason"] for i, row in removed.items()}


def test_a_junk_first_member_does_not_take_its_cluster_with_it(curated) -> None:
    """Dedup runs among the documents that pass the filters: with the first copy of p09
    filtered out, the next copy is its cluster's keeper."""
    _, _, paths, _, _ = curated
    table = pa.concat_tables([pq.read_table(p) for p in paths])
    ids = table.column("id").to_pylist()
    passing = np.array([i != "p09" for i in ids])
    dups = find_duplicates(paths, passing, table.column("norm_hash").to_numpy(), 14)
    second = ids.index("dup-p09a")
    assert dups.keeper[second] == second
    assert ids[dups.keeper[ids.index("dup-p09b")]] == "dup-p09a"
    assert dups.reason(ids.index("dup-p09b")) == "exact_duplicate"
    assert dups.reason(ids.index("p09")) is None  # not a candidate: the filter's reason stands


def test_config_checks_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"curate.thresholds has unknown names \['max_wrods'\]"):
        CurateConfig(thresholds={"max_wrods": 3})
    with pytest.raises(ValueError, match="curate.preset"):
        CurateConfig(preset="web")
    with pytest.raises(ValueError, match="curate.decontamination_min_words"):
        CurateConfig(decontamination_min_words=20)
    assert set(SIGNAL_FIELDS).isdisjoint(SELECTION_FIELDS)
    assert CurateConfig().lsh_threshold == pytest.approx(0.719, abs=1e-3)


def test_disabled_curation_keeps_every_document(curated, tmp_path: Path) -> None:
    planted, _, paths, info, _ = curated
    summary = curate_corpus(paths, CurateConfig(enabled=False, id_field="id"), planted.data,
                            tmp_path, info)
    assert summary["removed_documents"] == 0 and not removed_rows(tmp_path)
    assert all(keep_mask(tmp_path, i).all() for i in range(len(info.shards)))
