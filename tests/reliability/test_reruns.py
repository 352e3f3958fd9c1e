"""Reruns the way a user means them: a stage key covers the code that computes its output,
normalized; downstream keys cover what the upstream produced (early cutoff); more training
continues from the last checkpoint; --rerun-triggers keeps outputs made otherwise.
docs/reruns.md says which change reruns what."""
from __future__ import annotations

import ast
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from stages.config import ConfigError
from stages.mechanism import keys, tracking
from stages.mechanism.keys import ANY_STAGE, CODE_PACKAGES, code_hashes, code_modules
from stages.mechanism.selection import decide_stages, digest_of, resolve
from stages.registry import PIPELINE, STAGE_ORDER, declaration
from tests.evalkit import micro_config, open_pipeline, run_stages

REPO = Path(__file__).resolve().parents[2]
MECHANISM_EDITS = ("stages/mechanism/locks.py", "stages/mechanism/attempt.py",
                   "stages/mechanism/tracking.py", "stages/mechanism/keys.py",
                   "stages/mechanism/launch.py", "stages/mechanism/walk.py",
                   "stages/config.py", "stages/registry.py", "stages/train/__init__.py",
                   "stages/train/checks.py", "data_prep/progress.py", "data_prep/atomic.py",
                   "data_prep/errors.py", "model/training/plots.py")


@pytest.fixture()
def source_copy(tmp_path: Path) -> Path:
    """A copy of the code packages and cluster files a key hashes."""
    root = tmp_path / "src"
    for package in (*CODE_PACKAGES, "workflows"):
        shutil.copytree(REPO / package, root / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "configs", root / "configs")
    return root


def _stage_hashes(root: Path) -> dict[str, str]:
    hashes = code_hashes(PIPELINE, root)
    return {name: digest for name, digest in hashes.items() if name != ANY_STAGE}


def _reword_docstrings_and_comment(path: Path) -> bool:
    """Add a comment line and change the text of every docstring of ``path`` (the code
    stays the same); whether it had a docstring."""
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    found = False
    for node in ast.walk(tree):
        docstring = keys.docstring_of(node)
        if docstring is not None:
            line = docstring.lineno - 1
            quote = lines[line].find('"""')
            if quote >= 0:
                lines[line] = lines[line][:quote + 3] + "Reworded. " + lines[line][quote + 3:]
                found = True
    path.write_text("".join(lines) + "\n# a comment\n")
    return found


def test_comments_and_docstrings_anywhere_rerun_nothing(source_copy: Path):
    base = _stage_hashes(source_copy)
    reworded = 0
    for package in (*CODE_PACKAGES, "workflows"):
        for path in sorted((source_copy / package).rglob("*.py")):
            reworded += _reword_docstrings_and_comment(path)
    assert reworded > 50  # the edit really reached the docstrings
    assert _stage_hashes(source_copy) == base


def test_code_edits_in_the_mechanism_rerun_nothing(source_copy: Path):
    base = _stage_hashes(source_copy)
    for relative in (*MECHANISM_EDITS, "workflows/session.py", "workflows/pipeline.py"):
        path = source_copy / relative
        path.write_text(path.read_text() + "\n_EDITED = len('a new line of code')\n")
    assert _stage_hashes(source_copy) == base


def test_a_code_edit_reruns_the_stages_whose_code_it_is(source_copy: Path):
    base = _stage_hashes(source_copy)
    build = source_copy / "data_prep" / "build.py"
    build.write_text(build.read_text() + "\n_EDITED = 1\n")
    after = _stage_hashes(source_copy)
    assert [n for n in STAGE_ORDER if after[n] != base[n]] == ["tokenize"]
    gpt = source_copy / "model" / "gpt.py"
    gpt.write_text(gpt.read_text() + "\n_EDITED = 1\n")
    model_edit = _stage_hashes(source_copy)
    assert model_edit["tokenize"] == after["tokenize"]
    assert all(model_edit[n] != after[n] for n in ("plan", "train", "evaluate"))


def test_tokenize_code_is_data_code_only():
    modules = code_modules(declaration("tokenize"))
    assert "stages.tokenize.work" in modules and "data_prep.build" in modules
    assert not [m for m in modules if m.startswith(("model", "stages.mechanism", "workflows"))]
    for stage in STAGE_ORDER:
        assert not [m for m in code_modules(declaration(stage)) if m.startswith("stages.mechanism")]


def test_log_and_checkpoint_cadence_and_steps_leave_the_plan_key_alone(tmp_path: Path):
    stage = declaration("plan")
    cfg = micro_config(tmp_path)
    other = micro_config(tmp_path, "train.steps=99", "train.log_every=3",
                         "train.checkpoint_every=2", "train.checkpoint_minutes=5")
    ingredients = keys.key_ingredients(stage, cfg, {"tokenize": "t"}, "c")
    assert keys.key_ingredients(stage, other, {"tokenize": "t"}, "c") == ingredients
    train = declaration("train")
    steps = keys.key_ingredients(train, other, {"tokenize": "t", "plan": "p"}, "c")
    assert steps["extent"] == {"train.steps": 99}
    assert steps["software"]["torch"] and steps["software"]["python"]


# ----------------------------------------------------------------------- with real stages
def _copy_runs(runs_dir: Path, target: Path, seed_store) -> Path:
    """A second runs dir holding the same tokenize output (paths rewritten)."""
    from stages.mechanism.outputs import OUTPUTS_FILE, relocate, write_outputs

    target.mkdir()
    seed_store(target)
    shutil.copytree(runs_dir / "cache", target / "cache")
    for published in (runs_dir / "stages" / "tokenize").iterdir():
        if published.is_dir() and "." not in published.name:
            copy = target / "stages" / "tokenize" / published.name
            shutil.copytree(published, copy)
            outs = json.loads((copy / OUTPUTS_FILE).read_text())
            write_outputs(copy, relocate(outs, str(published), str(copy)))
    return target


def _losses(result) -> list[float]:
    return json.loads(Path(result.outputs["summary"]).read_text())["losses"]


TRAIN = ("train.decay_steps=12", "train.warmup_steps=2")


@pytest.mark.slow
def test_more_training_continues_and_matches_an_uninterrupted_run(
        tokenized_runs_dir: Path, tmp_path: Path, seed_store):
    runs = tokenized_runs_dir
    fresh_runs = _copy_runs(runs, tmp_path / "fresh", seed_store)
    short = micro_config(runs, *TRAIN, "train.steps=4")
    ctx = open_pipeline(short)
    first = run_stages(short, ctx, ("tokenize", "plan", "train"))
    assert first["train"].outputs["steps_done"] == 4

    # The README's recipe: raise train.steps, --from train. The plan is reused (train.steps
    # is not part of its key) and the training continues from step 4.
    longer = micro_config(runs, *TRAIN, "train.steps=6")
    decisions = {p.name: p for p in decide_stages(PIPELINE, longer, None, "train", False)}
    assert decisions["plan"].action == "reuse"
    assert decisions["train"].action == "force"
    assert f"continues {first['train'].key} from step 4" in decisions["train"].reason
    more = run_stages(longer, ctx, ("train",), done=first)
    assert more["train"].key == decisions["train"].key != first["train"].key
    assert more["train"].outputs["steps_done"] == 6

    # An uninterrupted 6-step training of the same config elsewhere: the same plan and,
    # bitwise, the same 6 losses.
    fresh_cfg = micro_config(fresh_runs, *TRAIN, "train.steps=6")
    fresh = run_stages(fresh_cfg, open_pipeline(fresh_cfg), ("tokenize", "plan", "train"))
    assert fresh["plan"].digest == first["plan"].digest
    assert _losses(more["train"]) == _losses(fresh["train"])
    assert _losses(more["train"])[:4] == _losses(first["train"])

    # The continued run holds the whole history in MLflow: steps 1-4 copied, 5-6 its own.
    run = tracking.get_run(ctx.tracking_uri, more["train"].run_id)
    assert run.data.tags["continued_from"] == first["train"].key
    steps = [s for s, _ in tracking.metric_history(ctx.tracking_uri, more["train"].run_id,
                                                     "loss")]
    assert sorted(set(steps)) == [1, 2, 3, 4, 5, 6]

    # Asking again reuses the continued output; nothing trains.
    again = {p.name: p for p in decide_stages(PIPELINE, longer, None, None, False)}
    assert again["train"].action == "reuse" and again["train"].key == more["train"].key

    # A change to the trainer's code: train.resume_from=auto continues at step 6.
    edited = dataclasses.replace(ctx, code={**ctx.code, "train": "edited-trainer"})
    resumed_cfg = micro_config(runs, *TRAIN, "train.steps=8", "train.resume_from=auto")
    inputs = {name: digest_of(first[name], PIPELINE) for name in ("tokenize", "plan")}
    resolution = resolve(runs, declaration("train"), resumed_cfg, inputs, "edited-trainer")
    assert resolution.continues is not None and resolution.continues.step == 6
    assert resolution.continues.key == more["train"].key
    resumed = run_stages(resumed_cfg, edited, ("train",), done=first)
    assert resumed["train"].outputs["steps_done"] == 8
    assert _losses(resumed["train"])[:6] == _losses(more["train"])

    # A continuation keeps the model's shape: a named source of another shape is refused,
    # naming the field.
    wider = micro_config(runs, *TRAIN, "train.steps=8", f"train.resume_from={more['train'].key}",
                         "model.d_model=64")
    with pytest.raises(ConfigError, match=r"model\.d_model differs"):
        resolve(runs, declaration("train"), wider, inputs, "edited-trainer")


@pytest.mark.slow
def test_a_tokenize_that_makes_the_same_tokens_leaves_the_rest_reused(
        tokenized_runs_dir: Path, source_copy: Path):
    runs = tokenized_runs_dir
    cfg = micro_config(runs, "train.steps=2")
    ctx = open_pipeline(cfg)
    before = run_stages(cfg, ctx, ("tokenize", "plan", "train"))

    # A real edit of the tokenization code that changes no token.
    build = source_copy / "data_prep" / "build.py"
    build.write_text(build.read_text() + "\n_EDITED = 1\n")
    edited = code_hashes(PIPELINE, source_copy)
    assert edited["tokenize"] != code_hashes(PIPELINE)["tokenize"]
    assert edited["train"] == code_hashes(PIPELINE)["train"]

    plans = {p.name: p for p in decide_stages(PIPELINE, cfg, None, None, False, edited)}
    assert plans["tokenize"].action == "run"
    assert plans["plan"].key is None and plans["train"].key is None  # decided after tokenize
    ctx = dataclasses.replace(ctx, code=edited)
    after = run_stages(cfg, ctx, ("tokenize", "plan", "train"))
    assert not after["tokenize"].reused and after["tokenize"].key != before["tokenize"].key
    assert after["tokenize"].digest == before["tokenize"].digest
    assert after["plan"].reused and after["plan"].key == before["plan"].key
    assert after["train"].reused and after["train"].key == before["train"].key


def test_rerun_triggers_keep_outputs_made_by_other_code_and_say_so(tmp_path: Path, seed_store):
    from stages.mechanism import attempt

    runs = tmp_path / "runs"
    seed_store(runs)
    cfg = micro_config(runs)
    ctx = open_pipeline(cfg)
    old = dataclasses.replace(ctx, code={**code_hashes(PIPELINE), "curate": "old-code"})
    opened = attempt.begin(old, declaration("curate"), cfg, {})
    made = attempt.finish(old, opened, {})

    assert decide_stages(PIPELINE, cfg, None, None, False)[0].action == "run"  # code is a trigger
    kept = decide_stages(PIPELINE, cfg, None, None, False, triggers=("config", "input", "software"))
    assert kept[0].action == "reuse" and kept[0].key == made.key
    assert "kept although code changed" in kept[0].reason

    narrowed = dataclasses.replace(ctx, triggers=("config", "input", "software"))
    reused = attempt.begin(narrowed, declaration("curate"), cfg, {})
    assert reused.reused is not None and reused.reused.key == made.key
    tags = tracking.get_run(ctx.tracking_uri, reused.run_id).data.tags
    assert tags["reused"] == "true" and tags["kept_although"] == "code"
    assert tags["rerun_triggers"] == "config,input,software"


def test_the_driver_hashes_the_code_once_per_invocation(tmp_path: Path, monkeypatch,
                                                        pipeline_main):
    calls = []
    real = keys.code_hashes

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(keys, "code_hashes", counted)
    out = pipeline_main("--config", "micro", "--runs-dir", str(tmp_path / "runs"), "--dry-run",
                        "--site", "slurm", "--set", "site.account=abc")
    assert "DAG:" in out.stdout
    assert len(calls) == 1
