"""Evaluation and its export when the training's newest checkpoint is damaged.

The micro preset's training (``tests.evalkit.micro_pipeline``: 6 steps, a checkpoint every
3, so ``step-00000003`` and ``step-00000006``) is trained once per test session and only
read here: each test damages a copy of its stages in a runs dir of its own, then runs the
real pipeline command line (``--only evaluate``) or the function that picks the checkpoint.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from model.evaluation.choice import NoIntactCheckpoint, usable_checkpoint
from model.evaluation.dcp_io import CheckpointTensors
from model.training.checkpoint import MANIFEST, checkpoint_problem
from model.training.files import SUMMARY_FILE
from stages.evaluate.checks import EvaluationError
from stages.mechanism import tracking, tracking_store
from stages.mechanism.outputs import OUTPUTS_FILE, relocate, write_outputs

# The shared micro training (multi-rank) is built on first use: with the end-to-end tests.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
pytest_plugins = ["tests.evalkit"]  # the shared micro_pipeline fixture

NEWEST, PREVIOUS = "step-00000006", "step-00000003"


def copy_stages(results: dict, dest: Path, seed_store: Callable[[Path], str]) -> Path:
    """A runs dir ``dest`` holding copies of the fixture's published curate, tokenize, plan and
    train stages (outputs rewritten to the copies) and a fresh MLflow store; its train stage
    dir."""
    for name in ("curate", "tokenize", "plan", "train"):
        source = Path(results[name].out_dir)
        target = dest / "stages" / name / source.name
        shutil.copytree(source, target)
        outputs = json.loads((target / OUTPUTS_FILE).read_text())
        write_outputs(target, relocate(outputs, str(source), str(target)))
    seed_store(dest)
    return dest / "stages" / "train" / Path(results["train"].out_dir).name


def largest_shard(ckpt: Path) -> Path:
    """The biggest ``.distcp`` file of a checkpoint."""
    return max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {"truncated": (truncate, "truncated"),
          "missing": (Path.unlink, "is missing"),
          "bad checksum": (flip_byte, "CRC-32")}


@pytest.fixture
def damaged_runs(micro_pipeline, tmp_path: Path,
                 seed_store: Callable[[Path], str]) -> tuple[Path, Path]:
    """(runs dir, train stage dir): a copy of the session's micro stages whose newest
    checkpoint has a truncated shard."""
    _, _, results = micro_pipeline
    runs = tmp_path / "runs"
    train_dir = copy_stages(results, runs, seed_store)
    checkpoints = train_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == [PREVIOUS, NEWEST]
    truncate(largest_shard(checkpoints / NEWEST))
    return runs, train_dir


def evaluate_run(runs: Path):
    """The evaluate stage's MLflow run in ``runs``'s store (exactly one)."""
    found = tracking.search_runs(tracking_store.default_tracking_uri(runs), "micro",
                                 "tags.stage = 'evaluate'")
    assert len(found) == 1, [r.info.run_id for r in found]
    return found[0]


def test_evaluation_and_export_use_the_previous_checkpoint_and_say_so(
        micro_pipeline, damaged_runs: tuple[Path, Path], pipeline_main) -> None:
    runs, train_dir = damaged_runs
    newest, previous = train_dir / "checkpoints" / NEWEST, train_dir / "checkpoints" / PREVIOUS
    console = pipeline_main("--config", "micro", "--runs-dir", str(runs), "--only", "evaluate")
    said = console.stdout + console.stderr
    assert console.returncode == 0, said[-4000:]
    lines = [line for line in said.splitlines() if "skipping damaged checkpoint" in line]
    assert len(lines) == 1, said[-4000:]
    assert str(newest) in lines[0] and "truncated" in lines[0], lines[0]
    assert f"step 3 ({previous})" in lines[0], lines[0]
    assert "Traceback" not in said

    (eval_dir,) = [p for p in (runs / "stages" / "evaluate").iterdir() if "." not in p.name]
    report = json.loads((eval_dir / "report.json").read_text())
    assert report["checkpoint"] == str(previous) and report["checkpoint_step"] == 3
    (skipped,) = report["checkpoint_skipped"]
    assert skipped["checkpoint"] == str(newest) and "truncated" in skipped["problem"]
    assert "(step 3)" in (eval_dir / "report.md").read_text()
    tags = evaluate_run(runs).data.tags
    assert tags["checkpoint_step"] == "3" and tags["checkpoint"] == str(previous)
    assert str(newest) in tags["checkpoint_skipped"]

    # The export holds step 3's weights, which training changed by step 6.
    exported = load_file(str(eval_dir / "hf" / "model.safetensors"))["lm_head.weight"]
    at_3 = CheckpointTensors(previous).load(["output.weight"])["output.weight"]
    assert exported.equal(at_3)
    intact_6 = Path(micro_pipeline[2]["train"].out_dir) / "checkpoints" / NEWEST  # the original
    at_6 = CheckpointTensors(intact_6).load(["output.weight"])["output.weight"]
    assert (exported - at_6).abs().max().item() > 1e-6


def test_no_intact_checkpoint_is_one_line_naming_the_fix(
        damaged_runs: tuple[Path, Path], pipeline_main) -> None:
    runs, train_dir = damaged_runs
    flip_byte(train_dir / "checkpoints" / PREVIOUS / "extra.pt")
    console = pipeline_main("--config", "micro", "--runs-dir", str(runs), "--only", "evaluate")
    said = console.stdout + console.stderr
    assert console.returncode == 1, said[-4000:]
    assert "Traceback" not in said
    (line,) = [line for line in console.stderr.splitlines() if "no intact checkpoint" in line]
    assert "EvaluationError" in line and f"{NEWEST}: " in line and f"{PREVIOUS}: " in line
    assert line.endswith("rerun the training: python -m workflows.pipeline --from train"), line
    assert not list((runs / "stages" / "evaluate").glob("*/report.json"))


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_each_kind_of_damage_falls_back_one_step(micro_pipeline, tmp_path: Path,
                                                 damage: str) -> None:
    _, _, results = micro_pipeline
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(Path(results["train"].out_dir) / "checkpoints", checkpoints)
    harm, said = DAMAGE[damage]
    harm(largest_shard(checkpoints / NEWEST))
    choice = usable_checkpoint(checkpoints / NEWEST)
    assert choice.path == checkpoints / PREVIOUS and choice.step == 3
    ((skipped, problem),) = choice.skipped
    assert skipped == checkpoints / NEWEST and said in problem, problem
    assert said in choice.note("evaluating") and choice.note().endswith(
        f"using step 3 ({checkpoints / PREVIOUS}) instead")
    intact = usable_checkpoint(checkpoints / PREVIOUS)  # an intact one is used as it is
    assert intact.skipped == () and intact.note() is None and intact.step == 3

    (checkpoints / PREVIOUS / MANIFEST).unlink()  # now neither can be read
    with pytest.raises(NoIntactCheckpoint, match=rf"no intact checkpoint is left in "
                       rf"{checkpoints}.*{NEWEST}: .*{PREVIOUS}: no {MANIFEST}"):
        usable_checkpoint(checkpoints / NEWEST)
    from stages.evaluate.work import choose_checkpoint

    with pytest.raises(EvaluationError, match=r"--from train$"):
        choose_checkpoint({"checkpoint": str(checkpoints / NEWEST)})


def test_export_command_names_the_intact_checkpoint_beside_a_damaged_one(
        micro_pipeline, tmp_path: Path, capsys) -> None:
    from model.evaluation.export_hf import main

    _, _, results = micro_pipeline
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(Path(results["train"].out_dir) / "checkpoints", checkpoints)
    truncate(largest_shard(checkpoints / NEWEST))
    assert main([str(checkpoints / NEWEST), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and err.strip().endswith(
        f"the newest intact checkpoint beside it is step 3: export {checkpoints / PREVIOUS}")
    assert not (tmp_path / "hf").exists()


def test_summary_names_the_published_checkpoint(micro_pipeline) -> None:
    _, _, results = micro_pipeline
    train = results["train"]
    stage_dir = Path(train.out_dir)
    assert not stage_dir.name.endswith(".partial") and stage_dir.is_dir()
    summary = json.loads((stage_dir / SUMMARY_FILE).read_text())
    assert summary["checkpoint"] == f"checkpoints/{NEWEST}"
    published = stage_dir / summary["checkpoint"]
    assert published.is_dir() and checkpoint_problem(published) is None
    assert Path(train.outputs["checkpoint"]) == published
