"""Data curation: per-document signals computed once per input shard, then a global
dedup and a threshold selection that can be rerun alone. Imports no torch, parsl or mlflow.

How a ``curate`` stage uses it (the same shard plan tokenization reads)::

    info = data_prep.corpus.prepare_corpus(cfg.data, out_dir)           # prepare
    index = eval_ngrams({**prompt_texts(cfg.eval.prompts),
                         **local_task_texts(task_dir)}, cfg.curate.decontamination_ngram,
                        cfg.curate.decontamination_min_words)
    for i, shard in enumerate(info.shards):                              # part(i), fanned out
        compute_shard_signals(info, i, shard, cfg.data, cfg.curate, index,
                              out_dir / f"signals/shard-{i:05d}.parquet")
    summary = curate_corpus(signal_paths, cfg.curate, cfg.data, out_dir)  # finalize
    mask = keep_mask(out_dir, i)       # tokenization: a bool per document of shard i

Reuse: the signal files depend on ``signal_config(cfg)`` (the SIGNAL fields), the corpus
fingerprint and the eval texts; the selection on the SELECTION fields only
(``SIGNAL_FIELDS`` / ``SELECTION_FIELDS``).

Public API
----------
- ``CurateConfig`` (``config``): the ``curate`` section; ``SIGNAL_FIELDS``,
  ``SELECTION_FIELDS``, ``signal_config(cfg) -> dict``.
- ``resolve_preset(cfg, data, label=None) -> dict[str, float | None]``: the effective
  thresholds of one source (preset, ``auto`` decided per source, plus overrides).
- ``shard_records(info, shard, data_cfg, id_field) -> Iterator[(doc_id, text)]``: one
  shard's documents with ids, in exactly the order and number ``shard_documents`` yields.
- ``eval_ngrams(task_texts, n, min_words=8) -> EvalIndex``; ``prompt_texts``,
  ``local_task_texts`` (the eval stage's prompts and local lm-eval task files);
  ``contamination(normalized_text, index) -> list[task]``.
- ``compute_shard_signals(info, shard_index, shard, data_cfg, curate_cfg, eval_index,
  out_path, progress=None) -> dict``: writes the shard's signal parquet atomically and
  returns its counts.
- ``curate_corpus(signal_paths, curate_cfg, data_cfg, out_dir, info=None) -> dict``: dedup,
  selection, removed.parquet, keep masks, summary.json, removed_sample.json; returns the
  summary with "paths" (the stage draws removals.png from it).
- ``keep_mask(out_dir, shard_index) -> np.ndarray``: a shard's keep mask.
- ``select(table, dedup, thresholds, languages) -> list[reason | None]`` and
  ``find_duplicates`` for callers holding a whole (small) signal table; ``PROSE``,
  ``CODE``, ``RULES``.

Modules: ``text`` (words, normalization, hashes), ``quality`` (Gopher/C4/FineWeb values),
``minhash`` (LSH band keys), ``decontaminate``, ``signals`` (one shard's parquet), ``dedup``,
``select`` (rules, presets, reasons), ``finalize`` (the corpus-wide step and its outputs),
``arrow`` (Arrow columns without pyarrow's pandas import).
"""
from __future__ import annotations

from data_prep.corpus import shard_records
from data_prep.curate.config import (
    SELECTION_FIELDS,
    SIGNAL_FIELDS,
    CurateConfig,
    signal_config,
)
from data_prep.curate.decontaminate import (
    EvalIndex,
    contamination,
    eval_ngrams,
    local_task_texts,
    prompt_texts,
)
from data_prep.curate.dedup import Duplicates, find_duplicates
from data_prep.curate.finalize import (
    curate_corpus,
    keep_mask,
    keep_path,
    resolve_preset,
)
from data_prep.curate.select import CODE, PRESETS, PROSE, RULES, select
from data_prep.curate.signals import compute_shard_signals, document_signals

__all__ = ["CODE", "PRESETS", "PROSE", "RULES", "SELECTION_FIELDS", "SIGNAL_FIELDS",
           "CurateConfig", "Duplicates", "EvalIndex", "compute_shard_signals",
           "contamination", "curate_corpus", "document_signals", "eval_ngrams",
           "find_duplicates", "keep_mask", "keep_path", "local_task_texts", "prompt_texts",
           "resolve_preset", "select", "shard_records", "signal_config"]
