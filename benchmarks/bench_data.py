"""Data pipeline benchmark: tokenize-to-Zarr vs raw encode, worker scaling, loader speed.

Runs on one corpus (a subset of this interpreter's standard library) and prints, as its last
line, one JSON object:

- encode_ratio: end-to-end tokenize-to-Zarr tokens/s (every shard + finalize, in this
  process) / raw ``Tokenizer.encode_batch`` tokens/s on the same documents (target >= 0.85).
  The shard tasks call ``encode_batch_fast`` (same ids, no character offsets), so the
  benchmark also prints ``encode_ratio_fast``: the same end-to-end rate over raw
  ``encode_batch_fast``, i.e. what the streamed reads, id conversion and Zarr writes cost;
- worker_scaling: tokenize tokens/s with 2 Parsl HTEX workers / with 1 worker, each worker
  limited to one encoder thread (RAYON_NUM_THREADS=1) (target >= 1.7);
- loader_ratio: shuffled training windows/s from the store (TokenWindowLoader) / the same
  from a numpy memmap of the same tokens, at seq_len 128 (target >= 0.3); loader_tokens_per_s;
  loader_ratio_2048: the same at seq_len 2048 (target >= 0.3), where a window's share of
  its chunk's decoding is 16x larger;
- dp8_over_dp1_chunk_reads: chunks decompressed per window by one rank at dp=8 over dp=1
  at seq_len 2048, over the first epoch's whole groups of 8 blocks, what a long epoch is
  made of (target <= 1.2); dp8_over_dp1_chunk_reads_3_epochs: the same over three epochs,
  where each epoch's short last group, and a batch that spans two epochs, weigh in a
  store of a few dozen blocks as they would not in one of millions;
- compression_ratio: raw token bytes / bytes of the compressed token arrays;
- e2e (``--e2e-mb``, default 1,000 MB of jsonl; 0 skips it): the tokenize stage run as the
  pipeline (``--only tokenize``, a fresh process, start-up included) against a
  Megatron-style baseline on the same documents, tokenizer and process count
  (``benchmarks/data_e2e.py``): e2e_vs_megatron_cpu, its tokens per CPU-second over the
  baseline's (target >= 0.9); e2e_wall_ratio (target <= 1.1); e2e_rss_ratio, whole-tree
  peak RSS over the baseline's (target <= 1.3); the same three against the baseline calling
  ``encode_batch_fast`` (``..._fast``). One run each, baselines first;
- big_jsonl_largest_process_rss_gb (``--big-jsonl-mb``, default 2,000; 0 skips it): one
  jsonl file of that size through the tokenize stage at a 32k vocabulary (trained by the
  stage), the peak RSS of its largest process (target < 1.5 GB: readers stream by byte
  ranges, so no process holds the file).

The same figures, with the commit and machine, are written to benchmarks/results/bench_data.json.

The machine may be shared, so each figure is the median over ``--reps`` repetitions of a
ratio between runs made back to back (a baseline run, then the measured run).

    python benchmarks/bench_data.py [--docs 600] [--reps 3] [--out runs/bench_data]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.results import RESULTS_DIR, write_results
from data_prep import build
from data_prep.corpus import load_corpus_info, shard_documents
from data_prep.loader import TokenWindowLoader
from data_prep.store import SplitReader, open_store
from data_prep.tokenizer import load_tokenizer
from data_prep.writer import directory_bytes
from stages.config import load_config
from stages.mechanism import tracking
from stages.tokenize import work as tokenize


def log(message: str) -> None:
    print(f"[bench_data] {message}", file=sys.stderr, flush=True)


def make_cfg(out: Path, docs: int, shards: int):
    return load_config(overrides=[
        "data.source=stdlib", f"data.max_documents={docs}", f"data.num_shards={shards}",
        "data.progress_seconds=30", "tokenizer.vocab_size=2048",
        "tokenizer.train_sample_bytes=2000000", f"tracking.runs_dir={out}",
    ])


def cpu_seconds() -> float:
    """CPU time of this process, all threads (the encoder's thread pool included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_encode(cfg, out: Path, tracker, reps: int) -> dict[str, float]:
    """End-to-end (shard tasks + finalize) vs raw encode_batch on the same documents.

    The machine is shared, so measurements are short and paired: for every shard, raw
    ``encode_batch`` of its documents and then ``part``; finalize runs once at the
    end and its time is added to every repetition. The result is the median over
    repetitions of the per-repetition ratio. Both sides use one Tokenizer for the whole
    process (the shard task through ``shared_tokenizer``), as a long-lived worker does:
    ``tokenizers`` slows down with every Tokenizer loaded in a process.
    """
    n = tokenize.prepare(cfg, {}, out, tracker)
    info = load_corpus_info(out)
    shards = build.read_prepared(out)["shards"]
    tok = load_tokenizer(out / tokenize.TOKENIZER, cfg.tokenizer.eos_token)
    ratios, ratios_cpu, e2e_rates, raw_rates = [], [], [], []
    per_rep = []
    for rep in range(reps):
        raw_s = raw_cpu = fast_s = e2e_s = e2e_cpu = 0.0
        tokens = 0
        results = []
        for i in range(n):
            texts = list(shard_documents(info, shards[i], cfg.data))
            t0, c0 = time.perf_counter(), cpu_seconds()
            encodings = tok.encode_batch(texts)
            raw_s += time.perf_counter() - t0
            raw_cpu += cpu_seconds() - c0
            tokens += sum(len(e.ids) for e in encodings) + len(texts)  # + one eos per document
            del encodings
            t0 = time.perf_counter()
            fast_encodings = tok.encode_batch_fast(texts)
            fast_s += time.perf_counter() - t0
            del fast_encodings
            build.remove_part_records(out)  # encode again: a finished shard would be skipped
            t0, c0 = time.perf_counter(), cpu_seconds()
            results.append(tokenize.part(cfg, out, i))
            e2e_s += time.perf_counter() - t0
            e2e_cpu += cpu_seconds() - c0
        assert sum(r["tokens"] for r in results) == tokens
        per_rep.append((raw_s, raw_cpu, fast_s, e2e_s, e2e_cpu))
    t0, c0 = time.perf_counter(), cpu_seconds()
    outputs = tokenize.finalize(cfg, out, results, tracker)
    fin_s, fin_cpu = time.perf_counter() - t0, cpu_seconds() - c0
    assert outputs["train_tokens"] + outputs["validation_tokens"] == tokens
    ratios_fast = []
    for rep, (raw_s, raw_cpu, fast_s, e2e_s, e2e_cpu) in enumerate(per_rep):
        raw_rates.append(tokens / raw_s)
        e2e_rates.append(tokens / (e2e_s + fin_s))
        ratios.append(raw_s / (e2e_s + fin_s))
        ratios_cpu.append(raw_cpu / (e2e_cpu + fin_cpu))
        ratios_fast.append(fast_s / (e2e_s + fin_s))
        log(f"rep {rep}: raw encode_batch {raw_rates[-1]:,.0f} tokens/s, encode_batch_fast "
            f"{tokens / fast_s:,.0f}; end-to-end {e2e_rates[-1]:,.0f} tokens/s (finalize "
            f"{fin_s:.2f}s); ratio {ratios[-1]:.3f} (vs fast {ratios_fast[-1]:.3f})")
    return {"ratio": median(ratios), "ratio_cpu": median(ratios_cpu),
            "ratio_fast": median(ratios_fast), "e2e": median(e2e_rates),
            "raw": median(raw_rates), "tokens": tokens}


def _warm(seconds: float) -> int:
    """Parsl app body: pay the imports before timing; return the worker's pid."""
    import os as o
    import time as t

    import stages.tokenize.work  # noqa: F401
    t.sleep(seconds)
    return o.getpid()


def _shard(cfg, out: Path, index: int) -> dict:
    """Parsl app body: tokenize one shard."""
    from stages.tokenize.work import part as tokenize_shard

    return tokenize_shard(cfg, out, index)


def measure_scaling(cfg, out: Path, tracker, run_dir: Path, reps: int) -> dict[int, list[float]]:
    """Tokens/s of the shard fan-out under Parsl HTEX with 1 and 2 workers, ``reps`` pairs
    (two executors loaded together, runs interleaved; one encoder thread per worker)."""
    import parsl
    from parsl.config import Config
    from parsl.executors import HighThroughputExecutor
    from parsl.providers import LocalProvider

    from workflows.executors import interchange_command

    n = tokenize.prepare(cfg, {}, out, tracker)
    bin_dir = Path(sys.executable).parent
    init = (f"export PATH={shlex.quote(str(bin_dir))}:$PATH; export RAYON_NUM_THREADS=1; "
            f"export PYTHONPATH={shlex.quote(str(REPO))}")
    executors = [
        HighThroughputExecutor(
            label=f"w{workers}", address="127.0.0.1", max_workers_per_node=workers,
            cores_per_worker=1e-6, interchange_launch_cmd=interchange_command(),
            provider=LocalProvider(init_blocks=1, min_blocks=1, max_blocks=1, worker_init=init),
        )
        for workers in (1, 2)
    ]
    parsl.load(Config(executors=executors, run_dir=str(run_dir / "parsl"), strategy_period=0.5))
    rates: dict[int, list[float]] = {1: [], 2: []}
    warm = {w: parsl.python_app(_warm, executors=[f"w{w}"]) for w in (1, 2)}
    shard = {w: parsl.python_app(_shard, executors=[f"w{w}"]) for w in (1, 2)}
    try:
        for workers in (1, 2):
            pids = {f.result() for f in [warm[workers](1.0) for _ in range(2 * workers)]}
            log(f"executor w{workers}: {len(pids)} worker process(es) warmed")
        for rep in range(reps):
            for workers in (1, 2):
                build.remove_part_records(out)  # encode again: finished shards would be skipped
                t0 = time.perf_counter()
                futures = [shard[workers](cfg, out, i) for i in range(n)]
                results = [f.result() for f in futures]
                seconds = time.perf_counter() - t0
                rate = sum(r["tokens"] for r in results) / seconds
                rates[workers].append(rate)
                log(f"rep {rep}: {workers} HTEX worker(s): {rate:,.0f} tokens/s ({n} shards, "
                    f"{seconds:.1f}s)")
    finally:
        parsl.dfk().cleanup()
        parsl.clear()
    return rates


def measure_loader(store: str, out: Path, reps: int, seq_len: int = 128, batch: int = 32,
                   steps: int = 300) -> tuple[float, float]:
    """(median paired store/memmap ratio, median store windows/s) for shuffled batches."""
    reader = SplitReader(store, "train")
    tokens = reader.read(0, reader.num_tokens)
    np.save(out / "train_tokens.npy", tokens)
    memmap = np.load(out / "train_tokens.npy", mmap_mode="r")
    windows = (len(memmap) - 1) // seq_len
    del tokens

    def store_rate() -> float:
        loader = TokenWindowLoader(store, "train", seq_len, batch, seed=0)
        t0 = time.perf_counter()
        for _ in range(steps):
            loader.next_batch()
        return steps * batch / (time.perf_counter() - t0)

    def memmap_rate() -> float:
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        for _ in range(steps):
            starts = rng.integers(0, windows, batch) * seq_len
            rows = [memmap[s : s + seq_len + 1] for s in starts]
            torch.from_numpy(np.stack(rows).astype(np.int64))
        return steps * batch / (time.perf_counter() - t0)

    store_runs, memmap_runs = [], []
    for _ in range(reps):  # paired runs; the machine is shared
        store_runs.append(store_rate())
        memmap_runs.append(memmap_rate())
    log(f"loader windows/s: store {[round(r) for r in store_runs]}, memmap "
        f"{[round(r) for r in memmap_runs]}")
    ratio = median([a / b for a, b in zip(store_runs, memmap_runs, strict=True)])
    return ratio, median(store_runs)


def measure_dp_reads(store: str, epochs: float | None, seq_len: int = 2048,
                     batch: int = 64) -> float:
    """Chunks decompressed per window by the last rank of dp=8 over dp=1 (no timing), over
    ``epochs`` epochs, or (None) over the first epoch's whole groups of blocks."""
    reads = {}
    for dp in (1, 8):
        loader = TokenWindowLoader(store, "train", seq_len, batch, dp_rank=dp - 1, dp_size=dp,
                                   seed=1)
        if epochs is None:
            whole_groups = loader.num_blocks // loader.group_blocks
            windows = int(loader._epoch_order(0)[1][whole_groups - 1])
        else:
            windows = int(epochs * loader.num_windows)
        steps = windows // batch
        for _ in range(steps):
            loader.next_batch()
        reads[dp] = loader.reader.chunk_reads / (steps * loader.rows)
    log(f"chunks decompressed per window at seq_len {seq_len} "
        f"({epochs or 'whole groups of one'} epoch(s)): {reads}")
    return reads[8] / reads[1]


def measure_e2e(out: Path, tokenizer_path: Path, eos_id: int, megabytes: int,
                workers: int = 2) -> dict[str, Any]:
    """The tokenize stage end to end over a Megatron-style baseline (``data_e2e``), with the
    tokenizer at ``tokenizer_path``; one run each."""
    from benchmarks import data_e2e

    corpus = data_e2e.build_corpus(out / "e2e_corpus", megabytes, files=4 * workers)
    log(f"end to end: {corpus['bytes'] / 1e6:,.0f} MB, {corpus['documents']:,} documents in "
        f"{corpus['files']} jsonl files")
    base = data_e2e.run_baseline(out / "e2e_corpus", tokenizer_path, eos_id, out / "megatron",
                                 workers)
    log(f"end to end, Megatron-style baseline: {base}")
    fast = data_e2e.run_baseline(out / "e2e_corpus", tokenizer_path, eos_id,
                                 out / "megatron_fast", workers, call="encode_batch_fast")
    log(f"end to end, the baseline with encode_batch_fast: {fast}")
    mine = data_e2e.run_project(out / "e2e_corpus", tokenizer_path, out / "e2e_runs", workers,
                                shards=corpus["files"])
    log(f"end to end, the tokenize stage: {mine}")
    if not mine["tokens"] == base["tokens"] == fast["tokens"]:
        raise RuntimeError(f"the sides encoded different token counts: {mine}, {base}, {fast}")
    return {
        "e2e_vs_megatron_cpu": round(base["cpu_s"] / mine["cpu_s"], 3),
        "e2e_wall_ratio": round(mine["wall_s"] / base["wall_s"], 3),
        "e2e_rss_ratio": round(mine["peak_rss_gb"] / base["peak_rss_gb"], 3),
        "e2e_megabytes": round(corpus["bytes"] / 1e6),
        "e2e_tokens": mine["tokens"],
        "e2e_wall_s": round(mine["wall_s"], 1), "e2e_cpu_s": round(mine["cpu_s"], 1),
        "e2e_peak_rss_gb": round(mine["peak_rss_gb"], 3),
        "megatron_wall_s": round(base["wall_s"], 1), "megatron_cpu_s": round(base["cpu_s"], 1),
        "megatron_peak_rss_gb": round(base["peak_rss_gb"], 3),
        "e2e_vs_megatron_fast_cpu": round(fast["cpu_s"] / mine["cpu_s"], 3),
        "e2e_wall_ratio_fast": round(mine["wall_s"] / fast["wall_s"], 3),
        "e2e_rss_ratio_fast": round(mine["peak_rss_gb"] / fast["peak_rss_gb"], 3),
        "megatron_fast_cpu_s": round(fast["cpu_s"], 1),
    }


def measure_big_file(out: Path, megabytes: int, vocab: int = 32000) -> dict[str, Any]:
    """One jsonl file of ``megabytes`` MB through the tokenize stage (2 workers, a
    ``vocab``-token tokenizer trained by the stage): the largest process's peak RSS."""
    from benchmarks import data_e2e

    corpus = data_e2e.build_corpus(out / "big_corpus", megabytes, files=1)
    measured = data_e2e.run_project(out / "big_corpus", vocab, out / "big_runs", workers=2,
                                    shards=8)
    log(f"one {corpus['bytes'] / 1e6:,.0f} MB jsonl file at vocab {vocab}: {measured}")
    return {"big_jsonl_megabytes": round(corpus["bytes"] / 1e6),
            "big_jsonl_largest_process_rss_gb": round(measured["largest_process_rss_gb"], 3),
            "big_jsonl_tree_rss_gb": round(measured["peak_rss_gb"], 3),
            "big_jsonl_wall_s": round(measured["wall_s"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=600, help="stdlib documents to use")
    parser.add_argument("--reps", type=int, default=5, help="paired repetitions (median kept)")
    parser.add_argument("--out", default=str(REPO / "runs" / "bench_data"), help="work directory")
    parser.add_argument("--e2e-mb", type=int, default=1000,
                        help="MB of jsonl for the end-to-end comparison (0: skip it)")
    parser.add_argument("--big-jsonl-mb", type=int, default=2000,
                        help="MB of the one jsonl file tokenized at vocab 32k (0: skip it)")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR),
                        help="where bench_data.json is written")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.environ.setdefault("HF_HOME", str(out / "hf_home"))
    uri = f"sqlite:///{out / 'mlflow.db'}"
    tracker = tracking.Tracker(uri, tracking.start_run(
        uri, tracking.ensure_experiment(uri, "bench_data", out), "bench"))

    (out / "e2e").mkdir()
    enc = measure_encode(make_cfg(out, args.docs, 2), out / "e2e", tracker, args.reps)
    tokens = enc["tokens"]
    store = str(out / "e2e" / tokenize.STORE)
    info = open_store(store)
    token_bytes = sum(directory_bytes(Path(store) / p["path"] / "tokens")
                      for s in info.splits.values() for p in s.parts)
    compression = tokens * np.dtype(info.dtype).itemsize / token_bytes
    loader_ratio, loader_rate = measure_loader(store, out, args.reps)
    loader_ratio_2048, _ = measure_loader(store, out, args.reps, seq_len=2048, steps=150)
    dp_reads = measure_dp_reads(store, None)
    dp_reads_epochs = measure_dp_reads(store, 3)
    (out / "scaling").mkdir()
    rates = measure_scaling(make_cfg(out, args.docs, 12), out / "scaling", tracker, out, args.reps)
    tracking.end_run(uri, tracker.run_id)
    e2e = (measure_e2e(out, out / "e2e" / tokenize.TOKENIZER, info.eos_id, args.e2e_mb)
           if args.e2e_mb else {})
    big = measure_big_file(out, args.big_jsonl_mb) if args.big_jsonl_mb else {}
    scaling = median([b / a for a, b in zip(rates[1], rates[2], strict=True)])
    result = {
        "encode_ratio": round(enc["ratio"], 3),
        "worker_scaling": round(scaling, 3),
        "loader_ratio": round(loader_ratio, 3),
        "loader_tokens_per_s": round(loader_rate * 128),
        "loader_ratio_2048": round(loader_ratio_2048, 3),
        "dp8_over_dp1_chunk_reads": round(dp_reads, 3),
        "dp8_over_dp1_chunk_reads_3_epochs": round(dp_reads_epochs, 3),
        "compression_ratio": round(compression, 3),
        "encode_ratio_fast": round(enc["ratio_fast"], 3),
        "encode_ratio_cpu": round(enc["ratio_cpu"], 3),
        "e2e_tokens_per_s": round(enc["e2e"]),
        "raw_encode_tokens_per_s": round(enc["raw"]),
        "tokens_per_s_1_worker": round(median(rates[1])),
        "tokens_per_s_2_workers": round(median(rates[2])),
        **e2e,
        **big,
        "load_average_1min": round(os.getloadavg()[0], 1),
        "tokens": tokens,
        "documents": info.documents,
    }
    path = write_results("bench_data", result, {"args": vars(args)}, args.results_dir)
    log(f"figures written to {path}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
