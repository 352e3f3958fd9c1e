"""A small curation corpus with planted duplicates, junk, a foreign document and a leaked
eval example, built from real technical prose (tests/data/curate/prose.txt), and the
helpers the curation tests share."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from data_prep.config import DataConfig
from data_prep.corpus import prepare_corpus
from data_prep.curate import (
    CurateConfig,
    compute_shard_signals,
    eval_ngrams,
    local_task_texts,
    prompt_texts,
)

PROSE = [p.strip() for p in (Path(__file__).parent / "data" / "curate" / "prose.txt")
         .read_text(encoding="utf-8").split("\n===\n")]
EVAL_TEXT = ("A farmer has seventeen sheep and all but nine run away through a hole in the "
             "fence, so how many sheep does the farmer still have left in the field?")
LEAK = ("Riddles like this one are a classic test of careful reading: all but nine run "
        "away through a hole in the fence, so how many sheep does the farmer have? "
        "Answers that subtract the numbers are the usual mistake.")
GERMAN = ("Die Bibliothek liest geschichtete Konfigurationsdateien und führt sie zu einem "
          "einzigen typisierten Objekt zusammen. Spätere Ebenen überschreiben frühere "
          "Schlüssel für Schlüssel, sodass eine Standortdatei nur die Werte enthalten muss, "
          "die sie ändert. Jeder Wert merkt sich die Datei und die Zeile, aus der er stammt, "
          "damit eine überraschende Einstellung leicht zu ihrer Quelle zurückverfolgt "
          "werden kann.")


def nav_menu() -> str:
    return "\n".join(["Home | About us | Products | Blog | Contact"] * 40)


def word_salad(seed: int = 7, count: int = 150) -> str:
    """Words drawn at random from the prose's own vocabulary, no sentence structure."""
    vocab = sorted({w.strip(".,:;()`*#!?\"'").lower() for p in PROSE for w in p.split()} - {""})
    rng = random.Random(seed)
    return " ".join(rng.choice(vocab) for _ in range(count))


def symbol_runs(seed: int = 3) -> str:
    rng = random.Random(seed)
    return "\n".join("".join(rng.choice("#*=~-_+<>|/\\^%$@") for _ in range(rng.randint(20, 70)))
                     for _ in range(25))


def click_spam() -> str:
    return " ".join(["Click here to claim your free prize now!",
                     "Click here for the best deals online!"] * 30)


def near_copy(text: str, seed: int = 1) -> str:
    """``text`` with 2 words in every 100 replaced and a byline header line on top."""
    rng = random.Random(seed)
    words = text.split(" ")
    for i in rng.sample(range(len(words)), max(1, len(words) * 2 // 100)):
        words[i] = rng.choice(["quickly", "simply", "often", "rarely"])
    return "Posted on 3 March 2024 by admin | Share\n" + " ".join(words)


@dataclass
class Planted:
    """The corpus and what each planted document should become."""

    data: DataConfig
    curate: CurateConfig
    task_dir: Path
    expected: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    """doc id -> (reason, duplicate_of id or None) for every document to be removed."""
    kept_ids: list[str] = field(default_factory=list)


def _write(path: Path, docs: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs),
                    encoding="utf-8")


def planted_corpus(root: Path) -> Planted:
    """Two sources: "web" (two JSON-lines files, two shards) and "docs" (one shard).

    Planted: exact duplicates within a shard, across shards, across sources (one of them a
    cluster of three); near duplicates (2 % of words changed plus a header line) within a
    shard and across sources; a navigation menu, word salad, symbol runs, click-here spam;
    a German document; a document quoting 13+ words of an eval task.
    """
    long1 = "\n\n".join(PROSE[40:43])
    long2 = "\n\n".join(PROSE[43:46])
    web1 = [(f"p{i:02d}", PROSE[i]) for i in range(0, 14)]
    web1 += [("long1", long1), ("dup-p03", PROSE[3].replace(" ", "  ", 3)),
             ("nav", nav_menu()), ("salad", word_salad()), ("german", GERMAN)]
    web2 = [(f"p{i:02d}", PROSE[i]) for i in range(14, 28)]
    web2 += [("long2", long2), ("dup-p05", PROSE[5]), ("dup-p09a", PROSE[9]),
             ("symbols", symbol_runs()), ("near-long2", near_copy(long2, 2)),
             ("leak", PROSE[20] + "\n\n" + LEAK), ("spam", click_spam())]
    docs = [(f"p{i:02d}", PROSE[i]) for i in range(28, 40)] + [
        (f"p{i:02d}", PROSE[i]) for i in (46, 47)]
    docs += [("dup-p08", PROSE[8].replace(". ", ".\n")), ("dup-p09b", PROSE[9]),
             ("near-long1", near_copy(long1, 1))]
    _write(root / "web" / "part-1.jsonl", web1)
    _write(root / "web" / "part-2.jsonl", web2)
    _write(root / "docs" / "all.jsonl", docs)
    task_dir = root / "tasks"
    task_dir.mkdir()
    (task_dir / "riddles.jsonl").write_text(json.dumps({"question": EVAL_TEXT,
                                                        "answer": "nine"}) + "\n")
    (task_dir / "riddles.yaml").write_text(json.dumps({
        "task": "riddles", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": "riddles.jsonl"}}}))
    data = DataConfig(sources={"web": str(root / "web"), "docs": str(root / "docs")},
                      num_shards=3)
    expected = {
        "dup-p03": ("exact_duplicate", "p03"), "dup-p05": ("exact_duplicate", "p05"),
        "dup-p09a": ("exact_duplicate", "p09"), "dup-p09b": ("exact_duplicate", "p09"),
        "dup-p08": ("exact_duplicate", "p08"),
        "near-long1": ("near_duplicate", "long1"), "near-long2": ("near_duplicate", "long2"),
        "nav": ("quality", None), "salad": ("quality", None), "symbols": ("quality", None),
        "spam": ("quality", None), "german": ("language", None),
        "leak": ("contamination:riddles", None),
    }
    every = [i for part in (web1, web2, docs) for i, _ in part]
    return Planted(data=data, curate=CurateConfig(id_field="id"), task_dir=task_dir,
                   expected=expected, kept_ids=[i for i in every if i not in expected])


def signal_files(planted: Planted, out: Path, curate: CurateConfig | None = None
                 ) -> tuple[list[Path], object]:
    """Plan the corpus in ``out`` and write every shard's signal file; (paths, info)."""
    cfg = curate or planted.curate
    info = prepare_corpus(planted.data, out)
    index = eval_ngrams({**prompt_texts(["def main(", "import "]),
                         **local_task_texts(planted.task_dir)},
                        cfg.decontamination_ngram, cfg.decontamination_min_words)
    paths = []
    for i, shard in enumerate(info.shards):
        path = out / "signals" / f"shard-{i:05d}.parquet"
        compute_shard_signals(info, i, shard, planted.data, cfg, index, path)
        paths.append(path)
    return paths, info
