"""The train stage's work, a ranks stage: validate and write the rank spec, then collect.

``prepare`` makes every check before any rank starts and writes the ranks' spec.json; the
ranks (``stages.train.worker``) are launched from it by ``stages.mechanism.launch`` locally or
srun under
Slurm; ``finalize`` reads their summary.json.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from data_prep.atomic import write_json_atomic
from model.config import TrainConfig
from model.parallel.layout import Plan
from model.planner.cluster import ClusterError, is_measured, load_cluster
from model.training.files import CHECKPOINTS_DIR, HEALTH_FILE, LOSS_CURVE_FILE, SUMMARY_FILE
from model.training.validate import TrainSetupError, plan_from_parallel, validate_training
from stages.config import PipelineConfig
from stages.mechanism.launch import OUT_OF_TIME_FILE, RANK_ERROR_FILE, SPEC_FILE, RankSpec
from stages.train import shape
from stages.train.checks import checkpoint_cadence_problem, predicted_step_time

INIT_DIR = "init"  # train.init_from imported from Hugging Face


def _store_vocab(tok: dict[str, Any]) -> int | None:
    """The token store's vocabulary size (from the tokenize outputs or its manifest)."""
    if not tok.get("store"):
        return None
    try:
        from data_prep.store import open_store
    except ImportError:  # pragma: no cover - data_prep always ships with the project
        return tok.get("vocab_size")
    return open_store(tok["store"]).vocab_size


def load_plan(cfg: PipelineConfig, inputs: dict[str, dict]) -> Plan:
    """The plan stage's plan.json, or a plan from the parallel.* settings."""
    plan_out = (inputs or {}).get("plan") or {}
    if plan_out.get("plan"):
        return Plan.from_json(plan_out["plan"])
    return plan_from_parallel(cfg.parallel, cfg.train)


def peak_tflops(cfg: PipelineConfig, plan: Plan) -> float | None:
    """Device peak (TFLOP/s) that MFU is reported against: the one the plan's predictions
    used, else the cluster description's for train.dtype, else None (trainer default). A
    measured cluster (this machine) gives None: its figures are the rates a block reached
    with every rank busy, which a run can beat, so MFU uses the device's own peak."""
    if is_measured(cfg.parallel.cluster):
        return None
    pred = plan.predictions
    if pred.get("mfu") and pred.get("tflops_per_device"):
        return pred["tflops_per_device"] / pred["mfu"]
    try:
        return load_cluster(cfg.parallel.cluster).peak_for(cfg.train.dtype) / 1e12
    except ClusterError:  # e.g. a cluster measured at plan time
        return None


def initial_checkpoint(cfg: PipelineConfig, out_dir: Path) -> Path:
    """The checkpoint of ours that ``train.init_from`` names, an HF directory imported into
    ``out_dir/init`` once; TrainSetupError naming a missing, unsupported or other-shaped one."""
    from model.evaluation.import_hf import resolve_init_from

    try:
        return resolve_init_from(cfg.train.init_from, Path(out_dir) / INIT_DIR, cfg.model)
    except ValueError as err:  # ImportHFError, CheckpointError
        raise TrainSetupError(f"train.init_from: {err}") from None


def resolved_train(cfg: PipelineConfig, tracker: Any = None) -> TrainConfig:
    """``cfg.train`` with ``checkpoint_minutes: auto`` resolved to Young/Daly's interval in
    minutes (``model.planner.failures``), said on the console and set as the MLflow tag
    ``checkpoint_minutes_auto`` (a tag: a resumed attempt may resolve it anew, e.g. after
    site.failures_per_node_hour changed); TrainSetupError naming the fix when the cluster
    file gives no save time. Any other value is returned as it is."""
    if cfg.train.checkpoint_minutes != "auto":
        return cfg.train
    from model.planner.failures import auto_checkpoint_minutes, config_interruptions, describe_auto

    figures = config_interruptions(cfg)
    try:
        minutes = auto_checkpoint_minutes(figures)
    except ValueError as err:
        raise TrainSetupError(str(err)) from None
    print(f"[train] {describe_auto(minutes, figures)}", flush=True)
    if tracker is not None and getattr(tracker, "run_id", None):
        tracker.set_tags({"checkpoint_minutes_auto": f"{minutes:.4g}"})
    return dataclasses.replace(cfg.train, checkpoint_minutes=minutes)


def prepare(cfg: PipelineConfig, inputs: dict[str, dict], out_dir: Path, tracker: Any) -> str:
    """Validate everything and write the ranks' ``spec.json``; return its path.

    Leftovers of an earlier attempt that this attempt must not adopt (a summary, a loss
    curve, a rank's error) are removed; its complete checkpoints stay and are resumed from.
    ``train.checkpoint_minutes: auto`` is resolved to minutes here (``resolved_train``) and
    the ranks' spec holds the minutes. A plan whose predicted step time lets no checkpoint
    land within one job of ``site.walltime`` is refused here, before any rank starts.
    """
    out_dir = Path(out_dir)
    plan = load_plan(cfg, inputs)
    tok = (inputs or {}).get("tokenize") or {}
    validate_training(cfg.model, cfg.train, plan, cfg.parallel.nproc,
                      store_vocab=_store_vocab(tok), checkpoint_root=out_dir / CHECKPOINTS_DIR)
    train = resolved_train(cfg, tracker)
    # Pre-flight made this check only if the plan already existed; now it always can.
    cadence = checkpoint_cadence_problem(train, cfg.site, predicted_step_time(plan.predictions))
    if cadence:
        raise TrainSetupError(cadence)
    for leftover in (SUMMARY_FILE, LOSS_CURVE_FILE, RANK_ERROR_FILE, OUT_OF_TIME_FILE,
                     HEALTH_FILE):
        (out_dir / leftover).unlink(missing_ok=True)
    tracking = None
    if tracker is not None and getattr(tracker, "run_id", None):
        tracking = {"uri": tracker.uri, "run_id": tracker.run_id}
        tracker.log_params({"plan": plan.to_dict()})
    config = cfg.to_dict()
    config["train"]["checkpoint_minutes"] = train.checkpoint_minutes  # minutes, never auto
    if cfg.train.init_from:  # ranks load one of our checkpoints (an HF one imported here)
        config["train"]["init_from"] = str(initial_checkpoint(cfg, out_dir).resolve())
    spec = RankSpec.for_shape(shape(cfg), out_dir=str(out_dir.resolve()),
                              config=config, plan=plan.to_dict(), store=tok.get("store"),
                              tracking=tracking, peak_tflops=peak_tflops(cfg, plan))
    return str(spec.write(out_dir / SPEC_FILE))


def finalize(cfg: PipelineConfig, out_dir: Path, parts: list[Any], tracker: Any) -> dict[str, Any]:
    """Read summary.json; return the stage outputs, with the provenance evaluate needs
    (the token store and its tokenizer's hash; both None for synthetic tokens).

    summary.json's ``checkpoint`` is rewritten relative to the stage directory
    (``checkpoints/step-N``), so it stays right once ``<key>.partial`` is published as
    ``<key>``; outputs' ``checkpoint`` stays absolute (relocated at publish).

    ``jobs`` (how many jobs the training ran in, a chain of them when it outlived one
    walltime, across every attempt) and ``node_hours`` (their nodes x their time from the
    job's start to its ranks' last record) go to the outputs and, as metrics, to MLflow."""
    out_dir = Path(out_dir)
    path = out_dir / SUMMARY_FILE
    if not path.is_file():
        raise TrainSetupError(f"{path} is missing: the training ranks did not finish")
    summary = json.loads(path.read_text())
    relative = _beside(summary.get("checkpoint"), out_dir)  # the ranks write it absolute
    if relative != summary.get("checkpoint"):
        summary["checkpoint"] = relative
        write_json_atomic(path, summary)
    if tracker is not None:
        tracker.log_dict(summary, SUMMARY_FILE)
        spent = {k: summary[k] for k in ("jobs", "node_hours") if summary.get(k) is not None}
        if spent:
            tracker.log_metrics(spent)
    keys = ("final_loss", "steps_done", "step_time_s", "tokens_per_s", "tflops_per_device",
            "mfu", "peak_memory_gb", "jobs", "node_hours")
    outputs = {k: summary.get(k) for k in keys}
    # Absolute in the outputs (relocated to the published directory at publish).
    checkpoint = str(Path(out_dir).resolve() / relative) if relative else None
    outputs.update(checkpoint=checkpoint, summary=str(path.resolve()))
    spec = RankSpec.read(out_dir / SPEC_FILE)
    outputs["store"] = spec.store
    outputs["tokenizer_hash"] = _tokenizer_hash(spec.store)
    if summary.get("losses"):
        outputs["loss_curve"] = str(loss_curve(summary["losses"], out_dir, tracker).resolve())
    outputs["validation"] = validation_outputs(summary.get("validation"), out_dir, tracker)
    return outputs


def validation_outputs(validation: dict[str, Any] | None, out_dir: Path,
                       tracker: Any) -> dict[str, Any] | None:
    """The in-loop validation the evaluate stage scores again (the slice's ``eval_tokens``,
    the last figures and their step), and the best checkpoint's tags on the run
    (``best_val_checkpoint``, ``best_val_step``, ``best_val_loss``); None without validation."""
    if not validation or not validation.get("last"):
        return None
    last, best = validation["last"], validation.get("best")
    if best and tracker is not None:
        where = _beside(best["checkpoint"], out_dir)
        tracker.set_tags({"best_val_checkpoint": where, "best_val_step": best["step"],
                          "best_val_loss": f"{best['val_loss']:.6g}"})
    return {"eval_tokens": validation["eval_tokens"], "step": last["step"],
            "val_loss": last["val_loss"], "val_bpb": last.get("val_bpb"),
            "best_step": best["step"] if best else None}


def _beside(checkpoint: str | None, out_dir: Path) -> str | None:
    """``checkpoint`` relative to the stage directory when it lies inside it
    ("checkpoints/step-00000060"): the directory is renamed when the stage is published, so
    summary.json names it from where it sits (join with summary.json's directory)."""
    if not checkpoint or not Path(checkpoint).is_absolute():
        return checkpoint
    try:
        return Path(checkpoint).relative_to(Path(out_dir).resolve()).as_posix()
    except ValueError:  # a checkpoint outside the stage directory keeps its own path
        return checkpoint


def loss_curve(losses: list[float], out_dir: Path, tracker: Any) -> Path:
    """Draw the whole loss history (every attempt's) as ``loss_curve.png`` and log it.

    Drawn by the stage's finalize, on the worker that runs the stages' apps (which draws
    their other plots), not by the logging rank: no rank imports matplotlib (a second of
    CPU in every training launch)."""
    from model.training.metrics import plot_losses

    png = plot_losses(losses, 0, out_dir / LOSS_CURVE_FILE)
    if tracker is not None:
        tracker.log_artifact(png)
    return png


def _tokenizer_hash(store: str | None) -> str | None:
    if not store:
        return None
    from data_prep.store import open_store

    return open_store(store).tokenizer_hash
