"""Paths: a corpus under spaces and non-ASCII names works end to end; a runs dir that Parsl's
unquoted worker command lines cannot carry (white space) is refused up front."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests import warm_cli

REPO = Path(__file__).resolve().parents[2]


def _pipeline(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return warm_cli.run("workflows.pipeline", list(args), cwd=REPO, timeout=timeout,
                        forked_launches=True)


def test_runs_dir_with_a_space_is_refused_before_any_work(tmp_path, pipeline_main):
    """Through ``workflows.pipeline.main`` in this process (the real console's path is
    tested in test_bad_inputs.py)."""
    runs = tmp_path / "my runs"
    proc = pipeline_main("--config", "configs/micro.yaml", "--runs-dir", str(runs))
    assert proc.returncode == 2
    assert "contains white space" in proc.stderr and "--runs-dir" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not runs.exists()  # nothing written, not even a stray file at the prefix
    assert not (tmp_path / "my").exists()


@pytest.mark.slow
def test_corpus_with_spaces_and_non_ascii_names_runs_end_to_end(tmp_path):
    corpus = tmp_path / "corpus dir é" / "Ünïcode texts"
    corpus.mkdir(parents=True)
    for i in range(12):  # a dozen small documents of fixed non-ASCII text: 2 held out
        words = " ".join(f"wörd{(i * 37 + j) % 101} café" for j in range(150))
        (corpus / f"doc {i} ñ.txt").write_text(f"# façade {i}\n{words}")
    runs = tmp_path / "runs-é"
    proc = _pipeline(
        "--config", "configs/micro.yaml", "--runs-dir", str(runs),
        "--set", f"data.source={corpus}", "data.max_documents=null", "tokenizer.vocab_size=300",
        "model.vocab_size=320", "train.steps=2", "train.checkpoint_every=0",
        "eval.max_tokens=256", "eval.tasks=[]", "eval.log_model=false",
        "curate.enabled=false",  # the corpus is generated word salad, which curation removes
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    statuses = [json.loads(p.read_text()) for p in runs.glob("stages/*/*/status.json")]
    assert sorted(s["state"] for s in statuses) == ["succeeded"] * 5
    report = json.loads(next(runs.glob("stages/evaluate/*/report.json")).read_text())
    assert report["tokens"] > 0 and report["perplexity"] > 1
