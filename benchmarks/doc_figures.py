"""Figures quoted in the README and docs, each tied to the results file it comes from.

A quoted figure carries a marker right after it (an HTML comment, invisible once rendered):

    at 33.5 %<!-- figure: bench_plan_search.json#figures.22b_1024_mfu x100 --> MFU
    0.557<!-- figure: bench_data.json#figures.encode_ratio target>=0.85 --> (missed)

- ``FILE#PATH``: a file in ``benchmarks/results`` and a dot-separated path into its JSON
  (list items by index);
- ``xSCALE`` (optional): the JSON value times SCALE is what the text quotes (x100: percent);
- ``target<op>NUMBER`` (optional, op one of ``>= <= > <``): the figure's target; the line
  must then say "missed" (or "misses") exactly when the recorded value misses it.

The quoted figure is the last number (``1,024``, ``-0.75``, ``1.21e26``, the 304 of
``182-304``; or ``true`` / ``false``) before the marker on its line, with at most a short
unit between them (``%``, ``s``, `` GB``, a backtick). It agrees with the file when it is
the recorded value rounded to as many decimals as the text shows.
``tests/test_doc_figures.py`` checks every marker; ``python benchmarks/doc_figures.py``
prints every disagreement.
"""
from __future__ import annotations

import json
import operator
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
DOC_FILES = ("README.md", "docs/*.md", "benchmarks/results/README.md")

MARKER = re.compile(r"<!--\s*figure:\s*(?P<file>[\w.-]+\.json)#(?P<path>[\w.-]+)"
                    r"(?:\s+x(?P<scale>[0-9.e+-]+))?"
                    r"(?:\s+target(?P<op>>=|<=|>|<)(?P<target>-?[0-9.e+-]+))?\s*-->")
QUOTED = re.compile(r"(?<![\d.])(?P<value>[+-]?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?|true|false)"
                    r"(?P<unit>[^\d<>]{0,16})$")
MISSED = re.compile(r"\bmiss(?:ed|es)?\b", re.IGNORECASE)
TARGET_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


@dataclass(frozen=True)
class Figure:
    """One marker: where it is, the text it quotes and where its value is recorded."""

    doc: str
    line: int
    quoted: str | None
    file: str
    path: str
    scale: float
    target_op: str | None
    target: float | None
    missed_stated: bool

    def where(self) -> str:
        """``doc:line`` and the marker's source, for messages."""
        scale = f" x{self.scale:g}" if self.scale != 1 else ""
        return f"{self.doc}:{self.line} ({self.file}#{self.path}{scale})"


def figures_in(text: str, doc: str) -> list[Figure]:
    """Every figure marker of a markdown text, with the figure it follows."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        start = 0
        for match in MARKER.finditer(line):
            before = line[start:match.start()]
            start = match.end()
            quoted = QUOTED.search(before)
            target = match["target"]
            found.append(Figure(
                doc, number, quoted["value"] if quoted else None, match["file"], match["path"],
                float(match["scale"]) if match["scale"] else 1.0, match["op"],
                float(target) if target is not None else None, bool(MISSED.search(line))))
    return found


def doc_figures(repo: Path = REPO) -> list[Figure]:
    """Every figure marker in the README, docs/ and the results README."""
    figures = []
    for pattern in DOC_FILES:
        for path in sorted(repo.glob(pattern)):
            figures += figures_in(path.read_text(), path.relative_to(repo).as_posix())
    return figures


def recorded(file: str, path: str, results_dir: Path = RESULTS_DIR) -> Any:
    """The value at ``path`` (dot-separated keys, list indices) of a results file;
    KeyError naming what is missing."""
    source = results_dir / file
    if not source.is_file():
        raise KeyError(f"no results file {file}")
    value: Any = json.loads(source.read_text())
    for key in path.split("."):
        if isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        elif isinstance(value, dict) and key in value:
            value = value[key]
        else:
            raise KeyError(f"{file} has no {path!r} (stops at {key!r})")
    return value


def disagreement(figure: Figure, results_dir: Path = RESULTS_DIR) -> str | None:
    """Why a quoted figure disagrees with its results file, or None when it agrees."""
    if figure.quoted is None:
        return f"{figure.where()}: no figure just before the marker"
    try:
        value = recorded(figure.file, figure.path, results_dir)
    except KeyError as err:
        return f"{figure.where()}: {err.args[0]}"
    if isinstance(value, bool) or figure.quoted in ("true", "false"):
        if str(value).lower() != figure.quoted:
            return f"{figure.where()}: quotes {figure.quoted}, the file says {value}"
        return None
    if not isinstance(value, int | float):
        return f"{figure.where()}: the file holds {value!r}, not a number"
    mantissa, _, exponent = figure.quoted.replace(",", "").partition("e")
    decimals = len(mantissa.partition(".")[2])
    scaled = value * figure.scale / 10 ** int(exponent or 0)
    if abs(scaled - float(mantissa)) > 0.5 * 10 ** -decimals + 1e-9:
        return (f"{figure.where()}: quotes {figure.quoted}, the file says {scaled:.{decimals}f}"
                f" ({scaled:g})")
    if figure.target_op is not None and figure.target is not None:
        missed = not TARGET_OPS[figure.target_op](value, figure.target)
        if missed != figure.missed_stated:
            state = "misses" if missed else "meets"
            return (f"{figure.where()}: {value:g} {state} its target {figure.target_op}"
                    f"{figure.target:g}, and the line {'does not say' if missed else 'says'}"
                    f" it is missed")
    return None


def main() -> int:
    """Print every figure marker that disagrees with its results file; exit 1 if any."""
    figures = doc_figures()
    problems = [p for p in (disagreement(f) for f in figures) if p]
    print("\n".join(problems) or f"{len(figures)} quoted figures agree with their results")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
