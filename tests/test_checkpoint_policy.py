"""When checkpoints are written and which are kept: the clock, retention, background saves,
and the refusal of a configuration under which no checkpoint lands within one Slurm job.

Real training runs of these rules: tests/test_train_checkpoint.py.
"""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from data_prep.atomic import storage_error
from model.gpt import GPT
from model.parallel.layout import Plan
from model.training.checkpoint import (
    checkpoint_problem,
    checkpoints_to_delete,
    finish_save,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    start_save,
    vote,
)
from model.training.validate import TrainSetupError
from stages.config import ConfigError, load_config, walltime_seconds
from stages.mechanism.outputs import StageResult
from stages.mechanism.preflight import preflight
from stages.mechanism.selection import StageDecision
from stages.registry import PIPELINE
from stages.train import work as train
from stages.train.checks import checkpoint_cadence_problem, predicted_step_time
from tests.train_helpers import run_function_ranks, tiny_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(("override", "words"), [
    ("train.checkpoint_minutes=-5", "train.checkpoint_minutes must be > 0 minutes or null"),
    ("train.checkpoint_minutes=0", "train.checkpoint_minutes must be > 0"),
    ("train.keep_last=0", "train.keep_last must be >= 1"),
    ("train.keep_every=0", "train.keep_every must be > 0 steps or null"),
    ("train.keep_every=-100", "train.keep_every must be > 0"),
])
def test_bad_checkpoint_settings_are_refused_by_name(override: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        load_config(None, [override])


def test_checkpoint_settings_defaults_and_overrides() -> None:
    cfg = load_config(None, [])
    assert (cfg.train.checkpoint_minutes, cfg.train.keep_last, cfg.train.keep_every,
            cfg.train.async_checkpoint) == (None, 2, None, False)
    cfg = load_config(None, ["train.checkpoint_minutes=30", "train.keep_last=3",
                             "train.keep_every=5000", "train.async_checkpoint=true"])
    assert (cfg.train.checkpoint_minutes, cfg.train.keep_last, cfg.train.keep_every,
            cfg.train.async_checkpoint) == (30, 3, 5000, True)


# ---------------------------------------------------------------- retention rules
@pytest.mark.parametrize(("steps", "keep_last", "keep_every", "protect", "deleted"), [
    ([1, 2, 3, 4, 5, 6], 2, None, [], [1, 2, 3, 4]),
    ([1, 2, 3, 4, 5, 6], 2, 2, [], [1, 3]),
    ([1, 2, 3, 4, 5, 6], 1, None, [2], [1, 3, 4, 5]),
    ([1, 2, 3, 4, 5, 6], 10, None, [], []),
    ([5000, 7500, 10000, 12500, 15000], 1, 5000, [], [7500, 12500]),
])
def test_retention_rules(steps, keep_last, keep_every, protect, deleted) -> None:
    assert checkpoints_to_delete(steps, keep_last, keep_every, protect) == deleted


def _model_and_optimizer():
    cfg = tiny_config().model
    model = GPT(cfg)
    model.init_weights(0)
    return cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_pruning_keeps_the_rules_and_never_counts_partial_saves(tmp_path: Path, capsys) -> None:
    cfg, model, opt = _model_and_optimizer()
    root = tmp_path / "checkpoints"
    for step in range(1, 7):
        save_checkpoint(root, step, model, opt, {"step": step}, cfg)
    # What crashes leave: a save that never finished, a step dir without its manifest, a
    # deletion cut short; and a newer crashed save, which may still be resumed past.
    (root / "step-00000004" / "manifest.json").unlink()
    (root / "step-00000005.tmp").mkdir()
    (root / "step-00000002.deleting").mkdir()
    (root / "step-00000009.tmp").mkdir()
    deleted = prune_checkpoints(root, keep_last=2, keep_every=None,
                                protect=[root / "step-00000001"])
    left = sorted(p.name for p in root.iterdir())
    # Kept: the newest two complete ones (6 and 5; the manifest-less 4 is not one of them),
    # the protected 1 and the newer crashed save.
    assert left == ["step-00000001", "step-00000005", "step-00000006", "step-00000009.tmp"]
    assert {p.name for p in deleted} == {"step-00000002", "step-00000003", "step-00000004",
                                         "step-00000005.tmp", "step-00000002.deleting"}
    err = capsys.readouterr().err
    assert f"[checkpoint] deleted {root / 'step-00000003'} (beyond train.keep_last=2)" in err
    assert "step-00000004 (incomplete: no manifest.json" in err
    for name in ("step-00000005", "step-00000006", "step-00000001"):
        assert checkpoint_problem(root / name) is None
    # keep_every keeps a multiple for good; the newest always stays even with keep_last=1.
    save_checkpoint(root, 8, model, opt, {"step": 8}, cfg)
    prune_checkpoints(root, keep_last=1, keep_every=5)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000005", "step-00000008",
                                                      "step-00000009.tmp"]


def test_a_background_save_holds_the_state_of_when_it_started(tmp_path: Path) -> None:
    """async_save stages a copy in host memory: changing the model afterwards (training on)
    does not reach the checkpoint, and it is published only by finish_save."""
    cfg, model, opt = _model_and_optimizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pending = start_save(tmp_path, 3, model, opt, {"step": 3}, cfg, asynchronous=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # what the next optimizer steps do while the thread writes
    assert not (tmp_path / "step-00000003").exists()
    path = finish_save(pending)
    assert path == tmp_path / "step-00000003" and checkpoint_problem(path) is None
    assert not (tmp_path / "step-00000003.tmp").exists()
    _, fresh, _ = _model_and_optimizer()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    assert load_checkpoint(path, fresh, None)["step"] == 3
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, before[name]), name


# ---------------------------------------------------------------- ranks agree
def _vote_rank(rank: int, init: str, cases: list, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        got = [vote(mine[rank], each[rank]) for mine, each in cases]
        Path(out, f"{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_rank_zeros_clock_decides_for_every_rank(tmp_path: Path) -> None:
    # (each rank's own clock says "save", each rank's writer says "still writing")
    cases = [((True, False), (False, False)), ((False, True), (False, True)),
             ((False, False), (True, False)), ((True, True), (False, False))]
    code, _, stderr = run_function_ranks(
        _vote_rank, [f"file://{tmp_path / 'store'}", cases, str(tmp_path)], 2)
    assert code == 0, stderr[-3000:]
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    want = [[True, False], [False, True], [False, True], [True, False]]
    assert results[0] == results[1] == want


def _save_rank(rank: int, init: str, out: str, width: int = 4) -> None:
    """Save a checkpoint where rank 0 cannot write a file over 256 KiB, as on a full disk:
    with ``width`` 4 the shards are small and ``extra.pt`` (2 MB of losses) is not; with
    ``width`` 512 rank 0's shard (1 MB of weights, 2 MB of moments) is too large. Record what
    each rank raised, and the storage error behind it."""
    import resource
    import signal

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    if rank == 0:  # writes past the limit fail with EFBIG rather than killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, width)).sum().backward()
    opt.step()  # the moments exist and are saved
    losses = [0.5] * (200_000 if width == 4 else 10)
    try:
        save_checkpoint(Path(out, "checkpoints"), 1, model, opt,
                        {"step": 1, "losses": losses}, tiny_config().model)
        got = None
    except BaseException as error:  # noqa: BLE001 - what each rank raised is the result
        behind = storage_error(error, {errno.EFBIG})
        got = [type(error).__name__, getattr(error, "errno", None), str(error),
               behind.errno if behind is not None else None]
    Path(out, f"{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


def test_a_write_only_rank_zero_makes_fails_every_rank_alike(tmp_path: Path) -> None:
    """A full disk under rank 0's own files (extra.pt, the manifest) ends every rank with
    the same OSError, not rank 0 with it and the others with a broken connection; and no
    half-written checkpoint stays."""
    import errno

    code, _, stderr = run_function_ranks(
        _save_rank, [f"file://{tmp_path / 'store'}", str(tmp_path)], 2)
    assert code == 0, stderr[-3000:]
    said = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert [s[:2] if s else s for s in said] == [["OSError", errno.EFBIG]] * 2, said
    assert "extra.pt" in said[0][2] and "on rank 0" in said[1][2], said
    assert not list((tmp_path / "checkpoints").iterdir())


def test_a_shard_too_large_for_the_disk_is_known_as_a_full_disk_on_every_rank(
        tmp_path: Path) -> None:
    """A full disk under a rank's own shard ends every rank with DCP's exception, behind
    which lies that rank's OSError (not the zip writer's RuntimeError, which does not say the
    disk is full); and no half-written checkpoint stays."""
    code, _, stderr = run_function_ranks(
        _save_rank, [f"file://{tmp_path / 'store'}", str(tmp_path), 512], 2)
    assert code == 0, stderr[-3000:]
    said = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert [s[0] for s in said] == ["CheckpointException"] * 2, said
    assert [s[3] for s in said] == [errno.EFBIG] * 2, said
    assert not list((tmp_path / "checkpoints").iterdir())


# ---------------------------------------------------------------- one job, one checkpoint
def _train(*sets: str):
    """A long training (100,000 steps unless ``sets`` says otherwise)."""
    return tiny_config("train.steps=100000", *sets).train


# No signal before the walltime (site.save_before_end_s=0): only checkpoints by step count
# or by the clock can land in a job.
SLURM = load_config(None, ["site.name=slurm", "site.walltime=02:00:00",
                           "site.save_before_end_s=0"]).site


def test_walltime_and_step_time() -> None:
    assert walltime_seconds("02:00:00") == 7200 and walltime_seconds("36:00:30") == 129630
    assert predicted_step_time({"step_time_s": 2.0}) == 2.0
    assert predicted_step_time({"step_time_s": 2.0, "measured_step_time_s": 3.0}) == 3.0
    assert predicted_step_time({}) is None and predicted_step_time(None) is None


def test_no_checkpoint_within_the_walltime_is_refused_with_the_fix() -> None:
    # 1000 steps at 10 s = 2.8 h > the 2 h walltime.
    problem = checkpoint_cadence_problem(_train("train.checkpoint_every=1000"), SLURM, 10.0)
    for words in ("no checkpoint can land within one Slurm job", "10 s/step",
                  "train.checkpoint_every=1000 steps take 2.78 h", "site.walltime=02:00:00 is 2 h",
                  "train.checkpoint_minutes is unset", "train.checkpoint_minutes=60",
                  "train.checkpoint_every <= 720", "raise site.walltime"):
        assert words in problem, (words, problem)
    longer = checkpoint_cadence_problem(
        _train("train.checkpoint_every=1000", "train.checkpoint_minutes=120"), SLURM, 10.0)
    assert "train.checkpoint_minutes=120 is not shorter than the walltime" in longer
    # Only at the end (checkpoint_every=0): the whole run must fit, else the same refusal.
    only_end = checkpoint_cadence_problem(_train("train.steps=1000"), SLURM, 10.0)
    assert "train.checkpoint_every=0 (only at the end: train.steps=1000 steps)" in only_end
    slow = checkpoint_cadence_problem(_train("train.checkpoint_every=10"), SLURM, 8000.0)
    assert "One step takes longer than the walltime" in slow


@pytest.mark.parametrize("sets", [
    ("train.checkpoint_every=1000", "train.checkpoint_minutes=30"),  # the clock saves in time
    ("train.checkpoint_every=700",),  # 7000 s < 7200 s
    ("train.steps=700",),  # the whole run fits in one job
])
def test_a_checkpoint_that_lands_in_time_passes(sets) -> None:
    assert checkpoint_cadence_problem(_train(*sets), SLURM, 10.0) is None


def test_a_save_before_the_walltime_lets_every_job_checkpoint() -> None:
    """With the training block signalled ahead of its end (the default), each job ends with
    a checkpoint of its own, as long as the signal leaves more than a step."""
    long_run = _train("train.checkpoint_every=1000")
    signalled = load_config(None, ["site.name=slurm", "site.walltime=02:00:00"]).site
    assert signalled.save_before_end() == 180
    assert checkpoint_cadence_problem(long_run, signalled, 10.0) is None
    signalled.save_before_end_s = 5  # shorter than one 10 s step: refused as without it
    problem = checkpoint_cadence_problem(long_run, signalled, 10.0)
    assert "no checkpoint can land" in problem and "site.save_before_end_s" in problem


def test_without_a_step_time_or_a_walltime_nothing_is_checked() -> None:
    never = _train("train.checkpoint_every=1000000")
    assert checkpoint_cadence_problem(never, SLURM, None) is None
    assert checkpoint_cadence_problem(never, tiny_config().site, 10.0) is None  # local


def _decisions(step_time_s: float | None) -> list[StageDecision]:
    """The driver's decisions for a run that reuses a plan stage output predicting
    ``step_time_s`` (None: the plan stage runs in this invocation) and trains."""
    plan = None
    if step_time_s is not None:
        plan = StageResult("plan", "k", "/nowhere", {"predictions": {"step_time_s": step_time_s}},
                           "r", "r", True)
    return [StageDecision("plan", "k" if plan else None, "reuse" if plan else "run", plan),
            StageDecision("train", None, "run", None)]


def test_preflight_refuses_it_when_the_plan_is_already_there(tmp_path: Path) -> None:
    cfg = tiny_config("site.name=slurm", "site.walltime=00:10:00", "train.steps=1000",
                      "train.checkpoint_every=500", f"tracking.runs_dir={tmp_path / 'runs'}",
                      "site.save_before_end_s=0")
    # No plan yet: nothing to check against.
    assert "train" in preflight(PIPELINE, cfg, _decisions(None))
    with pytest.raises(ConfigError, match=r"no checkpoint can land within one Slurm job.*"
                                          r"train\.checkpoint_every <= 300"):
        preflight(PIPELINE, cfg, _decisions(2.0))  # 500 steps = 1000 s > 600 s
    cfg.train.checkpoint_minutes = 5
    assert "train" in preflight(PIPELINE, cfg, _decisions(2.0))


def test_the_train_stage_refuses_it_before_any_rank_starts(tmp_path: Path) -> None:
    cfg = tiny_config("parallel.nproc=1", "site.name=slurm", "site.walltime=00:10:00",
                      "train.steps=1000", "train.checkpoint_every=500", "site.save_before_end_s=0")
    plan = Plan(micro_batch=8, predictions={"step_time_s": 2.0})
    inputs = {"plan": {"plan": str(plan.to_json(tmp_path / "plan.json"))}}
    with pytest.raises(TrainSetupError, match="no checkpoint can land within one Slurm job"):
        train.prepare(cfg, inputs, tmp_path, None)
    assert not (tmp_path / "spec.json").exists()
    cfg.train.checkpoint_minutes = 5
    assert Path(train.prepare(cfg, inputs, tmp_path, None)).is_file()
