"""Per-rank training entry: ``python -m stages.train_worker --spec SPEC.json``.

Launched by ``stages.launch`` (torchrun locally, srun under Slurm; rank identity from either
environment). The ``RankSpec`` holds the pipeline config, the plan, the token store (or
None for synthetic tokens), the output directory, the tracking run and an optional step
override. Rank (last pipeline stage, dp 0, tp 0) writes ``out_dir/summary.json``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from model.parallel.threads import CPU_RANK_THREADS, THREADS_VAR

os.environ.setdefault(THREADS_VAR, str(CPU_RANK_THREADS))  # before torch starts its threads

import torch.distributed as dist

from model.parallel.dist_env import from_environ, init_distributed
from model.planner.plan import Plan
from model.training.batches import SyntheticBatches
from model.training.metrics import SPOOL_FILE, BackgroundSink
from model.training.trainer import Trainer
from stages.config import config_from_dict
from stages.launch import RankSpec, rank_main


def make_batch_factory(spec: RankSpec, cfg):
    """(dp_rank, dp_size) -> batch source: the token store's loader, or synthetic tokens."""
    train = cfg.train

    def factory(dp_rank: int, dp_size: int):
        if spec.store:
            from data_prep.loader import TokenWindowLoader

            return TokenWindowLoader(spec.store, "train", train.seq_len, train.global_batch,
                                     dp_rank, dp_size, train.seed)
        return SyntheticBatches(cfg.model.vocab_size, train.seq_len, train.global_batch,
                                dp_rank, dp_size, train.seed)

    return factory


def run_spec(spec: RankSpec) -> dict[str, Any] | None:
    """Train as described by ``spec`` in this (already launched) rank."""
    cfg = config_from_dict(spec.config)
    if spec.plan is None:
        raise ValueError(f"{spec.out_dir}: the training rank spec has no plan")
    plan = Plan.from_dict(spec.plan)
    env = from_environ()
    plan.check(cfg.model, cfg.train, env.world_size)
    device = init_distributed(env)
    try:
        trainer = Trainer(cfg.model, cfg.train, plan, spec.out_dir, make_batch_factory(spec, cfg),
                          device, peak_tflops=spec.peak_tflops)
        tracking = spec.tracking
        if tracking and trainer.is_logger:
            from stages.tracking import Tracker

            # A lost tracking server must not stall training: one short try per write (MLflow
            # retries for minutes by default); what fails is spooled and sent later.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
            # Metric writes happen on a background thread, off the training step.
            trainer.tracker = BackgroundSink(Tracker(tracking["uri"], tracking["run_id"]),
                                             spool=Path(spec.out_dir) / SPOOL_FILE)
        return trainer.fit(spec.steps)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``--spec PATH``."""
    return rank_main(__doc__.splitlines()[0], run_spec, argv)


if __name__ == "__main__":
    sys.exit(main())
