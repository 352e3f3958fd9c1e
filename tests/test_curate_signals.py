"""Signals of single documents: decontamination rules, streamed MinHash and normalization,
bounded memory on a huge document, the word rule, and the package's imports."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from data_prep.curate import contamination, eval_ngrams
from data_prep.curate.minhash import band_keys, candidate_probability
from data_prep.curate.quality import text_values
from data_prep.curate.text import normalize, normalized_segments
from tests.curatekit import EVAL_TEXT, LEAK, PROSE

ROOT = Path(__file__).resolve().parents[1]


def test_a_13_word_span_of_an_eval_text_is_a_hit() -> None:
    index = eval_ngrams({"riddles": [EVAL_TEXT], "other": ["short text"]}, 13)
    assert contamination(normalize(LEAK), index) == ["riddles"]
    assert contamination(normalize(PROSE[0]), index) == []
    words = EVAL_TEXT.split()
    twelve = " ".join(words[5:17])  # 12 words: no 13-gram
    assert contamination(normalize(f"intro {twelve} outro"), index) == []
    assert contamination(normalize(" ".join(words[5:18]).upper()), index) == ["riddles"]


def test_short_eval_texts_are_whole_ngrams_and_tiny_ones_ignored() -> None:
    prompt = "Write a haiku about the sea at night please"  # 9 words < 13
    index = eval_ngrams({"gen": [prompt], "prompts": ["def main(", "import "]}, 13,
                        min_words=8)
    assert index.short_lengths == (9,)
    assert contamination(normalize(f"Task: {prompt}! Thanks."), index) == ["gen"]
    assert contamination(normalize("Write a haiku about the sea"), index) == []
    assert contamination(normalize("def main():\n    import os"), index) == []


def test_minhash_streams_segments_and_catches_near_copies() -> None:
    text = "\n\n".join(PROSE[:6])
    whole = band_keys(normalize(text), 5, 14, 8)
    assert band_keys(normalized_segments(text, 200), 5, 14, 8) == whole
    near = text.replace("scheduler", "planner", 1).replace("queue", "line", 1)
    assert set(band_keys(normalize(near), 5, 14, 8)) & set(whole)
    assert not set(band_keys(normalize(PROSE[10]), 5, 14, 8)) & set(whole)
    assert candidate_probability(0.8, 14, 8) == pytest.approx(0.924, abs=1e-3)


def test_short_documents_are_one_shingle_of_all_their_words() -> None:
    """Under 5 words, the whole text is the shingle: two 3-word files that end alike are
    not near duplicates (only their last word would be, were it kept alone)."""
    a = band_keys(normalize("from .test_zoneinfo import *"), 5, 14, 8)
    b = band_keys(normalize("from .test_import import *"), 5, 14, 8)
    assert not set(a) & set(b)
    assert band_keys(normalize("def util():\n    pass"), 5, 14, 8) == band_keys(
        "def util pass", 5, 14, 8)


PEAK_SCRIPT = """
import sys
from data_prep.curate import CurateConfig, document_signals
from tests.curatekit import PROSE
from benchmarks.peak_rss import own_peak_rss_bytes
text = ("\\n\\n".join(PROSE) + "\\n\\n") * (int(sys.argv[1]) // 4000)
document_signals(text[:5000], CurateConfig())  # imports and the language model
before = own_peak_rss_bytes() // 1024
document_signals(text, CurateConfig())
print(own_peak_rss_bytes() // 1024 - before)
"""


def test_memory_of_a_huge_document_does_not_grow_with_it() -> None:
    """The peak RSS a document's signals add (beyond the text) is the same for 1.2 and
    2.4 MB: both are normalized, shingled and scanned one 1 MB segment at a time."""
    runs = [subprocess.Popen([sys.executable, "-c", PEAK_SCRIPT, str(size)],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
            for size in (1_200_000, 2_400_000)]
    small, large = (int(run.communicate(timeout=120)[0].split()[-1]) for run in runs)
    assert large < small + 4096, (small, large)  # KiB: 1.2 MB more text, < 4 MB more memory


def test_words_are_not_punctuation() -> None:
    values = text_values("Run `pip install -e .` (see #12) -- v1.2.3 works ... fine.")
    assert values["words"] == 11  # run pip install e see 12 v1 2 3 works fine
    assert values["alpha_words"] == pytest.approx(8 / 11)


def test_curate_imports_no_torch_parsl_or_mlflow() -> None:
    code = ("import sys, data_prep.curate; "
            "print(sorted(m for m in ('torch', 'parsl', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
