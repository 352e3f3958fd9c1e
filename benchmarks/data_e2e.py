"""The tokenize stage end to end against a Megatron-style preprocessing baseline.

Both sides encode the same jsonl documents with the same tokenizer in the same number of
processes, each with one encoder thread (``RAYON_NUM_THREADS=1``):

- baseline (``python benchmarks/data_e2e.py CORPUS TOKENIZER EOS_ID OUT WORKERS CALL``):
  Megatron's ``preprocess_data.py`` shape: a pool of worker processes, each reading
  its jsonl files line by line and encoding 1,000 documents at a time with ``tokenizers``'
  ``encode_batch`` (and, a stronger baseline, ``encode_batch_fast``, what the stage's
  shard tasks call: the same ids without character offsets), the ids and one eos per
  document appended to a ``.bin`` file and the document offsets to an ``.idx`` file;
  nothing else (no split, no manifest, no tracking);
- the project: ``python -m workflows.pipeline --only tokenize`` in a fresh process, so its
  start-up (imports, MLflow's store, Parsl's executors), the corpus plan, the tokenizer's
  sample, the shard tasks, the Zarr writes and the tracking are all in.

Each side runs as a fresh process tree, measured alike (``measure_tree``): wall time, and,
sampled every 0.1 s with psutil, the CPU seconds of every process it started (found by a
tag in their environment) and the peak of their summed resident memory. The corpus is the
interpreter's standard library repeated until it reaches the asked size, each pass a
distinct document set (its pass number on the first line).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
BATCH_DOCS = 1000
_TOKENIZERS: dict[str, Any] = {}  # one per baseline worker process, loaded on first use


def build_corpus(directory: Path, megabytes: int, files: int) -> dict[str, int]:
    """Write about ``megabytes`` MB of jsonl (``{"text": ...}``) in ``files`` files."""
    from data_prep.sources import stdlib_files

    texts = []
    for path in stdlib_files():
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    texts = [t for t in texts if t.strip()]
    directory.mkdir(parents=True, exist_ok=True)
    outs = [open(directory / f"part-{i:03d}.jsonl", "w", encoding="utf-8") for i in range(files)]
    target, written, documents = megabytes * 1_000_000, 0, 0
    try:
        while written < target:
            for text in texts:
                line = json.dumps({"text": f"# pass {documents // len(texts)}\n{text}"}) + "\n"
                outs[documents % files].write(line)
                written += len(line.encode("utf-8"))
                documents += 1
                if written >= target:
                    break
    finally:
        for out in outs:
            out.close()
    return {"bytes": written, "documents": documents, "files": files}


def _encode_file(job: tuple[str, str, str, int, str]) -> int:
    """Baseline worker: one jsonl file to ``<prefix>.bin`` (uint16 ids) and ``.idx``."""
    from tokenizers import Tokenizer

    path, tokenizer_path, prefix, eos, call = job
    if tokenizer_path not in _TOKENIZERS:
        _TOKENIZERS[tokenizer_path] = Tokenizer.from_file(tokenizer_path)
    tok = _TOKENIZERS[tokenizer_path]
    offsets, tokens = [0], 0
    with open(path, encoding="utf-8") as src, open(prefix + ".bin", "wb") as bin_file:
        batch: list[str] = []
        for line in src:
            batch.append(json.loads(line)["text"])
            if len(batch) == BATCH_DOCS:
                tokens += _write_batch(getattr(tok, call)(batch), eos, bin_file, offsets)
                batch = []
        if batch:
            tokens += _write_batch(getattr(tok, call)(batch), eos, bin_file, offsets)
    np.asarray(offsets, dtype=np.int64).tofile(prefix + ".idx")
    return tokens


def _write_batch(encodings: list[Any], eos: int, bin_file: Any, offsets: list[int]) -> int:
    ids = []
    for encoding in encodings:
        ids.append(np.asarray(encoding.ids, dtype=np.uint16))
        ids.append(np.asarray([eos], dtype=np.uint16))
        offsets.append(offsets[-1] + len(encoding.ids) + 1)
    data = np.concatenate(ids)
    data.tofile(bin_file)
    return len(data)


TREE_TAG = "FRONTIER_LLM_BENCH_TREE"
"""Set in the measured command's environment: every process it starts inherits it, also
those that leave the process tree (Parsl's worker pools are started detached)."""


class TreeSampler:
    """Peak summed RSS and CPU seconds of the processes carrying ``TREE_TAG=tag``, sampled
    every 0.1 s (a process's CPU time as last seen: one that exits loses at most its last
    0.1 s)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.peak_rss = 0
        self.largest_rss = 0  # the peak of the largest single process
        self._tagged: dict[tuple[int, float], bool] = {}  # (pid, start time) -> carries the tag
        self._cpu: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def cpu_s(self) -> float:
        return sum(self._cpu.values())

    def _carries_tag(self, proc: psutil.Process, key: tuple[int, float]) -> bool:
        if key not in self._tagged:
            try:
                self._tagged[key] = proc.environ().get(TREE_TAG) == self.tag
            except psutil.Error:
                return False
        return self._tagged[key]

    def _sample(self) -> None:
        rss = 0
        for proc in psutil.process_iter():
            try:
                with proc.oneshot():
                    key = (proc.pid, proc.create_time())
                    if not self._carries_tag(proc, key):
                        continue
                    times = proc.cpu_times()
                    own = proc.memory_info().rss
                    self._cpu[key] = times.user + times.system
                rss += own
                self.largest_rss = max(self.largest_rss, own)
            except psutil.Error:
                pass
        self.peak_rss = max(self.peak_rss, rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(0.1)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure_tree(cmd: list[str], log_path: Path, env: dict[str, str]) -> dict[str, float]:
    """Run ``cmd`` (output to ``log_path``) and measure every process it starts."""
    tag = f"{os.getpid()}-{time.time_ns()}"
    t0 = time.perf_counter()
    with open(log_path, "w") as log, TreeSampler(tag) as tree:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**env, TREE_TAG: tag}, stdout=log,
                                stderr=subprocess.STDOUT)
        code = proc.wait()
        time.sleep(0.3)  # processes still ending after the command
    wall = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({code}): see {log_path}")
    return {"wall_s": wall, "cpu_s": tree.cpu_s, "peak_rss_gb": tree.peak_rss / 1e9,
            "largest_process_rss_gb": tree.largest_rss / 1e9}


def run_baseline(corpus: Path, tokenizer_path: Path, eos: int, out: Path, workers: int,
                 call: str = "encode_batch") -> dict[str, float]:
    """The Megatron-style baseline over every jsonl file of ``corpus``, in a fresh process,
    encoding with the Tokenizer's method ``call`` (``encode_batch_fast``: no offsets)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), str(corpus), str(tokenizer_path),
           str(eos), str(out), str(workers), call]
    measured = measure_tree(cmd, out / "baseline.log", env)
    tokens = int((out / "baseline.log").read_text().split()[-1])
    return {"tokens": tokens, **measured}


def run_project(corpus: Path, tokenizer: Path | int, runs_dir: Path, workers: int,
                shards: int) -> dict[str, float]:
    """``workflows.pipeline --only tokenize`` over ``corpus`` in a fresh process, with the
    tokenizer file ``tokenizer`` or (an int) one of that vocabulary trained by the stage."""
    from tokenizers import Tokenizer

    from data_prep.store import open_store

    runs_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, int):
        vocab, choice = tokenizer, [f"tokenizer.vocab_size={tokenizer}"]
    else:
        vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
        choice = [f"tokenizer.path={tokenizer}"]
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "workflows.pipeline", "--config", "micro",
           "--runs-dir", str(runs_dir), "--only", "tokenize", "--set",
           f"data.source={corpus}", "data.max_documents=null", f"data.num_shards={shards}",
           "data.chunk_tokens=65536", "data.chunks_per_shard=16", "data.progress_seconds=30",
           *choice, f"model.vocab_size={vocab}", f"site.max_workers={workers}"]
    measured = measure_tree(cmd, runs_dir / "driver.log", env)
    tokens = open_store(next(runs_dir.glob("stages/tokenize/*/store.zarr"))).tokens
    return {"tokens": tokens, **measured}


def baseline_main(corpus: str, tokenizer_path: str, eos: str, out: str, workers: str,
                  call: str) -> None:
    """The baseline's process: a pool of ``workers``, one jsonl file per task; prints the
    tokens written."""
    jobs = [(str(p), tokenizer_path, str(Path(out) / p.stem), int(eos), call)
            for p in sorted(Path(corpus).glob("*.jsonl"))]
    with multiprocessing.get_context("spawn").Pool(int(workers)) as pool:
        tokens = sum(pool.imap_unordered(_encode_file, jobs))
    print(tokens, flush=True)


if __name__ == "__main__":
    baseline_main(*sys.argv[1:])
