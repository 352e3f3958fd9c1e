"""Per-rank training entry: ``python -m stages.train_worker --spec SPEC.json``.

Launched by torchrun locally or srun under Slurm (rank identity from either environment).
The spec holds the pipeline config, the plan, the token store (or null for synthetic
tokens), the output directory, the tracking run and an optional step override. Rank
(last pipeline stage, dp 0, tp 0) writes ``out_dir/summary.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import torch.distributed as dist

from model.parallel.dist_env import from_environ, init_distributed
from model.planner.plan import Plan
from model.training.batches import SyntheticBatches
from model.training.metrics import BackgroundSink
from model.training.trainer import Trainer
from stages.config import config_from_dict


def make_batch_factory(spec: dict[str, Any], cfg):
    """(dp_rank, dp_size) -> batch source: the token store's loader, or synthetic tokens."""
    train = cfg.train

    def factory(dp_rank: int, dp_size: int):
        if spec.get("store"):
            from data_prep.loader import TokenWindowLoader

            return TokenWindowLoader(spec["store"], "train", train.seq_len, train.global_batch,
                                     dp_rank, dp_size, train.seed)
        return SyntheticBatches(cfg.model.vocab_size, train.seq_len, train.global_batch,
                                dp_rank, dp_size, train.seed)

    return factory


def run_spec(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Train as described by ``spec`` in this (already launched) rank."""
    cfg = config_from_dict(spec["config"])
    plan = Plan.from_dict(spec["plan"])
    env = from_environ()
    plan.check(cfg.model, cfg.train, env.world_size)
    device = init_distributed(env)
    try:
        trainer = Trainer(cfg.model, cfg.train, plan, spec["out_dir"], make_batch_factory(spec, cfg),
                          device, peak_tflops=spec.get("peak_tflops"))
        tracking = spec.get("tracking")
        if tracking and trainer.is_logger:
            from stages.tracking import Tracker

            # Metric writes happen on a background thread, off the training step.
            trainer.tracker = BackgroundSink(Tracker(tracking["uri"], tracking["run_id"]))
        return trainer.fit(spec.get("steps"))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="path of the SPEC.json written by stages.train")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    run_spec(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
