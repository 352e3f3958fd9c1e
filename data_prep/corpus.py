"""The document corpus of one tokenization: saved once, then read by every shard task.

``prepare_corpus`` loads the source (or each labelled source of ``data.sources``, in the
order given, as one contiguous document range per source), saves it as an Arrow dataset
(memory-mapped by the shard tasks, so they never re-read or re-parse the raw files),
fingerprints it, and fixes the train/validation assignment of every document. Shards are
contiguous document ranges that never span two sources, so concatenating the shards in
order gives the corpus order whatever their number.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from data_prep.atomic import write_json_atomic
from data_prep.config import DataConfig
from data_prep.errors import DataError
from data_prep.sources import load_source, text_features

BATCH = 2048
CORPUS = "corpus"
CORPUS_INFO = "corpus.json"


@dataclass
class CorpusInfo:
    """What the shard tasks need to know about the saved corpus (stored as corpus.json)."""

    path: str
    num_documents: int
    num_bytes: int
    fingerprint: str
    num_validation: int
    sources: list[dict[str, Any]] = field(default_factory=list)
    """Labelled sources in corpus order, each {"label", "source", "start", "stop",
    "num_validation"} (its document range [start, stop)); empty for a single data.source."""

    config: dict[str, Any] = field(default_factory=dict)
    """The data configuration the corpus was saved for (``saved_corpus`` compares it)."""

    def save(self, path: Path) -> None:
        write_json_atomic(path, asdict(self))

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


def validation_mask(num_documents: int, num_validation: int, seed: int | list[int]) -> np.ndarray:
    """Boolean mask over document indices: True for the seeded validation documents."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(num_documents, dtype=bool)
    mask[rng.choice(num_documents, size=num_validation, replace=False)] = True
    return mask


def _label_seed(seed: int, label: str) -> list[int]:
    # Seeded by the label, not its position: adding or reordering sources leaves each
    # source's own validation documents unchanged.
    return [seed, int.from_bytes(hashlib.sha256(label.encode("utf-8")).digest()[:8], "little")]


def source_validation_count(num_documents: int, fraction: float) -> int:
    """Held-out documents of one labelled source: as ``validation_count``, 0 for one document."""
    return 0 if num_documents < 2 else validation_count(num_documents, fraction)


def corpus_validation_mask(info: CorpusInfo, seed: int) -> np.ndarray:
    """Validation mask of the whole corpus; with labelled sources, drawn per source (stratified)."""
    if not info.sources:
        return validation_mask(info.num_documents, info.num_validation, seed)
    mask = np.zeros(info.num_documents, dtype=bool)
    for src in info.sources:
        start, stop = src["start"], src["stop"]
        mask[start:stop] = validation_mask(stop - start, src["num_validation"],
                                           _label_seed(seed, src["label"]))
    return mask


def shard_range(num_documents: int, num_shards: int, index: int) -> tuple[int, int]:
    """Document range [start, stop) of input shard ``index`` (contiguous, balanced)."""
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} out of range for {num_shards} shards")
    return index * num_documents // num_shards, (index + 1) * num_documents // num_shards


def allocate_shards(sizes: list[int], num_shards: int) -> list[int]:
    """Shards per source: one each, the rest in proportion to ``sizes`` (largest remainder).

    The counts sum to ``num_shards``; ties go to the earlier source.
    """
    if num_shards < len(sizes):
        raise DataError(f"data.num_shards={num_shards} is less than the {len(sizes)} sources: "
                        f"set data.num_shards >= {len(sizes)}")
    total = sum(sizes)
    shares = [(num_shards - len(sizes)) * n for n in sizes]
    counts = [1 + share // total for share in shares]
    order = sorted(range(len(sizes)), key=lambda i: (-(shares[i] % total), i))
    for i in order[: num_shards - sum(counts)]:
        counts[i] += 1
    return counts


def shard_plan(info: CorpusInfo, num_shards: int) -> list[dict[str, Any]]:
    """Every input shard as {"start", "stop", "source"}: contiguous document ranges in corpus
    order, each inside one labelled source ("source" None for a single data.source)."""
    if not info.sources:
        ranges = (shard_range(info.num_documents, num_shards, i) for i in range(num_shards))
        return [{"start": a, "stop": b, "source": None} for a, b in ranges]
    counts = allocate_shards([s["stop"] - s["start"] for s in info.sources], num_shards)
    plan = []
    for src, count in zip(info.sources, counts, strict=True):
        for i in range(count):
            a, b = shard_range(src["stop"] - src["start"], count, i)
            plan.append(
                {"start": src["start"] + a, "stop": src["start"] + b, "source": src["label"]}
            )
    return plan


def load_corpus(cfg: DataConfig, cache_dir: Path) -> tuple[datasets.Dataset, list[dict[str, Any]]]:
    """The corpus as one Dataset and its labelled sources ({"label", "source", "start", "stop"};
    empty for a single data.source). Errors name the label (``data.sources.<label>``)."""
    labelled = cfg.labelled_sources()
    if labelled[0][0] is None:
        return load_source(cfg, cache_dir), []
    parts, ranges, start = [], [], 0
    for label, spec in labelled:
        key = f"data.sources.{label}"
        try:
            ds = load_source(cfg, cache_dir, source=spec, key=key)
        except DataError as err:
            raise DataError(str(err) if key in str(err) else f"{key}: {err}") from None
        if ds.features != text_features():  # e.g. large_string from parquet: one schema
            ds = ds.cast(text_features())
        parts.append(ds)
        ranges.append({"label": label, "source": spec, "start": start, "stop": start + len(ds)})
        start += len(ds)
    return datasets.concatenate_datasets(parts), ranges


def prepare_corpus(cfg: DataConfig, out_dir: Path) -> CorpusInfo:
    """Load the source(s), save them to out_dir/corpus and write out_dir/corpus.json."""
    cache = out_dir / "hf_cache"
    ds, sources = load_corpus(cfg, cache)
    target = out_dir / CORPUS
    tmp = out_dir / ".corpus.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    (out_dir / CORPUS_INFO).unlink(missing_ok=True)  # it describes the copy replaced here
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
    if sources:  # the labels and their document ranges are part of what was tokenized
        digest.update(json.dumps([[s["label"], s["start"], s["stop"]] for s in sources]).encode())
        for src in sources:
            src["num_validation"] = source_validation_count(src["stop"] - src["start"],
                                                            cfg.validation_fraction)
        num_validation = sum(s["num_validation"] for s in sources)
        if num_validation == 0:
            raise DataError(
                f"every source in data.sources ({', '.join(s['label'] for s in sources)}) has a "
                "single document; the validation split needs a source with at least 2"
            )
    else:
        num_validation = validation_count(len(saved), cfg.validation_fraction)
    info = CorpusInfo(
        path=CORPUS,
        num_documents=len(saved),
        num_bytes=num_bytes,
        fingerprint=digest.hexdigest(),
        num_validation=num_validation,
        sources=sources,
        config=_config_record(cfg),
    )
    info.save(out_dir / CORPUS_INFO)  # last: from here on the saved corpus is complete
    return info


def _config_record(cfg: DataConfig) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(cfg)))


def saved_corpus(cfg: DataConfig, out_dir: Path) -> CorpusInfo | None:
    """The corpus an earlier ``prepare_corpus`` saved in ``out_dir`` for the same ``cfg``, or
    None. corpus.json is written last, so its presence (with the corpus directory, which
    ``drop_corpus`` removes) means the saved copy is complete."""
    path = Path(out_dir) / CORPUS_INFO
    try:
        info = CorpusInfo.load(path)
    except (DataError, OSError, TypeError, ValueError):
        return None
    if info.config != _config_record(cfg) or not (Path(out_dir) / info.path).is_dir():
        return None
    return info


def drop_corpus(out_dir: Path) -> None:
    """Remove the saved corpus copy (renamed away first, so no half-removed copy is left
    where ``saved_corpus`` would find it)."""
    target = Path(out_dir) / CORPUS
    if not target.exists():
        return
    doomed = target.with_name(f".{CORPUS}.removed-{os.getpid()}")
    os.replace(target, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def open_corpus(out_dir: Path) -> tuple[CorpusInfo, datasets.Dataset]:
    """The saved corpus (memory-mapped) and its description."""
    info = CorpusInfo.load(out_dir / CORPUS_INFO)
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
