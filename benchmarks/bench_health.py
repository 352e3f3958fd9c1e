"""What the step-health checks cost the trainer: tokens/s with them on over tokens/s with them off.

Two gloo ranks (data parallel, one process each, started here) each build two Trainers of the
same model on the same process group: one with the checks on (``train.step_checks``: the
per-step vote on the loss and gradient norm; ``train.slow_rank_every``: the gathering of the
ranks' busy times) and one with both off. They train in alternating rounds, so machine noise
hits both; ``health_ratio`` = on tokens/s / off tokens/s from the lower-quintile
whole-iteration time of each arm (target >= 0.98): on a shared machine other processes only
ever add time to a step, so a low quantile of many steps measures the code and the median
(``health_ratio_median``, also reported) measures the neighbours as well. No fault is
injected: this is the cost of a healthy run.

The last line printed is one JSON object; the same figures, with the commit and machine, go to
benchmarks/results/bench_health.json (nothing with --tiny).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.results import RESULTS_DIR, report
from model.config import ModelConfig, TrainConfig
from model.flops import param_count
from model.parallel.layout import Plan
from model.training.batches import SyntheticBatches
from model.training.trainer import Trainer

RANKS = 2
QUANTILE = 0.2  # of the iteration times each arm's tokens/s is taken from
CPU_MODEL = ModelConfig(family="llama", n_layers=4, d_model=128, n_heads=4, vocab_size=2048,
                        max_seq_len=128)
TINY_MODEL = ModelConfig(family="llama", n_layers=2, d_model=32, n_heads=4, vocab_size=256,
                         max_seq_len=32)


def make_trainer(args, model_cfg: ModelConfig, out: Path, checks: bool) -> Trainer:
    """A dp-2 Trainer of ``model_cfg`` with the step-health checks on or off."""
    seq = model_cfg.max_seq_len
    cfg = TrainConfig(steps=10**6, global_batch=args.batch, seq_len=seq, warmup_steps=2,
                      checkpoint_every=0, dtype="float32", step_checks=checks,
                      slow_rank_every=args.slow_every if checks else 0)
    plan = Plan(dp=RANKS, micro_batch=args.batch // RANKS, grad_accum=1, sharding="ddp")
    return Trainer(model_cfg, cfg, plan, out,
                   lambda r, n: SyntheticBatches(model_cfg.vocab_size, seq, args.batch, r, n,
                                                 cfg.seed),
                   torch.device("cpu"))


def rounds(trainer: Trainer, steps: int):
    """A generator running ``steps`` more steps per next(); yields their iteration times."""
    done = 0
    while True:
        done += steps
        trainer.fit(done, save_final=False)
        yield list(trainer.iteration_times)


def quantile(times: list[float], q: float) -> float:
    """The ``q`` quantile of ``times`` (nearest rank)."""
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rank_main(rank: int, args, tmp: str) -> None:
    """One rank: both trainers, alternating rounds; rank 0 writes the figures to tmp."""
    store = dist.FileStore(str(Path(tmp) / "store"), RANKS)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=RANKS)
    model_cfg = TINY_MODEL if args.tiny else CPU_MODEL
    on = rounds(make_trainer(args, model_cfg, Path(tmp) / "on", True), args.steps)
    off = rounds(make_trainer(args, model_cfg, Path(tmp) / "off", False), args.steps)
    next(on), next(off)  # warm-up round
    on_t: list[float] = []
    off_t: list[float] = []
    for r in range(args.rounds):
        first, second = (on, off) if r % 2 == 0 else (off, on)  # neither always goes first
        a, b = next(first), next(second)
        on_t += a if first is on else b
        off_t += b if first is on else a
        if rank == 0:
            print(f"[bench] round {r + 1}/{args.rounds}: checks on "
                  f"{quantile(on_t, QUANTILE):.4f} s/step, off {quantile(off_t, QUANTILE):.4f} "
                  f"s/step (lower quintiles so far)", flush=True)
    if rank == 0:
        tokens = args.batch * model_cfg.max_seq_len
        on_tps = tokens / quantile(on_t, QUANTILE)
        off_tps = tokens / quantile(off_t, QUANTILE)
        figures = {"ranks": RANKS, "params": param_count(model_cfg), "tokens_per_step": tokens,
                   "steps_each": len(on_t), "slow_rank_every": args.slow_every,
                   "checks_on_tokens_per_s": on_tps, "checks_off_tokens_per_s": off_tps,
                   "health_ratio": on_tps / off_tps,
                   "health_ratio_median": statistics.median(off_t) / statistics.median(on_t)}
        (Path(tmp) / "figures.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the two ranks, print the JSON result last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke runs, tests)")
    parser.add_argument("--steps", type=int, default=2, help="steps per round and arm")
    parser.add_argument("--rounds", type=int, default=60, help="alternating measurement rounds")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (both ranks)")
    parser.add_argument("--slow-every", type=int, default=10,
                        help="train.slow_rank_every with the checks on (default 10, more often "
                             "than the default 50 so that its gathering is in the figure)")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR),
                        help="where bench_health.json goes (not with --tiny)")
    args = parser.parse_args(argv)
    if args.batch % RANKS:
        parser.error(f"--batch must be a multiple of {RANKS} (one share per rank)")
    spawn_and_report("bench_health", rank_main, args)
    return 0


def spawn_and_report(name: str, rank_main, args) -> dict:
    """Run ``rank_main(rank, args, tmp)`` on ``RANKS`` spawned CPU processes; rank 0 leaves
    its figures in ``tmp/figures.json``; add the wall time and ``report`` them as ``name``."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        mp.start_processes(rank_main, (args, tmp), nprocs=RANKS, start_method="spawn")
        result = json.loads((Path(tmp) / "figures.json").read_text())
    result["wall_s"] = time.perf_counter() - started
    report(name, result, args)
    return result


if __name__ == "__main__":
    sys.exit(main())
