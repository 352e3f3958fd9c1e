"""What the system-metrics sampler costs a training step: trainer tokens/s with the node's
sampler on vs off, in one invocation.

One rank trains ``CPU_MODEL`` (``benchmarks/bench_train.py``'s) with per-step metrics going
to a real MLflow SQLite store, in alternating rounds: a round with the sampler
(``stages.mechanism.tracking.SystemMetricsSampler``, writing into the same run, every
``--interval`` seconds: 1 s by default, ten times ``tracking.system_metrics_interval_s``'s
default, so the cost measured is an upper bound), then a round without, so machine noise
hits both. ``overhead`` = 1 - tokens/s on / tokens/s off, from median step times (target:
below 0.01).

The last line printed is one JSON object; the same figures, with the commit and machine, go
to benchmarks/results/bench_system_metrics.json (nothing with --tiny).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.bench_train import CPU_MODEL, TINY_MODEL, make_tracker, trainer_steps
from benchmarks.results import RESULTS_DIR, report
from model.config import TrainConfig
from model.parallel.layout import Plan
from model.training.batches import SyntheticBatches
from model.training.metrics import BackgroundSink
from model.training.trainer import Trainer
from stages.mechanism.tracking import SystemMetricsSampler


def measure(args: argparse.Namespace, tmp: Path) -> dict:
    """Alternate rounds with and without the sampler; the medians and their ratio."""
    model_cfg = TINY_MODEL if args.tiny else CPU_MODEL
    seq = model_cfg.max_seq_len
    cfg = TrainConfig(steps=10**6, global_batch=args.batch, seq_len=seq, warmup_steps=2,
                      checkpoint_every=0, dtype="float32")
    plan = Plan(micro_batch=args.batch, grad_accum=1, sharding="none")
    tracker = make_tracker(tmp)
    trainer = Trainer(model_cfg, cfg, plan, tmp / "trainer",
                      lambda r, n: SyntheticBatches(model_cfg.vocab_size, seq, args.batch, r, n,
                                                    cfg.seed),
                      torch.device("cpu"), tracker=BackgroundSink(tracker))
    rounds = trainer_steps(trainer, args.steps)
    next(rounds)  # warm-up
    on_t: list[float] = []
    off_t: list[float] = []
    samples = 0
    for r in range(args.rounds):
        sampler = SystemMetricsSampler(tracker.uri, tracker.run_id, args.interval)
        on_t += next(rounds)
        sampler.stop()
        samples = sampler._monitor._logging_step  # samples logged so far (all rounds)
        off_t += next(rounds)
        print(f"[bench] round {r + 1}/{args.rounds}: sampler on "
              f"{statistics.median(on_t):.4f} s/step, off {statistics.median(off_t):.4f} s/step",
              flush=True)
    tokens = args.batch * seq
    on_tps, off_tps = tokens / statistics.median(on_t), tokens / statistics.median(off_t)
    return {"device": "cpu", "tokens_per_step": tokens, "steps_each": len(on_t),
            "interval_s": args.interval, "samples_logged": samples,
            "seconds_sampled": round(sum(on_t), 1),
            "tokens_per_s_on": on_tps, "tokens_per_s_off": off_tps,
            "overhead": 1 - on_tps / off_tps}


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure, print the JSON result last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (each: on, off)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke runs, tests)")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR),
                        help="where bench_system_metrics.json goes (not with --tiny)")
    args = parser.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="bench-system-metrics-") as tmp:
        result = measure(args, Path(tmp))
    dist.destroy_process_group()
    report("bench_system_metrics", result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
