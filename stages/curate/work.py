"""Stage curate's work, a fan-out: plan the corpus, one part per input shard computes its
signals, ``finalize`` deduplicates across the corpus and selects.

``prepare`` plans the corpus exactly as tokenization does (``data_prep.corpus``: the same
shards, so a keep mask per shard lines up with tokenization's documents) and saves the
evaluation texts decontamination compares against; ``part`` computes one shard's signals
(``data_prep.curate.compute_shard_signals``) unless this attempt already holds them (an
earlier attempt's, or those of the output it continues: ``stages.curate.reuse``);
``finalize`` runs ``data_prep.curate.curate_corpus`` and logs what was removed and why.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from data_prep.atomic import write_json_atomic
from data_prep.corpus import load_corpus_info, prepare_corpus, saved_corpus
from data_prep.curate import (
    compute_shard_signals,
    curate_corpus,
    eval_ngrams,
    resolve_preset,
    signal_config,
)
from data_prep.curate.finalize import keep_path
from data_prep.curate.signals import file_metadata
from data_prep.errors import DataError
from stages.config import PipelineConfig
from stages.curate import eval_texts
from stages.curate.reuse import SIGNALS_DIR, signal_files

EVAL_TEXTS_FILE = "eval_texts.json"  # task -> texts decontamination compares against


def _signal_path(out_dir: Path, index: int) -> Path:
    return out_dir / SIGNALS_DIR / f"shard-{index:05d}.parquet"


def prepare(cfg: PipelineConfig, inputs: dict[str, dict], out_dir: Path, tracker: Any) -> int:
    """Plan the corpus (kept from an earlier attempt with the same configuration and
    unchanged files) and save the evaluation texts; return the shard count."""
    out_dir = Path(out_dir)
    if not cfg.curate.enabled:
        print("curate: off (curate.enabled=false): every document is kept", flush=True)
        return cfg.data.num_shards
    info = saved_corpus(cfg.data, out_dir) or prepare_corpus(cfg.data, out_dir)
    texts = eval_texts(cfg)
    write_json_atomic(out_dir / EVAL_TEXTS_FILE, texts)
    presets = {str(label): resolve_preset(cfg.curate, cfg.data, label)
               for label, _ in cfg.data.labelled_sources()}
    tracker.log_dict({"thresholds": presets, "signals": signal_config(cfg.curate)},
                     "curate_settings.json")
    tracker.log_metrics({"corpus_bytes": info.num_bytes, "corpus_files": len(info.files)})
    kept = len(signal_files(out_dir))
    print(f"curate: {len(info.files)} files, {info.num_bytes / 1e6:.1f} MB in "
          f"{len(info.shards)} shards; near duplicates by MinHash LSH "
          f"({cfg.curate.minhash_bands} x {cfg.curate.minhash_rows}, similarity ~"
          f"{cfg.curate.lsh_threshold:.2f}); decontamination against "
          f"{', '.join(sorted(texts))} ({cfg.curate.decontamination_ngram}-word n-grams)"
          + (f"; {kept} shard(s) of signals kept" if kept else ""), flush=True)
    return len(info.shards)


def part(cfg: PipelineConfig, out_dir: Path, index: int) -> dict[str, Any]:
    """Shard ``index``'s signals, computed unless this attempt already holds them."""
    out_dir = Path(out_dir)
    if not cfg.curate.enabled:
        return {"shard": index, "documents": None}
    path = _signal_path(out_dir, index)
    if path.is_file() and file_metadata(path).get("signal_config") == signal_config(cfg.curate):
        print(f"curate shard {index + 1}: signals kept ({path.name})", flush=True)
        return {"shard": index, "kept": True, "path": str(path)}
    info = load_corpus_info(out_dir)
    texts = json.loads((out_dir / EVAL_TEXTS_FILE).read_text())
    index_ = eval_ngrams(texts, cfg.curate.decontamination_ngram,
                         cfg.curate.decontamination_min_words)
    return compute_shard_signals(info, index, info.shards[index], cfg.data, cfg.curate,
                                 index_, path)


def _metric(reason: str) -> str:
    """A removal reason as an MLflow metric name part (no ':' there)."""
    return reason.replace(":", ".")


def _refuse_an_emptied_source(summary: dict[str, Any]) -> None:
    """DataError when curation removed every document of a source: tokenization would fail
    saying the source yielded none, which hides why."""
    for label, source in summary["by_source"].items():
        if source.get("documents") and not source.get("kept_documents"):
            key = "data.source" if label == "None" else f"data.sources.{label}"
            reasons = ", ".join(f"{reason} {value['documents']}" for reason, value
                                in sorted(source["removed"].items()))
            raise DataError(
                f"curate removed all {source['documents']} documents of {key} ({reasons}); "
                f"see {summary['paths']['removed']} and {Path(summary['paths']['sample']).name}"
                ": if they are text you want, relax curate.thresholds or curate.preset, or "
                "set curate.enabled=false")


def finalize(cfg: PipelineConfig, out_dir: Path, parts: list[dict[str, Any]],
             tracker: Any) -> dict[str, Any]:
    """Deduplicate and select over every shard's signals; log the removals per reason
    (documents and bytes), the chart, the sample and ``removed.parquet``."""
    out_dir = Path(out_dir)
    if not cfg.curate.enabled:
        return {"enabled": False}
    paths = [_signal_path(out_dir, i) for i in range(len(parts))]
    summary = curate_corpus(paths, cfg.curate, cfg.data, out_dir, load_corpus_info(out_dir))
    from stages.curate.report import CHART, removals_chart  # matplotlib: this task only

    summary["paths"]["chart"] = str(removals_chart(summary, out_dir / CHART))
    total, removed = summary["documents"], summary["removed_documents"]
    print(f"curate: kept {summary['kept_documents']} of {total} documents "
          f"({summary['kept_bytes'] / max(summary['bytes'], 1):.1%} of the bytes); removed "
          f"{removed}" + "".join(f"\n  {reason}: {v['documents']} documents, {v['bytes']:,} bytes"
                                 for reason, v in summary["by_reason"].items()), flush=True)
    metrics = {"documents": total, "bytes": summary["bytes"],
               "kept_documents": summary["kept_documents"], "kept_bytes": summary["kept_bytes"],
               "removed_documents": removed, "removed_bytes": summary["removed_bytes"]}
    for reason, value in summary["by_reason"].items():
        metrics[f"removed_documents.{_metric(reason)}"] = value["documents"]
        metrics[f"removed_bytes.{_metric(reason)}"] = value["bytes"]
    tracker.log_metrics(metrics)
    for name in ("removed", "summary", "sample", "chart"):
        tracker.log_artifact(Path(summary["paths"][name]))
    tracker.flush()
    _refuse_an_emptied_source(summary)
    keep = Path(summary["paths"]["keep"])
    return {"enabled": True, "keep": str(keep),
            "keep_files": [str(keep_path(out_dir, i)) for i in range(len(parts))],
            "removed": summary["paths"]["removed"], "summary": summary["paths"]["summary"],
            "documents": total, "kept_documents": summary["kept_documents"],
            "removed_documents": removed}
