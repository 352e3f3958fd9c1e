"""What validation in the loop costs a training at a preset's defaults: the same run with
``train.eval_every`` on and off, in one invocation.

Two gloo ranks (data parallel, one process each, started here, the preset's plan when it has
two ranks: DDP) build one Trainer of the preset's model and training settings
(``configs/<preset>.yaml``, default tiny) and train it in rounds of ``train.eval_every`` steps,
alternately validating at the round's end (on ``train.eval_tokens`` tokens, as a run does every
``eval_every`` steps) and not: the same model, memory and process in both arms (two Trainers
side by side differed by 10 % in step time, the validating one faster), and machine noise hits
both. The headline, ``validation_overhead``, is the fraction of the run's training time its
validations add: the preset's validations per run x the median validation (``validation_s``)
over its steps x the step time of the rounds without validation (``step_s``), both measured
here (target: at most 0.05). Step times are lower quintiles
(``benchmarks.bench_health.QUANTILE``): on a shared machine other processes only ever add time,
so a low quantile of many steps measures the code. That a validation slows no training step is
checked, not assumed: ``step_ratio`` is the validating rounds' step time over the others' (1
within the machine's noise). Also reported: the median round times and their ratio
(``round_ratio``, which carries that noise in full).

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

from benchmarks.bench_health import QUANTILE, RANKS, quantile, rounds, spawn_and_report
from benchmarks.results import RESULTS_DIR
from model.config import ModelConfig, TrainConfig
from model.parallel.layout import Plan
from model.training.batches import SyntheticBatches
from model.training.trainer import RunHooks, Trainer
from model.training.validation import ValidationSet
from stages.config import load_config


def make_trainer(model_cfg: ModelConfig, cfg: TrainConfig, out: Path, validate: bool) -> Trainer:
    """A dp-2 Trainer of the preset, validating every ``cfg.eval_every`` steps or never (its
    ``validation`` may be switched between rounds)."""
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
    trainer = make_trainer(model_cfg, cfg, Path(tmp) / "run", True)
    data = trainer.validation
    steps = rounds(trainer, every)

    def round_of(validating: bool) -> tuple[float, list[float]]:
        trainer.validation = data if validating else None
        return sum(next(steps)), list(trainer.step_times)

    round_of(True), round_of(False)  # warm-up rounds
    on_rounds: list[float] = []
    off_rounds: list[float] = []
    on_steps: list[float] = []
    off_steps: list[float] = []
    for r in range(args.rounds):
        for validating in ((True, False) if r % 2 == 0 else (False, True)):
            seconds, step_times = round_of(validating)
            (on_rounds if validating else off_rounds).append(seconds)
            (on_steps if validating else off_steps).extend(step_times)
        if rank == 0:
            print(f"[bench] round {r + 1}/{args.rounds} ({every} steps): validating "
                  f"{on_rounds[-1]:.3f} s, not {off_rounds[-1]:.3f} s", flush=True)
    if rank == 0:
        seconds = [e["seconds"] for e in trainer.val_history[1:]]  # not the warm-up's
        validation_s = statistics.median(seconds)
        step_on, step_off = quantile(on_steps, QUANTILE), quantile(off_steps, QUANTILE)
        runs = -(-preset.train.steps // preset.train.eval_every)
        figures = {
            "preset": args.preset, "ranks": RANKS, "steps": preset.train.steps,
            "eval_every": every, "eval_tokens": cfg.eval_tokens,
            "validations_per_run": runs, "rounds": args.rounds,
            "validation_overhead": runs * validation_s / (preset.train.steps * step_off),
            "validation_s": validation_s, "step_s": step_off, "step_ratio": step_on / step_off,
            "round_s_validating": statistics.median(on_rounds),
            "round_s_not": statistics.median(off_rounds),
            "round_ratio": statistics.median(on_rounds) / statistics.median(off_rounds)}
        (Path(tmp) / "figures.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the two ranks, print the JSON result last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="configs/<preset>.yaml (default tiny)")
    parser.add_argument("--tiny", action="store_true",
                        help="a smoke run (validation every 2 steps; figures not recorded)")
    parser.add_argument("--rounds", type=int, default=8,
                        help="alternating rounds of eval_every steps per arm")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR),
                        help="where bench_validation.json goes (not with --tiny)")
    args = parser.parse_args(argv)
    spawn_and_report("bench_validation", rank_main, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
