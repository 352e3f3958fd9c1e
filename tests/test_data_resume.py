"""The tokenize stage started again in an earlier attempt's directory keeps what was finished."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from data_prep.errors import DataError
from data_prep.store import SplitReader
from stages.mechanism import tracking
from stages.mechanism.walk import run_work
from stages.registry import declaration
from stages.tokenize import work as tokenize
from tests.test_data_common import make_cfg, make_corpus, make_tracker

N_DOCS = 30

TOKENIZE = declaration("tokenize")


@pytest.fixture(autouse=True)
def _hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


@pytest.fixture(scope="module")
def tracker(tmp_path_factory: pytest.TempPathFactory, seed_store) -> tracking.Tracker:
    return make_tracker(tmp_path_factory.mktemp("mlruns"), seed_store, "data-resume-tests")[0]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, tracker: tracking.Tracker) -> dict:
    """One uninterrupted run: the store every resumed run must equal."""
    tmp = tmp_path_factory.mktemp("resume")
    make_corpus(tmp / "corpus", n_docs=N_DOCS, seed=11)
    cfg = make_cfg(tmp, tmp / "corpus")
    (tmp / "clean").mkdir()
    return {"tmp": tmp, "cfg": cfg, "outputs": run_work(TOKENIZE, cfg, {}, tmp / "clean", tracker)}


def store_files(store: Path) -> dict[str, bytes]:
    """Every file of a store by relative path; the manifest without its creation time."""
    files = {}
    for path in sorted(p for p in store.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == "manifest.json":
            manifest = json.loads(data)
            assert manifest.pop("created")
            data = json.dumps(manifest, sort_keys=True).encode()
        files[str(path.relative_to(store))] = data
    return files


def identities(*roots: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every file under ``roots``: a file written again changes both."""
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns)
            for root in roots for p in ([root] if root.is_file() else root.rglob("*"))
            if p.is_file()}


def part_files(out: Path, shard: int) -> list[Path]:
    return [out / "store.zarr" / split / f"{shard:05d}" for split in ("train", "validation")] + [
        out / "parts" / f"{shard:05d}.json"]


def rerun(cfg, out: Path, tracker) -> tuple[list[dict], dict]:
    """What a new attempt of the stage does in the same directory."""
    n = tokenize.prepare(cfg, {}, out, tracker)
    results = [tokenize.part(cfg, out, i) for i in range(n)]
    return results, tokenize.finalize(cfg, out, results, tracker)


def test_rerun_after_prepare_and_one_part_keeps_them(clean: dict, tracker, capsys) -> None:
    tmp, cfg = clean["tmp"], clean["cfg"]
    out = tmp / "resumed"
    out.mkdir()
    tokenize.prepare(cfg, {}, out, tracker)
    first = tokenize.part(cfg, out, 0)  # then the attempt dies
    kept = identities(out / "tokenizer.json", out / "corpus", *part_files(out, 0))
    n = tokenize.prepare(cfg, {}, out, tracker)
    assert "corpus and tokenizer kept from an earlier attempt" in capsys.readouterr().out
    assert identities(out / "tokenizer.json", out / "corpus", *part_files(out, 0)) == kept
    results = [tokenize.part(cfg, out, i) for i in range(n)]
    assert "finished by an earlier attempt" in capsys.readouterr().out
    assert results[0] == first
    assert identities(*part_files(out, 0)) == {
        k: v for k, v in kept.items() if "/store.zarr/" in k or "/parts/" in k}
    outputs = tokenize.finalize(cfg, out, results, tracker)
    assert outputs["tokenizer_hash"] == clean["outputs"]["tokenizer_hash"]
    assert store_files(Path(outputs["store"])) == store_files(Path(clean["outputs"]["store"]))


@pytest.mark.parametrize("damage", ["record_removed", "record_truncated", "part_removed"])
def test_half_written_part_is_redone(clean: dict, tracker, damage: str) -> None:
    tmp, cfg = clean["tmp"], clean["cfg"]
    out = tmp / f"damaged_{damage}"
    out.mkdir()
    run_work(TOKENIZE, cfg, {}, out, tracker)
    record = out / "parts" / "00001.json"
    if damage == "record_removed":  # the writer died after publishing the train part
        record.unlink()
        shutil.rmtree(out / "store.zarr" / "validation" / "00001")
    elif damage == "record_truncated":
        record.write_bytes(record.read_bytes()[:40])
    else:
        shutil.rmtree(out / "store.zarr" / "validation" / "00001")
    stale = out / "store.zarr" / "validation" / ".00001.tmp-deadhost-1"
    stale.mkdir()
    (stale / "zarr.json").write_text("{")
    untouched = identities(*part_files(out, 0), *part_files(out, 2))
    redone = identities(out / "store.zarr" / "train" / "00001")
    results, outputs = rerun(cfg, out, tracker)
    assert identities(*part_files(out, 0), *part_files(out, 2)) == untouched
    now = identities(out / "store.zarr" / "train" / "00001")
    assert now.keys() == redone.keys() and all(now[k] != redone[k] for k in now)
    assert json.loads(record.read_text())["result"] == results[1]
    assert not stale.exists()
    assert store_files(Path(outputs["store"])) == store_files(Path(clean["outputs"]["store"]))


def test_other_configuration_in_the_same_directory_starts_over(clean: dict, tracker) -> None:
    tmp, cfg = clean["tmp"], clean["cfg"]
    out = tmp / "reconfigured"
    out.mkdir()
    tokenize.prepare(cfg, {}, out, tracker)
    tokenize.part(cfg, out, 0)
    earlier = identities(*part_files(out, 0))
    bigger = make_cfg(tmp, tmp / "corpus", "data.chunk_tokens=2048")
    _, outputs = rerun(bigger, out, tracker)
    assert not set(identities(*part_files(out, 0)).items()) & set(earlier.items())
    tokens = zarr.open_array(str(out / "store.zarr" / "train" / "00000" / "tokens"), mode="r")
    assert tokens.chunks == (2048,)
    for split in ("train", "validation"):
        a, b = SplitReader(clean["outputs"]["store"], split), SplitReader(outputs["store"], split)
        assert np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))
        assert np.array_equal(a.doc_offsets(), b.doc_offsets())


def test_part_before_prepare_is_refused(tmp_path: Path, clean: dict) -> None:
    with pytest.raises(DataError, match="prepared.json is missing: run the tokenize stage's "
                                        "prepare step first"):
        tokenize.part(clean["cfg"], tmp_path, 0)
    assert not os.listdir(tmp_path)
