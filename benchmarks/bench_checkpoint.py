"""Checkpoint overhead on training: no checkpoints vs synchronous vs background (async) saves.

One process, one CPU rank: the same model, batches and optimizer are trained three ways in
one invocation (``Trainer.fit`` each time, a fresh output directory per run), the modes
alternating in rounds so machine noise hits all three:

- ``none``: no checkpoint;
- ``sync``: a checkpoint every ``--every`` steps (``train.checkpoint_every``), written
  before training continues;
- ``async``: the same with ``train.async_checkpoint`` (host-memory staging, a writer thread).

A run's training time is its loop: every iteration (step, logging) plus the time saves held
training up (``Trainer.checkpoint_seconds``: staging, waiting for an earlier background
save, publishing), including the wait for a save still in flight when the run ends. Runs
stop half an interval after their last save. ``sync_overhead`` / ``async_overhead`` are
(median training time per step with checkpoints) / (without) - 1, over the rounds.

The last line printed is one JSON object; the same figures, with the commit and machine, go
to benchmarks/results/bench_checkpoint.json (nothing with --tiny).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.results import RESULTS_DIR, report
from model.config import ModelConfig, TrainConfig
from model.flops import param_count
from model.parallel.layout import Plan
from model.training.batches import SyntheticBatches
from model.training.trainer import Trainer

# ~5M parameters: a checkpoint (weights + two AdamW moments, fp32) of ~60 MB.
CPU_MODEL = ModelConfig(family="llama", n_layers=4, d_model=256, n_heads=4, vocab_size=4096,
                        max_seq_len=128)
TINY_MODEL = ModelConfig(family="llama", n_layers=2, d_model=32, n_heads=4, vocab_size=256,
                         max_seq_len=32)
MODES = ("none", "sync", "async")


def train_once(mode: str, model_cfg: ModelConfig, args: argparse.Namespace, out: Path) -> dict:
    """One fresh training run in ``mode``; its loop time per step and checkpoint time."""
    seq = model_cfg.max_seq_len
    cfg = TrainConfig(steps=10**6, global_batch=args.batch, seq_len=seq, warmup_steps=2,
                      checkpoint_every=0 if mode == "none" else args.every, keep_last=1,
                      async_checkpoint=mode == "async", dtype="float32")
    plan = Plan(micro_batch=args.batch, grad_accum=1, sharding="none")
    trainer = Trainer(model_cfg, cfg, plan, out,
                      lambda r, n: SyntheticBatches(model_cfg.vocab_size, seq, args.batch, r, n,
                                                    cfg.seed),
                      torch.device("cpu"))
    trainer.fit(args.steps, save_final=False)
    held = sum(trainer.checkpoint_seconds)
    loop = sum(trainer.iteration_times) + held
    return {"s_per_step": loop / args.steps, "checkpoint_s": held,
            "saves": len(list((out / "checkpoints").glob("step-*")))}


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the rounds, print the JSON result last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke runs, tests)")
    parser.add_argument("--every", type=int, default=6, help="steps between checkpoints")
    parser.add_argument("--saves", type=int, default=3, help="checkpoints per run")
    parser.add_argument("--rounds", type=int, default=2, help="alternating measurement rounds")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR),
                        help="where bench_checkpoint.json goes (not with --tiny)")
    args = parser.parse_args(argv)
    # Stop half an interval after the last save, as a long run sits between two saves.
    args.steps = args.every * args.saves + args.every // 2
    model_cfg = TINY_MODEL if args.tiny else CPU_MODEL
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as tmp:
        train_once("none", model_cfg, args, Path(tmp) / "warm-up")  # first-call costs
        for r in range(args.rounds):
            for mode in MODES:
                runs[mode].append(train_once(mode, model_cfg, args, Path(tmp) / f"{mode}-{r}"))
            print(f"[bench] round {r + 1}/{args.rounds}: " + ", ".join(
                f"{m} {runs[m][-1]['s_per_step']:.4f} s/step" for m in MODES), flush=True)
    dist.destroy_process_group()
    per_step = {m: statistics.median(x["s_per_step"] for x in runs[m]) for m in MODES}
    result = {"device": "cpu", "params": param_count(model_cfg), "steps_per_run": args.steps,
              "checkpoint_every": args.every, "rounds": args.rounds,
              **{f"{m}_s_per_step": per_step[m] for m in MODES},
              "sync_checkpoint_s": statistics.median(x["checkpoint_s"] for x in runs["sync"]),
              "async_checkpoint_s": statistics.median(x["checkpoint_s"] for x in runs["async"]),
              "sync_overhead": per_step["sync"] / per_step["none"] - 1,
              "async_overhead": per_step["async"] / per_step["none"] - 1,
              "async_vs_sync": per_step["async"] / per_step["sync"]}
    report("bench_checkpoint", result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
