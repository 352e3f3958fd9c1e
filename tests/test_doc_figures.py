"""Figures quoted in the README and docs agree with benchmarks/results, which record the code
that measured them (benchmarks/doc_figures.py, benchmarks/results.py)."""
from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import doc_figures  # noqa: E402 (needs the repository on sys.path)
from benchmarks.results import RESULTS_DIR, code_changes, write_results  # noqa: E402

NOT_YET_RUN = {"bench_train_gpu.json", "gpu_check.json"}
"""Results files the docs name though no run has written them yet (they say so)."""
RESULTS_NAME = re.compile(r"\b((?:bench|gpu)_[\w-]+\.json)\b")


def test_every_quoted_figure_agrees_with_its_results_file() -> None:
    figures = doc_figures.doc_figures()
    assert len(figures) >= 20, "the docs quote their figures with markers"
    problems = [p for p in (doc_figures.disagreement(f) for f in figures) if p]
    assert not problems, "\n".join(problems)


def test_a_marker_checks_rounding_scale_and_stated_misses(tmp_path: Path) -> None:
    (tmp_path / "bench_x.json").write_text(json.dumps(
        {"figures": {"mfu": 0.3349, "ratio": 0.557, "fit": False, "runs": [1.5, 2.25]}}))

    def problems(line: str) -> list[str | None]:
        return [doc_figures.disagreement(f, tmp_path)
                for f in doc_figures.figures_in(line, "doc.md")]

    assert problems("at 33.5 %<!-- figure: bench_x.json#figures.mfu x100 --> MFU") == [None]
    assert problems("at 33.49 %<!-- figure: bench_x.json#figures.mfu x100 -->") == [None]
    [wrong] = problems("at 34.4 %<!-- figure: bench_x.json#figures.mfu x100 -->")
    assert "quotes 34.4, the file says 33.5" in wrong and "doc.md:1" in wrong
    assert problems("0.3<!-- figure: bench_x.json#figures.mfu --> and "
                    "2.2<!-- figure: bench_x.json#figures.runs.1 -->") == [None, None]
    assert problems("fits: false<!-- figure: bench_x.json#figures.fit -->") == [None]
    assert problems("from 1-2.2<!-- figure: bench_x.json#figures.runs.1 --> s") == [None]
    assert "quotes true" in problems("true<!-- figure: bench_x.json#figures.fit -->")[0]
    assert "stops at 'nope'" in problems("1<!-- figure: bench_x.json#figures.nope -->")[0]
    assert "no results file" in problems("1<!-- figure: bench_y.json#figures.a -->")[0]
    assert "no figure just before" in problems("text <!-- figure: bench_x.json#a -->")[0]
    target = "<!-- figure: bench_x.json#figures.ratio target>=0.85 -->"
    assert problems(f"0.557{target} (missed)") == [None]
    assert "does not say" in problems(f"| 0.557{target} | >= 0.85 |")[0]
    assert problems(f"0.557{target.replace('0.85', '0.5')}") == [None]
    assert "says" in problems(f"0.557{target.replace('0.85', '0.5')} missed")[0]


def test_results_files_named_in_the_docs_exist() -> None:
    named: dict[str, str] = {}
    for pattern in doc_figures.DOC_FILES:
        for path in REPO.glob(pattern):
            for name in RESULTS_NAME.findall(path.read_text()):
                named.setdefault(name, path.relative_to(REPO).as_posix())
    missing = {name: doc for name, doc in named.items()
               if not (RESULTS_DIR / name).is_file() and name not in NOT_YET_RUN}
    assert not missing, f"results files named but absent: {missing}"
    recorded_now = sorted(n for n in NOT_YET_RUN if (RESULTS_DIR / n).is_file())
    assert not recorded_now, f"{recorded_now} now recorded: quote them, drop from NOT_YET_RUN"


def test_quoted_results_were_measured_by_the_benchmark_scripts_as_they_are() -> None:
    """A results file a doc quotes fails when its benchmark script changed since it was
    written; a change in the project modules it imported, a file written before results
    recorded their code (unversioned) and records kept from an older run are reported as
    warnings (docs/benchmarks policy: benchmarks/results/README.md)."""
    quoted = sorted({f.file for f in doc_figures.doc_figures()})
    failures, notes = [], []
    for name in quoted:
        record = json.loads((RESULTS_DIR / name).read_text())
        changes = code_changes(record)
        if changes is None:
            notes.append(f"{name}: unversioned")
            continue
        if record["code"].get("script") in changes:
            failures.append(f"{name}: {record['code']['script']} changed since it wrote it")
        elif changes:
            notes.append(f"{name}: project code changed since: {', '.join(changes)}")
        older = [r for r in record.get("ranks", [])
                 if r.get("code_digest") != record["code"]["digest"]]
        if older:
            notes.append(f"{name}: {len(older)} of {len(record['ranks'])} ranks measured "
                         "by other code than the file's")
    for note in notes:
        warnings.warn(note, stacklevel=1)
    assert not failures, "\n".join(failures)


def test_a_result_records_the_code_it_measured_and_notices_changes(tmp_path: Path,
                                                                   monkeypatch) -> None:
    from benchmarks import results

    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    (repo / "model").mkdir()
    script, module = repo / "benchmarks" / "bench_x.py", repo / "model" / "m.py"
    script.write_text('"""Doc."""\nX = 1\n')
    module.write_text("def f():\n    return 2\n")
    files = [Path("benchmarks/bench_x.py"), Path("model/m.py")]
    record = {"code": results.code_record(files, repo)}
    assert set(record["code"]["files"]) == {"benchmarks/bench_x.py", "model/m.py"}
    assert results.code_changes(record, repo) == []
    script.write_text('"""Another doc."""\n# a comment\nX = 1  # same code\n')
    assert results.code_changes(record, repo) == []
    module.write_text("def f():\n    return 3\n")
    assert results.code_changes(record, repo) == ["model/m.py"]
    script.unlink()
    assert results.code_changes(record, repo) == ["benchmarks/bench_x.py", "model/m.py"]
    assert results.code_changes({"figures": {}}, repo) is None

    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(REPO / "benchmarks" / "x.py"),
                        raising=False)
    written = json.loads(write_results("bench_x", {"a": 1}, directory=tmp_path).read_text())
    measured = written["code"]["files"]
    assert written["code"]["script"] == "benchmarks/x.py"
    assert "benchmarks/x.py" in measured and "benchmarks/results.py" not in measured
    assert measured["benchmarks/x.py"] == "missing"
    assert "benchmarks/doc_figures.py" in measured  # imported by this module
    assert all(Path(f).parts[0] in results.PROJECT_PACKAGES for f in measured)


@pytest.mark.parametrize("doc", ["README.md", "docs/planner.md"])
def test_docs_quote_with_markers(doc: str) -> None:
    text = (REPO / doc).read_text()
    assert doc_figures.figures_in(text, doc), f"{doc} quotes no figure with a marker"
