"""Token stores built from several labelled sources (data.sources), and per-source evaluation."""
from __future__ import annotations

import itertools
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from tokenizers import Tokenizer

from data_prep.config import DataConfig
from data_prep.corpus import (
    allocate_shards,
    group_pieces,
    prepare_corpus,
    split_key,
    validation_flags,
)
from data_prep.errors import DataError, StoreError
from data_prep.store import SplitReader, open_store
from model.config import ModelConfig
from model.gpt import GPT
from model.training.heldout import heldout_loss
from stages.config import ConfigError, load_config
from stages.evaluate.work import split_sources
from stages.mechanism import tracking
from stages.mechanism.walk import run_work
from stages.registry import declaration
from stages.tokenize import work as tokenize
from tests.test_data_common import make_cfg, make_corpus, make_tracker

PROSE = ("the", "river", "morning", "quietly", "garden", "a", "letter", "she", "walked", "over",
         "hills", "and", "wrote", "slowly", "bright", "autumn", "of", "window", "light", ".")
N_CODE, N_PROSE = 30, 14
SEED = 2

TOKENIZE = declaration("tokenize")


@pytest.fixture(autouse=True)
def _hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def make_prose(path: Path, n_docs: int, seed: int = 0) -> list[str]:
    """A .jsonl file of ``n_docs`` English-like documents (no word shared with make_corpus)."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(PROSE) for _ in range(rng.randint(20, 120)))
             for _ in range(n_docs)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return texts


def sources_cfg(tmp: Path, sources: dict[str, Path | str], *overrides: str):
    """make_cfg with data.source=null and data.sources given as a YAML flow mapping (and a
    split seed that holds out documents of both of the ``built`` store's sources)."""
    mapping = ", ".join(f"{label}: '{spec}'" for label, spec in sources.items())
    return make_cfg(tmp, "null", f"data.sources={{{mapping}}}", f"data.split_seed={SEED}",
                    *overrides)


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory, seed_store) -> tuple:
    return make_tracker(tmp_path_factory.mktemp("mlruns"), seed_store, "multi-source-tests")


@pytest.fixture
def tracker(tracked: tuple) -> tracking.Tracker:
    return tracked[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tracked: tuple) -> dict:
    """A 2-source store (code: .txt files, prose: one .jsonl) in 4 input shards."""
    tmp = tmp_path_factory.mktemp("multi")
    texts = {"code": make_corpus(tmp / "code", n_docs=N_CODE, seed=11),
             "prose": make_prose(tmp / "prose" / "docs.jsonl", N_PROSE, seed=12)}
    specs = {"code": tmp / "code", "prose": tmp / "prose"}
    cfg = sources_cfg(tmp, specs, "data.num_shards=4")
    out = tmp / "out4"
    out.mkdir()
    outputs = run_work(TOKENIZE, cfg, {}, out, tracked[0])
    return {"tmp": tmp, "texts": texts, "specs": specs, "cfg": cfg, "outputs": outputs,
            "uri": tracked[1], "run_id": tracked[2]}


def part_docs(store: str, part: dict) -> list[np.ndarray]:
    """The documents (eos included) of one store part, read straight from its arrays."""
    tokens = zarr.open_array(str(Path(store) / part["path"] / "tokens"), mode="r")[:]
    offsets = zarr.open_array(str(Path(store) / part["path"] / "doc_offsets"), mode="r")[:]
    return [tokens[a:b] for a, b in itertools.pairwise(offsets)]


def test_parts_are_labelled_and_counts_add_up(built: dict) -> None:
    out, store = built["outputs"], built["outputs"]["store"]
    info = open_store(store, out["tokenizer_hash"])
    assert out["sources"] == ["code", "prose"]
    assert [s.label for s in info.sources] == ["code", "prose"]
    assert [s.source for s in info.sources] == [str(p) for p in built["specs"].values()]
    assert info.manifest["source"] is None and info.manifest["num_shards"] == 4
    for split, sinfo in info.splits.items():
        labels = [p["source"] for p in sinfo.parts]
        # Parts in corpus order: the code parts, then the prose parts; both get shards.
        assert labels == sorted(labels) and set(labels) == {"code", "prose"}
        assert len(labels) == 4
        for part in sinfo.parts:  # the label is in the part's own Zarr attributes too
            attrs = zarr.open_group(str(Path(store) / part["path"]), mode="r").attrs
            assert (attrs["source"], attrs["split"], attrs["tokens"]) == (
                part["source"], split, part["tokens"])
        for src in info.sources:
            mine = [p for p in sinfo.parts if p["source"] == src.label]
            assert src.split_tokens[split] == sum(p["tokens"] for p in mine)
            assert src.split_documents[split] == sum(p["documents"] for p in mine)
        assert sum(s.split_tokens[split] for s in info.sources) == sinfo.tokens
        assert sum(s.split_documents[split] for s in info.sources) == sinfo.documents
    code, prose = info.sources
    assert (code.documents, prose.documents) == (N_CODE, N_PROSE)
    assert (code.tokens + prose.tokens == info.tokens
            == out["train_tokens"] + out["validation_tokens"])
    # Each document is held out by its keyed hash: the key is the seed and its source's label.
    held = {label: int(validation_flags(texts, split_key(SEED, label), 0.2).sum())
            for label, texts in built["texts"].items()}
    assert (code.split_documents["validation"], prose.split_documents["validation"]) == (
        held["code"], held["prose"]) == (7, 4)
    root = zarr.open_group(store, mode="r")
    assert root.attrs["sources"] == info.manifest["sources"]
    assert root.attrs["sources"][0] == {
        "label": "code", "source": str(built["specs"]["code"]), "tokens": code.tokens,
        "documents": N_CODE, "split_tokens": code.split_tokens,
        "split_documents": code.split_documents}


def test_each_part_decodes_to_its_own_sources_documents(built: dict) -> None:
    out, texts = built["outputs"], built["texts"]
    info = open_store(out["store"])
    tok = Tokenizer.from_file(out["tokenizer"])
    decoded: dict[str, list[str]] = {"code": [], "prose": []}
    for split in ("train", "validation"):
        for part in info.splits[split].parts:
            docs = part_docs(out["store"], part)
            assert len(docs) == part["documents"]
            for doc in docs:
                assert doc[-1] == out["eos_id"] and out["eos_id"] not in doc[:-1]
                text = tok.decode(doc[:-1].tolist())
                assert text in texts[part["source"]], f"{part['path']} holds a foreign document"
                decoded[part["source"]].append(text)
    for label in ("code", "prose"):
        assert sorted(decoded[label]) == sorted(texts[label])


def test_same_tokens_for_any_shard_count_and_shard_order(built: dict, tracker) -> None:
    tmp, base = built["tmp"], built["outputs"]
    stores = {}
    cfg = sources_cfg(tmp, built["specs"], "data.num_shards=2",
                      f"tokenizer.path={base['tokenizer']}")
    (tmp / "out2").mkdir()
    stores[2] = run_work(TOKENIZE, cfg, {}, tmp / "out2", tracker)
    # 7 shards, tokenized in reverse order (as unordered parallel workers would), then finalized.
    cfg = sources_cfg(tmp, built["specs"], "data.num_shards=7",
                      f"tokenizer.path={base['tokenizer']}")
    out = tmp / "out7"
    out.mkdir()
    n = tokenize.prepare(cfg, {}, out, tracker)
    assert n == 7
    results = [tokenize.part(cfg, out, i) for i in reversed(range(n))]
    stores[7] = tokenize.finalize(cfg, out, results, tracker)
    for count, other in stores.items():
        info = open_store(other["store"])
        assert len(info.splits["train"].parts) == count
        assert info.source_fingerprint == open_store(base["store"]).source_fingerprint
        assert info.sources == open_store(base["store"]).sources
        for split in ("train", "validation"):
            a, b = SplitReader(base["store"], split), SplitReader(other["store"], split)
            assert np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))
            assert np.array_equal(a.doc_offsets(), b.doc_offsets())


def test_shard_allocation() -> None:
    assert allocate_shards([30, 14], 4) == [2, 2]
    assert allocate_shards([1000, 10], 4) == [3, 1]
    assert allocate_shards([5, 5, 5], 3) == [1, 1, 1]
    assert allocate_shards([1, 1], 5) == [3, 2]  # ties go to the earlier source
    for sizes, shards in (([7, 300, 41], 10), ([1, 1, 1, 1], 9), ([100], 6)):
        counts = allocate_shards(sizes, shards)
        assert sum(counts) == shards and min(counts) >= 1
    with pytest.raises(DataError, match="num_shards=1 is less than the 2 sources"):
        allocate_shards([3, 4], 1)
    # Pieces go to the shard their middle byte falls in: contiguous, balanced by bytes.
    pieces = [{"bytes": b} for b in (10, 10, 10, 10, 60)]
    assert group_pieces(pieces, 3) == [[0, 1, 2], [3], [4]]
    assert group_pieces([{"bytes": 5}] * 6, 3) == [[0, 1], [2, 3], [4, 5]]
    assert group_pieces([{"bytes": 1}], 3) == [[], [0], []]


def test_tracking_logs_per_source_counts(built: dict) -> None:
    metrics = tracking.get_run(built["uri"], built["run_id"]).data.metrics
    info = open_store(built["outputs"]["store"])
    for src in info.sources:
        assert metrics[f"tokens.{src.label}"] == src.tokens
        assert metrics[f"documents.{src.label}"] == src.documents


def test_fingerprint_covers_labels(built: dict, tmp_path: Path) -> None:
    specs, base = built["specs"], open_store(built["outputs"]["store"]).source_fingerprint
    same = DataConfig(sources={"code": str(specs["code"]), "prose": str(specs["prose"])})
    renamed = DataConfig(sources={"code": str(specs["code"]), "text": str(specs["prose"])})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert prepare_corpus(same, tmp_path / "a").fingerprint == base
    info = prepare_corpus(renamed, tmp_path / "b")
    assert info.fingerprint != base
    assert info.sources == [{"label": "code", "source": str(specs["code"])},
                            {"label": "text", "source": str(specs["prose"])}]


def test_per_source_evaluation(built: dict) -> None:
    info = open_store(built["outputs"]["store"])
    reader = SplitReader(info, "validation")
    spans = split_sources(info, "validation")
    assert {name for _, _, name in spans} == {"code", "prose"}
    assert spans[-1][1] == reader.num_tokens
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=1, d_model=32, n_heads=2, vocab_size=info.vocab_size,
                            max_seq_len=32))
    result = heldout_loss(model, reader, seq_len=32, max_tokens=10**9, batch_size=8,
                          sources=spans, progress_seconds=0)
    per = result["per_source"]
    assert set(per) == {"code", "prose"}
    assert sum(p["tokens"] for p in per.values()) == result["tokens"] == reader.num_tokens - 1 - (
        (reader.num_tokens - 1) % 32)
    # Each predicted position (1 .. tokens) counts for the span holding it.
    positions = np.arange(1, result["tokens"] + 1)
    for label in per:
        inside = sum(((positions >= a) & (positions < b)).sum() for a, b, n in spans if n == label)
        assert per[label]["tokens"] == inside
    mean = sum(p["val_loss"] * p["tokens"] for p in per.values()) / result["tokens"]
    assert abs(mean - result["val_loss"]) < 1e-5
    assert per["code"]["val_loss"] != per["prose"]["val_loss"]


def test_single_source_store_stays_unlabelled(tmp_path: Path, tracker) -> None:
    make_corpus(tmp_path / "c", n_docs=8, seed=4)
    cfg = make_cfg(tmp_path, tmp_path / "c", "data.num_shards=2")
    (tmp_path / "o").mkdir()
    out = run_work(TOKENIZE, cfg, {}, tmp_path / "o", tracker)
    info = open_store(out["store"])
    assert info.sources == [] and out["sources"] == []
    assert info.manifest["source"] == str(tmp_path / "c")
    assert all("source" not in p for s in info.splits.values() for p in s.parts)
    assert {name for _, _, name in split_sources(info, "validation")} == {"all"}


def test_config_forms(tmp_path: Path) -> None:
    preset = tmp_path / "two.yaml"
    preset.write_text("data:\n  sources:\n    code: stdlib\n    notes.v2: /data/notes\n"
                      "  num_shards: 4\n")
    cfg = load_config(preset)
    assert cfg.data.source is None
    assert cfg.data.labelled_sources() == [("code", "stdlib"), ("notes.v2", "/data/notes")]
    cfg = load_config(overrides=["data.source=null", "data.sources.a=/x", "data.sources.b-1=/y"])
    assert cfg.data.sources == {"a": "/x", "b-1": "/y"}
    assert load_config(overrides=["data.source=null"]).data.labelled_sources() == [(None, "stdlib")]


@pytest.mark.parametrize("overrides, match", [
    (["data.sources={code: /x}"],  # tiny.yaml sets data.source: stdlib
     r"data.source='stdlib' and data.sources are both set: set exactly one"),
    (["data.source=null", "data.sources={'a b': /x}"], r"label 'a b' is not allowed"),
    (["data.source=null", "data.sources={'val/loss': /x}"], r"label 'val/loss' is not allowed"),
    (["data.source=null", "data.sources={'': /x}"], r"label '' is not allowed"),
    (["data.source=null", "data.sources={Code: /x, code: /y}"],
     r"'Code' and 'code' differ only in case"),
    (["data.source=null", "data.sources={a: ''}"], r"data.sources.a must be a non-empty"),
    (["data.source=null", "data.sources=[a, b]"], r"data.sources must be a mapping"),
    (["data.source=null", "data.sources={a: /x, b: /y, c: /z}"],
     r"data.num_shards=2 is less than the 3 data.sources"),
])
def test_bad_config(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=overrides)


@pytest.mark.parametrize("case", ["empty", "no_files", "non_utf8", "missing_field", "single_docs"])
def test_bad_source_names_label_and_file(case: str, tmp_path: Path, tracker) -> None:
    make_corpus(tmp_path / "code", n_docs=4, seed=5)
    prose = tmp_path / "prose"
    prose.mkdir()
    if case == "empty":
        (prose / "a.txt").write_text("")
        match = r"data.sources.prose .*prose.*yielded no documents"
    elif case == "no_files":
        (prose / "a.md").write_text("not a supported file")
        match = r"data.sources.prose directory .*prose.* has no"
    elif case == "non_utf8":
        (prose / "ok.txt").write_text("fine")
        (prose / "zz.txt").write_bytes(b"\xff\xfe not utf-8")
        match = r"zz\.txt: not valid UTF-8.*remove it from data.sources.prose"
    elif case == "missing_field":
        (prose / "d.jsonl").write_text('{"text": "a b"}\n{"body": "c d"}\n')
        match = r"data.sources.prose: .*d\.jsonl:2: record has no field 'text'"
    else:
        shutil.rmtree(tmp_path / "code")
        make_corpus(tmp_path / "code", n_docs=1, seed=5)
        (prose / "a.txt").write_text("one prose document")
        match = (r"data.validation_fraction=0.2 held out none of the 2 documents .*raise it to "
                 r"at least 0.5")
    cfg = sources_cfg(tmp_path, {"code": tmp_path / "code", "prose": prose})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError, match=match):
        run_work(TOKENIZE, cfg, {}, out, tracker)
    with pytest.raises(StoreError):
        open_store(out / "store.zarr")
