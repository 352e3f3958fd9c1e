"""The document corpus of one tokenization: saved once, then read by every shard task.

``prepare_corpus`` loads the source, saves it as an Arrow dataset (memory-mapped by the
shard tasks, so they never re-read or re-parse the raw files), fingerprints it, and fixes
the train/validation assignment of every document. Shards are contiguous document
ranges, so concatenating the shards in order gives the corpus order whatever their number.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import numpy as np

from data_prep.config import DataConfig
from data_prep.errors import DataError
from data_prep.sources import load_source

BATCH = 2048


@dataclass
class CorpusInfo:
    """What the shard tasks need to know about the saved corpus (stored as corpus.json)."""

    path: str
    num_documents: int
    num_bytes: int
    fingerprint: str
    num_validation: int

    def save(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> CorpusInfo:
        if not path.is_file():
            raise DataError(f"{path} is missing: run the tokenize stage's prepare step first")
        return cls(**json.loads(path.read_text()))


def validation_count(num_documents: int, fraction: float) -> int:
    """Documents held out: round(fraction * n), at least 1, leaving at least 1 for training."""
    if num_documents < 2:
        raise DataError(
            f"the corpus has {num_documents} document(s); train and validation splits need at "
            "least 2: add documents to data.source or raise data.max_documents"
        )
    return min(num_documents - 1, max(1, round(fraction * num_documents)))


def validation_mask(num_documents: int, num_validation: int, seed: int) -> np.ndarray:
    """Boolean mask over document indices: True for the seeded validation documents."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(num_documents, dtype=bool)
    mask[rng.choice(num_documents, size=num_validation, replace=False)] = True
    return mask


def shard_range(num_documents: int, num_shards: int, index: int) -> tuple[int, int]:
    """Document range [start, stop) of input shard ``index`` (contiguous, balanced)."""
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} out of range for {num_shards} shards")
    return index * num_documents // num_shards, (index + 1) * num_documents // num_shards


def prepare_corpus(cfg: DataConfig, out_dir: Path) -> CorpusInfo:
    """Load ``cfg.source``, save it to out_dir/corpus and write out_dir/corpus.json."""
    cache = out_dir / "hf_cache"
    ds = load_source(cfg, cache)
    target = out_dir / "corpus"
    tmp = out_dir / ".corpus.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    shutil.rmtree(cache, ignore_errors=True)  # the saved copy is all later steps read
    digest = hashlib.sha256()
    num_bytes = 0
    saved = datasets.load_from_disk(str(target))
    for start in range(0, len(saved), BATCH):
        for text in saved[start : start + BATCH]["text"]:
            raw = text.encode("utf-8")
            num_bytes += len(raw)
            digest.update(len(raw).to_bytes(8, "little"))
            digest.update(raw)
    info = CorpusInfo(
        path="corpus",
        num_documents=len(saved),
        num_bytes=num_bytes,
        fingerprint=digest.hexdigest(),
        num_validation=validation_count(len(saved), cfg.validation_fraction),
    )
    info.save(out_dir / "corpus.json")
    return info


def open_corpus(out_dir: Path) -> tuple[CorpusInfo, datasets.Dataset]:
    """The saved corpus (memory-mapped) and its description."""
    info = CorpusInfo.load(out_dir / "corpus.json")
    return info, datasets.load_from_disk(str(out_dir / info.path))


def training_sample(ds: datasets.Dataset, max_bytes: int, seed: int) -> list[str]:
    """Whole documents in a seeded random order until ``max_bytes`` (at least one document)."""
    order = np.random.default_rng(seed).permutation(len(ds))
    sample: list[str] = []
    total = 0
    for start in range(0, len(order), 256):
        rows = ds.select(order[start : start + 256].tolist())["text"]
        for text in rows:
            size = len(text.encode("utf-8"))
            if sample and total + size > max_bytes:
                return sample
            sample.append(text)
            total += size
    return sample
