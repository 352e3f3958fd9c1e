"""What validation in the loop costs a training at a preset's defaults: the same run with
``train.eval_every`` on and off, in one invocation.

Two gloo ranks (data parallel, one process each, started here, the preset's plan when it has
two ranks: DDP) each build two Trainers of the preset's model and training settings
(``configs/<preset>.yaml``, default tiny) on one process group: one validating every
``train.eval_every`` steps on ``train.eval_tokens`` tokens, one never. They train in
alternating rounds of ``eval_every`` steps (so each round of the validating arm ends with
exactly one validation, as a run does every ``eval_every`` steps), so machine noise hits
both. ``validation_overhead`` = (the validating arm's median round time) / (the other's)
- 1, the fraction of training time validation adds (target: at most 0.05). Also reported:
``validation_s`` (median seconds of one validation) and ``step_s`` (median step time of the
other arm), and ``preset_overhead`` = the preset's validations per run x validation_s over
its steps x step_s (the same fraction, priced from its parts).

The validation slice is held-out synthetic sequences of ``eval_tokens`` tokens
(``model.training.validation.ValidationSet.synthetic``): the same windows, batch and forward
as a store's split, without needing a tokenized store; the training tokens are synthetic too.

The last line printed is one JSON object; the same figures, with the commit and machine, go to
benchmarks/results/bench_validation.json (nothing with --tiny).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.bench_health import RANKS, rounds, spawn_and_report
from benchmarks.results import RESULTS_DIR
from model.config import ModelConfig, TrainConfig
from model.parallel.layout import Plan
from model.training.batches import SyntheticBatches
from model.training.trainer import RunHooks, Trainer
from model.training.validation import ValidationSet
from stages.config import load_config


def make_trainer(model_cfg: ModelConfig, cfg: TrainConfig, out: Path, validate: bool) -> Trainer:
    """A dp-2 Trainer of the preset, validating every ``cfg.eval_every`` steps or never."""
    cfg = replace(cfg, steps=10**6, checkpoint_every=0, eval_every=cfg.eval_every * validate)
    plan = Plan(dp=RANKS, micro_batch=cfg.global_batch // RANKS, grad_accum=1, sharding="ddp")
    data = ValidationSet.synthetic(model_cfg.vocab_size, cfg.seq_len, cfg.eval_tokens, cfg.seed)
    return Trainer(model_cfg, cfg, plan, out,
                   lambda r, n: SyntheticBatches(model_cfg.vocab_size, cfg.seq_len,
                                                 cfg.global_batch, r, n, cfg.seed),
                   torch.device("cpu"), hooks=RunHooks(validation=data if validate else None))


def rank_main(rank: int, args, tmp: str) -> None:
    """One rank: both trainers, alternating rounds; rank 0 writes the figures to tmp."""
    store = dist.FileStore(str(Path(tmp) / "store"), RANKS)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=RANKS)
    preset = load_config(args.preset)
    model_cfg, cfg = preset.model, preset.train
    if args.tiny:  # a smoke run of the code path: few steps, a small slice
        cfg = replace(cfg, eval_every=2, eval_tokens=cfg.seq_len * 2)
    every = cfg.eval_every
    on_trainer = make_trainer(model_cfg, cfg, Path(tmp) / "on", True)
    on = rounds(on_trainer, every)
    off_trainer = make_trainer(model_cfg, cfg, Path(tmp) / "off", False)
    off = rounds(off_trainer, every)
    next(on), next(off)  # warm-up round
    on_rounds: list[float] = []
    off_rounds: list[float] = []
    step_times: list[float] = []
    for r in range(args.rounds):
        first, second = (on, off) if r % 2 == 0 else (off, on)  # neither always goes first
        a, b = sum(next(first)), sum(next(second))
        on_rounds.append(a if first is on else b)
        off_rounds.append(b if first is on else a)
        step_times += off_trainer.step_times
        if rank == 0:
            print(f"[bench] round {r + 1}/{args.rounds} ({every} steps): validating "
                  f"{on_rounds[-1]:.3f} s, not {off_rounds[-1]:.3f} s", flush=True)
    if rank == 0:
        seconds = [e["seconds"] for e in on_trainer.val_history[1:]]  # not the warm-up's
        validation_s = statistics.median(seconds) if seconds else None
        step_s = statistics.median(step_times)
        runs = preset.train.steps // preset.train.eval_every + bool(
            preset.train.steps % preset.train.eval_every)
        figures = {
            "preset": args.preset, "ranks": RANKS, "steps": preset.train.steps,
            "eval_every": every, "eval_tokens": cfg.eval_tokens,
            "validations_per_run": runs, "rounds": args.rounds,
            "round_s_validating": statistics.median(on_rounds),
            "round_s_not": statistics.median(off_rounds),
            "validation_overhead": statistics.median(on_rounds) / statistics.median(off_rounds)
            - 1, "validation_s": validation_s, "step_s": step_s,
            "preset_overhead": (runs * validation_s / (preset.train.steps * step_s)
                                if validation_s else None)}
        (Path(tmp) / "figures.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the two ranks, print the JSON result last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="configs/<preset>.yaml (default tiny)")
    parser.add_argument("--tiny", action="store_true",
                        help="a smoke run (validation every 2 steps; figures not recorded)")
    parser.add_argument("--rounds", type=int, default=6,
                        help="alternating rounds of eval_every steps per arm")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR),
                        help="where bench_validation.json goes (not with --tiny)")
    args = parser.parse_args(argv)
    spawn_and_report("bench_validation", rank_main, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
