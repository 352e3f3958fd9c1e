"""The curate stage in the pipeline: a planted two-source corpus goes through curate and
tokenize (real files, a real MLflow store); every planted document is removed for its
reason and nothing else, the token store holds exactly the kept documents, MLflow shows the
removals, and a threshold change reruns the selection on the same signal files."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from stages.mechanism import tracking
from stages.mechanism.selection import decide_stages
from stages.registry import PIPELINE
from tests.curatekit import planted_corpus
from tests.evalkit import micro_config, open_pipeline, run_stages


def _config(runs: Path, planted, *overrides: str):
    sources = ", ".join(f"{label}: {spec}" for label, spec in planted.data.sources.items())
    return micro_config(runs, f"data.sources={{{sources}}}", "data.source=null",
                        "data.max_documents=null", "data.num_shards=3",
                        "data.validation_fraction=0.3", "curate.id_field=id",
                        f"eval.task_include={planted.task_dir}", "eval.tasks=[riddles]",
                        "tokenizer.train_sample_bytes=100000", *overrides)


@pytest.fixture(scope="module")
def curated(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("curate-stage")
    planted = planted_corpus(root / "input")
    cfg = _config(root / "runs", planted)
    ctx = open_pipeline(cfg)
    results = run_stages(cfg, ctx, ("tokenize",))
    return root, planted, ctx, results


def test_the_planted_documents_are_removed_for_their_reasons(curated) -> None:
    _, planted, _, results = curated
    removed = {r["id"]: r for r in pq.read_table(results["curate"].outputs["removed"]).to_pylist()}
    assert sorted(removed) == sorted(planted.expected), "removed other documents than planted"
    for doc_id, (reason, duplicate_of) in planted.expected.items():
        got = removed[doc_id]["reason"]
        assert got.startswith("quality:") if reason == "quality" else got == reason, (doc_id, got)
        assert removed[doc_id]["duplicate_of"] == duplicate_of, doc_id
    assert results["curate"].outputs["kept_documents"] == len(planted.kept_ids)


def test_tokenization_encodes_exactly_the_kept_documents(curated) -> None:
    _, planted, _, results = curated
    tokenized = results["tokenize"].outputs
    assert tokenized["documents"] == len(planted.kept_ids)
    assert tokenized["sources"] == ["web", "docs"]


def test_mlflow_shows_each_reason_and_the_removed_documents(curated) -> None:
    _, planted, ctx, results = curated
    run = tracking.get_run(ctx.tracking_uri, results["curate"].run_id)
    metrics = run.data.metrics
    assert metrics["removed_documents.exact_duplicate"] == 5
    assert metrics["removed_documents.near_duplicate"] == 2
    assert metrics["removed_documents.contamination.riddles"] == 1
    assert metrics["removed_documents.language"] == 1
    assert metrics["removed_documents"] == len(planted.expected)
    assert metrics["removed_bytes.exact_duplicate"] > 0
    artifacts = {Path(a).name for a in _artifacts(ctx.tracking_uri, run.info.run_id)}
    assert {"removed.parquet", "removals.png", "removed_sample.json", "summary.json"} <= artifacts
    sample = json.loads(Path(results["curate"].outputs["removed"]).with_name(
        "removed_sample.json").read_text())
    assert sample["language"][0]["id"] == "german" and sample["language"][0]["text"]


def _artifacts(uri: str, run_id: str) -> list[str]:
    client = tracking.MlflowClient(uri)
    return [a.path for a in client.list_artifacts(run_id)]


def test_a_threshold_change_reselects_from_the_same_signals(curated) -> None:
    root, planted, _, results = curated
    first = Path(results["curate"].out_dir)
    cfg = _config(root / "runs", planted, "curate.thresholds={min_words: 60}")
    decisions = {d.name: d for d in decide_stages(PIPELINE, cfg, None, None, False)}
    assert decisions["curate"].action == "run"
    assert f"the signals of {results['curate'].key} are kept" in decisions["curate"].reason
    assert "curate.thresholds changed" in decisions["curate"].reason
    again = run_stages(cfg, open_pipeline(cfg), ("tokenize",))
    second = Path(again["curate"].out_dir)
    assert second != first
    for old, new in zip(sorted((first / "signals").glob("*.parquet")),
                        sorted((second / "signals").glob("*.parquet")), strict=True):
        assert old.stat().st_ino == new.stat().st_ino, "a signal file was computed again"
    assert again["curate"].outputs["removed_documents"] > results["curate"].outputs[
        "removed_documents"]
    assert again["tokenize"].outputs["documents"] == again["curate"].outputs["kept_documents"]


def test_a_selection_that_empties_a_source_is_refused_naming_why(curated) -> None:
    """Tokenization would only say the source yielded no documents: curation says which
    rules removed them and what to change."""
    from data_prep.errors import DataError

    root, planted, _, _ = curated
    cfg = _config(root / "runs", planted, "curate.thresholds={min_words: 100000}")
    with pytest.raises(DataError, match=r"curate removed all \d+ documents of data\.sources\.\w+ "
                                        r"\(.*quality:min_words \d+.*\).*relax curate\.thresholds"):
        run_stages(cfg, open_pipeline(cfg), ("curate",))
