"""Stage keys cover the code that makes the output, and --dry-run says why a stage reruns."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from stages.config import load_config
from stages.mechanism import attempt, outputs, tracking, tracking_store
from stages.mechanism.keys import ANY_STAGE, CODE_PACKAGES, code_hashes
from stages.mechanism.selection import decide_stages, stage_keys
from stages.registry import PIPELINE, STAGE_ORDER, declaration
from workflows.pipeline import describe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def source_copy(tmp_path: Path) -> Path:
    """A copy of the sources a key hashes, plus files it must ignore."""
    root = tmp_path / "src"
    for package in CODE_PACKAGES:
        shutil.copytree(REPO / package, root / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "configs", root / "configs")
    shutil.copy(REPO / "README.md", root / "README.md")
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text("def test_x():\n    pass\n")
    return root


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_code_hash_follows_the_sources_a_stage_uses(source_copy: Path):
    base = code_hashes(PIPELINE, source_copy)
    assert set(base) == {*STAGE_ORDER, ANY_STAGE}
    assert base == code_hashes(PIPELINE, REPO)  # the copy hashes like the checkout

    # README, tests and docs are no stage's code.
    _append(source_copy / "README.md", "\nmore words\n")
    _append(source_copy / "tests" / "test_x.py", "# note\n")
    (source_copy / "docs").mkdir()
    (source_copy / "docs" / "notes.md").write_text("notes")
    assert code_hashes(PIPELINE, source_copy) == base

    # The tokenizer code is tokenize's, not evaluate's.
    _append(source_copy / "data_prep" / "tokenizer.py", "\n_EDITED = 1\n")
    after = code_hashes(PIPELINE, source_copy)
    assert after["tokenize"] != base["tokenize"] and after[ANY_STAGE] != base[ANY_STAGE]
    assert after["evaluate"] == base["evaluate"]

    # A cluster description is code for the stages that read cluster files (plan), by its
    # parsed content: a comment changes nothing, a value reruns the plan and nothing else
    # (the training follows only if the plan's layout comes out different).
    cluster = source_copy / "configs" / "clusters" / "h100.yaml"
    _append(cluster, "\n# retuned\n")
    assert code_hashes(PIPELINE, source_copy) == after
    cluster.write_text(cluster.read_text() + "\nretuned_note: 1\n")
    clusters = code_hashes(PIPELINE, source_copy)
    assert clusters["plan"] != after["plan"]
    assert {n: clusters[n] for n in ("tokenize", "train", "evaluate")} == {
        n: after[n] for n in ("tokenize", "train", "evaluate")}

    # The stage mechanism is no stage's code: a new line of code in it reruns nothing.
    _append(source_copy / "stages" / "mechanism" / "attempt.py", "\n_EDITED = 1\n")
    assert {n: h for n, h in code_hashes(PIPELINE, source_copy).items() if n != ANY_STAGE} == {
        n: h for n, h in clusters.items() if n != ANY_STAGE}


def test_code_hash_is_cheap(source_copy: Path):
    started = time.process_time()  # CPU time: other work on the machine does not count
    first = code_hashes(PIPELINE, source_copy)  # every file parsed
    parsed = time.process_time() - started
    started = time.process_time()
    assert code_hashes(PIPELINE, source_copy) == first  # parsed again only where a file changed
    again = time.process_time() - started
    assert parsed < 3 and again < 0.1, (parsed, again)


def test_changed_code_changes_the_stage_key_and_leaves_the_later_ones_pending():
    cfg = load_config("micro")
    code = code_hashes(PIPELINE)
    keys = stage_keys(PIPELINE, cfg, code)
    assert keys == stage_keys(PIPELINE, cfg)  # computed from the checkout when not given
    changed = stage_keys(PIPELINE, cfg, {**code, "curate": "0" * 16})
    assert changed["curate"] != keys["curate"]
    # Later keys hash what curate makes: unknown until it has made it (early cutoff).
    assert all(changed[n] is None for n in ("tokenize", "plan", "train", "evaluate"))


def _publish(runs_dir: Path, name: str, cfg, code: dict[str, str] | str, inputs=None) -> str:
    """Publish an (empty) output of stage ``name`` through begin/finish; return its key."""
    uri = tracking_store.default_tracking_uri(runs_dir)
    experiment = tracking.ensure_experiment(uri, "keys", runs_dir)
    parent = tracking.start_run(uri, experiment, "pipeline-keys")
    ctx = attempt.PipelineContext(str(runs_dir), uri, experiment, parent, code)
    opened = attempt.begin(ctx, declaration(name), cfg, inputs or {})
    assert opened.reused is None
    return attempt.finish(ctx, opened, {}).key


def test_dry_run_says_why_a_stage_reruns(tmp_path: Path, seed_store):
    runs_dir = tmp_path / "runs"
    seed_store(runs_dir)
    cfg = load_config("micro", [f"tracking.runs_dir={runs_dir}"])
    code = code_hashes(PIPELINE)
    old_key = _publish(runs_dir, "curate", cfg, {**code, "curate": "old-code"})
    status = outputs.read_status(outputs.stage_dir(runs_dir, "curate", old_key))
    assert status["ingredients"]["code"] == "old-code"
    assert set(status["ingredients"]["sections"]) == set(declaration("curate").sections)

    plans = decide_stages(PIPELINE, cfg, None, None, False, code)
    assert plans[0].action == "run"
    assert plans[0].reason == f"code changed since key {old_key}"
    assert all(p.key is None and "will make" in p.reason for p in plans[1:])
    text = describe(plans, cfg)
    assert f"why: code changed since key {old_key}" in text

    # Same code, another data section: the section is named.
    cfg2 = load_config("micro", [f"tracking.runs_dir={runs_dir}", "data.max_documents=20"])
    old_code = {**code, "curate": "old-code"}
    assert decide_stages(PIPELINE, cfg2, None, None, False, old_code)[0].reason == (
        f"config section data changed since key {old_key}")
    both = decide_stages(PIPELINE, cfg2, None, None, False, code)[0].reason
    assert both == f"code, config section data changed since key {old_key}"

    # Downstream: a tokenize output made from another curate output.
    _publish(runs_dir, "curate", cfg, code)
    old_tokens = _publish(runs_dir, "tokenize", cfg, code,
                          {"curate": outputs.find_succeeded(runs_dir, "curate", old_key)})
    # The new curate output holds what the old one held (the same digest): the tokenize
    # output made from the old one is reused (early cutoff), however the curate key changed.
    plans = decide_stages(PIPELINE, cfg, None, None, False, code)
    assert [p.action for p in plans[:2]] == ["reuse", "reuse"]
    assert plans[1].key == old_tokens
