"""Stage evaluate: held-out loss/perplexity, generations, HF export, plots, MLflow model.

Reads the trained checkpoint (``inputs["train"]["checkpoint"]``; when that one is damaged,
the newest intact one before it, said in one console line: ``choose_checkpoint``) and the
token store (``inputs["tokenize"]["store"]``) and writes into ``out_dir``:

- ``report.json`` / ``report.md``: validation loss and perplexity (token-weighted over
  ``eval.max_tokens`` tokens of the validation split), per source, the number of ranks
  (``eval_ranks``), lm-eval results;
- ``generations.txt``: greedy and sampled continuations of ``eval.prompts``;
- ``hf/``: the Hugging Face export (LlamaForCausalLM / GPTNeoXForCausalLM + tokenizer),
  streamed from the checkpoint into safetensors shards of at most ``EXPORT_SHARD_BYTES``
  (``model.evaluation.export_hf.export_checkpoint``: never the whole model in memory);
- ``plots/``: loss, learning rate and tokens/s of the train run, and perplexity (PNG).

The stage has three parts, like train: ``prepare`` (every input check, then ``spec.json``),
the ranks (``python -m stages.evaluate.worker --spec spec.json`` on ``eval.ranks`` processes,
each computing the loss over its share of the windows; rank 0 writes ``loss.json``) and
``finalize`` (everything else, once, in the driver-side app). The pipeline launches the
ranks like the training ranks; ``run`` chains the three on this machine, computing the loss
in this process when ``eval.ranks`` is 1.

``eval.layout=training`` (a model too big for one process): the ranks take the training
plan's tp x pp layout (``eval.ranks`` = tp*pp*k) and each loads only its shard of the
checkpoint; they compute the loss and the generations (rank 0 also writes
``generations.json``), and ``finalize`` never loads the model. lm-eval tasks are refused
with that layout (``stages.config.EvalConfig``); the export is streamed either way.

All of it is logged to the stage's MLflow run, and the export is logged as an MLflow
``transformers`` model with a signature (``eval.log_model``).

Per-source breakdown: a store part may carry a ``"source"`` label in the manifest; parts
without one count as source ``"all"`` (the current tokenizer writes none, so a store built
from one corpus reports a single ``"all"`` source).
"""
from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from data_prep.atomic import write_text_atomic
from data_prep.store import SplitReader, StoreInfo, open_store
from model.config import vocab_fit_problem
from model.evaluation.choice import CheckpointChoice, NoIntactCheckpoint, usable_checkpoint
from model.evaluation.shards import DEFAULT_SHARD_BYTES
from model.training.heldout import plan_windows
from stages.config import PipelineConfig
from stages.evaluate import shape
from stages.evaluate.checks import EvaluationError, check_evaluate, ranks_problem
from stages.mechanism import tracking
from stages.mechanism.launch import SPEC_FILE, RankSpec

SPLIT = "validation"
LOSS_FILE = "loss.json"  # written by rank 0 of stages.evaluate.worker
GENERATIONS_FILE = "generations.json"  # written by rank 0 with eval.layout=training
EXPORT_SHARD_BYTES = DEFAULT_SHARD_BYTES  # safetensors shard size of the hf/ export
# What to do when no checkpoint of the training is intact: train again (the train stage
# recomputes from scratch; its published checkpoints are replaced once the new ones exist).
RETRAIN = "rerun the training: python -m workflows.pipeline --from train"


def training_layout(cfg: PipelineConfig, train_outputs: dict[str, Any]) -> dict[str, int] | None:
    """{"tp", "pp", "dp"} of the evaluation ranks with ``eval.layout=training``, from the plan
    the checkpoint was trained with (the train stage's summary.json); None with
    ``eval.layout=replicas`` or a plan that does not split the model (tp = pp = 1)."""
    if cfg.eval.layout != "training":
        return None
    summary = train_outputs.get("summary")
    plan = None
    if summary and Path(summary).is_file():
        plan = json.loads(Path(summary).read_text()).get("plan")
    if not plan:
        raise EvaluationError(
            f"eval.layout=training needs the training plan, but the train outputs' summary "
            f"{summary} has none: rerun the train stage (python -m workflows.pipeline "
            "--from train) or set eval.layout=replicas")
    tp, pp, ranks = int(plan["tp"]), int(plan["pp"]), cfg.eval.ranks
    if ranks % (tp * pp):
        where = f"the plan checkpoint {train_outputs.get('checkpoint')} was trained with"
        raise EvaluationError(ranks_problem(ranks, tp, pp, cfg.parallel.nproc, where))
    if tp * pp == 1:
        return None
    return {"tp": tp, "pp": pp, "dp": ranks // (tp * pp)}


def training_tokenizer_hash(train_outputs: dict[str, Any]) -> tuple[str | None, str]:
    """(hash of the tokenizer the checkpoint was trained with, where it was found).

    The train stage's outputs carry it ("tokenizer_hash", with the "store" it came from);
    None when training used synthetic tokens.
    """
    if train_outputs.get("tokenizer_hash"):
        store = train_outputs.get("store")
        return train_outputs["tokenizer_hash"], f"train outputs (store {store})"
    if "tokenizer_hash" in train_outputs and not train_outputs.get("store"):
        return None, "trained on synthetic tokens"
    raise EvaluationError(
        "the train outputs carry no tokenizer_hash, so the store it was trained on is unknown: "
        "rerun the train stage (python -m workflows.pipeline --from train)"
    )


def choose_checkpoint(train_outputs: dict[str, Any]) -> CheckpointChoice:
    """The checkpoint to evaluate and export: the one the train outputs name, or, when it is
    damaged, the newest intact one before it (``model.evaluation.choice``), said in one
    console line. EvaluationError, naming the fix, when none is intact."""
    named = train_outputs.get("checkpoint")
    if not named:
        raise EvaluationError(f"the train outputs name no checkpoint: {RETRAIN}")
    try:
        choice = usable_checkpoint(named)
    except NoIntactCheckpoint as err:
        raise EvaluationError(f"{err}: {RETRAIN}") from None
    if choice.skipped:
        print(f"[evaluate] {choice.note('evaluating and exporting')}", flush=True)
    return choice


def check_inputs(cfg: PipelineConfig, store: StoreInfo, train_outputs: dict[str, Any]) -> str:
    """Refuse a store whose tokenizer or vocabulary differs from the checkpoint's; return a note."""
    vocab = vocab_fit_problem(store.vocab_size, cfg.model.vocab_size)
    if vocab:
        raise EvaluationError(f"token store {store.path}: {vocab} (evaluate with the store the "
                              "model was trained on)")
    trained, where = training_tokenizer_hash(train_outputs)
    if trained is None:
        return f"tokenizer check skipped ({where})"
    if trained != store.tokenizer_hash:
        raise EvaluationError(
            f"checkpoint {train_outputs['checkpoint']} was trained with tokenizer "
            f"{trained[:12]}... ({where}) but token store {store.path} was built with tokenizer "
            f"{store.tokenizer_hash[:12]}...: evaluate with the store used for training "
            "(same tokenizer.* and data.* settings) or retrain"
        )
    return f"tokenizer {trained[:12]}... matches ({where})"


def split_sources(store: StoreInfo, split: str) -> list[tuple[int, int, str]]:
    """(start, stop, source) token spans of a split from its parts' optional "source" label."""
    return store.split_spans(split)


def heldout_documents(reader: SplitReader, tokenizer, eos_id: int, limit: int | None) -> list[str]:
    """The first ``limit`` documents of a split, decoded (eos removed)."""
    offsets = reader.doc_offsets()
    count = len(offsets) - 1 if limit is None else min(limit, len(offsets) - 1)
    docs = []
    for i in range(count):
        ids = [int(t) for t in reader.read(int(offsets[i]), int(offsets[i + 1])) if t != eos_id]
        text = tokenizer.decode(ids)
        if text.strip():
            docs.append(text)
    return docs


# -- parts of the run ---------------------------------------------------------------------
def _write_text(path: Path, text: str) -> Path:
    return write_text_atomic(path, text)


def _train_histories(tracker) -> tuple[str | None, dict[str, list[tuple[int, float]]]]:
    """The train run id (from this run's input tags) and its loss/lr/tokens_per_s history,
    read from the store that holds that run (a reused training may have been tracked in
    another); no history where that store cannot be read (the console says so)."""
    tags = tracking.get_run(tracker.uri, tracker.run_id).data.tags
    run_id = tags.get("input.train.run_id")
    if not run_id:
        return None, {}
    uri = tags.get("input.train.tracking_uri", tracker.uri)
    keys = ("loss", "lr", "tokens_per_s")
    try:
        return run_id, {k: tracking.metric_history(uri, run_id, k) for k in keys}
    except Exception as error:  # noqa: BLE001 - the plots are extra; the evaluation stands
        print(f"[evaluate] no training history for the plots: run {run_id} is not readable "
              f"in {uri} ({type(error).__name__})", flush=True)
        return run_id, {}


def _lm_eval(cfg, model, tokenizer, eos_id, reader, out_dir: Path) -> dict[str, dict[str, float]]:
    from model.evaluation import lm_eval_adapter as harness

    task_dir = out_dir / "lm_eval_tasks"
    docs = heldout_documents(reader, tokenizer, eos_id, cfg.eval.task_limit)
    harness.write_heldout_task(task_dir, docs)
    include = [str(task_dir)] + ([cfg.eval.task_include] if cfg.eval.task_include else [])
    lm = harness.GPTHarnessLM(model, tokenizer, eos_id, cfg.eval.batch_size)
    return harness.run_tasks(lm, cfg.eval.tasks, include, cfg.eval.task_limit)


def _layout_text(layout: Any) -> str:
    """", training layout tp2 x pp2 x dp1" for a layout dict; "" for replicas."""
    if not isinstance(layout, dict):
        return ""
    return f", training layout tp{layout['tp']} x pp{layout['pp']} x dp{layout['dp']}"


def report_markdown(report: dict[str, Any]) -> str:
    """A short human summary of report.json."""
    lines = [
        "# Evaluation",
        "",
        f"- checkpoint: `{report['checkpoint']}` (step {report.get('checkpoint_step')})",
        *[f"- skipped damaged checkpoint `{item['checkpoint']}`: {item['problem']}"
          for item in report.get("checkpoint_skipped", [])],
        (f"- validation loss: **{report['val_loss']:.4f}** nats/token, perplexity "
        f"**{report['perplexity']:.2f}** over {report['tokens']:,} tokens "
        f"({report['windows']} windows of {report['seq_len']}, "
        f"{report.get('eval_ranks', 1)} rank(s){_layout_text(report.get('eval_layout'))})"),
        *_bpb_lines(report),
        f"- {report['tokenizer_check']}",
        "",
        "| source | tokens | loss | perplexity |",
        "|---|---:|---:|---:|",
    ]
    for name, src in report["per_source"].items():
        lines.append(f"| {name} | {src['tokens']:,} | {src['val_loss']:.4f} "
                     f"| {src['perplexity']:.2f} |")
    if report.get("lm_eval"):
        lines += ["", "## lm-eval", ""]
        for task, metrics in sorted(report["lm_eval"].items()):
            shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()))
            lines.append(f"- {task}: {shown}")
    if report.get("hf_export"):
        lines += ["", f"Hugging Face export: `{report['hf_export']}/` beside this report "
                      f"({report['hf_class']})"]
    return "\n".join(lines) + "\n"


def _bpb_lines(report: dict[str, Any]) -> list[str]:
    """report.md's bits-per-byte lines: this slice's, and the training's validation slice
    scored again (the figure the training's last in-loop validation logged)."""
    lines = []
    if report.get("val_bpb") is not None:
        lines.append(f"- bits per byte: **{report['val_bpb']:.4f}**")
    loop = report.get("train_slice")
    if loop:
        bpb = f", {loop['val_bpb']:.4f} bits/byte" if loop.get("val_bpb") is not None else ""
        lines.append(f"- the training's validation slice ({loop['tokens']:,} tokens): "
                     f"{loop['val_loss']:.4f} nats/token{bpb} (the training logged "
                     f"{loop['trained_val_loss']:.4f} at step {loop['trained_step']})")
    return lines


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise EvaluationError(f"{path} is missing: {what}")
    return json.loads(path.read_text())


def prepare(cfg: PipelineConfig, inputs: dict[str, dict], out_dir: Path, tracker: Any) -> str:
    """Every check before a rank starts; write ``out_dir/spec.json``.

    Refuses (EvaluationError) a store whose tokenizer differs from the checkpoint's, a store
    without a validation split or with too few tokens, a model family that cannot be
    exported, and a training without an intact checkpoint. Chooses the checkpoint
    (``choose_checkpoint``) and tags the run with it (``checkpoint``, ``checkpoint_step``,
    ``checkpoint_skipped``). Returns the path of the ranks' ``stages.mechanism.launch.RankSpec``.
    """
    from model.evaluation.export_hf import hf_architecture

    out_dir = Path(out_dir)
    tok_out, train_out = inputs["tokenize"], inputs["train"]
    store = open_store(tok_out["store"])
    tokenizer_note = check_inputs(cfg, store, train_out)
    if SPLIT not in store.splits:
        raise EvaluationError(f"token store {store.path} has no {SPLIT!r} split")
    reader = SplitReader(store, SPLIT)
    try:
        plan_windows(reader.num_tokens, cfg.train.seq_len, cfg.eval.max_tokens,
                     f"{SPLIT} split of token store {store.path}")
    except ValueError as err:
        raise EvaluationError(str(err)) from None
    hf_class = hf_architecture(cfg.model)  # refuse an unexportable model before work
    check_evaluate(cfg)
    layout = training_layout(cfg, train_out)
    choice = choose_checkpoint(train_out)
    if tracker is not None:  # tags, not params: a retry may find another checkpoint intact
        tracker.set_tags({"checkpoint": choice.path, "checkpoint_step": choice.step,
                          "checkpoint_skipped": choice.note() or "none"})
    for name in (LOSS_FILE, GENERATIONS_FILE):
        (out_dir / name).unlink(missing_ok=True)
    spec = RankSpec.for_shape(
        shape(cfg), out_dir=str(out_dir.resolve()),
        config=cfg.to_dict(), store=str(store.path),
        tracking=({"uri": tracker.uri, "run_id": tracker.run_id}  # the nodes' system metrics
                  if getattr(tracker, "run_id", None) else None),
        extra={
            "checkpoint": str(choice.path),
            "checkpoint_step": choice.step,
            "checkpoint_skipped": choice.skipped_records(),
            "tokenizer": str(tok_out.get("tokenizer") or store.tokenizer_file),
            "split": SPLIT,
            "sources": [list(span) for span in split_sources(store, SPLIT)],
            "tokenizer_check": tokenizer_note,
            "hf_class": hf_class,
            "layout": layout,
            # the training's in-loop validation slice, scored again for this checkpoint
            "train_slice": train_out.get("validation"),
        },
    )
    return str(spec.write(out_dir / SPEC_FILE))


def _loss_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The MLflow metrics of the ranks' held-out loss (per source when there are several)."""
    metrics = {"val_loss": result["val_loss"], "perplexity": result["perplexity"],
               **({"val_bpb": result["val_bpb"]} if "val_bpb" in result else {}),
               **{f"train_slice_{k}": v for k, v in (result.get("train_slice") or {}).items()
                  if k in ("val_loss", "val_bpb") and v is not None},
               "eval_tokens": result["tokens"],
               "eval_tokens_per_s": result["tokens"] / result["eval_seconds"],
               "eval_ranks": result["ranks"]}
    if len(result["per_source"]) > 1:
        for name, src in result["per_source"].items():
            metrics[f"val_loss.{name}"] = src["val_loss"]
            metrics[f"perplexity.{name}"] = src["perplexity"]
            if "val_bpb" in src:
                metrics[f"val_bpb.{name}"] = src["val_bpb"]
    return metrics


def _generations(cfg: PipelineConfig, extra: dict[str, Any], eos_id: int,
                 out_dir: Path) -> tuple[list[dict[str, str]], Any, Any]:
    """(generations, model, tokenizer): read from the ranks with the training layout (no
    process here loads the model; model and tokenizer are None), else generated here."""
    from tokenizers import Tokenizer

    from model.evaluation.generate import generate_text
    from model.training.checkpoint import load_for_inference

    if extra.get("layout"):
        ranked = _read_json(out_dir / GENERATIONS_FILE, "the evaluation ranks did not finish")
        return ([{k: item[k] for k in ("prompt", "greedy", "sampled")}
                 for item in ranked["generations"]], None, None)
    model = load_for_inference(extra["checkpoint"], cfg.model)
    tokenizer = Tokenizer.from_file(extra["tokenizer"])
    generations = generate_text(model, tokenizer, cfg.eval.prompts, cfg.eval.generate_tokens,
                                cfg.eval.temperature, cfg.train.seed, eos_id)
    return generations, model, tokenizer


def _plots(tracker: Any, result: dict[str, Any], plots_dir: Path) -> str | None:
    """Loss, learning rate and tokens/s of the train run, and perplexity, as PNGs; the train
    run's id."""
    from model.training.plots import plot_perplexity, plot_training

    plots_dir.mkdir(exist_ok=True)
    train_run_id, histories = _train_histories(tracker)
    plot_training(histories, plots_dir)
    plot_perplexity(histories.get("loss", []), result["perplexity"],
                    {n: s["perplexity"] for n, s in result["per_source"].items()},
                    plots_dir / "perplexity.png")
    return train_run_id


def _report(spec: RankSpec, store: StoreInfo, result: dict[str, Any],
            generations: list[dict[str, str]], lm_eval_results: dict[str, dict[str, float]],
            hf_dir: Path, train_run_id: str | None) -> dict[str, Any]:
    """report.json's contents."""
    extra = spec.extra
    loss_keys = ("val_loss", "perplexity", "tokens", "windows", "seq_len", "per_source")
    return {
        "checkpoint": extra["checkpoint"],
        "checkpoint_step": extra.get("checkpoint_step"),
        "checkpoint_skipped": extra.get("checkpoint_skipped", []),
        "store": store.path,
        "split": extra["split"],
        **{k: result[k] for k in loss_keys},
        "val_bpb": result.get("val_bpb"),
        "train_slice": result.get("train_slice"),
        "eval_ranks": result["ranks"],
        "eval_layout": extra.get("layout") or "replicas",
        "windows_per_rank": result["windows_per_rank"],
        "eval_device": result.get("device", "cpu"),
        "tokenizer_check": extra["tokenizer_check"],
        "eval_seconds": result["eval_seconds"],
        "generations": generations,
        "lm_eval": lm_eval_results,
        "hf_export": hf_dir.name,  # relative: the stage directory moves when published
        "hf_class": extra["hf_class"],
        "train_run_id": train_run_id,
        "host": socket.gethostname(),  # where finalize ran (a compute node under Slurm)
    }


def finalize(cfg: PipelineConfig, out_dir: Path, parts: list[Any], tracker: Any) -> dict[str, Any]:
    """Read the ranks' loss.json; export, generate, run lm-eval, plot and write the report;
    log it all to MLflow; return the stage outputs."""
    from model.evaluation.export_hf import export_checkpoint
    from model.evaluation.generate import format_generations

    out_dir = Path(out_dir)
    if not (out_dir / SPEC_FILE).is_file():
        raise EvaluationError(f"{out_dir / SPEC_FILE} is missing: run stages.evaluate.prepare "
                              "first")
    spec = RankSpec.read(out_dir / SPEC_FILE)
    extra = spec.extra
    result = _read_json(out_dir / LOSS_FILE, "the evaluation ranks did not finish")
    store = open_store(spec.store)
    print(f"[evaluate] val_loss {result['val_loss']:.4f} perplexity {result['perplexity']:.2f} "
          f"over {result['tokens']:,} tokens on {result['ranks']} rank(s) in "
          f"{result['eval_seconds']:.1f}s", flush=True)
    metrics = _loss_metrics(result)

    # Streamed from the checkpoint, one tensor at a time: the export never holds the model.
    hf_dir = export_checkpoint(extra["checkpoint"], cfg.model, out_dir / "hf",
                               tokenizer_file=extra["tokenizer"],
                               eos_token=cfg.tokenizer.eos_token, shard_bytes=EXPORT_SHARD_BYTES)
    generations, model, tokenizer = _generations(cfg, extra, store.eos_id, out_dir)
    gen_path = _write_text(out_dir / "generations.txt",
                           format_generations(generations, cfg.eval.temperature))
    lm_eval_results = {}
    if cfg.eval.tasks and model is not None:  # EvalConfig refuses tasks with the training layout
        reader = SplitReader(store, extra["split"])
        lm_eval_results = _lm_eval(cfg, model, tokenizer, store.eos_id, reader, out_dir)
        for task, values in lm_eval_results.items():
            metrics.update({f"{task}.{k}": v for k, v in values.items()})
    plots_dir = out_dir / "plots"
    train_run_id = _plots(tracker, result, plots_dir)
    report = _report(spec, store, result, generations, lm_eval_results, hf_dir, train_run_id)
    report_path = _write_text(out_dir / "report.json", json.dumps(report, indent=2))
    md_path = _write_text(out_dir / "report.md", report_markdown(report))

    tracker.log_metrics(metrics)
    tracker.flush()
    for path in (report_path, md_path, gen_path):
        tracker.log_artifact(path)
    tracker.log_artifact(plots_dir, "plots")
    tracker.log_artifact(hf_dir, "hf")
    outputs = {"report": str(report_path), "val_loss": result["val_loss"],
               "perplexity": result["perplexity"], "tokens": result["tokens"],
               "eval_ranks": result["ranks"], "hf_export": str(hf_dir),
               "checkpoint": extra["checkpoint"], "checkpoint_step": extra.get("checkpoint_step"),
               "generations": str(gen_path)}
    if cfg.eval.log_model:
        outputs["model_uri"] = tracking.log_hf_model(
            tracker.uri, tracker.run_id, hf_dir, max_new_tokens=cfg.eval.generate_tokens,
            temperature=cfg.eval.temperature)
    return outputs


def run(cfg: PipelineConfig, inputs: dict[str, dict], out_dir: Path, tracker) -> dict[str, Any]:
    """The single-app shape (``eval.ranks`` = 1): prepare, the held-out loss in this
    process, finalize. With more ranks the stage runs as ranks: prepare, the ranks,
    finalize (see the module docstring)."""
    from stages.evaluate import worker as eval_worker

    spec_path = prepare(cfg, inputs, out_dir, tracker)
    eval_worker.run_single(RankSpec.read(spec_path))
    return finalize(cfg, out_dir, [], tracker)
