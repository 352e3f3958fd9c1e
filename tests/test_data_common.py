"""Helpers shared by the data tests: a generated corpus, configs, a real MLflow tracker."""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from stages.config import PipelineConfig, load_config
from stages.mechanism import tracking

WORDS = ("def", "class", "return", "import", "token", "naïve", "café", "日本語", "data", "loader",
         "zarr", "shard", "window", "(", ")", ":", "=", "+", "0", "42", "\t", "über", "emoji🙂")


def make_corpus(directory: Path, n_docs: int = 40, seed: int = 0) -> list[str]:
    """Write ``n_docs`` .txt documents (one per file, sorted names); return their texts."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(n_docs):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
                 for _ in range(rng.randint(5, 40))]
        text = "\n".join(lines) + "\n"
        (directory / f"doc_{i:04d}.txt").write_text(text, encoding="utf-8")
        texts.append(text)
    return texts


def make_cfg(tmp: Path, source: str | Path, *overrides: str) -> PipelineConfig:
    """A small tokenize config reading ``source`` (small chunks so stores have many)."""
    base = [
        f"data.source={source}",
        f"tracking.runs_dir={tmp / 'runs'}",
        "data.max_documents=null",
        "data.num_shards=3",
        "data.chunk_tokens=1024",
        "data.chunks_per_shard=2",
        "data.validation_fraction=0.2",
        "data.encode_batch_bytes=3000",
        "data.progress_seconds=0",
        "tokenizer.vocab_size=320",
        "tokenizer.train_sample_bytes=200000",
    ]
    return load_config(overrides=base + list(overrides))


def make_tracker(tmp: Path, seed_store: Callable[[Path], str], name: str = "data-tests"
                 ) -> tuple[tracking.Tracker, str, str]:
    """A Tracker on a fresh MLflow run in a SQLite store under ``tmp``: (tracker, uri, run_id).

    The store is a copy of the session's migrated one (the ``seed_store`` fixture)."""
    uri = seed_store(tmp)
    experiment = tracking.ensure_experiment(uri, name, tmp)
    run_id = tracking.start_run(uri, experiment, "tokenize")
    return tracking.Tracker(uri, run_id), uri, run_id


def test_make_corpus_is_deterministic(tmp_path: Path) -> None:
    first = make_corpus(tmp_path / "a", n_docs=5, seed=3)
    second = make_corpus(tmp_path / "b", n_docs=5, seed=3)
    assert first == second
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == [f"doc_{i:04d}.txt" for i in range(5)]
    assert make_corpus(tmp_path / "c", n_docs=5, seed=4) != first
