"""The evaluate stage on several ranks (eval.ranks): same loss as one process, early refusals."""
import dataclasses
import json
from pathlib import Path

import pytest

from stages.evaluate import work as evaluate
from stages.evaluate.worker import LOSS_FILE
from stages.mechanism import tracking
from stages.mechanism.launch import RankSpec
from stages.mechanism.walk import run_work
from stages.registry import declaration

EVALUATE = declaration("evaluate")

pytest_plugins = ["tests.evalkit"]  # the shared micro_pipeline fixture
# The first test also builds the session's pipeline (several minutes on 2 busy cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def test_two_ranks_give_the_one_rank_loss(micro_pipeline):
    from tests.evalkit import micro_config, run_stages  # after pytest registered the plugin

    cfg, ctx, results = micro_pipeline
    one = results["evaluate"]
    assert cfg.eval.ranks == 1
    # The stage under its own key (eval.ranks is part of it), from the same checkpoint/store;
    # no lm-eval or MLflow model here: only the loss path differs between the two.
    cfg2 = micro_config(Path(ctx.runs_dir), "eval.ranks=2", "eval.tasks=[]", "eval.log_model=false")
    two = run_stages(cfg2, ctx, ("evaluate",), done=results)["evaluate"]
    assert not two.reused and two.key != one.key
    assert two.outputs["val_loss"] == pytest.approx(one.outputs["val_loss"], abs=1e-6)
    assert two.outputs["tokens"] == one.outputs["tokens"]
    assert (one.outputs["eval_ranks"], two.outputs["eval_ranks"]) == (1, 2)

    r1 = json.loads(Path(one.outputs["report"]).read_text())
    r2 = json.loads(Path(two.outputs["report"]).read_text())
    windows = cfg.eval.max_tokens // cfg.train.seq_len
    assert r1["windows"] == r2["windows"] == windows
    assert (r1["eval_ranks"], r1["windows_per_rank"]) == (1, [windows])
    # Windows are dealt round-robin: each rank evaluated half of them.
    assert (r2["eval_ranks"], r2["windows_per_rank"]) == (2, [windows // 2, windows - windows // 2])
    assert r1["eval_device"] == r2["eval_device"] == "cpu"  # no GPU on the test machine
    assert r2["perplexity"] == pytest.approx(r1["perplexity"], rel=1e-6)
    assert r2["per_source"].keys() == r1["per_source"].keys()
    for name, src in r2["per_source"].items():
        assert src["tokens"] == r1["per_source"][name]["tokens"]
        assert src["val_loss"] == pytest.approx(r1["per_source"][name]["val_loss"], abs=1e-6)
    assert "2 rank(s)" in (Path(two.out_dir) / "report.md").read_text()
    # rank 0's loss.json is what the report was built from.
    loss = json.loads((Path(two.out_dir) / LOSS_FILE).read_text())
    assert loss["ranks"] == 2 and loss["val_loss"] == r2["val_loss"]
    # Rank output went to the stage's own log.
    assert "[eval] val_loss" in (Path(two.out_dir) / "eval-ranks.log").read_text()

    run = tracking.get_run(ctx.tracking_uri, two.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["eval_ranks"] == 2
    assert run.data.metrics["val_loss"] == pytest.approx(one.outputs["val_loss"], abs=1e-6)
    assert run.data.params["eval.ranks"] == "2"
    assert tracking.get_run(ctx.tracking_uri, one.run_id).data.metrics["eval_ranks"] == 1


def test_tokenizer_mismatch_fails_in_prepare_before_any_rank(micro_pipeline, tmp_path):
    from tests.evalkit import micro_config, run_stages

    _, ctx, results = micro_pipeline
    # A store built with another tokenizer (the same stage test_evaluate.py builds: reused
    # when both files run in one session).
    other_cfg = micro_config(Path(ctx.runs_dir), "tokenizer.vocab_size=400")
    other = run_stages(other_cfg, ctx, ("tokenize",))["tokenize"].outputs
    cfg2 = micro_config(Path(ctx.runs_dir), "eval.ranks=2")
    inputs = {"tokenize": other, "train": results["train"].outputs}
    tracker = tracking.Tracker(ctx.tracking_uri, tracking.start_run(
        ctx.tracking_uri, ctx.experiment_id, "mismatch-ranks"))
    pattern = r"trained with tokenizer .* built with tokenizer .*evaluate with the store used"
    prepared_dir = tmp_path / "prepare"
    prepared_dir.mkdir()
    with pytest.raises(evaluate.EvaluationError, match=pattern):
        evaluate.prepare(cfg2, inputs, prepared_dir, tracker)
    # Through run(): refused before any rank starts (no spec, no rank log, no loss.json).
    out = tmp_path / "eval"
    out.mkdir()
    with pytest.raises(evaluate.EvaluationError, match=pattern):
        run_work(EVALUATE, cfg2, inputs, out, tracker)
    assert list(out.iterdir()) == [] and list(prepared_dir.iterdir()) == []


def test_finalize_without_rank_output_is_a_clear_error(micro_pipeline, tmp_path):
    cfg, ctx, results = micro_pipeline
    inputs = {"tokenize": results["tokenize"].outputs, "train": results["train"].outputs}
    spec_path = evaluate.prepare(cfg, inputs, tmp_path, None)
    assert spec_path == str((tmp_path / "spec.json").resolve())
    spec = RankSpec.read(spec_path)
    assert spec.extra["checkpoint"] == results["train"].outputs["checkpoint"] and spec.nproc == 1
    tracker = tracking.Tracker(ctx.tracking_uri, tracking.start_run(
        ctx.tracking_uri, ctx.experiment_id, "no-ranks"))
    with pytest.raises(evaluate.EvaluationError, match=r"loss\.json is missing: the evaluation "
                       r"ranks did not finish"):
        evaluate.finalize(cfg, tmp_path, [], tracker)


def test_worker_refuses_a_launch_that_does_not_match_the_spec(
    micro_pipeline, tmp_path, monkeypatch
):
    from stages.evaluate.worker import run_spec

    cfg, _, results = micro_pipeline
    inputs = {"tokenize": results["tokenize"].outputs, "train": results["train"].outputs}
    cfg2 = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, ranks=2))
    spec = RankSpec.read(evaluate.prepare(cfg2, inputs, tmp_path, None))
    assert spec.nproc == 2
    # e.g. scheduler variables leaking into a launch of 3 processes: stop before rendezvous.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError,
                       match=r"launched on 3 rank\(s\) but the spec asks for eval.ranks=2"):
        run_spec(spec)
    assert not (tmp_path / LOSS_FILE).exists()
