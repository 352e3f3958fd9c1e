"""Per-rank measurement of several plans in one launch: ``python -m stages.measure_worker
--spec SPEC.json``.

Starting ranks costs seconds a launch on a small machine (interpreter, torch, the process
group), several times the steps of a small plan, and each launch lands differently on the
cores. So plans of one world size are measured here in one launch: the ranks join one process
group and run every plan of the spec's ``extra["plans"]`` (``Plan.to_dict()``s) for
``spec.steps`` steps of synthetic tokens, in ``extra["rounds"]`` rounds, each round in a
rotated order so that the machine's slow drift falls on every plan alike. Each plan is built
afresh in its own ``out_dir/plan<i>`` (the real ``Trainer``, no checkpoint, no tracking) and
freed before the next.

The rank that logs a plan's training appends one JSON line per (round, plan) to
``out_dir/MEASUREMENTS_FILE``: ``index``, ``round``, ``step_time_s`` (the trainer's median,
first step left out) and ``step_times_s`` (every step). A plan the trainer refuses (a
``ValueError`` from ``Plan.check``, raised alike on every rank before any collective) gets a
line with ``error`` and the others go on; anything else ends the launch.
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

from model.parallel.threads import CPU_RANK_THREADS, THREADS_VAR

MEASUREMENTS_FILE = "measurements.jsonl"


def round_order(n_plans: int, round_index: int) -> list[int]:
    """The plans' order in one round: rotated by the round, so each plan is first once in
    every ``n_plans`` rounds."""
    shift = round_index % n_plans if n_plans else 0
    return list(range(shift, n_plans)) + list(range(shift))


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


def run_spec(spec: Any) -> None:
    """Measure every plan of ``spec`` in this (already launched) rank."""
    import os

    os.environ.setdefault(THREADS_VAR, str(CPU_RANK_THREADS))
    import torch.distributed as dist

    from model.parallel.dist_env import from_environ, init_distributed
    from model.planner.plan import Plan
    from model.training.batches import synthetic_batch_factory
    from model.training.trainer import Trainer
    from stages.config import config_from_dict

    cfg = config_from_dict(spec.config)
    plans = [Plan.from_dict(raw) for raw in spec.extra["plans"]]
    rounds = int(spec.extra.get("rounds", 1))
    out = Path(spec.out_dir)
    records = out / MEASUREMENTS_FILE
    env = from_environ()
    device = init_distributed(env)
    train = cfg.train

    batches = synthetic_batch_factory(cfg.model.vocab_size, train)

    try:
        for r in range(rounds):
            for i in round_order(len(plans), r):
                try:
                    plans[i].check(cfg.model, train, env.world_size)
                except ValueError as refused:
                    if env.rank == 0:
                        _append(records, {"index": i, "round": r, "error": str(refused)})
                    continue
                trainer = Trainer(cfg.model, train, plans[i], out / f"plan{i}", batches, device,
                                  peak_tflops=spec.peak_tflops)
                summary = trainer.fit(spec.steps, save_final=False)
                if trainer.is_logger:
                    _append(records, {"index": i, "round": r, "plan": plans[i].describe(),
                                      "step_time_s": summary["step_time_s"],
                                      "step_times_s": trainer.step_times})
                del trainer, summary
                gc.collect()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``--spec PATH``."""
    from stages.launch import rank_main

    return rank_main(__doc__.splitlines()[0], run_spec, argv)


if __name__ == "__main__":
    sys.exit(main())
