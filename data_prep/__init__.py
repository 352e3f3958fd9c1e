"""Corpus -> tokenizer -> sharded Zarr token store -> packed training windows.

Modules: ``readers`` (streaming readers of one file), ``sources`` (one source's files from
metadata, pieces, streamed documents), ``corpus`` (the corpus of one or several labelled
sources planned from metadata, fingerprint, the train/validation hash rule, input shards),
``tokenizer`` (byte-level BPE, hash), ``build`` (writing a store: layout, batching and
encoding of input shards, part records for resuming, manifest), ``writer`` (the low-level
writer of one part), ``store`` (``open_store``, ``SplitReader``), ``loader``
(``TokenWindowLoader``), ``atomic`` (atomic file writes), ``progress``, ``errors``
(``DataError``, ``StoreError``), ``curate`` (data curation: per-document signals, global
dedup, decontamination, a threshold selection; docs/data.md, "Curation"). The curate and
tokenize stages (stages/curate/, stages/tokenize/) wire them to the configuration,
progress lines and tracking.

Token store format (version 1)
------------------------------
One Zarr v3 group per dataset, ``<out_dir>/store.zarr``::

    store.zarr/
      zarr.json              root group; attributes (written by finalize): format_version,
                             tokenizer_hash, vocab_size, eos_id, dtype, chunk_tokens,
                             chunks_per_shard, source, sources, source_fingerprint, tokens,
                             documents, split_tokens, split_documents
      tokenizer.json         the tokenizer the tokens were made with
      manifest.json          written LAST and atomically: the store is complete only when it
                             exists ({"complete": true, "format_version": 1, ...,
                             "splits": {split: {"tokens", "documents", "parts": [...]}},
                             each part entry naming the "host" that encoded it,
                             "sources": [...]})
      train/                 group per split ("train", "validation")
        00000/               one part per input shard (group; attributes: shard, split,
          tokens             tokenizer_hash, tokens, documents, and source when labelled)
          doc_offsets
        00001/ ...
      validation/ ...

Per split, the token array is the concatenation of the split's parts in shard order (the
manifest lists them with their token counts): each part's ``tokens`` is a 1-D array of
uint16 when every id fits (vocab <= 65536) else uint32 (``data.token_dtype``), chunked by
``data.chunk_tokens``, compressed with Blosc zstd + byte shuffle, and Zarr-sharded with
``data.chunks_per_shard`` chunks per shard file. ``doc_offsets`` (int64, documents + 1
entries, starting at 0) gives where each document starts inside the part; every document
ends with the eos token. Documents are in corpus order within each split.

Sources. A store built from ``data.source`` has unlabelled parts, ``source`` (the spec
string) and ``sources: []``. A store built from ``data.sources`` (label -> spec) holds the
sources' documents in the order given, each source one contiguous document range; every
input shard lies inside one source, so every part belongs to exactly one source and carries
its label (``"source"`` in the part's attributes and in ``splits.<split>.parts[i]``).
``source`` is then null and ``sources`` lists, in corpus order, ``{"label", "source" (spec),
"tokens", "documents", "split_tokens": {split: n}, "split_documents": {split: n}}``; the
fingerprint covers the labels. ``data.num_shards`` is divided among the sources in
proportion to their bytes (at least one each), and a document is held out for validation
by a hash of its text keyed by ``split_seed`` and its source's label
(``corpus.validation_flags``). ``open_store`` exposes them as
``StoreInfo.sources`` (``SourceInfo``). Stores without these keys (written before sources
existed) read as single-source stores, so the format version is still 1.

Why parts instead of one merged array: each input shard is tokenized by its own process
and writes only its own arrays (Zarr loses updates when processes write different chunks
of one shard file), and no serial merge pass re-reads the whole corpus. Shards are
contiguous document ranges (runs of file pieces) and the train/validation assignment
depends on each document's text only, so the logical token sequence of each split (and
everything the loader serves) is identical for any ``data.num_shards`` and any number of workers.

``store.open_store(path, expected_tokenizer_hash=None)`` refuses a store without a complete
manifest, with a missing part, or built with another tokenizer (``StoreError``).
"""
