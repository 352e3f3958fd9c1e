"""The train stage: validate, write the rank spec, launch the ranks, collect the summary.

``run`` = ``prepare`` (all checks before any rank starts; writes spec.json) + a
``torchrun --standalone`` subprocess of ``stages.train_worker`` (output streamed) +
``finalize`` (reads summary.json). Under Slurm the workflow launches the same worker with
srun from the spec that ``prepare`` wrote.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from model.planner.cluster import ClusterError, load_cluster
from model.planner.plan import Plan
from model.training.validate import TrainSetupError, plan_from_parallel, validate_training
from stages.config import PipelineConfig
from stages.stage import RANKS, StageShape

SECTIONS = ("model", "train")
UPSTREAM = ("tokenize", "plan")
RESUMABLE = True  # a failed attempt's checkpoints are kept and resumed from
WORKER = "stages.train_worker"


def shape(cfg: PipelineConfig) -> StageShape:
    """Ranks: ``parallel.nproc`` processes of stages.train_worker on ``parallel.nodes`` nodes."""
    return StageShape(RANKS, nproc=cfg.parallel.nproc, nodes=cfg.parallel.nodes, worker=WORKER,
                      note=f"on {cfg.parallel.nproc} ranks")
REPO_ROOT = Path(__file__).resolve().parent.parent


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
    used, else the cluster description's for train.dtype, else None (trainer default)."""
    pred = plan.predictions
    if pred.get("mfu") and pred.get("tflops_per_device"):
        return pred["tflops_per_device"] / pred["mfu"]
    try:
        return load_cluster(cfg.parallel.cluster).peak_for(cfg.train.dtype) / 1e12
    except ClusterError:  # e.g. a cluster measured at plan time
        return None


def prepare(cfg: PipelineConfig, inputs: dict[str, dict], out_dir: Path, tracker: Any) -> dict:
    """Validate everything, write ``out_dir/spec.json``; return {"spec", "nproc", "nodes"}."""
    out_dir = Path(out_dir)
    plan = load_plan(cfg, inputs)
    tok = (inputs or {}).get("tokenize") or {}
    validate_training(cfg.model, cfg.train, plan, cfg.parallel.nproc,
                      store_vocab=_store_vocab(tok), checkpoint_root=out_dir / "checkpoints")
    tracking = None
    if tracker is not None and getattr(tracker, "run_id", None):
        tracking = {"uri": tracker.uri, "run_id": tracker.run_id}
        tracker.log_params({"plan": plan.to_dict()})
    peak = peak_tflops(cfg, plan)
    spec = {"config": cfg.to_dict(), "plan": plan.to_dict(), "store": tok.get("store"),
            "out_dir": str(out_dir.resolve()), "tracking": tracking, "steps": None,
            "peak_tflops": peak}
    path = out_dir / "spec.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(spec, indent=2))
    os.replace(tmp, path)
    return {"spec": str(path.resolve()), "nproc": cfg.parallel.nproc, "nodes": cfg.parallel.nodes}


def launch_local(spec: str | Path, nproc: int, log_path: Path | None = None,
                 worker: str = "stages.train_worker", what: str = "training") -> None:
    """Run ``nproc`` ranks of ``python -m <worker> --spec SPEC`` with torchrun on this
    machine, streaming their output (shared by the train and evaluate stages)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), "-m", worker, "--spec", str(spec)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    tail: collections.deque[str] = collections.deque(maxlen=40)
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(log_path, "a")) if log_path else None
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=REPO_ROOT, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line)
            if log:
                log.write(line)
        rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"{what} ranks failed (torchrun exit {rc}); last output:\n"
                           + "".join(tail))


def finalize(cfg: PipelineConfig, out_dir: Path, tracker: Any) -> dict[str, Any]:
    """Read summary.json; return the stage outputs."""
    out_dir = Path(out_dir)
    path = out_dir / "summary.json"
    if not path.is_file():
        raise TrainSetupError(f"{path} is missing: the training ranks did not finish")
    summary = json.loads(path.read_text())
    if tracker is not None:
        tracker.log_dict(summary, "summary.json")
    keys = ("final_loss", "steps_done", "step_time_s", "tokens_per_s", "tflops_per_device",
            "mfu", "peak_memory_gb")
    outputs = {k: summary.get(k) for k in keys}
    outputs.update(checkpoint=summary.get("checkpoint"), summary=str(path.resolve()))
    curve = out_dir / "loss_curve.png"
    if curve.is_file():
        outputs["loss_curve"] = str(curve.resolve())
    return outputs


def run(cfg: PipelineConfig, inputs: dict[str, dict], out_dir: Path, tracker: Any) -> dict[str, Any]:
    """prepare + local torchrun launch + finalize."""
    prepared = prepare(cfg, inputs, out_dir, tracker)
    if prepared["nodes"] > 1:
        raise TrainSetupError(
            f"parallel.nodes={prepared['nodes']}: multi-node training is launched by the "
            "workflow with srun (site slurm/frontier), not by stages.train.run"
        )
    launch_local(prepared["spec"], prepared["nproc"], Path(out_dir) / "train.log")
    return finalize(cfg, out_dir, tracker)
