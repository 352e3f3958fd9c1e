"""No pass over the corpus before the shards: the hash split, a cap read only up to the cap,
and the tokenizer's sample from a spread of the corpus that ignores the shard count."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from data_prep.config import DataConfig
from data_prep.corpus import (
    SAMPLE_PIECES,
    prepare_corpus,
    shard_documents,
    split_key,
    training_sample,
    validation_flags,
)
from data_prep.errors import DataError
from tests.test_data_common import make_corpus


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


def numbered(n: int, words: int = 8, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choice("abcdefgh") * rng.randint(1, 9)
                                    for _ in range(words)) for i in range(n)]


def test_the_hash_split_holds_out_the_fraction_and_keeps_duplicates_together() -> None:
    texts = numbered(20000)
    key = split_key(1234, None)
    flags = validation_flags(texts, key, 0.05)
    # Binomial(20000, 0.05): mean 1000, sd ~31; 4 sd either side.
    assert 876 <= flags.sum() <= 1124
    assert np.array_equal(flags, validation_flags(texts, key, 0.05))  # deterministic
    # A copy of a document lands where the document does, whatever its position.
    again = validation_flags(texts[::-1] + texts[:100], key, 0.05)
    assert np.array_equal(again[:20000][::-1], flags) and np.array_equal(again[20000:],
                                                                        flags[:100])
    # Another seed or another source's label is another split; a higher fraction a superset.
    assert not np.array_equal(flags, validation_flags(texts, split_key(1, None), 0.05))
    assert not np.array_equal(flags, validation_flags(texts, split_key(1234, "code"), 0.05))
    assert np.all(validation_flags(texts, key, 0.2)[flags])


def test_planning_reads_no_document(tmp_path: Path) -> None:
    texts = numbered(300)
    lines = [json.dumps({"text": t}) + "\n" for t in texts]
    lines[250] = "{not json\n"
    (tmp_path / "a.jsonl").write_text("".join(lines))
    cfg = DataConfig(source=str(tmp_path / "a.jsonl"), num_shards=4)
    info = prepare_corpus(cfg, tmp_path / "out")  # the bad line is not read here
    assert not info.capped and info.num_documents is None
    assert all(p["docs"] is None for p in info.pieces)
    with pytest.raises(DataError, match=r"a\.jsonl:251: malformed JSON line"):
        for shard in info.shards:
            list(shard_documents(info, shard, cfg))


def test_a_binding_cap_is_read_up_to_the_cap_and_no_further(tmp_path: Path) -> None:
    texts = numbered(300)
    lines = [json.dumps({"text": t}) + "\n" for t in texts]
    lines[250] = "{not json\n"  # past the cap: never read
    (tmp_path / "a.jsonl").write_text("".join(lines))
    cfg = DataConfig(source=str(tmp_path / "a.jsonl"), num_shards=4, max_documents=200)
    info = prepare_corpus(cfg, tmp_path / "out")
    assert info.capped and info.num_documents == 200
    got = [t for shard in info.shards for t in shard_documents(info, shard, cfg)]
    assert got == texts[:200]
    for shards in (1, 3):  # the same documents for any shard count
        other = prepare_corpus(DataConfig(source=cfg.source, num_shards=shards,
                                          max_documents=200), tmp_path / f"out{shards}")
        assert [t for s in other.shards for t in shard_documents(info=other, shard=s,
                                                                   cfg=cfg)] == got


def test_the_shards_of_a_capped_corpus_share_its_documents(tmp_path: Path) -> None:
    texts = make_corpus(tmp_path / "c", n_docs=40, seed=3)
    cfg = DataConfig(source=str(tmp_path / "c"), num_shards=4, max_documents=12)
    info = prepare_corpus(cfg, tmp_path / "out")
    per_shard = [list(shard_documents(info, shard, cfg)) for shard in info.shards]
    assert [t for docs in per_shard for t in docs] == texts[:12]
    assert all(2 <= len(docs) <= 5 for docs in per_shard), [len(d) for d in per_shard]
    assert [s["bytes"] for s in info.shards] == [sum(len(t.encode()) for t in docs)
                                                for docs in per_shard]


def test_a_cap_the_metadata_shows_cannot_bind_reads_nothing(tmp_path: Path) -> None:
    make_corpus(tmp_path / "c", n_docs=12, seed=1)
    info = prepare_corpus(DataConfig(source=str(tmp_path / "c"), max_documents=12),
                          tmp_path / "out")  # 12 text files: at most 12 documents
    assert not info.capped and info.num_documents is None
    capped = prepare_corpus(DataConfig(source=str(tmp_path / "c"), max_documents=11),
                            tmp_path / "out2")
    assert capped.capped and capped.num_documents == 11


def test_the_tokenizer_sample_is_a_spread_that_ignores_the_shard_count(tmp_path: Path) -> None:
    texts = numbered(4000, words=20)
    (tmp_path / "src").mkdir()
    write_jsonl(tmp_path / "src" / "a.jsonl", texts[:2500])
    write_jsonl(tmp_path / "src" / "b.jsonl", texts[2500:])
    total = sum(len(t) for t in texts)
    budget = total // 10
    samples = []
    for shards in (1, 4, 7):
        cfg = DataConfig(source=str(tmp_path / "src"), num_shards=shards)
        info = prepare_corpus(cfg, tmp_path / f"out{shards}")
        samples.append(training_sample(tmp_path / f"out{shards}", info, cfg, budget, seed=5))
    assert samples[0] == samples[1] == samples[2]
    sample = samples[0]
    size = sum(len(t.encode()) for t in sample)
    assert budget <= size <= budget + max(len(t.encode()) for t in texts)
    # Whole documents from all over the corpus: both files and most of the 64 spread pieces.
    index = {t: i for i, t in enumerate(texts)}
    where = sorted(index[t] for t in sample)
    assert where[0] < 2500 <= where[-1]
    assert len({i * SAMPLE_PIECES // len(texts) for i in where}) >= SAMPLE_PIECES * 3 // 4
    assert training_sample(tmp_path / "out1", info, cfg, budget, seed=6) != sample
