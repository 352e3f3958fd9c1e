"""Checks run before any training rank starts; each message says what to change."""
from __future__ import annotations

from pathlib import Path

from model.config import ModelConfig, ParallelConfig, TrainConfig, vocab_fit_problem
from model.parallel.layout import Plan


class TrainSetupError(ValueError):
    """A training setup that cannot run (layout, batch, sequence, store or checkpoint)."""


def training_problems(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    plan: Plan,
    world_size: int,
    store_vocab: int | None = None,
) -> list[str]:
    """Every rule the combination breaks (empty when it can run): the plan's rules
    (``Plan.problems``, the same the planner searches with) and the store's vocabulary."""
    out = plan.problems(model_cfg, train_cfg, world_size)
    vocab = vocab_fit_problem(store_vocab, model_cfg.vocab_size)
    return out + ([vocab] if vocab else [])


def validate_training(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    plan: Plan,
    world_size: int,
    store_vocab: int | None = None,
    checkpoint_root: str | Path | None = None,
) -> None:
    """Raise TrainSetupError naming every problem, including a checkpoint of another shape."""
    problems = training_problems(model_cfg, train_cfg, plan, world_size, store_vocab)
    if checkpoint_root is not None and any(Path(checkpoint_root).glob("*")):
        # torch: only where there may be a checkpoint (a fresh training's driver imports none)
        from model.training import checkpoint as ckpt

        # Names and sizes only: the ranks check the shards' checksums when they resume.
        latest = ckpt.latest_checkpoint(checkpoint_root, checksum_limit=0)
        if latest is not None:
            try:
                ckpt.check_model_shape(latest, model_cfg)
            except ckpt.CheckpointError as err:
                problems.append(str(err))
    if problems:
        raise TrainSetupError(f"cannot train with plan {plan.describe()}: " + "; ".join(problems))


def plan_from_parallel(par: ParallelConfig, train_cfg: TrainConfig) -> Plan:
    """A plan from explicit parallel.* settings (used when no plan stage ran).

    Unset degrees default to tp=1, pp=1, dp=nproc/(tp*pp); micro_batch defaults to the
    whole per-rank batch (grad_accum 1), or pp micro-batches when pipelining.
    """
    tp, pp = par.tp or 1, par.pp or 1
    dp = par.dp or max(1, par.nproc // (tp * pp))
    per_rank = max(1, train_cfg.global_batch // dp)
    micro = par.micro_batch or (max(1, per_rank // pp) if pp > 1 else per_rank)
    schedule = par.schedule or ("interleaved_1f1b" if (par.virtual_stages or 1) > 1 else "1f1b")
    return Plan(tp=tp, pp=pp, dp=dp, micro_batch=micro, grad_accum=max(1, per_rank // micro),
                schedule=schedule, virtual_stages=par.virtual_stages or 1,
                sharding=par.sharding or ("zero3" if dp > 1 else "none"),
                recompute=par.recompute or "none", recompute_layers=par.recompute_layers or 0,
                sequence_parallel=par.sequence_parallel)
