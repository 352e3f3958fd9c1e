"""Stage tokenize: raw text -> tokenizer.json + a Zarr token store (train/validation).

``prepare`` plans the corpus from file metadata (no pass over the corpus: see
``data_prep.corpus``) and trains (or loads) the tokenizer on a sample; ``part`` streams one
input shard (contiguous pieces of
the source files: byte ranges of JSON lines, parquet row groups, whole files) into its own
store parts, each document held out for validation by a seeded hash of its text (safe to
run in parallel processes); ``finalize`` checks every part and writes
the manifest last, atomically. The store format and how it is written live in
``data_prep`` (``data_prep.build``); this module wires the configuration, progress lines
and tracking.

Resumable: a failed attempt's directory is kept and the next attempt runs in it. ``prepare``
keeps the planned corpus and tokenizer of an earlier attempt with the same configuration
and unchanged input files, and ``part`` returns at once for a shard an earlier attempt
finished, so only the unfinished
shards are encoded again; the store is the same as one uninterrupted run's.

With ``data.sources`` every input shard lies inside one labelled source, so each part carries
its source label (part attributes and manifest), and the manifest lists every source with its
token and document counts per split.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from data_prep import build
from data_prep.atomic import write_json_atomic
from data_prep.build import PREPARED, STORE, TOKENIZER
from data_prep.corpus import load_corpus_info, prepare_corpus, saved_corpus, training_sample
from data_prep.progress import Progress
from data_prep.store import MANIFEST
from data_prep.tokenizer import load_tokenizer, shared_tokenizer, train_tokenizer
from stages.config import PipelineConfig

__all__ = ["PREPARED", "STORE", "TOKENIZER", "finalize", "part", "prepare"]

CURATION_FILE = "curation.json"  # where the curation's keep masks are (null: none)


def prepare(cfg: PipelineConfig, inputs: dict[str, dict], out_dir: Path, tracker) -> int:
    """Plan the corpus, train or load the tokenizer, lay out the store; return the shard
    count.

    The count is ``data.num_shards``; with ``data.sources`` they are divided among the sources
    in proportion to their bytes (at least one each). A planned corpus and a trained tokenizer
    that an earlier attempt saved in ``out_dir`` for the same configuration are kept.
    ``inputs["curate"]`` names the curation's keep mask of each shard (``CURATION_FILE``
    records them for the parts); without it, or with curation off, every document is
    encoded.
    """
    out_dir = Path(out_dir)
    curated = (inputs.get("curate") or {}).get("keep_files")
    write_json_atomic(out_dir / CURATION_FILE, {"keep_files": curated})
    t0 = time.perf_counter()
    info = saved_corpus(cfg.data, out_dir)
    kept = ["corpus"] if info is not None else []
    if info is None:
        info = prepare_corpus(cfg.data, out_dir)
    t1 = time.perf_counter()
    if cfg.tokenizer.path:
        tokenizer = load_tokenizer(cfg.tokenizer.path, cfg.tokenizer.eos_token)
    else:
        tokenizer = build.saved_tokenizer(out_dir, info, cfg.data, cfg.tokenizer)
        if tokenizer is not None:
            kept.append("tokenizer")
        else:
            sample = training_sample(out_dir, info, cfg.data, cfg.tokenizer.train_sample_bytes,
                                     cfg.data.split_seed)
            print(f"tokenize: training a {cfg.tokenizer.vocab_size}-id byte-level BPE on "
                  f"{len(sample)} documents ({sum(len(t) for t in sample) / 1e6:.1f} M "
                  "characters)", flush=True)
            tokenizer = train_tokenizer(sample, cfg.tokenizer)
    t2 = time.perf_counter()
    prepared = build.prepare_store(out_dir, info, tokenizer, cfg.data, cfg.tokenizer)
    shards = prepared["shards"]
    tracker.set_tags({"tokenizer_hash": prepared["tokenizer_hash"],
                      "source_fingerprint": info.fingerprint})
    tracker.log_metrics({"corpus_bytes": info.num_bytes, "corpus_files": len(info.files),
                         "corpus_load_s": t1 - t0, "tokenizer_train_s": t2 - t1})
    if info.sources:
        origin = "sources " + ", ".join(
            f"{s['label']} ({_megabytes(shards, s['label'])}, {_shards_of(shards, s['label'])})"
            for s in info.sources)
    else:
        origin = f"{cfg.data.source or 'stdlib'!r} ({len(shards)} shards)"
    capped = (f", the first {info.num_documents} documents (data.max_documents)"
              if info.capped else "")
    print(f"tokenize: {len(info.files)} files, {info.num_bytes / 1e6:.1f} MB from "
          f"{origin}{capped}; tokenizer vocab {prepared['vocab_size']} in {t2 - t1:.1f}s"
          + (f" ({' and '.join(kept)} kept from an earlier attempt)" if kept else ""), flush=True)
    return len(shards)


def _megabytes(shards: list[dict[str, Any]], label: str) -> str:
    return f"{sum(s['bytes'] for s in shards if s['source'] == label) / 1e6:.1f} MB"


def _shards_of(shards: list[dict[str, Any]], label: str) -> str:
    n = sum(1 for s in shards if s["source"] == label)
    return f"{n} shard{'s' if n > 1 else ''}"


def part(cfg: PipelineConfig, out_dir: Path, shard_index: int) -> dict[str, Any]:
    """Encode input shard ``shard_index`` into its own train and validation parts.

    A shard an earlier attempt finished is not encoded again: its recorded result is returned.
    """
    out_dir = Path(out_dir)
    prepared = build.read_prepared(out_dir)
    shard = build.shard_entry(prepared, shard_index)
    title = (f"tokenize shard {shard_index + 1}/{prepared['num_shards']}"
             + (f" [{shard['source']}]" if shard["source"] is not None else ""))
    finished = build.finished_part(out_dir, shard_index, prepared, cfg.data)
    if finished is not None:
        print(f"{title}: {finished['documents']} docs, {finished['tokens']:,} tokens, finished by "
              "an earlier attempt; kept", flush=True)
        return finished
    info = load_corpus_info(out_dir)
    tokenizer = shared_tokenizer(out_dir / TOKENIZER, cfg.tokenizer.eos_token)
    progress = Progress(title, shard["bytes"], cfg.data.progress_seconds)
    result = build.write_part(out_dir, shard_index, prepared, info, tokenizer, cfg.data,
                              progress, keep=_keep_mask(out_dir, shard_index))
    progress.emit(done=True)
    return result


def _keep_mask(out_dir: Path, shard_index: int) -> np.ndarray | None:
    """The curation's keep mask of one input shard, or None when nothing was curated."""
    files = json.loads((out_dir / CURATION_FILE).read_text()).get("keep_files")
    return np.load(files[shard_index], allow_pickle=False) if files else None


def finalize(cfg: PipelineConfig, out_dir: Path, shard_results: list[dict[str, Any]],
             tracker) -> dict[str, Any]:
    """Check all parts, write store attributes and the manifest (last, atomically); log."""
    out_dir = Path(out_dir)
    done = build.finish_store(out_dir, shard_results, cfg.data)
    manifest, splits = done.manifest, done.manifest["splits"]
    raw_bytes = manifest["tokens"] * np.dtype(manifest["dtype"]).itemsize
    span = (max(r["end_time"] for r in shard_results) - min(r["start_time"] for r in shard_results))
    held_out = splits["validation"]["documents"]
    print(f"tokenize: {manifest['documents']} documents, {manifest['tokens']:,} tokens; "
          f"{held_out} held out for validation ({100 * held_out / manifest['documents']:.1f} %, "
          f"data.validation_fraction={cfg.data.validation_fraction})", flush=True)
    hosts = Counter(r["host"] for r in shard_results if r.get("host"))
    if hosts:
        print("tokenize: shards encoded on " + ", ".join(f"{host} ({count})" for host, count
                                                        in sorted(hosts.items())), flush=True)
        tracker.set_tags({"hosts": ",".join(sorted(hosts))})
    tracker.log_metrics({
        "tokens": manifest["tokens"],
        "documents": manifest["documents"],
        "train_tokens": splits["train"]["tokens"],
        "validation_tokens": splits["validation"]["tokens"],
        "tokens_per_s": manifest["tokens"] / max(span, 1e-9),
        "bytes_on_disk": done.bytes_on_disk,
        "compression_ratio": raw_bytes / max(done.token_bytes, 1),
        **{f"{key}.{src['label']}": src[key] for src in manifest["sources"]
           for key in ("tokens", "documents")},
    })
    tracker.log_artifact(out_dir / TOKENIZER)
    tracker.log_artifact(done.path / MANIFEST)
    tracker.flush()
    return {
        "store": str(done.path.resolve()),
        "tokenizer": str((out_dir / TOKENIZER).resolve()),
        "vocab_size": done.info.vocab_size,
        "eos_id": done.info.eos_id,
        "train_tokens": splits["train"]["tokens"],
        "validation_tokens": splits["validation"]["tokens"],
        "documents": manifest["documents"],
        "sources": [src.label for src in done.info.sources],
        "tokenizer_hash": done.info.tokenizer_hash,
        "source_fingerprint": manifest["source_fingerprint"],
    }
