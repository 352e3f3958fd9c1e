"""docs/reruns.md's table, checked against the code: each row's change is made (to a copy of
the sources, to the config, or to a library version) and exactly the keys the row names
change. A row in the table without a case here, or a case without a row, fails too."""
from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from stages.config import load_config
from stages.mechanism import keys
from stages.registry import PIPELINE

REPO = Path(__file__).resolve().parents[2]
STAGE_INPUTS = {"curate": {}, "tokenize": {"curate": "k"}, "plan": {"tokenize": "t"},
                "train": {"tokenize": "t", "plan": "p"},
                "evaluate": {"tokenize": "t", "train": "c"}}
"""Fixed upstream digests: the table is about what a change does to keys by itself."""


@dataclass
class World:
    """What a stage key is computed from: a source tree, config overrides, versions."""

    root: Path
    overrides: list[str]
    versions: dict[str, str]

    def keys(self) -> dict[str, str]:
        cfg = load_config("micro", self.overrides)
        code = keys.code_hashes(PIPELINE, self.root)
        out = {}
        for stage in PIPELINE:
            ingredients = keys.key_ingredients(stage, cfg, STAGE_INPUTS[stage.name],
                                               code[stage.name])
            ingredients["software"].update({n: v for n, v in self.versions.items()
                                            if n in ingredients["software"]})
            out[stage.name] = keys.key_of(ingredients)
        return out


def _append(relative: str, text: str) -> Callable[[World], None]:
    def edit(world: World) -> None:
        path = world.root / relative
        path.write_text(path.read_text() + text)
    return edit


def _code(relative: str) -> Callable[[World], None]:
    return _append(relative, "\n_EDITED = len('a new line of code')\n")


def _set(*overrides: str) -> Callable[[World], None]:
    def edit(world: World) -> None:
        world.overrides.extend(overrides)
    return edit


def _upgrade(name: str) -> Callable[[World], None]:
    def edit(world: World) -> None:
        world.versions[name] = "99.0"
    return edit


def _each(*edits: Callable[[World], None]) -> Callable[[World], None]:
    def edit(world: World) -> None:
        for one in edits:
            one(world)
    return edit


def _docstring_and_comment(world: World) -> None:
    for relative in ("model/gpt.py", "data_prep/build.py", "stages/train/work.py"):
        path = world.root / relative
        text = path.read_text()
        path.write_text(text.replace('"""', '"""A new first sentence. ', 1)
                        + "\n# a comment\n\n\n")


CASES: dict[str, tuple[Callable[[World], None], set[str]]] = {
    "a comment, a docstring or blank lines in stage code": (_docstring_and_comment, set()),
    "code in `stages/mechanism/` or `workflows/`": (
        _each(*(_code(f"stages/mechanism/{m}.py") for m in
                ("keys", "attempt", "walk", "launch", "tracking", "locks", "outputs")),
              _code("workflows/session.py"), _code("workflows/pipeline.py")), set()),
    "a stage's declaration (`stages/<name>/__init__.py`) or the stage list": (
        _each(*(_code(f"stages/{s.name}/__init__.py") for s in PIPELINE),
              _code("stages/registry.py"), _code("stages/config.py")), set()),
    "progress lines, plots, atomic writes, error classes": (
        _each(_code("data_prep/progress.py"), _code("model/training/plots.py"),
              _code("data_prep/atomic.py"), _code("data_prep/errors.py")), set()),
    "curation code (`data_prep/curate/signals.py`, `stages/curate/work.py`)": (
        _each(_code("data_prep/curate/signals.py"), _code("stages/curate/work.py")), {"curate"}),
    "tokenization code (`data_prep/build.py`, `stages/tokenize/work.py`)": (
        _each(_code("data_prep/build.py"), _code("stages/tokenize/work.py")), {"tokenize"}),
    "model code (`model/gpt.py`)": (_code("model/gpt.py"), {"plan", "train", "evaluate"}),
    "parallelism code (`model/parallel/parallelize.py`)": (
        _code("model/parallel/parallelize.py"), {"plan", "train", "evaluate"}),
    "trainer code (`model/training/trainer.py`)": (
        _code("model/training/trainer.py"), {"plan", "train"}),
    "planner code (`model/planner/search.py`)": (_code("model/planner/search.py"), {"plan"}),
    "a value in a cluster file (`configs/clusters/*.yaml`)": (
        _append("configs/clusters/h100.yaml", "\nretuned: 1\n"), {"plan"}),
    "a comment in a cluster file": (
        _append("configs/clusters/local.yaml", "\n# retuned by hand\n"), set()),
    "evaluation code (`model/evaluation/generate.py`)": (
        _code("model/evaluation/generate.py"), {"evaluate"}),
    "`data.*` (say `data.num_shards`)": (_set("data.num_shards=3"), {"curate", "tokenize"}),
    "`tokenizer.*`": (_set("tokenizer.vocab_size=400"), {"tokenize"}),
    "`curate.thresholds`, `curate.preset`, `curate.languages` (the selection)": (
        _set("curate.thresholds={min_words: 5}", "curate.preset=prose",
             "curate.languages=[en, de]"), {"curate"}),
    "`curate.shingle_words`, `curate.minhash_bands`, `curate.decontamination_ngram` "
    "(the signals)": (_set("curate.shingle_words=4", "curate.minhash_bands=20",
                           "curate.decontamination_ngram=8"), {"curate"}),
    "the evaluation's texts (`eval.prompts`, the local task files of `eval.task_include`: "
    "what decontamination compares against)": (_set("eval.prompts=[hello]"),
                                                {"curate", "evaluate"}),
    "`data.progress_seconds`, `data.encode_batch_bytes`": (
        _set("data.progress_seconds=1", "data.encode_batch_bytes=1000"), set()),
    "`model.*`": (_set("model.n_layers=3"), {"plan", "train"}),
    "`parallel.*`": (_set("parallel.refine_top_k=1"), {"plan"}),
    "`train.lr`, `train.global_batch`, other `train.*` that change the result": (
        _set("train.lr=0.01"), {"plan", "train"}),
    "`train.steps`": (_set("train.steps=99"), {"train"}),
    "`train.log_every`, checkpoint cadence, `train.resume_from`, in-loop validation "
    "(`train.eval_every`, `train.eval_tokens`)": (
        _set("train.log_every=3", "train.checkpoint_every=2", "train.checkpoint_minutes=5",
             "train.keep_last=4", "train.eval_every=2", "train.eval_tokens=1024"), set()),
    "`site.*` (walltime, account, ...), `tracking.*`": (
        _set("site.walltime=05:00:00", "site.account=abc123", "tracking.experiment=other"),
        set()),
    "other `eval.*` (say `eval.max_tokens`)": (_set("eval.max_tokens=4096"), {"evaluate"}),
    "torch upgraded": (_upgrade("torch"), {"plan", "train", "evaluate"}),
    "tokenizers upgraded": (_upgrade("tokenizers"), {"tokenize"}),
    "rensa, py3langid, ftfy or pyarrow upgraded": (
        _each(*(_upgrade(n) for n in ("rensa", "py3langid", "ftfy", "pyarrow"))), {"curate"}),
}


def _table_rows() -> dict[str, set[str]]:
    """The table of docs/reruns.md: first column -> the stages of its second column."""
    text = (REPO / "docs" / "reruns.md").read_text()
    table = text.split("<!-- reruns-table:", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[3:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = set() if cells[1] == "none" else set(re.split(r",\s*", cells[1]))
        rows[cells[0]] = names
    return rows


def test_every_row_has_a_case_and_every_case_a_row() -> None:
    rows = _table_rows()
    assert sorted(rows) == sorted(CASES)
    assert {row: rows[row] for row in rows} == {row: CASES[row][1] for row in CASES}


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reruns") / "src"
    for package in (*keys.CODE_PACKAGES, "workflows", "configs"):
        shutil.copytree(REPO / package, root / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.parametrize("row", list(CASES))
def test_the_change_of_each_row_changes_exactly_its_keys(row: str, source_copy: Path,
                                                         tmp_path: Path) -> None:
    root = tmp_path / "src"
    shutil.copytree(source_copy, root)
    world = World(root, [f"tracking.runs_dir={tmp_path / 'runs'}"], {})
    before = world.keys()
    edit, expected = CASES[row]
    edit(world)
    after = world.keys()
    changed = {name for name in before if before[name] != after[name]}
    assert changed == expected, f"{row}: {sorted(changed)} changed, the table says " \
                                f"{sorted(expected)}"
