"""Build a token store: lay it out, encode input shards into parts, write the manifest.

The writing side of the store format in the package docstring (``store`` is the reading
side, ``writer`` the low-level part writer). A build lives in one directory ``out_dir``::

    corpus.json            the planned corpus (``data_prep.corpus``; with a binding
                           ``data.max_documents`` also doc_bytes.bin); corpus/ holds saved
                           hub datasets, the only copy of input made
    tokenizer.json         the tokenizer
    prepared.json          what ``prepare_store`` decided: shard plan, dtype, eos, hashes, config
    store.zarr/            the store
    parts/<shard>.json     one record per finished input shard (its result, with the host
                           that encoded it)

``prepare_store`` saves the tokenizer and lays out an empty store; ``write_part`` encodes one
input shard, streamed from the source files, into its train and validation parts (one
process per shard, in parallel);
``finish_store`` checks every part and writes the manifest last.

Resuming. Every file is written so that present means complete: JSON files atomically
(``data_prep.atomic``), parts under a temporary name renamed into place, a part's record
after both of its parts. A build started again in the same directory therefore keeps what
an earlier attempt finished: ``saved_corpus`` and ``saved_tokenizer`` return the earlier
corpus and tokenizer when the configuration matches, ``prepare_store`` keeps the store when
the preparation is the same, and ``finished_part`` returns the record of a shard whose
parts are complete (a shard without a record is encoded again from scratch). The result
is the same store as one uninterrupted build.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from tokenizers import Tokenizer

from data_prep.atomic import write_bytes_atomic, write_text_atomic
from data_prep.config import DataConfig, TokenizerConfig
from data_prep.corpus import (
    CORPUS_INFO,
    CorpusInfo,
    drop_corpus,
    no_documents_error,
    shard_documents,
    shard_plan,
    split_key,
    validation_flags,
)
from data_prep.errors import DataError
from data_prep.progress import Progress
from data_prep.store import FORMAT_VERSION, MANIFEST, SPLITS, StoreInfo, open_store
from data_prep.tokenizer import load_tokenizer, token_dtype, tokenizer_hash
from data_prep.writer import PartWriter, directory_bytes, part_name

STORE = "store.zarr"
TOKENIZER = "tokenizer.json"
PREPARED = "prepared.json"
PART_RECORDS = "parts"
TAIL_FRACTION = 0.125


def build_config(data: DataConfig, tokenizer: TokenizerConfig) -> dict[str, Any]:
    """The configuration a build is made from, as plain JSON values (recorded in prepared.json)."""
    return json.loads(json.dumps({"data": asdict(data), "tokenizer": asdict(tokenizer)}))


def _write_json(path: Path, obj: Any) -> None:
    # Sorted keys: the manifest's bytes depend only on its content.
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True))


def _read_json(path: Path) -> Any:
    """A JSON file's content, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_prepared(out_dir: Path) -> dict[str, Any]:
    """prepared.json of ``out_dir`` (refuses a directory that ``prepare_store`` has not set up)."""
    path = Path(out_dir) / PREPARED
    if not path.is_file():
        raise DataError(f"{path} is missing: run the tokenize stage's prepare step first")
    return json.loads(path.read_text())


def saved_tokenizer(out_dir: Path, info: CorpusInfo, data: DataConfig,
                    tokenizer: TokenizerConfig) -> Tokenizer | None:
    """The tokenizer an earlier ``prepare_store`` saved in ``out_dir`` for the same
    configuration and corpus, or None. prepared.json, written after tokenizer.json, vouches
    for it: same configuration, same corpus fingerprint, same tokenizer hash."""
    out_dir = Path(out_dir)
    earlier = _read_json(out_dir / PREPARED)
    path = out_dir / TOKENIZER
    if (not isinstance(earlier, dict) or not path.is_file()
            or earlier.get("config") != build_config(data, tokenizer)
            or earlier.get("source_fingerprint") != info.fingerprint):
        return None
    try:
        saved = load_tokenizer(path, tokenizer.eos_token)
    except DataError:
        return None
    return saved if tokenizer_hash(saved) == earlier.get("tokenizer_hash") else None


def prepare_store(out_dir: Path, info: CorpusInfo, tokenizer: Tokenizer, data: DataConfig,
                  tokenizer_cfg: TokenizerConfig) -> dict[str, Any]:
    """Save tokenizer.json, lay out an empty store, write prepared.json last; return it.

    The dtype is checked before anything is written. When an earlier attempt prepared the
    same build here (same prepared.json), its store and finished parts are kept and only its
    manifest is removed (the store is complete again once ``finish_store`` has run);
    otherwise the store and part records are replaced.
    """
    out_dir = Path(out_dir)
    vocab = tokenizer.get_vocab_size()
    dtype = token_dtype(vocab, data.token_dtype)  # refuse before anything is written
    shards = shard_plan(info, data.num_shards)
    prepared = {
        "num_shards": len(shards),
        "shards": shards,
        "vocab_size": vocab,
        "eos_id": tokenizer.token_to_id(tokenizer_cfg.eos_token),
        "dtype": dtype.name,
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "source_fingerprint": info.fingerprint,
        "config": build_config(data, tokenizer_cfg),
    }
    store = out_dir / STORE
    keep = (_read_json(out_dir / PREPARED) == prepared
            and all((store / name / "zarr.json").is_file() for name in ("", *SPLITS)))
    if not keep:
        (out_dir / PREPARED).unlink(missing_ok=True)
        shutil.rmtree(out_dir / PART_RECORDS, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
    text = tokenizer.to_str(pretty=True)  # the bytes Tokenizer.save(pretty=True) writes
    path = out_dir / TOKENIZER
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        write_text_atomic(path, text)
    if keep:
        (store / MANIFEST).unlink(missing_ok=True)
    else:
        root = zarr.open_group(str(store), mode="w", zarr_format=3)
        for split in SPLITS:
            root.create_group(split)
    _write_json(out_dir / PREPARED, prepared)
    return prepared


def text_batches(texts: Iterator[str], total_bytes: int,
                 max_bytes: int) -> Iterator[list[str]]:
    """Documents grouped into lists of about ``max_bytes`` of UTF-8 text (at least one each).

    ``total_bytes`` (the shard's input bytes, an estimate of its text) marks the last batch:
    it is cut again so that its final ~1/8 of the bytes is a batch of its own, so the writes
    of the long batch overlap the encoding of the short one and only the short batch's
    writes are left after the encoder finishes. Only the current batch is held.
    """
    batch: list[str] = []
    size = done = 0
    cut = None  # where the tail of the last batch starts, once the last batch is under way
    for text in texts:
        n = len(text.encode("utf-8"))
        if batch and (size + n > max_bytes or (cut is not None and done >= cut)):
            yield batch
            batch, size = [], 0
            if cut is not None and done >= cut:
                cut = float("inf")  # the tail is cut once
        if not batch and cut is None and total_bytes - done <= max_bytes:
            rest = total_bytes - done  # the last batch: its last TAIL_FRACTION goes alone
            cut = done + rest - TAIL_FRACTION * rest
        batch.append(text)
        size += n
        done += n
    if batch:
        yield batch


def _write_batch(encodings: list, is_val: np.ndarray, eos: int, dtype: np.dtype,
                 writers: dict[str, PartWriter], progress: Progress, text_bytes: int) -> None:
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
    progress.update(len(encodings), tokens, text_bytes)


def shard_entry(prepared: dict[str, Any], shard_index: int) -> dict[str, Any]:
    """Input shard ``shard_index`` of the plan: {"source", "pieces", "bytes"}."""
    num_shards = prepared["num_shards"]
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard index {shard_index} out of range for {num_shards} shards")
    return prepared["shards"][shard_index]


def _record_path(out_dir: Path, shard_index: int) -> Path:
    return Path(out_dir) / PART_RECORDS / f"{shard_index:05d}.json"


def _part_digest(prepared: dict[str, Any], shard_index: int, data: DataConfig) -> str:
    """What a part is made from: the preparation, the shard and the store layout."""
    made_from = {"prepared": prepared, "shard": shard_index, "chunk_tokens": data.chunk_tokens,
                 "chunks_per_shard": data.chunks_per_shard, "split_seed": data.split_seed}
    return hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()


def finished_part(out_dir: Path, shard_index: int, prepared: dict[str, Any],
                  data: DataConfig) -> dict[str, Any] | None:
    """The result of shard ``shard_index`` if an earlier ``write_part`` finished it for this
    preparation (its record is present and both of its parts hold what the record says);
    None when the shard has to be encoded."""
    record = _read_json(_record_path(out_dir, shard_index))
    if not isinstance(record, dict) or record.get("digest") != _part_digest(prepared, shard_index,
                                                                           data):
        return None
    result = record["result"]
    store = Path(out_dir) / STORE
    for split in SPLITS:
        attrs = _read_json(store / part_name(split, shard_index) / "zarr.json")
        attrs = attrs.get("attributes", {}) if isinstance(attrs, dict) else {}
        expected = result["splits"][split]
        if (attrs.get("tokens"), attrs.get("documents")) != (expected["tokens"],
                                                             expected["documents"]):
            return None
    return result


def kept_documents(texts: Iterator[str], keep: np.ndarray | None,
                   shard_index: int) -> Iterator[str]:
    """The documents of one shard whose entry in ``keep`` (the curation stage's mask, one
    bool per document in shard order) is true; all of them when ``keep`` is None. A mask of
    another length than the shard is refused: it was made for another corpus."""
    if keep is None:
        yield from texts
        return

    def refused(found: str) -> DataError:
        return DataError(f"input shard {shard_index}: the curation mask holds {len(keep)} "
                         f"documents, the shard {found}; the curated corpus differs from this "
                         "one: rerun the curate stage")

    count = 0
    for text in texts:
        if count == len(keep):
            raise refused("more")
        if keep[count]:
            yield text
        count += 1
    if count != len(keep):
        raise refused(str(count))


def write_part(out_dir: Path, shard_index: int, prepared: dict[str, Any], info: CorpusInfo,
               tokenizer: Tokenizer, data: DataConfig, progress: Progress,
               keep: np.ndarray | None = None) -> dict[str, Any]:
    """Encode input shard ``shard_index`` into its train and validation parts; record it.
    ``keep``: the curation stage's mask of the shard's documents (None: every document).

    The shard's documents are streamed from its pieces of the source files, in batches of
    about ``data.encode_batch_bytes``; each is held out for validation or not by
    ``corpus.validation_flags``. Any earlier record of the shard is removed first, and
    the parts are written from scratch (each under a temporary name, renamed into place);
    the record is written last. Returns the shard's result: its counts, part summaries,
    timings and ``host`` (the hostname of the machine that encoded it).
    """
    out_dir = Path(out_dir)
    shard = shard_entry(prepared, shard_index)
    label = shard["source"]
    record = _record_path(out_dir, shard_index)
    record.unlink(missing_ok=True)
    began, t0 = time.time(), time.perf_counter()
    documents_in = kept_documents(shard_documents(info, shard, data), keep, shard_index)
    batches = text_batches(documents_in, shard["bytes"], data.encode_batch_bytes)
    key = split_key(data.split_seed, label)

    def encode(texts: list[str]) -> list:
        # The fast variant skips character offsets, which a token store never needs (same ids).
        return tokenizer.encode_batch_fast(texts)

    # Encoding releases the GIL: the first batch is encoding while the checks and writers are
    # set up, and the next batch is read from its file (and the split of this one hashed)
    # while this one encodes, so the reading, Python and Zarr work does not leave the
    # encoder idle. At most two batches of text and their encodings are alive at once.
    with ThreadPoolExecutor(1) as pool:
        current = next(batches, None)
        pending = pool.submit(encode, current) if current else None
        if tokenizer_hash(tokenizer) != prepared["tokenizer_hash"]:
            raise DataError(
                f"{out_dir / TOKENIZER} changed since prepare; rerun the tokenize stage"
            )
        eos, dtype = prepared["eos_id"], np.dtype(prepared["dtype"])
        writers = {
            split: PartWriter(out_dir / STORE, split, shard_index, dtype,
                              data.chunk_tokens, data.chunks_per_shard)
            for split in SPLITS
        }
        documents = 0
        while pending is not None:
            following = next(batches, None)  # read while the current batch encodes
            is_val = validation_flags(current, key, data.validation_fraction)
            text_bytes = sum(len(t) for t in current)
            encodings = pending.result()
            pending = pool.submit(encode, following) if following else None
            _write_batch(encodings, is_val, eos, dtype, writers, progress, text_bytes)
            documents += len(encodings)
            del encodings, current
            current = following
    attrs = {"shard": shard_index, "tokenizer_hash": prepared["tokenizer_hash"]}
    if label is not None:
        attrs["source"] = label
    parts = {split: writers[split].close({**attrs, "split": split}) for split in SPLITS}
    result = {
        "shard": shard_index,
        "source": label,
        "documents": documents,
        "curated_out": 0 if keep is None else int(len(keep) - keep.sum()),
        "tokens": sum(p["tokens"] for p in parts.values()),
        "splits": parts,
        "start_time": began,
        "end_time": began + (time.perf_counter() - t0),
        "seconds": time.perf_counter() - t0,
        "host": socket.gethostname(),
    }
    _write_json(record, {"digest": _part_digest(prepared, shard_index, data), "result": result})
    return result


def _collect_parts(store: Path, split: str, shards: list[dict[str, Any]],
                   token_hash: str, hosts: dict[int, str | None]) -> list[dict[str, Any]]:
    """Each shard's part of ``split``, checked against the attributes its writer left, with
    the host that encoded it (``hosts``: shard -> hostname, None when unknown)."""
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
        if hosts.get(shard):
            part["host"] = hosts[shard]
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
        out.append({"label": label, "source": src["source"], "tokens": sum(split_tokens.values()),
                    "documents": sum(split_docs.values()), "split_tokens": split_tokens,
                    "split_documents": split_docs})
    return out


def _check_documents(info: CorpusInfo, data: DataConfig, splits: dict[str, dict[str, Any]],
                     documents: int, curated_out: int = 0) -> None:
    """Refuse a store whose parts lost documents (a capped corpus knows its count; the
    curation stage's removals, ``curated_out``, are not lost), a source
    without documents, a labelled source of several documents with none held out (its own
    validation loss is reported), or an empty split (the hash split found no document to
    hold out, or held out all), each with the fix."""
    if info.num_documents is not None and documents + curated_out != info.num_documents:
        raise DataError(f"store parts hold {documents} documents and curation removed "
                        f"{curated_out}, the corpus has {info.num_documents}; rerun the "
                        "tokenize stage")
    fraction = data.validation_fraction
    for label in [s["label"] for s in info.sources] or [None]:
        held = {split: sum(p["documents"] for p in splits[split]["parts"]
                           if p.get("source") == label) for split in SPLITS}
        if sum(held.values()) == 0:
            raise no_documents_error(data, label)
        if label is not None and held["validation"] == 0 and held["train"] > 1:
            raise DataError(  # its own validation loss is promised: it needs a document
                f"data.sources.{label}: data.validation_fraction={fraction} held out none of "
                f"its {held['train']} documents (each is held out when its seeded hash falls "
                f"under the fraction): raise the fraction to at least "
                f"{min(0.5, 3 / held['train']):.3g}, change data.split_seed, or add documents")
    if splits["validation"]["documents"] == 0:
        raise DataError(
            f"data.validation_fraction={fraction} held out none of the {documents} documents "
            "(each is held out when its seeded hash falls under the fraction): raise it to at "
            f"least {min(0.5, 3 / documents):.3g}, change data.split_seed, or add documents")
    if splits["train"]["documents"] == 0:
        raise DataError(
            f"data.validation_fraction={fraction} held out all {documents} documents, leaving "
            "none to train on: lower it, change data.split_seed, or add documents")


@dataclass
class FinishedStore:
    """A store ``finish_store`` completed: its manifest, what ``open_store`` reads, sizes."""

    path: Path
    manifest: dict[str, Any]
    info: StoreInfo
    bytes_on_disk: int
    """All files of the store."""
    token_bytes: int
    """The parts' token arrays (compressed)."""


def finish_store(out_dir: Path, shard_results: list[dict[str, Any]],
                 data: DataConfig) -> FinishedStore:
    """Check every part, write the store attributes and the manifest (last, atomically).

    ``shard_results`` are the results of every input shard (``write_part`` or
    ``finished_part``); each manifest part names the host that encoded it. Afterwards the
    saved hub datasets are removed (the store holds it all).
    """
    out_dir = Path(out_dir)
    prepared = read_prepared(out_dir)
    info = CorpusInfo.load(out_dir / CORPUS_INFO)
    store = out_dir / STORE
    num_shards = prepared["num_shards"]
    done = sorted(r["shard"] for r in shard_results)
    if done != list(range(num_shards)):
        missing = sorted(set(range(num_shards)) - set(done))
        raise DataError(
            f"finalize got results for shards {done}; missing {missing} of {num_shards}"
        )
    hosts = {r["shard"]: r.get("host") for r in shard_results}
    splits = {}
    for split in SPLITS:
        parts = _collect_parts(store, split, prepared["shards"], prepared["tokenizer_hash"],
                               hosts)
        splits[split] = {"tokens": sum(p["tokens"] for p in parts),
                         "documents": sum(p["documents"] for p in parts), "parts": parts}
    documents = sum(s["documents"] for s in splits.values())
    curated_out = sum(r.get("curated_out", 0) for r in shard_results)
    _check_documents(info, data, splits, documents, curated_out)
    for split in SPLITS:  # temp dirs of writers that died (their shard was rerun since)
        for stale in (store / split).glob(".*.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    write_bytes_atomic(store / TOKENIZER, (out_dir / TOKENIZER).read_bytes())
    summary = {
        "format_version": FORMAT_VERSION,
        "tokenizer_hash": prepared["tokenizer_hash"],
        "vocab_size": prepared["vocab_size"],
        "eos_id": prepared["eos_id"],
        "dtype": prepared["dtype"],
        "chunk_tokens": data.chunk_tokens,
        "chunks_per_shard": data.chunks_per_shard,
        # One source: its spec; several: null, and "sources" lists them in corpus order.
        "source": None if info.sources else (data.source or "stdlib"),
        "sources": _source_summary(info, splits),
        "source_fingerprint": info.fingerprint,
        "tokens": sum(s["tokens"] for s in splits.values()),
        "documents": documents,
        "split_tokens": {k: v["tokens"] for k, v in splits.items()},
        "split_documents": {k: v["documents"] for k, v in splits.items()},
    }
    zarr.open_group(str(store), mode="r+").update_attributes(summary)
    manifest = {**summary, "complete": True, "tokenizer_file": TOKENIZER, "num_shards": num_shards,
                "splits": splits, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _write_json(store / MANIFEST, manifest)  # the store is complete from here on
    opened = open_store(store, prepared["tokenizer_hash"])
    drop_corpus(out_dir)
    token_bytes = sum(directory_bytes(store / p["path"] / "tokens")
                      for s in splits.values() for p in s["parts"])
    return FinishedStore(path=store, manifest=manifest, info=opened,
                         bytes_on_disk=directory_bytes(store), token_bytes=token_bytes)


def remove_part_records(out_dir: Path) -> None:
    """Forget which shards are finished: ``finished_part`` then finds none and every shard is
    encoded again (as when measuring encoding). The store itself is left as it is."""
    shutil.rmtree(Path(out_dir) / PART_RECORDS, ignore_errors=True)

