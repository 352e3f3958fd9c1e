"""Checks run before any training rank starts; each message says what to change."""
from __future__ import annotations

from pathlib import Path

from model.config import ModelConfig, ParallelConfig, TrainConfig
from model.planner.plan import Plan
from model.training import checkpoint as ckpt


class TrainSetupError(ValueError):
    """A training setup that cannot run (layout, batch, sequence, store or checkpoint)."""


def training_problems(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    plan: Plan,
    world_size: int,
    store_vocab: int | None = None,
) -> list[str]:
    """Every rule the combination breaks (empty when it can run)."""
    out = plan.problems(model_cfg, train_cfg, world_size)
    tp = plan.tp
    if model_cfg.vocab_size % tp:
        out.append(f"tp={tp} must divide model.vocab_size={model_cfg.vocab_size} "
                   f"(vocab-parallel embedding): round model.vocab_size up to a multiple of {tp}")
    if model_cfg.ffn_dim % tp:
        out.append(f"tp={tp} must divide the MLP size {model_cfg.ffn_dim} (model.ffn_hidden)")
    if train_cfg.global_batch % plan.dp:
        out.append(f"dp={plan.dp} must divide train.global_batch={train_cfg.global_batch}")
    if train_cfg.seq_len > model_cfg.max_seq_len:
        out.append(f"train.seq_len={train_cfg.seq_len} exceeds model.max_seq_len="
                   f"{model_cfg.max_seq_len}: lower train.seq_len or raise model.max_seq_len")
    if store_vocab is not None and store_vocab > model_cfg.vocab_size:
        out.append(f"the token store's vocabulary ({store_vocab}) exceeds model.vocab_size="
                   f"{model_cfg.vocab_size}: raise model.vocab_size")
    return out


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
    if checkpoint_root is not None:
        latest = ckpt.latest_checkpoint(checkpoint_root)
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
                recompute=par.recompute or "none", sequence_parallel=par.sequence_parallel)
