"""The tokenize stage end to end: store format, round trip, determinism, tracking, bad input."""
from __future__ import annotations

import itertools
import json
import multiprocessing
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from tokenizers import Tokenizer

from data_prep.corpus import split_key, validation_flags
from data_prep.errors import DataError, StoreError
from data_prep.loader import TokenWindowLoader
from data_prep.store import SplitReader, open_store
from stages.mechanism import tracking
from stages.mechanism.walk import run_work
from stages.registry import PIPELINE, declaration
from stages.tokenize import work as tokenize
from tests.test_data_common import make_cfg, make_corpus, make_tracker
from tests.test_data_tokenizer import big_vocab_tokenizer

N_DOCS = 40

TOKENIZE = declaration("tokenize")


@pytest.fixture(autouse=True)
def _hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory, seed_store) -> tuple:
    """One MLflow run (SQLite) shared by this module's stage runs: (tracker, uri, run_id)."""
    return make_tracker(tmp_path_factory.mktemp("mlruns"), seed_store)


@pytest.fixture
def tracker(tracked: tuple) -> tracking.Tracker:
    return tracked[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tracked: tuple) -> dict:
    tmp = tmp_path_factory.mktemp("stage")
    texts = make_corpus(tmp / "corpus", n_docs=N_DOCS, seed=7)
    cfg = make_cfg(tmp, tmp / "corpus")
    tracker, uri, run_id = tracked
    out = tmp / "out3"
    out.mkdir()
    outputs = run_work(TOKENIZE, cfg, {}, out, tracker)
    return {"tmp": tmp, "texts": texts, "cfg": cfg, "outputs": outputs, "uri": uri,
            "run_id": run_id}


def split_docs(store: str, split: str) -> list[np.ndarray]:
    reader = SplitReader(store, split)
    tokens = reader.read(0, reader.num_tokens)
    offsets = reader.doc_offsets()
    return [tokens[a:b] for a, b in itertools.pairwise(offsets)]


def test_outputs_and_store_format(built: dict) -> None:
    out, cfg = built["outputs"], built["cfg"]
    info = open_store(out["store"], out["tokenizer_hash"])
    assert info.vocab_size == out["vocab_size"] == 320
    assert info.eos_id == out["eos_id"] == 0
    assert info.splits["train"].tokens == out["train_tokens"] > 0
    assert info.splits["validation"].tokens == out["validation_tokens"] > 0
    assert info.documents == N_DOCS
    held_out = validation_flags(built["texts"], split_key(cfg.data.split_seed, None), 0.2)
    assert info.splits["validation"].documents == held_out.sum() == 7  # about 0.2 * N_DOCS
    assert json.loads(json.dumps(out)) == out
    root = zarr.open_group(out["store"], mode="r")
    for key in ("tokenizer_hash", "vocab_size", "eos_id", "tokens", "documents",
                "source_fingerprint", "format_version"):
        assert root.attrs[key] == info.manifest[key]
    assert root.attrs["tokens"] == out["train_tokens"] + out["validation_tokens"]
    part = zarr.open_array(str(Path(out["store"]) / "train" / "00000" / "tokens"), mode="r")
    assert part.dtype == np.uint16 and part.ndim == 1
    assert part.chunks == (cfg.data.chunk_tokens,)
    assert part.shards == (cfg.data.chunk_tokens * cfg.data.chunks_per_shard,)
    blosc = part.metadata.codecs[0].codecs[1]
    assert (blosc.cname.value, blosc.shuffle.value) == ("zstd", "shuffle")
    tok = Tokenizer.from_file(out["tokenizer"])
    assert tok.get_vocab_size() == 320
    assert (Path(out["store"]) / "tokenizer.json").read_text() == Path(out["tokenizer"]).read_text()
    assert not (Path(out["store"]).parent / "corpus").exists()  # the temporary corpus copy is gone


def test_round_trip_text(built: dict) -> None:
    out, texts = built["outputs"], built["texts"]
    tok = Tokenizer.from_file(out["tokenizer"])
    decoded = {}
    for split in ("train", "validation"):
        for doc in split_docs(out["store"], split):
            assert doc[-1] == out["eos_id"] and out["eos_id"] not in doc[:-1]
            decoded.setdefault(split, []).append(tok.decode(doc[:-1].tolist()))
    assert sorted(decoded["train"] + decoded["validation"]) == sorted(texts)
    assert not set(decoded["train"]) & set(decoded["validation"])
    order = {t: i for i, t in enumerate(texts)}  # each split keeps corpus order
    for docs in decoded.values():
        assert [order[t] for t in docs] == sorted(order[t] for t in docs)
    # The loader's sequential windows are the packed stream, block after block: each holds
    # the stream's tokens at its start, and only each block's tail (< 17 tokens) is left out.
    loader = TokenWindowLoader(out["store"], "validation", seq_len=16, global_batch=4,
                               shuffle=False)
    rows = [r for batch in loader.iter_sequential() for r in batch.numpy()]
    full = np.concatenate(split_docs(out["store"], "validation"))
    starts = loader.window_starts(np.arange(len(rows))).tolist()
    assert all(np.array_equal(r, full[s : s + 17]) for r, s in zip(rows, starts, strict=True))
    assert len(full) - 16 * len(rows) <= 17 * loader.num_blocks
    stream = np.concatenate([rows[0][:1]] + [r[1:] for r in rows[:loader.block_windows]])
    text = tok.decode(stream.tolist(), skip_special_tokens=False)
    assert text.startswith(decoded["validation"][0][:len(text) // 2])


def test_tracking(built: dict) -> None:
    run = tracking.get_run(built["uri"], built["run_id"])
    metrics, out = run.data.metrics, built["outputs"]
    assert metrics["tokens"] == out["train_tokens"] + out["validation_tokens"]
    assert metrics["documents"] == N_DOCS
    assert metrics["tokens_per_s"] > 0
    store_bytes = sum(f.stat().st_size for f in Path(out["store"]).rglob("*") if f.is_file())
    assert metrics["bytes_on_disk"] == store_bytes
    assert metrics["compression_ratio"] > 1.2  # zstd + shuffle on uint16 tokens
    assert run.data.tags["tokenizer_hash"] == out["tokenizer_hash"]
    client = tracking.MlflowClient(built["uri"])
    artifacts = {a.path for a in client.list_artifacts(built["run_id"])}
    assert {"tokenizer.json", "manifest.json"} <= artifacts


def test_progress_lines(tmp_path: Path, capsys: pytest.CaptureFixture, tracker) -> None:
    make_corpus(tmp_path / "c", n_docs=12, seed=2)
    cfg = make_cfg(tmp_path, tmp_path / "c", "data.num_shards=1")
    (tmp_path / "o").mkdir()
    run_work(TOKENIZE, cfg, {}, tmp_path / "o", tracker)
    lines = [line for line in capsys.readouterr().out.splitlines() if "tokenize shard 1/1" in line]
    assert len(lines) >= 2  # one per encode batch with progress_seconds=0, plus the last
    total = sum(f.stat().st_size for f in (tmp_path / "c").iterdir())  # the shard's input
    assert f"{total / 1e6:,.1f}/{total / 1e6:,.1f} MB (100%) | 12 docs |" in lines[-1]
    assert "done in" in lines[-1]
    for word in ("docs/s", "tokens/s", "ETA"):
        assert word in lines[0]


def test_same_tokens_for_any_shard_count_and_parallel_processes(built: dict, tracker) -> None:
    tmp, base = built["tmp"], built["outputs"]
    stores = {}
    for shards in (1, 4, 5):
        cfg = make_cfg(tmp, tmp / "corpus", f"data.num_shards={shards}")
        out = tmp / f"out{shards}"
        out.mkdir()
        stores[shards] = run_work(TOKENIZE, cfg, {}, out, tracker)
    # 4 shards tokenized by 2 concurrent processes, finalized here.
    cfg = make_cfg(tmp, tmp / "corpus", "data.num_shards=4")
    out = tmp / "out4p"
    out.mkdir()
    n = tokenize.prepare(cfg, {}, out, tracker)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(tokenize.part, [(cfg, out, i) for i in range(n)])
    stores["4p"] = tokenize.finalize(cfg, out, results, tracker)
    for other in stores.values():
        assert other["tokenizer_hash"] == base["tokenizer_hash"]
        for split in ("train", "validation"):
            a, b = SplitReader(base["store"], split), SplitReader(other["store"], split)
            assert np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))
            assert np.array_equal(a.doc_offsets(), b.doc_offsets())
    # The windows follow the parts' chunks: the same for the same shard count, however the
    # shards were encoded.
    x = TokenWindowLoader(stores[4]["store"], "train", 16, 8, seed=3)
    y = TokenWindowLoader(stores["4p"]["store"], "train", 16, 8, seed=3)
    for _ in range(5):
        assert x.next_batch().equal(y.next_batch())
    assert len(open_store(stores[5]["store"]).splits["train"].parts) == 5


def test_existing_tokenizer_path(built: dict, tmp_path: Path, tracker) -> None:
    base = built["outputs"]
    cfg = make_cfg(tmp_path, built["tmp"] / "corpus", f"tokenizer.path={base['tokenizer']}",
                   "data.num_shards=2")
    (tmp_path / "o").mkdir()
    out = run_work(TOKENIZE, cfg, {}, tmp_path / "o", tracker)
    assert out["tokenizer_hash"] == base["tokenizer_hash"]
    assert out["train_tokens"] == base["train_tokens"]


def test_incomplete_store_and_other_tokenizer_are_refused(
    built: dict, tmp_path: Path, tracker
) -> None:
    copy = tmp_path / "store.zarr"
    shutil.copytree(built["outputs"]["store"], copy)
    with pytest.raises(StoreError, match="built with tokenizer .* asks for"):
        open_store(copy, expected_tokenizer_hash="0" * 64)
    shutil.rmtree(copy / "train" / "00001")
    with pytest.raises(StoreError, match="train/00001 listed in manifest.json is missing"):
        open_store(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(StoreError, match="incomplete"):
        open_store(copy)
    with pytest.raises(StoreError, match="incomplete"):
        TokenWindowLoader(copy, "train", 16, 8)
    # A stage stopped before finalize leaves no manifest; finalize names missing shards.
    cfg = make_cfg(tmp_path, built["tmp"] / "corpus")
    out = tmp_path / "partial"
    out.mkdir()
    n = tokenize.prepare(cfg, {}, out, tracker)
    results = [tokenize.part(cfg, out, i) for i in range(n - 1)]
    with pytest.raises(StoreError, match="incomplete"):
        open_store(out / "store.zarr")
    with pytest.raises(DataError, match=r"missing \[2\]"):
        tokenize.finalize(cfg, out, results, tracker)
    assert not (out / "store.zarr" / "manifest.json").exists()
    # The missing shard is rerun; a dead writer's temp dir is cleared; the store completes.
    stale = out / "store.zarr" / "train" / ".00001.tmp-otherhost-999"
    stale.mkdir()
    results.append(tokenize.part(cfg, out, n - 1))
    outputs = tokenize.finalize(cfg, out, results, tracker)
    assert not stale.exists()
    assert open_store(outputs["store"]).documents == N_DOCS


def test_a_damaged_chunk_is_an_error_naming_the_part_not_silent_tokens(
    built: dict, tmp_path: Path
) -> None:
    """Five flipped bytes in a chunk file: the chunk's CRC32C fails on read, and the error
    names the part and the fix; the same read from the intact store gives the tokens."""
    copy = tmp_path / "store.zarr"
    shutil.copytree(built["outputs"]["store"], copy)
    intact = SplitReader(open_store(copy), "train").read(0, 64)
    shard_file = next(p for p in sorted((copy / "train" / "00000" / "tokens").rglob("*"))
                      if p.is_file() and p.name != "zarr.json")
    data = bytearray(shard_file.read_bytes())
    for i in range(40, 45):  # inside the first chunk's compressed bytes
        data[i] ^= 0xFF
    shard_file.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"train/00000/tokens: chunk 0 .* is damaged .* remove"):
        SplitReader(open_store(copy), "train").read(0, 64)
    assert np.array_equal(SplitReader(open_store(built["outputs"]["store"]), "train").read(0, 64),
                          intact)


def test_shard_refuses_a_tokenizer_replaced_after_prepare(built: dict, tmp_path: Path,
                                                          tracker) -> None:
    cfg = make_cfg(tmp_path, built["tmp"] / "corpus")
    out = tmp_path / "swapped"
    out.mkdir()
    tokenize.prepare(cfg, {}, out, tracker)
    shutil.copyfile(big_vocab_tokenizer(tmp_path / "other.json"), out / tokenize.TOKENIZER)
    with pytest.raises(DataError, match="changed since prepare"):
        tokenize.part(cfg, out, 0)
    parts = out / "store.zarr" / "train"
    assert [p.name for p in parts.iterdir()] == ["zarr.json"]  # no part, not even a temporary one


@pytest.mark.parametrize("case", ["non_utf8", "malformed_json", "missing_field", "not_string",
                                  "empty", "big_vocab"])
def test_bad_input_leaves_no_complete_store(case: str, tmp_path: Path, tracker) -> None:
    src = tmp_path / "src"
    make_corpus(src, n_docs=4, seed=5)
    extra = []
    if case == "non_utf8":
        (src / "zz.txt").write_bytes(b"\xff\xfe\x00 not utf-8")
        match = r"zz\.txt: not valid UTF-8"
    elif case == "malformed_json":
        shutil.rmtree(src)
        src.mkdir()
        (src / "d.jsonl").write_text('{"text": "a b c"}\n{"text": "d e f"\n')
        match = r"d\.jsonl:2: malformed JSON"
    elif case == "missing_field":
        shutil.rmtree(src)
        src.mkdir()
        (src / "d.jsonl").write_text('{"text": "a b c"}\n{"content": "d e f"}\n')
        match = r"d\.jsonl:2: record has no field 'text'"
    elif case == "not_string":
        shutil.rmtree(src)
        src.mkdir()
        (src / "d.jsonl").write_text('{"text": "a b c"}\n{"text": 12}\n')
        match = r"d\.jsonl:2: field 'text' is int"
    elif case == "empty":
        shutil.rmtree(src)
        src.mkdir()
        (src / "a.txt").write_text("")
        match = "no documents"
    else:
        extra = [f"tokenizer.path={big_vocab_tokenizer(tmp_path / 'big.json')}",
                 "data.token_dtype=uint16"]
        match = "70000 ids does not fit data.token_dtype=uint16"
    cfg = make_cfg(tmp_path, src, *extra)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError, match=match):
        run_work(TOKENIZE, cfg, {}, out, tracker)
    assert not (out / "store.zarr" / "manifest.json").exists()
    with pytest.raises(StoreError):
        open_store(out / "store.zarr")


def test_more_shards_than_documents(tmp_path: Path, tracker) -> None:
    texts = make_corpus(tmp_path / "c", n_docs=3, seed=8)
    cfg = make_cfg(tmp_path, tmp_path / "c", "data.num_shards=5", "data.validation_fraction=0.4")
    (tmp_path / "o").mkdir()
    out = run_work(TOKENIZE, cfg, {}, tmp_path / "o", tracker)
    info = open_store(out["store"])
    assert [p["documents"] for p in info.splits["train"].parts].count(0) >= 2  # empty parts
    assert (info.splits["train"].documents, info.splits["validation"].documents) == (2, 1)
    tok = Tokenizer.from_file(out["tokenizer"])
    docs = [tok.decode(d[:-1].tolist())
            for s in ("train", "validation") for d in split_docs(out["store"], s)]
    assert sorted(docs) == sorted(texts)


def test_a_removed_part_is_encoded_again_and_only_it(tmp_path: Path, seed_store,
                                                     capsys: pytest.CaptureFixture) -> None:
    """The fix a damaged chunk names: remove its part and rerun. The published store no
    longer passes tokenize's reuse check, so the stage continues from it (same directory,
    same MLflow run): the removed part is encoded again, the others are kept, and the store
    holds the same tokens as before."""
    from stages.mechanism.selection import decide_stages
    from tests.evalkit import micro_config, open_pipeline, run_stages

    seed_store(tmp_path)
    cfg = micro_config(tmp_path)
    first = run_stages(cfg, open_pipeline(cfg), ("tokenize",))["tokenize"]
    store = Path(first.outputs["store"])
    before = {s: SplitReader(open_store(store), s).read(0, 256) for s in ("train", "validation")}
    shutil.rmtree(store / "train" / "00000")  # the shard that holds the documents
    decisions = decide_stages(PIPELINE, cfg, None, None, False)
    (decision,) = [d for d in decisions if d.name == "tokenize"]
    assert decision.action == "run" and "its output is damaged" in decision.reason
    assert "train/00000 listed in manifest.json is missing" in decision.reason
    capsys.readouterr()
    again = run_stages(cfg, open_pipeline(cfg), ("tokenize",))["tokenize"]
    out = capsys.readouterr().out
    assert again.key == first.key and again.outputs["store"] == str(store)
    assert "its output is damaged" in out
    kept = [line for line in out.splitlines() if "finished by an earlier attempt" in line]
    assert len(kept) == 1 and kept[0].startswith("tokenize shard 2/2: "), kept
    assert any(line.startswith("tokenize shard 1/2: ") and "done in" in line
               for line in out.splitlines()), out
    after = {s: SplitReader(open_store(store), s).read(0, 256) for s in ("train", "validation")}
    assert all(np.array_equal(before[s], after[s]) for s in before)
    assert again.run_id == first.run_id  # the same stage run, continued
