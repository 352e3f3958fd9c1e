"""Stage tokenize: raw text -> tokenizer.json + a Zarr token store (train/validation).

``prepare`` saves the corpus and trains (or loads) the tokenizer; ``part`` encodes
one contiguous range of documents into its own store parts (safe to run in parallel
processes); ``finalize`` checks every part and writes the manifest last, atomically.
``run`` does the three serially. The store layout is described in ``data_prep``.

With ``data.sources`` every input shard lies inside one labelled source, so each part carries
its source label (part attributes and manifest), and the manifest lists every source with its
token and document counts per split.
"""
from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import zarr

from data_prep.corpus import (
    CorpusInfo,
    corpus_validation_mask,
    open_corpus,
    prepare_corpus,
    shard_plan,
    training_sample,
)
from data_prep.errors import DataError
from data_prep.progress import Progress
from data_prep.store import FORMAT_VERSION, MANIFEST, SPLITS, open_store
from data_prep.tokenizer import (
    load_tokenizer,
    save_tokenizer,
    shared_tokenizer,
    token_dtype,
    tokenizer_hash,
    train_tokenizer,
)
from data_prep.writer import PartWriter, directory_bytes, part_name, write_json_atomic
from stages.config import PipelineConfig
from stages.stage import FAN_OUT, StageShape

SECTIONS = ("data", "tokenizer")
UPSTREAM: tuple[str, ...] = ()
RESUMABLE = True  # finished shards are kept and not encoded again


def shape(cfg: PipelineConfig) -> StageShape:
    """Fan-out: one part per input shard."""
    return StageShape(FAN_OUT, parts=cfg.data.num_shards, note=f"x{cfg.data.num_shards} shards")
STORE = "store.zarr"
TOKENIZER = "tokenizer.json"
PREPARED = "prepared.json"


def prepare(cfg: PipelineConfig, inputs: dict[str, dict], out_dir: Path, tracker) -> int:
    """Save the corpus, train or load the tokenizer, lay out the store; return the shard count.

    The count is ``data.num_shards``; with ``data.sources`` they are divided among the sources
    in proportion to their documents (at least one each). ``inputs`` is empty (the first
    stage); it keeps the signature every stage shares.
    """
    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    prepare_corpus(cfg.data, out_dir)
    info, ds = open_corpus(out_dir)
    t1 = time.perf_counter()
    if cfg.tokenizer.path:
        tokenizer = load_tokenizer(cfg.tokenizer.path, cfg.tokenizer.eos_token)
    else:
        sample = training_sample(ds, cfg.tokenizer.train_sample_bytes, cfg.data.split_seed)
        print(f"tokenize: training a {cfg.tokenizer.vocab_size}-id byte-level BPE on {len(sample)} "
              f"documents ({sum(len(t) for t in sample) / 1e6:.1f} M characters)", flush=True)
        tokenizer = train_tokenizer(sample, cfg.tokenizer)
    t2 = time.perf_counter()
    vocab = tokenizer.get_vocab_size()
    dtype = token_dtype(vocab, cfg.data.token_dtype)  # refuse before anything is written
    save_tokenizer(tokenizer, out_dir / TOKENIZER)
    store = out_dir / STORE
    shutil.rmtree(store, ignore_errors=True)  # an earlier, unfinished attempt
    root = zarr.open_group(str(store), mode="w", zarr_format=3)
    for split in SPLITS:
        root.create_group(split)
    shards = shard_plan(info, cfg.data.num_shards)
    prepared = {
        "num_shards": len(shards),
        "shards": shards,
        "vocab_size": vocab,
        "eos_id": tokenizer.token_to_id(cfg.tokenizer.eos_token),
        "dtype": dtype.name,
        "tokenizer_hash": tokenizer_hash(tokenizer),
    }
    write_json_atomic(out_dir / PREPARED, prepared)
    tracker.set_tags({"tokenizer_hash": prepared["tokenizer_hash"],
                      "source_fingerprint": info.fingerprint})
    tracker.log_metrics({"corpus_documents": info.num_documents, "corpus_bytes": info.num_bytes,
                         "corpus_load_s": t1 - t0, "tokenizer_train_s": t2 - t1})
    if info.sources:
        counts = {s["label"]: sum(1 for p in shards if p["source"] == s["label"]) for s in info.sources}
        origin = "sources " + ", ".join(
            f"{s['label']} ({s['stop'] - s['start']} docs, {counts[s['label']]} "
            f"shard{'s' if counts[s['label']] > 1 else ''})"
            for s in info.sources)
    else:
        origin = repr(cfg.data.source or "stdlib")
    print(f"tokenize: {info.num_documents} documents ({info.num_bytes / 1e6:.1f} MB) from "
          f"{origin}; tokenizer vocab {vocab} in {t2 - t1:.1f}s", flush=True)
    return len(shards)


def part(cfg: PipelineConfig, out_dir: Path, shard_index: int) -> dict[str, Any]:
    """Encode input shard ``shard_index`` into its own train and validation parts."""
    out_dir = Path(out_dir)
    prepared = json.loads((out_dir / PREPARED).read_text())
    num_shards = prepared["num_shards"]
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard index {shard_index} out of range for {num_shards} shards")
    info, ds = open_corpus(out_dir)
    tokenizer = shared_tokenizer(out_dir / TOKENIZER, cfg.tokenizer.eos_token)
    shard = prepared["shards"][shard_index]
    start, stop, label = shard["start"], shard["stop"], shard["source"]
    began, t0 = time.time(), time.perf_counter()
    batches = _batches(ds, start, stop, cfg.data.encode_batch_bytes)

    def encode(batch: tuple[int, int]) -> list:
        # The fast variant skips character offsets, which a token store never needs (same ids).
        return tokenizer.encode_batch_fast(ds[batch[0] : batch[1]]["text"])

    # Encoding releases the GIL: the first batch is encoding while the checks and writers are
    # set up, and the next batch while this one is converted and written, so the Python and
    # Zarr work does not leave the encoder idle.
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(encode, batches[0]) if batches else None
        if tokenizer_hash(tokenizer) != prepared["tokenizer_hash"]:
            raise DataError(f"{out_dir / TOKENIZER} changed since prepare; rerun the tokenize stage")
        eos, dtype = prepared["eos_id"], np.dtype(prepared["dtype"])
        is_val = corpus_validation_mask(info, cfg.data.split_seed)[start:stop]
        writers = {
            split: PartWriter(out_dir / STORE, split, shard_index, dtype,
                              cfg.data.chunk_tokens, cfg.data.chunks_per_shard)
            for split in SPLITS
        }
        progress = Progress(f"tokenize shard {shard_index + 1}/{num_shards}"
                            + (f" [{label}]" if label is not None else ""), stop - start,
                            cfg.data.progress_seconds)
        for k, (a, b) in enumerate(batches):
            encodings = pending.result()
            if k + 1 < len(batches):
                pending = pool.submit(encode, batches[k + 1])
            _write_batch(encodings, is_val[a - start : b - start], eos, dtype, writers, progress)
    attrs = {"shard": shard_index, "tokenizer_hash": prepared["tokenizer_hash"]}
    if label is not None:
        attrs["source"] = label
    parts = {split: writers[split].close({**attrs, "split": split}) for split in SPLITS}
    progress.emit(done=True)
    return {
        "shard": shard_index,
        "source": label,
        "documents": stop - start,
        "tokens": sum(p["tokens"] for p in parts.values()),
        "splits": parts,
        "start_time": began,
        "end_time": began + (time.perf_counter() - t0),
        "seconds": time.perf_counter() - t0,
    }


TAIL_FRACTION = 0.125


def _batches(ds, start: int, stop: int, max_bytes: int) -> list[tuple[int, int]]:
    """Document ranges of about ``max_bytes`` of text each (at least one document).

    The last range is cut again so that its final ~1/8 of the bytes is a batch of its own:
    the writes of the long batch then overlap the encoding of the short one, and only the
    short batch's writes are left after the encoder finishes.
    """
    sizes = pc.binary_length(ds.data.column("text").slice(start, stop - start)).to_numpy(
        zero_copy_only=False)
    batches, first, total = [], start, 0
    for i, size in enumerate(sizes.tolist(), start=start):
        if total and total + size > max_bytes:
            batches.append((first, i))
            first, total = i, 0
        total += size
    if first < stop:
        batches.append((first, stop))
    if batches:
        a, b = batches[-1]
        tail = np.cumsum(sizes[a - start : b - start][::-1])
        cut = b - int(np.searchsorted(tail, TAIL_FRACTION * tail[-1]))  # first doc of the tail
        if a < cut < b:
            batches[-1:] = [(a, cut), (cut, b)]
    return batches


def _write_batch(encodings: list, is_val: np.ndarray, eos: int, dtype: np.dtype,
                 writers: dict[str, PartWriter], progress: Progress) -> None:
    """Append one encoded batch (eos after every document) to the train/validation parts."""
    docs: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
    tokens = 0
    for enc, val in zip(encodings, is_val, strict=True):
        ids = enc.ids
        ids.append(eos)
        tokens += len(ids)
        docs["validation" if val else "train"].append(np.array(ids, dtype=dtype))
    for split in SPLITS:
        writers[split].add(docs[split])
    progress.update(len(encodings), tokens)


def _collect_parts(store: Path, split: str, shards: list[dict[str, Any]],
                   token_hash: str) -> list[dict[str, Any]]:
    """Each shard's part of ``split``, checked against the attributes its writer left."""
    parts = []
    for shard, plan in enumerate(shards):
        path = store / part_name(split, shard)
        if not (path / "zarr.json").is_file():
            raise DataError(f"tokenize shard {shard} has not written {path}: run part "
                            f"for shard {shard} before finalize")
        attrs = dict(zarr.open_group(str(path), mode="r").attrs)
        if attrs.get("tokenizer_hash") != token_hash:
            raise DataError(f"{path} was written with another tokenizer; rerun its shard")
        if attrs.get("source") != plan["source"]:
            raise DataError(f"{path} holds source {attrs.get('source')!r}, the shard plan says "
                            f"{plan['source']!r}; rerun its shard")
        part = {"path": part_name(split, shard), "tokens": attrs["tokens"],
                "documents": attrs["documents"]}
        if plan["source"] is not None:
            part["source"] = plan["source"]
        parts.append(part)
    return parts


def _source_summary(info: CorpusInfo, splits: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per labelled source: its token and document counts, in total and per split."""
    out = []
    for src in info.sources:
        label = src["label"]
        mine = {split: [p for p in splits[split]["parts"] if p.get("source") == label]
                for split in SPLITS}
        split_tokens = {split: sum(p["tokens"] for p in parts) for split, parts in mine.items()}
        split_docs = {split: sum(p["documents"] for p in parts) for split, parts in mine.items()}
        if sum(split_docs.values()) != src["stop"] - src["start"]:
            raise DataError(f"store parts of source {label!r} hold {sum(split_docs.values())} "
                            f"documents, the corpus has {src['stop'] - src['start']}; rerun the "
                            "tokenize stage")
        out.append({"label": label, "source": src["source"], "tokens": sum(split_tokens.values()),
                    "documents": sum(split_docs.values()), "split_tokens": split_tokens,
                    "split_documents": split_docs})
    return out


def finalize(cfg: PipelineConfig, out_dir: Path, shard_results: list[dict[str, Any]], tracker) -> dict[str, Any]:
    """Check all parts, write store attributes and the manifest (last, atomically); log."""
    out_dir = Path(out_dir)
    prepared = json.loads((out_dir / PREPARED).read_text())
    info = CorpusInfo.load(out_dir / "corpus.json")
    store = out_dir / STORE
    num_shards = prepared["num_shards"]
    shards = prepared["shards"]
    done = sorted(r["shard"] for r in shard_results)
    if done != list(range(num_shards)):
        missing = sorted(set(range(num_shards)) - set(done))
        raise DataError(f"finalize got results for shards {done}; missing {missing} of {num_shards}")
    splits = {}
    for split in SPLITS:
        parts = _collect_parts(store, split, shards, prepared["tokenizer_hash"])
        splits[split] = {"tokens": sum(p["tokens"] for p in parts),
                         "documents": sum(p["documents"] for p in parts), "parts": parts}
    if sum(s["documents"] for s in splits.values()) != info.num_documents:
        raise DataError(f"store parts hold {sum(s['documents'] for s in splits.values())} documents, "
                        f"corpus has {info.num_documents}; rerun the tokenize stage")
    for split in SPLITS:  # temp dirs of writers that died (their shard was rerun since)
        for stale in (store / split).glob(".*.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    shutil.copyfile(out_dir / TOKENIZER, store / TOKENIZER)
    summary = {
        "format_version": FORMAT_VERSION,
        "tokenizer_hash": prepared["tokenizer_hash"],
        "vocab_size": prepared["vocab_size"],
        "eos_id": prepared["eos_id"],
        "dtype": prepared["dtype"],
        "chunk_tokens": cfg.data.chunk_tokens,
        "chunks_per_shard": cfg.data.chunks_per_shard,
        # One source: its spec; several: null, and "sources" lists them in corpus order.
        "source": None if info.sources else (cfg.data.source or "stdlib"),
        "sources": _source_summary(info, splits),
        "source_fingerprint": info.fingerprint,
        "tokens": sum(s["tokens"] for s in splits.values()),
        "documents": info.num_documents,
        "split_tokens": {k: v["tokens"] for k, v in splits.items()},
        "split_documents": {k: v["documents"] for k, v in splits.items()},
    }
    zarr.open_group(str(store), mode="r+").update_attributes(summary)
    manifest = {**summary, "complete": True, "tokenizer_file": TOKENIZER, "num_shards": num_shards,
                "splits": splits, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json_atomic(store / MANIFEST, manifest)  # the store is complete from here on
    opened = open_store(store, prepared["tokenizer_hash"])
    shutil.rmtree(out_dir / info.path, ignore_errors=True)  # the saved corpus copy is no longer needed
    token_bytes = sum(directory_bytes(store / p["path"] / "tokens")
                      for s in splits.values() for p in s["parts"])
    raw_bytes = summary["tokens"] * np.dtype(prepared["dtype"]).itemsize
    span = (max(r["end_time"] for r in shard_results) - min(r["start_time"] for r in shard_results))
    tracker.log_metrics({
        "tokens": summary["tokens"],
        "documents": summary["documents"],
        "train_tokens": splits["train"]["tokens"],
        "validation_tokens": splits["validation"]["tokens"],
        "tokens_per_s": summary["tokens"] / max(span, 1e-9),
        "bytes_on_disk": directory_bytes(store),
        "compression_ratio": raw_bytes / max(token_bytes, 1),
        **{f"{key}.{src['label']}": src[key] for src in summary["sources"]
           for key in ("tokens", "documents")},
    })
    tracker.log_artifact(out_dir / TOKENIZER)
    tracker.log_artifact(store / MANIFEST)
    tracker.flush()
    return {
        "store": str(store.resolve()),
        "tokenizer": str((out_dir / TOKENIZER).resolve()),
        "vocab_size": opened.vocab_size,
        "eos_id": opened.eos_id,
        "train_tokens": splits["train"]["tokens"],
        "validation_tokens": splits["validation"]["tokens"],
        "documents": summary["documents"],
        "sources": [src.label for src in opened.sources],
        "tokenizer_hash": opened.tokenizer_hash,
        "source_fingerprint": info.fingerprint,
    }


def run(cfg: PipelineConfig, inputs: dict[str, dict], out_dir: Path, tracker) -> dict[str, Any]:
    """prepare + every shard + finalize, in this process."""
    num_shards = prepare(cfg, inputs, out_dir, tracker)
    results = [part(cfg, out_dir, i) for i in range(num_shards)]
    return finalize(cfg, out_dir, results, tracker)
