"""Decontamination: which eval tasks a training document shares a word n-gram with.

Rule: the n-grams (``curate.decontamination_ngram`` words, 13 by default, as GPT-3 and
lm-eval) of every eval text, over normalized words (``text.normalize`` then ``text.WORD``).
An eval text shorter than n words is one n-gram as a whole (lm-eval's rule), so a document
containing that whole text matches; texts under ``curate.decontamination_min_words`` words
are ignored, since a generation prompt such as ``def main(`` would match most of a code
corpus. A document is contaminated by every task one of its n-grams belongs to.

Eval texts come from the eval stage's inputs: the generation prompts (``eval.prompts``) and
local lm-eval task files (``eval.task_include``: YAML whose ``dataset_path`` is json with
local ``data_files``, every string field of every record), see ``local_task_texts``.
"""
from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from data_prep.curate.text import WORD, normalize

PROMPTS_TASK = "eval.prompts"
"""Task name given to the eval stage's generation prompts."""


@dataclass
class EvalIndex:
    """The eval n-grams: each (as one space-joined string of normalized words) with the
    indices of the tasks (``tasks``) that have it. Picklable, so a Parsl task can take it."""

    n: int
    tasks: list[str]
    grams: dict[str, tuple[int, ...]] = field(default_factory=dict)
    short_lengths: tuple[int, ...] = ()
    """Word counts (< n) of eval texts kept whole: documents are also searched for them."""

    def __len__(self) -> int:
        return len(self.grams)


def eval_ngrams(task_texts: dict[str, list[str]], n: int = 13, min_words: int = 8) -> EvalIndex:
    """The n-gram index of the eval texts, task name -> texts (see the module docstring)."""
    index = EvalIndex(n=n, tasks=sorted(task_texts))
    found: dict[str, set[int]] = {}
    short: set[int] = set()
    for t, task in enumerate(index.tasks):
        for text in task_texts[task]:
            words = WORD.findall(normalize(text))
            if len(words) < min_words:
                continue
            if len(words) < n:
                short.add(len(words))
                found.setdefault(" ".join(words), set()).add(t)
                continue
            for i in range(len(words) - n + 1):
                found.setdefault(" ".join(words[i:i + n]), set()).add(t)
    index.grams = {gram: tuple(sorted(ts)) for gram, ts in found.items()}
    index.short_lengths = tuple(sorted(short))
    return index


def contamination(normalized: str | Iterable[str], index: EvalIndex | None) -> list[str]:
    """The tasks whose n-grams occur in the normalized text (a ``text.normalize`` output,
    or its ``normalized_segments``), sorted.

    Streams the words through a window of n: memory does not grow with the document.
    """
    if index is None or not index.grams:
        return []
    lengths = sorted({index.n, *index.short_lengths})
    window: deque[str] = deque(maxlen=lengths[-1])
    hits: set[int] = set()
    grams = index.grams
    segments = [normalized] if isinstance(normalized, str) else normalized
    for match in (m for segment in segments for m in WORD.finditer(segment)):
        window.append(match.group())
        size = len(window)
        for k in lengths:
            if k > size:
                break
            tasks = grams.get(" ".join(list(window)[size - k:]) if k < size
                              else " ".join(window))
            if tasks:
                hits.update(tasks)
    return [index.tasks[t] for t in sorted(hits)]


def local_task_texts(task_dir: str | Path) -> dict[str, list[str]]:
    """Texts of the local lm-eval tasks in ``task_dir`` (``eval.task_include``): for each
    YAML (or JSON) task file whose ``dataset_path`` is json with local ``data_files``, every
    string value of every record, keyed by the task name."""
    import yaml

    out: dict[str, list[str]] = {}
    for spec_path in sorted(Path(task_dir).glob("*.y*ml")):
        spec = yaml.safe_load(spec_path.read_text()) or {}
        if not isinstance(spec, dict) or spec.get("dataset_path") != "json":
            continue
        files = (spec.get("dataset_kwargs") or {}).get("data_files") or {}
        paths = files.values() if isinstance(files, dict) else [files]
        texts: list[str] = []
        for entry in paths:
            for path in [entry] if isinstance(entry, str) else entry:
                texts += _record_strings(_resolve(Path(path), spec_path.parent))
        out[str(spec.get("task", spec_path.stem))] = texts
    return out


def prompt_texts(prompts: Iterable[str]) -> dict[str, list[str]]:
    """The eval stage's generation prompts as one task."""
    return {PROMPTS_TASK: list(prompts)}


def _resolve(path: Path, folder: Path) -> Path:
    return path if path.is_absolute() else folder / path


def _record_strings(path: Path) -> list[str]:
    """Every string value of every JSON line (or JSON array element) of ``path``."""
    raw = path.read_text(encoding="utf-8")
    stripped = raw.lstrip()
    records = (json.loads(stripped) if stripped.startswith("[")
               else [json.loads(line) for line in raw.splitlines() if line.strip()])
    out: list[str] = []
    for record in records:
        values = record.values() if isinstance(record, dict) else [record]
        out += [v for v in values if isinstance(v, str)]
    return out
