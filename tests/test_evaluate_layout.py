"""The evaluate stage with the training layout (eval.layout=training): a checkpoint trained
under tp=2 x pp=2 and evaluated on 4 gloo ranks, each holding its quarter of the model, gives
the one-process loss and generations; layouts that cannot work are refused before any rank."""
import json
from pathlib import Path

import pytest

from model.evaluation.generate import generate_tokens
from model.training.checkpoint import load_for_inference
from stages.config import ConfigError
from stages.evaluate import work as evaluate
from stages.evaluate.checks import check_evaluate
from stages.evaluate.worker import GENERATIONS_FILE, LOSS_FILE
from stages.mechanism import tracking
from stages.registry import declaration

EVALUATE = declaration("evaluate")

pytest_plugins = ["tests.evalkit"]  # micro_config, open_pipeline, run_stages
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# A micro model trained 2 steps under tp=2 x pp=2 (one layer per stage); 10 windows.
TRAINED = ("parallel.nproc=4", "parallel.tp=2", "parallel.pp=2", "train.steps=2",
           "train.checkpoint_every=2", "eval.max_tokens=640", "eval.generate_tokens=6",
           "eval.prompts=['def ', 'import ']", "eval.tasks=[]", "eval.log_model=false")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, seed_microbench, seed_store):
    from tests.evalkit import micro_config, open_pipeline, run_stages

    runs_dir = tmp_path_factory.mktemp("eval-layout")
    seed_microbench(runs_dir, 4)
    seed_store(runs_dir)
    cfg = micro_config(runs_dir, *TRAINED)
    ctx = open_pipeline(cfg)
    results = run_stages(cfg, ctx, ("tokenize", "plan", "train"))
    summary = json.loads(Path(results["train"].outputs["summary"]).read_text())
    assert (summary["plan"]["tp"], summary["plan"]["pp"]) == (2, 2)
    yield cfg, ctx, results
    tracking.end_run(ctx.tracking_uri, ctx.parent_run_id)


def test_training_layout_gives_the_one_process_loss_and_generations(trained, monkeypatch):
    from tokenizers import Tokenizer

    from tests.evalkit import micro_config, run_stages

    cfg, ctx, results = trained
    one = run_stages(cfg, ctx, ("evaluate",), done=results)["evaluate"]
    layout_cfg = micro_config(Path(ctx.runs_dir), *TRAINED, "eval.layout=training",
                              "eval.ranks=4")
    shape = EVALUATE.shape(layout_cfg)
    assert (shape.kind, shape.nproc, shape.nodes) == ("ranks", 4, 1)

    def no_whole_model(*args, **kwargs):
        raise AssertionError("the training layout loaded the whole model in one process")

    # finalize runs in this process: with the training layout it must not load the model.
    monkeypatch.setattr("model.training.checkpoint.load_for_inference", no_whole_model)
    four = run_stages(layout_cfg, ctx, ("evaluate",), done=results)["evaluate"]
    monkeypatch.undo()
    assert not four.reused and four.key != one.key

    r1 = json.loads(Path(one.outputs["report"]).read_text())
    r4 = json.loads(Path(four.outputs["report"]).read_text())
    assert (r1["eval_layout"], r4["eval_layout"]) == ("replicas", {"tp": 2, "pp": 2, "dp": 1})
    assert r1["tokens"] == r4["tokens"] == 640 and r1["windows"] == r4["windows"] == 10
    assert r4["val_loss"] == pytest.approx(r1["val_loss"], abs=1e-6)
    assert r4["per_source"]["all"]["tokens"] == r1["per_source"]["all"]["tokens"]
    # One replica: every rank of it went through all 10 windows (its stage, its tp shard).
    assert r4["windows_per_rank"] == [10] * 4 and r4["eval_ranks"] == 4
    assert r4["generations"] == r1["generations"]  # greedy and sampled text, every prompt
    assert (Path(four.out_dir) / "generations.txt").read_text() == \
        (Path(one.out_dir) / "generations.txt").read_text()
    assert "4 rank(s), training layout tp2 x pp2 x dp1" in \
        (Path(four.out_dir) / "report.md").read_text()

    # The ranks' greedy token ids are the one-process model's.
    tok, train = results["tokenize"].outputs, results["train"].outputs
    model = load_for_inference(train["checkpoint"], cfg.model)
    tokenizer = Tokenizer.from_file(tok["tokenizer"])
    ranked = json.loads((Path(four.out_dir) / GENERATIONS_FILE).read_text())["generations"]
    assert [g["prompt"] for g in ranked] == cfg.eval.prompts
    for item in ranked:
        ids = tokenizer.encode(item["prompt"]).ids
        assert item["greedy_ids"] == generate_tokens(model, ids, 6, eos_id=tok["eos_id"])
        assert len(item["greedy_ids"]) == 6
    assert len({t for item in ranked for t in item["greedy_ids"]}) > 2  # not one repeated token
    loss = json.loads((Path(four.out_dir) / LOSS_FILE).read_text())
    assert loss["layout"] == r4["eval_layout"] and loss["val_loss"] == r4["val_loss"]
    assert "tp2 x pp2 x dp1 ranks" in (Path(four.out_dir) / "eval-ranks.log").read_text()


def test_layouts_that_cannot_work_are_refused_before_any_rank(trained, tmp_path):
    from tests.evalkit import micro_config

    cfg, ctx, results = trained
    runs = Path(ctx.runs_dir)
    # lm-eval needs the whole model in one process: refused when the config is read.
    with pytest.raises(ConfigError, match=r"eval\.tasks=.* with eval\.layout=training.*set "
                       r"eval\.tasks=\[\] or eval\.layout=replicas"):
        micro_config(runs, *TRAINED, "eval.layout=training", "eval.tasks=[heldout_perplexity]")
    # Pre-flight, from the config alone: fixed tp x pp, and the training's rank count.
    with pytest.raises(evaluate.EvaluationError, match=r"tp=2 x pp=2 = 4 ranks \(parallel\.tp x "
                       r"parallel\.pp\).*eval\.ranks=2 is not a multiple of 4: set eval\.ranks=4"):
        check_evaluate(micro_config(runs, *TRAINED, "eval.layout=training", "eval.ranks=2"))
    with pytest.raises(evaluate.EvaluationError, match=r"eval\.ranks=8 .*parallel\.nproc=4"):
        check_evaluate(micro_config(runs, *TRAINED, "eval.layout=training", "eval.ranks=8"))
    check_evaluate(micro_config(runs, *TRAINED, "eval.ranks=2"))  # replicas: any count
    # prepare, against the plan the checkpoint was trained with (tp/pp not fixed here).
    free = micro_config(runs, "parallel.nproc=4", "eval.layout=training", "eval.ranks=2")
    check_evaluate(free)
    inputs = {"tokenize": results["tokenize"].outputs, "train": results["train"].outputs}
    with pytest.raises(evaluate.EvaluationError, match=r"tp=2 x pp=2 = 4 ranks \(the plan "
                       r"checkpoint .* was trained with\).*set eval\.ranks=4"):
        evaluate.run(free, inputs, tmp_path, None)
    assert list(tmp_path.iterdir()) == []  # no spec, no rank started
