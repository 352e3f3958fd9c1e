"""data_prep.chunk_files: the direct chunk reader gives Zarr's tokens and Zarr's checks."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from data_prep.chunk_files import ChunkFile, CorruptChunk, open_chunk_file
from data_prep.store import SplitReader
from data_prep.writer import PartWriter
from stages.mechanism.walk import run_work
from stages.registry import declaration
from tests.test_data_common import make_cfg, make_corpus, make_tracker

CHUNK, PER_SHARD = 1024, 4


@pytest.fixture(scope="module")
def part(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A part of 3 whole shard files and a partial one (its last chunk partial too), with a
    chunk of zeros in the middle (the fill value: Zarr does not store it)."""
    tmp = tmp_path_factory.mktemp("chunks")
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 60000, size=CHUNK * PER_SHARD * 3 + CHUNK * 2 + 300).astype(np.uint16)
    tokens[5 * CHUNK : 6 * CHUNK] = 0
    writer = PartWriter(tmp, "train", 0, np.uint16, CHUNK, PER_SHARD)
    writer.add([tokens])
    writer.close({})
    np.save(tmp / "expected.npy", tokens)
    return tmp / "train" / "00000" / "tokens"


def test_every_chunk_equals_zarrs_read(part: Path) -> None:
    direct = open_chunk_file(part)
    assert isinstance(direct, ChunkFile)
    expected = np.load(part.parent.parent.parent / "expected.npy")
    array = zarr.open_array(str(part), mode="r")
    assert direct.length == len(expected) == array.shape[0]
    chunks = [direct.chunk(i) for i in range(-(-len(expected) // CHUNK))]
    assert [len(c) for c in chunks[-2:]] == [CHUNK, 300]
    assert all(c.dtype == np.uint16 for c in chunks)
    assert np.array_equal(np.concatenate(chunks), expected)
    assert np.array_equal(np.concatenate(chunks), array[:])
    assert not chunks[5].any()  # the chunk Zarr did not store reads as its fill value
    with pytest.raises(IndexError, match="outside an array"):
        direct.chunk(len(chunks))


@pytest.mark.parametrize("where", ["chunk", "index"])
def test_a_flipped_byte_fails_the_crc(part: Path, tmp_path: Path, where: str) -> None:
    copy = tmp_path / "tokens"
    shutil.copytree(part, copy)
    shard = copy / "c" / "1"
    data = bytearray(shard.read_bytes())
    data[10 if where == "chunk" else len(data) - 10] ^= 0x01
    shard.write_bytes(bytes(data))
    direct = open_chunk_file(copy)
    assert np.array_equal(direct.chunk(0), open_chunk_file(part).chunk(0))  # shard 0 intact
    with pytest.raises(CorruptChunk, match=r"shard file c/1 fails its CRC32C"):
        direct.chunk(PER_SHARD)


def test_another_layout_is_left_to_zarr(part: Path, tmp_path: Path) -> None:
    copy = tmp_path / "tokens"
    shutil.copytree(part, copy)
    meta = json.loads((copy / "zarr.json").read_text())
    meta["codecs"][0]["configuration"]["index_location"] = "start"
    (copy / "zarr.json").write_text(json.dumps(meta))
    assert open_chunk_file(copy) is None
    assert open_chunk_file(tmp_path / "absent") is None


def test_the_loader_reads_a_store_through_it(tmp_path: Path, seed_store) -> None:
    """A token store's split reads the same through the direct reader as through Zarr."""
    make_corpus(tmp_path / "corpus", n_docs=30, seed=2)
    cfg = make_cfg(tmp_path, tmp_path / "corpus")
    (tmp_path / "out").mkdir()
    store = run_work(declaration("tokenize"), cfg, {}, tmp_path / "out",
                     make_tracker(tmp_path / "ml", seed_store)[0])["store"]
    reader = SplitReader(store, "train")
    assert all(isinstance(reader._array(i), ChunkFile) for i in range(len(reader.parts)))
    through_zarr = np.concatenate([
        zarr.open_array(str(Path(store) / p["path"] / "tokens"), mode="r")[:]
        for p in reader.parts])
    assert np.array_equal(reader.read(0, reader.num_tokens), through_zarr)
