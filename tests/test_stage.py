"""The shared stage mechanism: keys, status.json, atomic publish, reuse, MLflow child runs."""
import json
import types
from pathlib import Path

import pytest

from stages.config import load_config
from stages.mechanism import keys, outputs, tracking, tracking_store
from stages.mechanism.attempt import PipelineContext
from stages.mechanism.walk import run_stage
from tests.stagekit import declare


def _context(tmp_path: Path) -> PipelineContext:
    uri = tracking_store.default_tracking_uri(tmp_path)
    experiment = tracking.ensure_experiment(uri, "test", tmp_path)
    parent = tracking.start_run(uri, experiment, "pipeline-test")
    return PipelineContext(str(tmp_path), uri, experiment, parent, "1.0")


COUNTING = declare("counting")


def _counting_stage(calls: list, fail: bool = False) -> types.ModuleType:
    module = types.ModuleType("stages.counting")
    module.SECTIONS = ("train",)

    def run(cfg, inputs, out_dir, tracker):
        calls.append(out_dir)
        (out_dir / "result.txt").write_text(str(cfg.train.steps))
        tracker.log_metrics({"value": cfg.train.steps}, step=0)
        if fail:
            raise RuntimeError("boom")
        return {"result": str(out_dir / "result.txt")}

    module.run = run
    return module


def _key(cfg, inputs: dict[str, str], code: str, name: str = "train") -> str:
    return keys.key_of(keys.key_ingredients(declare(name, ("train",)), cfg, inputs, code))


def test_key_depends_on_sections_inputs_and_version():
    cfg = load_config()
    base = _key(cfg, {"plan": "a"}, "1")
    assert _key(cfg, {"plan": "a"}, "1") == base
    assert _key(cfg, {"plan": "b"}, "1") != base
    assert _key(cfg, {"plan": "a"}, "2") != base
    changed = load_config(None, ["train.lr=0.01"])
    assert _key(changed, {"plan": "a"}, "1") != base
    # A section the stage does not read does not change its key, nor does how often the
    # training logs or saves.
    other = load_config(None, ["eval.max_tokens=7", "train.log_every=5",
                               "train.checkpoint_every=3", "train.keep_last=4"])
    assert _key(other, {"plan": "a"}, "1") == base


def test_run_publishes_then_reuses_then_forces(tmp_path):
    ctx, cfg, calls = _context(tmp_path), load_config(), []
    module = _counting_stage(calls)
    first = run_stage(ctx, COUNTING, cfg, {}, work=module)
    assert not first.reused and len(calls) == 1
    out = Path(first.out_dir)
    assert json.loads((out / "status.json").read_text())["state"] == "succeeded"
    # Output paths point at the published directory, not the work directory.
    assert first.outputs["result"] == str(out / "result.txt")
    assert Path(first.outputs["result"]).read_text() == str(cfg.train.steps)
    assert not out.with_name(out.name + ".partial").exists()

    second = run_stage(ctx, COUNTING, cfg, {}, work=module)
    assert second.reused and len(calls) == 1
    reused_run = tracking.get_run(ctx.tracking_uri, second.run_id)
    assert reused_run.data.tags["reused"] == "true"
    assert reused_run.data.tags["producer_run_id"] == first.run_id
    assert reused_run.data.metrics["value"] == cfg.train.steps
    assert reused_run.info.status == "FINISHED"

    third = run_stage(ctx, COUNTING, cfg, {}, work=module, force=True)
    assert not third.reused and len(calls) == 2
    assert third.out_dir == first.out_dir and third.run_id != first.run_id
    assert json.loads((out / "status.json").read_text())["run_id"] == third.run_id


def test_reuse_from_another_tracking_store_records_the_producer_and_looks_nothing_up(tmp_path):
    """A runs dir whose stage was tracked in one store, rerun with another --tracking-uri:
    the stage is reused; its run in the new store names the producer's run and store."""
    ctx, cfg, calls = _context(tmp_path), load_config(), []
    module = _counting_stage(calls)
    first = run_stage(ctx, COUNTING, cfg, {}, work=module)
    assert first.producer_tracking_uri == ctx.tracking_uri
    other_uri = f"sqlite:///{tmp_path / 'other' / 'mlflow.db'}"
    experiment = tracking.ensure_experiment(other_uri, "test", tmp_path / "other")
    other = PipelineContext(str(tmp_path), other_uri, experiment,
                            tracking.start_run(other_uri, experiment, "pipeline-test"), "1.0")
    second = run_stage(other, COUNTING, cfg, {}, work=module)
    assert second.reused and len(calls) == 1
    assert (second.producer_run_id, second.producer_tracking_uri) == (first.run_id,
                                                                      ctx.tracking_uri)
    reused_run = tracking.get_run(other_uri, second.run_id)
    assert reused_run.info.status == "FINISHED"
    assert reused_run.data.tags["producer_run_id"] == first.run_id
    assert reused_run.data.tags["producer_tracking_uri"] == ctx.tracking_uri
    assert "value" not in reused_run.data.metrics  # another store's run is not looked up
    # A consumer of the reused stage tags where its input's run lives.
    made = run_stage(other, declare("consumer", ("eval",)), cfg, {"counting": second},
                     work=_counting_stage(calls))
    tags = tracking.get_run(other_uri, made.run_id).data.tags
    assert tags["input.counting.run_id"] == first.run_id
    assert tags["input.counting.tracking_uri"] == ctx.tracking_uri


def test_failure_leaves_nothing_that_looks_done(tmp_path):
    ctx, cfg, calls = _context(tmp_path), load_config(), []
    with pytest.raises(RuntimeError, match="boom"):
        run_stage(ctx, COUNTING, cfg, {}, work=_counting_stage(calls, fail=True))
    key = keys.key_of(keys.key_ingredients(COUNTING, cfg, {}, "1.0"))
    final = outputs.stage_dir(tmp_path, "counting", key)
    assert not final.exists()
    status = outputs.read_status(final.with_name(key + ".partial"))
    assert status["state"] == "failed" and "boom" in status["error"]
    assert outputs.find_succeeded(tmp_path, "counting", key) is None
    assert tracking.get_run(ctx.tracking_uri, status["run_id"]).info.status == "FAILED"
    # The next attempt starts clean and succeeds.
    result = run_stage(ctx, COUNTING, cfg, {}, work=_counting_stage(calls))
    assert not result.reused and Path(result.out_dir) == final


def test_child_runs_are_nested_and_carry_config(tmp_path):
    ctx, cfg = _context(tmp_path), load_config()
    result = run_stage(ctx, COUNTING, cfg, {}, work=_counting_stage([]))
    run = tracking.get_run(ctx.tracking_uri, result.run_id)
    assert run.data.tags["mlflow.parentRunId"] == ctx.parent_run_id
    assert run.info.run_name == f"counting-{result.key[:8]}"
    assert run.data.params["train.steps"] == str(cfg.train.steps)
