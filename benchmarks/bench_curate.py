"""Curation benchmark: this project's curation library against datatrove 0.10.1, side by side.

One deterministic corpus (``--seed``) of real technical prose, read offline from the long
descriptions (READMEs, changelogs) in the METADATA files of the installed packages, cut at
paragraph boundaries into documents of ``--doc-chars`` characters, plus planted exact
duplicates (the same text, or with its case or spacing changed), near duplicates (2 % of
the words changed and a "Posted ... | Share" header line), and junk (a navigation menu
repeated, word salad from the corpus's vocabulary, symbol runs, click-here spam).

Both sides run the SAME rules with the SAME thresholds: the prose preset's Gopher
repetition, Gopher quality and C4 lorem-ipsum rules (datatrove's filters configured to
them, its C4 line rewriting switched off), then MinHash dedup with the same shingles, bands
and rows (datatrove: signatures, buckets, clusters, then its filter over the documents its
filters kept; its sha1 hash, since its default xxhash path hands str to xxhash 4, which
refuses it). Left out on both sides: the language rule (datatrove's downloads a fastText
model), decontamination (datatrove's downloads lighteval tasks) and our stop-word fraction
(datatrove has none; our full preset's results are reported beside). datatrove runs twice:
with its own English words (spaCy tokens, punctuation included: what datatrove does), and
with our word rule passed in as a datatrove ``WordTokenizer`` (the same filters exactly).
Our side is two tasks as the curate stage runs them (the shards' signals, then the final
step), each in a subprocess of its own that reports its CPU seconds and peak RSS; so is
each datatrove run.

Printed as the last line (one JSON object) and written to
benchmarks/results/bench_curate.json with the commit, date and machine:

- removed_jaccard: |removed by both| / |removed by either|, ours against datatrove with the
  same words (target >= 0.95); filter_removed_jaccard and dedup_removed_jaccard split it;
  removed_jaccard_spacy_words: against datatrove with its own words;
- docs_per_cpu_s_ratio: ours / datatrove (its own words) documents per CPU-second (target
  >= 1.0); ..._regex_words: against datatrove with our words;
- peak_rss_ratio: our larger task's peak RSS / datatrove's (target <= 0.5);
- planted_*: planted junk removed, planted duplicate pairs left with both copies kept;
  clean_removed_*: real documents removed (those a planted copy repeats not counted);
  ``ours_full_preset``: the prose preset with every rule (a second selection over the
  same signals: reselect_cpu_s is its cost);
- huge_doc_*: our signals task on ``--huge-docs`` documents of ``--huge-mb`` MB each;
- bytes_per_cpu_s / hours_per_tb_per_core / hours_per_tb_per_node: our signal tasks'
  steady text throughput (process start-up and the language model's load left out: a
  shard of a TB corpus runs for hours) extrapolated to 1 TB, on a node of
  ``--node-cores`` cores with one shard task per core (shards are independent, so the rate
  is taken to scale with cores; the final step is a small part, see ours_finalize_cpu_s);
  bytes_per_cpu_s_with_startup: the same with everything counted; rss_per_task_mb: the
  memory each concurrent shard task needs.

    python benchmarks/bench_curate.py [--docs 3000] [--seed 0] [--out runs/bench_curate]
"""
from __future__ import annotations

import argparse
import email
import glob
import gzip
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.peak_rss import own_peak_rss_bytes
from benchmarks.results import RESULTS_DIR, write_results

PLANTED_KINDS = ("exact", "near", "nav", "salad", "symbols", "spam")


def log(message: str) -> None:
    print(f"[bench_curate] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the corpus

def package_texts() -> list[tuple[str, str]]:
    """(package, long description) of every installed distribution, sorted by name."""
    site = sysconfig.get_paths()["purelib"]
    out = []
    for path in sorted(glob.glob(os.path.join(site, "*.dist-info", "METADATA"))):
        with open(path, encoding="utf-8", errors="replace") as handle:
            message = email.message_from_file(handle)
        body = message.get_payload()
        if isinstance(body, str) and len(body) > 500:
            out.append((Path(path).parent.name.split("-")[0], body))
    return out


def cut_documents(text: str, size: int) -> list[str]:
    """Paragraph groups of about ``size`` characters (a paragraph is never split)."""
    docs, current = [], []
    for para in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        if not para.strip():
            continue
        current.append(para.rstrip())
        if sum(len(p) for p in current) >= size:
            docs.append("\n\n".join(current))
            current = []
    if current and sum(len(p) for p in current) >= size // 3:
        docs.append("\n\n".join(current))
    return docs


def _near(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), max(1, len(words) * 2 // 100)):
        words[i] = rng.choice(["quickly", "simply", "often", "rarely", "usually"])
    return f"Posted on {rng.randint(1, 28)} March 2024 by admin | Share\n" + " ".join(words)


def _junk(kind: str, vocab: list[str], rng: random.Random) -> str:
    if kind == "nav":
        items = rng.sample(["Home", "About us", "Products", "Blog", "Contact", "Login",
                            "Pricing", "Careers", "Support", "Docs"], 5)
        return "\n".join([" | ".join(items)] * rng.randint(20, 60))
    if kind == "salad":
        return " ".join(rng.choice(vocab) for _ in range(rng.randint(100, 300)))
    if kind == "symbols":
        return "\n".join("".join(rng.choice("#*=~-_+<>|/\\^%$@")
                                 for _ in range(rng.randint(20, 80)))
                         for _ in range(rng.randint(10, 40)))
    phrases = ["Click here to claim your free prize now!", "Click here for the best deals!",
               "Limited offer, click here today!", "Click here to win big!"]
    return " ".join(rng.choice(phrases[:2]) for _ in range(rng.randint(20, 50)))


def make_corpus(path: Path, docs: int, seed: int,
                doc_chars: int) -> tuple[dict[str, str], dict[str, str]]:
    """Write the corpus (JSON lines {"id", "text"}) to ``path``; returns (id -> planted
    kind, "clean" for the real documents; planted copy id -> its original's id)."""
    rng = random.Random(seed)
    clean = [d for _, text in package_texts() for d in cut_documents(text, doc_chars)]
    rng.shuffle(clean)
    clean = clean[: int(docs * 0.88)]
    vocab = sorted({w.strip(".,:;()`*#!?\"'[]").lower() for d in clean for w in d.split()}
                   - {""})
    planted: list[tuple[str, str, int | None]] = []
    per_kind = max(2, docs * 2 // 100)
    for _ in range(per_kind * 2):
        source = rng.randrange(len(clean))
        original = clean[source]
        planted.append(("exact", rng.choice([original, original.upper(),
                                             original.replace(" ", "  ")]), source))
    for _ in range(per_kind * 2):
        source = rng.randrange(len(clean))
        planted.append(("near", _near(clean[source], rng), source))
    for kind in ("nav", "salad", "symbols", "spam"):
        planted += [(kind, _junk(kind, vocab, rng), None) for _ in range(per_kind // 2)]
    entries = [("clean", text, i) for i, text in enumerate(clean)] + planted
    order = list(range(len(entries)))
    rng.shuffle(order)
    kinds: dict[str, str] = {}
    clean_ids: dict[int, str] = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for i, entry in enumerate(order):
            kind, text, source = entries[entry]
            doc_id = f"doc-{i:06d}"
            kinds[doc_id] = kind
            if kind == "clean":
                clean_ids[source] = doc_id
            handle.write(json.dumps({"id": doc_id, "text": text}) + "\n")
    originals = {f"doc-{i:06d}": clean_ids[entries[e][2]] for i, e in enumerate(order)
                 if entries[e][0] in ("exact", "near")}
    return kinds, originals


# ---------------------------------------------------------------------------- the two sides

def bench_thresholds() -> dict[str, float | None]:
    """The prose preset's rules that datatrove has: without the language rule (datatrove's
    needs a download) and the stop-word fraction (not in datatrove)."""
    from data_prep.curate import PROSE

    return {**PROSE, "min_language_score": None, "min_stop_word_fraction": None}


def ours_signals(corpus: Path, work: Path, shards: int) -> float:
    """Our part tasks: plan the corpus and write every shard's signals. Returns the CPU
    seconds of the shards' work alone (imports and the language model loaded before)."""
    from data_prep.config import DataConfig
    from data_prep.corpus import prepare_corpus
    from data_prep.curate import CurateConfig, compute_shard_signals, document_signals

    data = DataConfig(source=str(corpus), num_shards=shards)
    cfg = CurateConfig(id_field="id", preset="prose")
    info = prepare_corpus(data, work)
    document_signals("start-up: the language model is loaded once a process", cfg)
    started = time.process_time()
    for i, shard in enumerate(info.shards):
        compute_shard_signals(info, i, shard, data, cfg, None,
                              work / "signals" / f"shard-{i:05d}.parquet")
    return time.process_time() - started


def ours_finalize(corpus: Path, work: Path, shards: int,
                  thresholds: dict[str, float | None]) -> dict[str, str]:
    """Our final task over the signal files in ``work``: removed id -> "filter" or
    "dedup"."""
    import pyarrow.parquet as pq

    from data_prep.config import DataConfig
    from data_prep.corpus import load_corpus_info
    from data_prep.curate import CurateConfig, curate_corpus

    data = DataConfig(source=str(corpus), num_shards=shards)
    cfg = CurateConfig(id_field="id", preset="prose", thresholds=thresholds)
    paths = sorted((work / "signals").glob("shard-*.parquet"))
    out = work / "selection" / str(abs(hash(json.dumps(thresholds, sort_keys=True))))
    curate_corpus(paths, cfg, data, out, load_corpus_info(work))
    rows = pq.read_table(out / "removed.parquet", columns=["id", "reason"]).to_pylist()
    return {r["id"]: "dedup" if r["reason"].endswith("_duplicate") else "filter" for r in rows}


def regex_tokenizer():
    """A datatrove WordTokenizer whose words are ``data_prep.curate.text.WORD`` matches
    (datatrove takes a WordTokenizer instance wherever it takes a language)."""
    from datatrove.utils.word_tokenizers import WordTokenizer

    from data_prep.curate.text import WORD

    class RegexWords(WordTokenizer):
        def word_tokenize(self, text: str) -> list[str]:
            return WORD.findall(text)

        def sent_tokenize(self, text: str) -> list[str]:
            return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [m.span() for m in re.finditer(r"[^.!?]+[.!?]*", text)]

    return RegexWords()


def datatrove_filters(thresholds: dict[str, float | None], writer_dir: Path,
                      language: Any) -> list:
    """datatrove's filters set to the same rules and thresholds, each with an exclusion
    writer (the removed documents' ids are read back from them); ``language``: datatrove's
    "en" (spaCy words, punctuation tokens included) or ``regex_tokenizer()``."""
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )
    from datatrove.pipeline.writers import JsonlWriter

    t = thresholds
    if t["max_hash_ratio"] != t["max_ellipsis_ratio"]:
        raise ValueError("datatrove has one symbol-to-word threshold for '#' and '...'")
    return [
        GopherRepetitionFilter(
            dup_line_frac=t["max_dup_line_frac"], dup_para_frac=t["max_dup_para_frac"],
            dup_line_char_frac=t["max_dup_line_char_frac"],
            dup_para_char_frac=t["max_dup_para_char_frac"],
            top_n_grams=tuple((n, t[f"max_top_{n}gram"]) for n in (2, 3, 4)),
            dup_n_grams=tuple((n, t[f"max_dup_{n}gram"]) for n in range(5, 11)),
            exclusion_writer=JsonlWriter(str(writer_dir / "repetition")), language=language),
        GopherQualityFilter(
            min_doc_words=t["min_words"], max_doc_words=t["max_words"],
            min_avg_word_length=t["min_mean_word_length"],
            max_avg_word_length=t["max_mean_word_length"],
            max_symbol_word_ratio=t["max_hash_ratio"],
            max_bullet_lines_ratio=t["max_bullet_lines"],
            max_ellipsis_lines_ratio=t["max_ellipsis_lines"],
            max_non_alpha_words_ratio=t["min_alpha_words"], min_stop_words=t["min_stop_words"],
            exclusion_writer=JsonlWriter(str(writer_dir / "quality")), language=language),
        C4QualityFilter(  # only its lorem-ipsum rule: no line is dropped or rewritten
            split_paragraph=True, remove_citations=False, filter_no_terminal_punct=False,
            min_num_sentences=-1, min_words_per_line=-1, max_word_length=-1,
            filter_lorem_ipsum=t["max_lorem_ipsum"] is not None, filter_javascript=False,
            filter_curly_bracket=False, filter_policy=False,
            exclusion_writer=JsonlWriter(str(writer_dir / "c4")), language=language),
    ]


def run_datatrove(corpus: Path, work: Path, words: str) -> dict[str, str]:
    """datatrove's filters, then its four MinHash steps: removed id -> "filter" or
    "dedup"."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig

    from data_prep.curate import CurateConfig

    ours = CurateConfig()
    language = regex_tokenizer() if words == "regex" else "en"
    # sha1: datatrove 0.10.1's default xxhash path passes str to xxhash 4, which refuses it
    config = MinhashConfig(n_grams=ours.shingle_words, num_buckets=ours.minhash_bands,
                           hashes_per_bucket=ours.minhash_rows,
                           hash_config=HashConfig(precision=64, hash_fc="sha1"))
    removed = work / "removed"
    kept = work / "kept"

    def execute(pipeline: list, tasks: int = 1, name: str = "step") -> None:
        LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1,
                              logging_dir=str(work / "logs" / name)).run()

    execute([JsonlReader(str(corpus.parent), glob_pattern=corpus.name),
             *datatrove_filters(bench_thresholds(), removed, language),
             JsonlWriter(str(kept))], name="filters")
    execute([JsonlReader(str(kept)), MinhashDedupSignature(str(work / "sigs"), config=config,
                                                           language=language)],
            name="signatures")
    execute([MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=config)],
            tasks=config.num_buckets, name="buckets")
    execute([MinhashDedupCluster(str(work / "buckets"), str(work / "remove_ids"),
                                 config=config)], name="cluster")
    execute([JsonlReader(str(kept)),
             MinhashDedupFilter(str(work / "remove_ids"),
                                exclusion_writer=JsonlWriter(str(removed / "minhash")))],
            name="dedup")
    ids: dict[str, str] = {}
    for path in sorted(removed.rglob("*.jsonl*")):
        step = "dedup" if path.relative_to(removed).parts[0] == "minhash" else "filter"
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            ids.update((json.loads(line)["id"], step) for line in handle if line.strip())
    return ids


def _usage(started: resource.struct_rusage) -> tuple[float, float]:
    """(CPU seconds since ``started``, with children; peak RSS in MB: this process's own,
    not the parent's it inherits over fork + exec, or a child's)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (usage.ru_utime - started.ru_utime + usage.ru_stime - started.ru_stime
           + children.ru_utime + children.ru_stime)
    return cpu, max(own_peak_rss_bytes() / 1024, children.ru_maxrss) / 1024


def side(args: argparse.Namespace) -> None:
    """One side (or one of our two tasks) in this process: removed ids, CPU seconds and
    peak RSS, as JSON in ``args.report``."""
    work = Path(args.work)
    corpus = Path(args.corpus)
    started, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    record: dict[str, Any] = {}
    if args.side == "ours-finalize":  # the comparison selection, then the full preset's
        from data_prep.curate import PROSE

        record["removed"] = ours_finalize(corpus, work, args.shards, bench_thresholds())
        record["cpu_s"], record["peak_rss_mb"] = _usage(started)
        again = time.process_time()
        record["removed_full_preset"] = ours_finalize(corpus, work, args.shards, PROSE)
        record["reselect_cpu_s"] = time.process_time() - again
    else:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        if args.side == "ours-signals":
            record["steady_cpu_s"] = ours_signals(corpus, work, args.shards)
        else:
            record["removed"] = run_datatrove(corpus, work, args.words)
        record["cpu_s"], record["peak_rss_mb"] = _usage(started)
    record["wall_s"] = time.perf_counter() - wall
    Path(args.report).write_text(json.dumps(record))


def run_side(name: str, corpus: Path, out: Path, shards: int,
             words: str = "spacy") -> dict[str, Any]:
    """Run one side in a subprocess of its own; ours is two tasks (signals, then the
    final step), as the curate stage runs them: CPU adds up, peak RSS is the larger."""
    if name == "ours":
        first = run_side("ours-signals", corpus, out, shards)
        second = run_side("ours-finalize", corpus, out, shards)
        return {**second, "cpu_s": first["cpu_s"] + second["cpu_s"],
                "peak_rss_mb": max(first["peak_rss_mb"], second["peak_rss_mb"]),
                "signals_cpu_s": first["cpu_s"], "signals_peak_rss_mb": first["peak_rss_mb"],
                "signals_steady_cpu_s": first["steady_cpu_s"],
                "finalize_cpu_s": second["cpu_s"],
                "finalize_peak_rss_mb": second["peak_rss_mb"]}
    tag = f"{name}_{words}" if name == "datatrove" else name
    report = out / f"{tag}.json"
    work = out / ("ours" if name.startswith("ours") else tag)
    command = [sys.executable, __file__, "--side", name, "--corpus", str(corpus),
               "--work", str(work), "--report", str(report), "--shards", str(shards),
               "--words", words]
    log(f"running {tag}")
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                              "RAYON_NUM_THREADS": "1"})
    return json.loads(report.read_text())


def huge_documents(out: Path, count: int, megabytes: int) -> dict[str, Any]:
    """Ours on ``count`` documents of ``megabytes`` MB of real prose each (one shard)."""
    corpus = out / "huge" / "huge.jsonl"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    texts = [text for _, text in package_texts()]
    with open(corpus, "w", encoding="utf-8") as handle:
        for i in range(count):
            parts, size = [], 0
            while size < megabytes << 20:
                parts.append(rng.choice(texts))
                size += len(parts[-1])
            handle.write(json.dumps({"id": f"huge-{i}", "text": "\n\n".join(parts)}) + "\n")
    (out / "huge").mkdir(exist_ok=True)
    return run_side("ours-signals", corpus, out / "huge", 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=3000,
                        help="documents in the corpus (fewer when the installed packages' "
                             "descriptions run out: 2,538 here)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--doc-chars", type=int, default=700,
                        help="characters of a real document (paragraphs grouped)")
    parser.add_argument("--shards", type=int, default=2, help="input shards on our side")
    parser.add_argument("--huge-docs", type=int, default=2)
    parser.add_argument("--huge-mb", type=int, default=10)
    parser.add_argument("--node-cores", type=int, default=56,
                        help="cores of the node the 1 TB figure is for (Frontier: 56 usable)")
    parser.add_argument("--out", default=str(REPO / "runs" / "bench_curate"))
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    parser.add_argument("--side", choices=["ours-signals", "ours-finalize", "datatrove"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    parser.add_argument("--words", choices=["spacy", "regex"], default="spacy",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side(args)
        return
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    corpus = out / "corpus" / "corpus.jsonl"
    kinds, originals = make_corpus(corpus, args.docs, args.seed, args.doc_chars)
    corpus_bytes = sum(len(json.loads(line)["text"].encode()) for line in open(corpus))
    log(f"{len(kinds)} documents, {corpus_bytes / 1e6:.1f} MB of text")
    stock = run_side("datatrove", corpus, out, args.shards, "spacy")
    same = run_side("datatrove", corpus, out, args.shards, "regex")
    ours = run_side("ours", corpus, out, args.shards)
    a, b, c = set(ours["removed"]), set(same["removed"]), set(stock["removed"])
    n = len(kinds)

    def by(removed: dict[str, str], step: str) -> set[str]:
        return {i for i, s in removed.items() if s == step}

    figures: dict[str, Any] = {
        "removed_jaccard": _jaccard(a, b),
        "filter_removed_jaccard": _jaccard(by(ours["removed"], "filter"),
                                           by(same["removed"], "filter")),
        "dedup_removed_jaccard": _jaccard(by(ours["removed"], "dedup"),
                                          by(same["removed"], "dedup")),
        "docs_per_cpu_s_ratio": round(stock["cpu_s"] / ours["cpu_s"], 2),
        "peak_rss_ratio": round(ours["peak_rss_mb"] / stock["peak_rss_mb"], 3),
        "removed_jaccard_spacy_words": _jaccard(a, c),
        "docs_per_cpu_s_ratio_regex_words": round(same["cpu_s"] / ours["cpu_s"], 2),
        "peak_rss_ratio_regex_words": round(ours["peak_rss_mb"] / same["peak_rss_mb"], 3),
        "documents": n, "text_mb": round(corpus_bytes / 1e6, 2),
        "ours_docs_per_cpu_s": round(n / ours["cpu_s"], 1),
        "datatrove_docs_per_cpu_s": round(n / stock["cpu_s"], 1),
        "datatrove_regex_words_docs_per_cpu_s": round(n / same["cpu_s"], 1),
        "ours_peak_rss_mb": round(ours["peak_rss_mb"], 1),
        "datatrove_peak_rss_mb": round(stock["peak_rss_mb"], 1),
        "datatrove_regex_words_peak_rss_mb": round(same["peak_rss_mb"], 1),
        "ours_removed": len(a), "datatrove_regex_words_removed": len(b),
        "datatrove_spacy_words_removed": len(c),
        "removed_only_ours": len(a - b), "removed_only_datatrove_regex_words": len(b - a),
    }
    full = set(ours["removed_full_preset"])
    sides = (("ours", a), ("ours_full_preset", full), ("datatrove_regex_words", b),
             ("datatrove_spacy_words", c))
    copied = set(originals.values())
    for kind in ("clean", *PLANTED_KINDS):
        members = {i for i, k in kinds.items() if k == kind}
        if kind == "clean":  # a real document that a planted copy repeats is not counted
            members -= copied
        prefix = "clean_removed" if kind == "clean" else f"planted_{kind}_removed"
        if kind in ("exact", "near"):  # a pair is resolved when one copy is left
            prefix = f"planted_{kind}_pairs_both_kept"
        for label, removed in sides:
            if kind in ("exact", "near"):
                both = sum(1 for copy in members
                           if copy not in removed and originals[copy] not in removed)
                figures[f"{prefix}_{label}"] = f"{both}/{len(members)}"
            else:
                figures[f"{prefix}_{label}"] = f"{len(members & removed)}/{len(members)}"
    figures["reselect_cpu_s"] = round(ours["reselect_cpu_s"], 2)
    figures["ours_signals_cpu_s"] = round(ours["signals_cpu_s"], 2)
    figures["ours_finalize_cpu_s"] = round(ours["finalize_cpu_s"], 2)
    figures["ours_signals_peak_rss_mb"] = round(ours["signals_peak_rss_mb"], 1)
    figures["ours_finalize_peak_rss_mb"] = round(ours["finalize_peak_rss_mb"], 1)
    # the shards' steady rate (start-up excluded: a shard of a TB corpus runs for hours)
    rate = corpus_bytes / ours["signals_steady_cpu_s"]
    figures.update({
        "bytes_per_cpu_s": round(rate),
        "bytes_per_cpu_s_with_startup": round(corpus_bytes / ours["cpu_s"]),
        "hours_per_tb_per_core": round(1e12 / rate / 3600, 1),
        "hours_per_tb_per_node": round(1e12 / rate / 3600 / args.node_cores, 2),
        "node_cores": args.node_cores,
        "rss_per_task_mb": round(ours["peak_rss_mb"], 1),
    })
    if args.huge_docs:
        huge = huge_documents(out, args.huge_docs, args.huge_mb)
        figures.update({"huge_docs": args.huge_docs, "huge_doc_mb": args.huge_mb,
                        "huge_doc_peak_rss_mb": round(huge["peak_rss_mb"], 1),
                        "huge_doc_cpu_s": round(huge["cpu_s"], 1)})
    figures["targets"] = {
        "removed_jaccard>=0.95": figures["removed_jaccard"] >= 0.95,
        "docs_per_cpu_s_ratio>=1.0": figures["docs_per_cpu_s_ratio"] >= 1.0,
        "peak_rss_ratio<=0.5": figures["peak_rss_ratio"] <= 0.5,
    }
    figures["load_average_1min"] = round(os.getloadavg()[0], 1)
    only = {"only_ours": sorted(a - b)[:50], "only_datatrove": sorted(b - a)[:50],
            "kinds_of_only_ours": _kinds(a - b, kinds),
            "kinds_of_only_datatrove": _kinds(b - a, kinds),
            "kinds_of_only_datatrove_spacy_words": _kinds(c - a, kinds)}
    path = write_results("bench_curate", figures, {"args": vars(args), "differences": only},
                         args.results_dir)
    log(f"figures written to {path}")
    print(json.dumps(figures), flush=True)


def _jaccard(a: set[str], b: set[str]) -> float:
    return round(len(a & b) / max(1, len(a | b)), 4)


def _kinds(ids: set[str], kinds: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in ids:
        out[kinds[i]] = out.get(kinds[i], 0) + 1
    return out


if __name__ == "__main__":
    main()
