"""The evaluate stage over a real micro pipeline (store, 2-rank training, MLflow on SQLite)."""
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from data_prep.store import MANIFEST, SplitReader, open_store
from data_prep.writer import PartWriter
from model.evaluation.generate import generate_tokens
from model.training.checkpoint import load_for_inference
from model.training.heldout import EmptySplitError, plan_windows
from stages.evaluate import work as evaluate
from stages.mechanism import tracking
from stages.mechanism.walk import run_work
from stages.registry import declaration

EVALUATE = declaration("evaluate")

pytest_plugins = ["tests.evalkit"]  # the shared micro_pipeline fixture
# The first test also builds the session's pipeline (several minutes on 2 busy cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _outputs(micro_pipeline):
    cfg, ctx, results = micro_pipeline
    return cfg, ctx, results["tokenize"].outputs, results["train"].outputs, results["evaluate"]


def test_report_loss_matches_direct_computation(micro_pipeline):
    cfg, _, tok, train, ev = _outputs(micro_pipeline)
    report = json.loads(Path(ev.outputs["report"]).read_text())
    # Recompute window by window (batch of one) from the checkpoint and the raw split.
    model = load_for_inference(train["checkpoint"], cfg.model)
    reader = SplitReader(tok["store"], "validation")
    T = cfg.train.seq_len
    windows = cfg.eval.max_tokens // T
    assert reader.num_tokens > windows * T + 1  # the split is longer than the budget
    plan = plan_windows(reader.num_tokens, T, cfg.eval.max_tokens)  # spread over the split
    total, nbytes = 0.0, 0
    token_bytes = open_store(tok["store"]).token_bytes()
    with torch.no_grad():
        for w in map(plan.window_index, range(windows)):
            x = torch.from_numpy(reader.read(w * T, w * T + T + 1).astype(np.int64))
            total += F.cross_entropy(model(x[None, :-1])[0], x[1:], reduction="sum").item()
            nbytes += int(token_bytes[x[1:].numpy()].sum())
    expected = total / (windows * T)
    assert report["val_bpb"] == pytest.approx(total / math.log(2) / nbytes, rel=1e-6)
    assert report["tokens"] == windows * T == ev.outputs["tokens"]
    assert report["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert report["perplexity"] == pytest.approx(math.exp(expected), rel=1e-6)
    assert ev.outputs["val_loss"] == report["val_loss"]
    # One corpus, no source labels: a single "all" source equal to the total.
    assert report["per_source"] == {
        "all": {"val_loss": report["val_loss"], "perplexity": report["perplexity"],
                "tokens": report["tokens"], "val_bpb": report["val_bpb"], "bytes": nbytes}}
    # Six steps of training already beat the uniform distribution over the vocabulary.
    assert report["val_loss"] < math.log(cfg.model.vocab_size)
    md = (Path(ev.out_dir) / "report.md").read_text()
    assert f"{report['val_loss']:.4f}" in md and "| all |" in md


def test_the_trainings_validation_slice_gives_one_figure_in_two_places(micro_pipeline):
    """The training validated every 3 steps (the micro preset); the evaluate stage scores the
    same slice for the final checkpoint and gets the figures the training logged last (the
    training on 2 DDP ranks, the evaluation in one process); the best checkpoint is tagged."""
    cfg, ctx, tok, train, ev = _outputs(micro_pipeline)
    report = json.loads(Path(ev.outputs["report"]).read_text())
    loop = report["train_slice"]
    assert train["validation"]["step"] == loop["trained_step"] == cfg.train.steps == 6
    assert loop["tokens"] == cfg.train.eval_tokens == 512
    assert loop["val_loss"] == pytest.approx(train["validation"]["val_loss"], rel=1e-6)
    assert loop["val_bpb"] == pytest.approx(train["validation"]["val_bpb"], rel=1e-6)
    client = MlflowClient(ctx.tracking_uri)
    ev_metrics = client.get_run(ev.run_id).data.metrics
    train_run = client.get_run(micro_pipeline[2]["train"].run_id)
    assert ev_metrics["train_slice_val_bpb"] == pytest.approx(
        train_run.data.metrics["val_bpb"], rel=1e-6)
    assert [m.step for m in client.get_metric_history(train_run.info.run_id, "val_bpb")] == [3, 6]
    summary = json.loads(Path(train["summary"]).read_text())
    best = min((e for e in summary["validation"]["history"]), key=lambda e: e["val_loss"])
    assert train_run.data.tags["best_val_step"] == str(best["step"])
    assert train_run.data.tags["best_val_checkpoint"] == f"checkpoints/step-{best['step']:08d}"


def test_generations_are_the_models_greedy_continuations(micro_pipeline):
    from tokenizers import Tokenizer

    cfg, _, tok, train, ev = _outputs(micro_pipeline)
    model = load_for_inference(train["checkpoint"], cfg.model)
    tokenizer = Tokenizer.from_file(tok["tokenizer"])
    text = Path(ev.outputs["generations"]).read_text()
    report = json.loads(Path(ev.outputs["report"]).read_text())
    assert [g["prompt"] for g in report["generations"]] == cfg.eval.prompts
    for item in report["generations"]:
        ids = tokenizer.encode(item["prompt"]).ids
        greedy = generate_tokens(model, ids, cfg.eval.generate_tokens, eos_id=tok["eos_id"])
        assert item["greedy"] == tokenizer.decode(greedy)
        assert f"--- greedy:\n{item['prompt']}{item['greedy']}\n" in text
        assert f"--- sampled (temperature {cfg.eval.temperature}):" in text


def test_mlflow_run_has_metrics_artifacts_plots_and_model(micro_pipeline):
    _cfg, ctx, _, _, ev = _outputs(micro_pipeline)
    run = tracking.get_run(ctx.tracking_uri, ev.run_id)
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert metrics["val_loss"] == pytest.approx(ev.outputs["val_loss"])
    assert metrics["perplexity"] == pytest.approx(ev.outputs["perplexity"])
    assert metrics["eval_tokens"] == ev.outputs["tokens"]
    client = MlflowClient(ctx.tracking_uri)
    top = {a.path for a in client.list_artifacts(ev.run_id)}
    assert {"report.json", "report.md", "generations.txt", "plots", "hf"} <= top
    plots = {a.path for a in client.list_artifacts(ev.run_id, "plots")}
    assert plots == {"plots/loss.png", "plots/lr.png", "plots/tokens_per_s.png",
                     "plots/perplexity.png"}
    for png in (Path(ev.out_dir) / "plots").glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    hf = {a.path for a in client.list_artifacts(ev.run_id, "hf")}
    assert {"hf/config.json", "hf/model.safetensors", "hf/tokenizer.json"} <= hf
    # The export is an MLflow model with a signature, linked to the run, that generates text.
    assert run.data.tags["model_uri"] == ev.outputs["model_uri"]
    (logged,) = [m for m in client.search_logged_models(experiment_ids=[ctx.experiment_id])
                 if m.source_run_id == ev.run_id]
    assert ev.outputs["model_uri"] == f"models:/{logged.model_id}"
    assert logged.artifact_location.startswith(Path(ctx.runs_dir).as_uri())  # not ./mlruns
    model = tracking.load_logged_model(ctx.tracking_uri, ev.outputs["model_uri"])
    # Logging and loading the model leave MLflow's process-wide settings as they were.
    assert "MLFLOW_TRACKING_URI" not in os.environ
    signature = model.metadata.signature
    assert [c["type"] for c in signature.inputs.to_dict()] == ["string"]
    assert [c["type"] for c in signature.outputs.to_dict()] == ["string"]
    assert {p.name for p in signature.params.params} >= {"max_new_tokens", "temperature"}
    out = model.predict(["def "], params={"max_new_tokens": 4})
    # The text-generation flavour returns prompt + continuation (whitespace-stripped).
    assert isinstance(out, list) and len(out) == 1 and out[0].startswith("def")
    # The plots are drawn from the train run's metric history.
    train_run = tracking.get_run(ctx.tracking_uri, run.data.tags["input.train.run_id"])
    assert train_run.data.tags["stage"] == "train"
    report = json.loads(Path(ev.outputs["report"]).read_text())
    assert report["train_run_id"] == train_run.info.run_id


def test_export_is_streamed_into_shards_that_compute_the_checkpoints_logits(
        micro_pipeline, tmp_path, monkeypatch):
    """finalize exports from the checkpoint in safetensors shards of EXPORT_SHARD_BYTES."""
    import dataclasses

    import transformers

    cfg, ctx, _, train, ev = _outputs(micro_pipeline)
    out = tmp_path / "eval"
    shutil.copytree(ev.out_dir, out, ignore=shutil.ignore_patterns("hf", "lm_eval_tasks"))
    monkeypatch.setattr(evaluate, "EXPORT_SHARD_BYTES", 100_000)
    quick = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, tasks=[], log_model=False))
    tracker = tracking.Tracker(ctx.tracking_uri, tracking.start_run(
        ctx.tracking_uri, ctx.experiment_id, "sharded-export"))
    outputs = evaluate.finalize(quick, out, [], tracker)
    hf_dir = Path(outputs["hf_export"])
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in hf_dir.glob("model-*.safetensors"))
    assert len(shards) >= 2 and sorted(set(index["weight_map"].values())) == shards
    assert not (hf_dir / "model.safetensors").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    ours = load_for_inference(train["checkpoint"], cfg.model)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - hf.eval()(tokens).logits).abs().max().item() < 1e-4


def test_tokenizer_mismatch_is_refused_before_any_work(micro_pipeline, tmp_path):
    from tests.evalkit import micro_config, run_stages  # after pytest registered the plugin

    cfg, ctx, _, train, _ = _outputs(micro_pipeline)
    other_cfg = micro_config(Path(ctx.runs_dir), "tokenizer.vocab_size=400")
    other = run_stages(other_cfg, ctx, ("tokenize",))["tokenize"].outputs
    # The train outputs carry the provenance evaluate checks against.
    assert train["tokenizer_hash"] == open_store(train["store"]).tokenizer_hash
    assert other["tokenizer_hash"] != train["tokenizer_hash"]
    tracker = tracking.Tracker(ctx.tracking_uri, tracking.start_run(
        ctx.tracking_uri, ctx.experiment_id, "mismatch"))
    out = tmp_path / "eval"
    out.mkdir()
    with pytest.raises(evaluate.EvaluationError, match=r"trained with tokenizer .*train outputs.* "
                       r"built with tokenizer .*evaluate with the store used for training"):
        run_work(EVALUATE, cfg, {"tokenize": other, "train": train}, out, tracker)
    assert list(out.iterdir()) == []


def _store_with_empty_validation(store: Path, target: Path) -> Path:
    """A copy of ``store`` whose validation split is one empty (but complete) part."""
    shutil.copytree(store, target)
    info = open_store(target)
    for part in info.splits["validation"].parts:
        shutil.rmtree(target / part["path"])
    summary = PartWriter(target, "validation", 0, np.dtype(info.dtype), info.chunk_tokens, 1).close(
        {"tokenizer_hash": info.tokenizer_hash})
    manifest = dict(info.manifest)
    manifest["splits"] = {**manifest["splits"], "validation": {
        "tokens": 0, "documents": 0,
        "parts": [{"path": "validation/00000", "tokens": summary["tokens"], "documents": 0}]}}
    (target / MANIFEST).write_text(json.dumps(manifest))
    return target


def test_empty_validation_split_is_a_clear_error(micro_pipeline, tmp_path):
    cfg, ctx, tok, train, _ = _outputs(micro_pipeline)
    empty = _store_with_empty_validation(Path(tok["store"]), tmp_path / "store.zarr")
    assert open_store(empty).splits["validation"].tokens == 0
    tracker = tracking.Tracker(ctx.tracking_uri, tracking.start_run(
        ctx.tracking_uri, ctx.experiment_id, "empty"))
    out = tmp_path / "eval"
    out.mkdir()
    with pytest.raises(evaluate.EvaluationError, match=r"validation split of token store .* has 0 "
                       r"tokens.*raise data.validation_fraction"):
        run_work(EVALUATE, cfg, {"tokenize": {**tok, "store": str(empty)}, "train": train}, out,
                 tracker)
    assert list(out.iterdir()) == []


def test_window_plan_bounds():
    assert plan_windows(10_000, 64, 2048).windows == 32  # budget-bound
    assert plan_windows(129, 64, 10_000).windows == 2  # split-bound: 2*64 + 1 tokens
    short = plan_windows(20, 64, 2048)  # shorter than a window: one shorter window
    assert (short.seq_len, short.windows, short.tokens) == (19, 1, 19)
    for n in (0, 1):
        with pytest.raises(EmptySplitError, match=f"has {n} tokens"):
            plan_windows(n, 64, 2048)
