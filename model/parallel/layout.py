"""The parallel plan: how a training step is laid out over ranks (plan.json).

A ``Plan`` fixes the mesh (pp, dp, tp; tp varies fastest), the batch split
(micro_batch sequences per micro-batch per data-parallel rank, grad_accum micro-batches
per step), the pipeline schedule, data-parallel sharding and activation recompute (all
blocks, or with ``recompute_layers`` the first N blocks of each pipeline chunk).
``Plan.check`` enforces every rule the trainer relies on and raises ``PlanError``
(a ``ValueError``) naming the factors involved and what to change. The rules are the
``*_problems`` functions below, one per group of factors; the search applies the same
functions while it enumerates, so it never emits a plan that training refuses.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from data_prep.atomic import write_text_atomic
from model.config import ParallelConfig

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
SHARDINGS = ("zero3", "zero2", "ddp", "none")
RECOMPUTES = ("none", "selective", "full")
CHOICES = {"schedule": SCHEDULES, "sharding": SHARDINGS, "recompute": RECOMPUTES}
"""The plan fields that take one of a few names, and their names."""


def check_choice(name: str, value: Any) -> None:
    """PlanError unless plan field ``name`` (one of ``CHOICES``) holds one of its names.

    ZeRO-1 is zero2 here: FSDP2 with gradient sync on a step's last micro-batch is the same
    once-per-step reduce-scatter over sharded optimizer states and keeps less (the full
    gradients are freed after it), so a plan that names it is refused with that advice."""
    if name == "sharding" and str(value).lower().replace("-", "") == "zero1":
        raise PlanError(f"plan.sharding={value!r} is not a mode of its own here: use zero2, "
                        "which shards the optimizer states and reduce-scatters the accumulated "
                        "gradients once per step as ZeRO-1 does (Megatron's distributed "
                        "optimizer), and frees the full gradients after it")
    if value not in CHOICES[name]:
        raise PlanError(f"plan.{name}={value!r} is not one of {CHOICES[name]}")


FIGURES_KEY = "figures"
"""plan.json's record of where the cluster's figures came from (not a plan field)."""


class PlanError(ValueError):
    """A plan that cannot run for this model, batch and world size; the message says why."""


@dataclass
class Plan:
    """One parallel layout of a training step (see module docstring)."""

    tp: int = 1
    """Tensor-parallel degree (innermost mesh dim: neighbouring ranks)."""
    pp: int = 1
    """Pipeline-parallel degree (outermost mesh dim)."""
    dp: int = 1
    """Data-parallel degree (middle mesh dim)."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (the pipeline's n_microbatches when pp > 1)."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b or interleaved_1f1b."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (> 1 only for interleaved_1f1b)."""
    sharding: str = "zero3"
    """Data-parallel sharding: zero3, zero2, ddp or none (none needs dp == 1)."""
    recompute: str = "none"
    """Activation recompute: none, selective or full."""
    recompute_layers: int = 0
    """With recompute full: recompute only the first N blocks of each pipeline chunk (each
    model chunk a rank holds; the whole model without pipelining); 0 recomputes every block."""
    sequence_parallel: bool = False
    """Shard norm/dropout activations along the sequence over the tp group (needs tp > 1)."""
    predictions: dict[str, float] = field(default_factory=dict)
    """Model predictions: step_time_s, tokens_per_s, tflops_per_device, mfu,
    memory_gb_per_device."""

    # --- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        out = asdict(self)
        out["predictions"] = {k: float(v) for k, v in self.predictions.items()}
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Plan:
        """Build a plan from a mapping; unknown keys or bad values raise PlanError."""
        if not isinstance(raw, dict):
            raise PlanError(f"a plan must be a mapping, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise PlanError(f"unknown plan keys {unknown}; allowed: {sorted(known)}")
        plan = cls(**raw)
        plan.validate_fields()
        return plan

    def to_json(self, path: str | Path, figures: dict[str, Any] | None = None) -> Path:
        """Write plan.json atomically (data_prep.atomic); ``figures``, where the cluster's
        figures came from (``model.planner.choose.figures_record``), goes beside the fields."""
        out = self.to_dict() | ({FIGURES_KEY: figures} if figures is not None else {})
        return write_text_atomic(path, json.dumps(out, indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> Plan:
        """Read a plan.json written by ``to_json``."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"cannot read plan file {path}: {exc}") from exc
        try:
            if isinstance(raw, dict):
                raw = {k: v for k, v in raw.items() if k != FIGURES_KEY}  # about, not of, it
            return cls.from_dict(raw)
        except PlanError as exc:
            raise PlanError(f"{path}: {exc}") from exc

    # --- derived quantities --------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def key(self) -> tuple:
        """Identity of the layout, without predictions (for dedup and comparisons)."""
        return (self.tp, self.pp, self.dp, self.micro_batch, self.grad_accum, self.schedule,
                self.virtual_stages, self.sharding, self.recompute, self.recompute_layers,
                self.sequence_parallel)

    def describe(self) -> str:
        """A short one-line label, e.g. 'tp2 pp4 dp8 mb1 ga16 1f1b zero2 selective'; partial
        recompute shows its block count ('full3': the first 3 blocks of each chunk)."""
        sched = self.schedule if self.pp > 1 else "-"
        if self.schedule == "interleaved_1f1b":
            sched = f"il{self.virtual_stages}"
        sp = " sp" if self.sequence_parallel else ""
        rec = self.recompute + (str(self.recompute_layers) if self.recompute_layers else "")
        return (f"tp{self.tp} pp{self.pp} dp{self.dp} mb{self.micro_batch} ga{self.grad_accum} "
                f"{sched} {self.sharding} {rec}{sp}")

    # --- validation ----------------------------------------------------------------------
    def validate_fields(self) -> None:
        """Check each field on its own (types and allowed values)."""
        for name in INTEGER_FIELDS:
            value, least = getattr(self, name), 0 if name in COUNT_FIELDS else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise PlanError(f"plan.{name} must be an integer >= {least}, got {value!r}")
        for name in CHOICES:
            check_choice(name, getattr(self, name))
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(
                f"plan.sequence_parallel must be true/false, got {self.sequence_parallel!r}"
            )
        if not isinstance(self.predictions, dict):
            raise PlanError("plan.predictions must be a mapping")

    def problems(self, model_cfg: Any, train_cfg: Any, world_size: int) -> list[str]:
        """Every rule this plan breaks for the model, training batch and world size.

        The one statement of plan validity: the search (model.planner.search) applies the
        same rule functions below while it enumerates, and training refuses what they refuse.
        """
        try:
            self.validate_fields()
        except PlanError as exc:
            return [str(exc)]
        kv = getattr(model_cfg, "kv_heads", None) or getattr(model_cfg, "n_kv_heads", None) \
            or model_cfg.n_heads
        dims = {"n_heads": model_cfg.n_heads, "kv_heads": kv, "vocab": model_cfg.vocab_size,
                "ffn": model_cfg.ffn_dim}
        return [
            *world_problems(self.tp, self.pp, self.dp, world_size, **dims),
            *tp_problems(self.tp, **dims),
            *pipeline_problems(self.pp, self.virtual_stages, model_cfg.n_layers),
            *batch_problems(self.micro_batch, self.grad_accum, self.dp, train_cfg.global_batch),
            *schedule_problems(self.schedule, self.pp, self.grad_accum, self.virtual_stages),
            *sharding_problems(self.sharding, self.dp, self.tp),
            *recompute_problems(self.recompute, self.recompute_layers, model_cfg.n_layers,
                                self.pp * self.virtual_stages),
            *sequence_parallel_problems(self.sequence_parallel, self.tp, train_cfg.seq_len),
            *sequence_length_problems(train_cfg.seq_len, model_cfg.max_seq_len),
        ]

    def check(self, model_cfg: Any, train_cfg: Any, world_size: int) -> None:
        """Raise PlanError listing every broken rule (factor names and values)."""
        found = self.problems(model_cfg, train_cfg, world_size)
        if found:
            raise PlanError(f"plan {self.describe()} is invalid: " + "; ".join(found))


# --- the rules -------------------------------------------------------------------------
# Each returns the broken rules (empty when none) for the factors it names. Plan.problems
# applies all of them; the search applies each where it enumerates that factor.

def tp_problems(tp: int, n_heads: int, kv_heads: int, vocab: int, ffn: int) -> list[str]:
    """tp must divide the heads, the key/value heads, the vocabulary and the MLP width."""
    out = []
    if n_heads % tp:
        out.append(f"tp={tp} must divide model.n_heads={n_heads}")
    elif kv_heads % tp:
        out.append(f"tp={tp} must divide the key/value heads ({kv_heads})")
    if vocab % tp:
        out.append(f"tp={tp} must divide model.vocab_size={vocab} (vocab-parallel embedding): "
                   f"round model.vocab_size up to a multiple of {tp}")
    if ffn % tp:
        out.append(f"tp={tp} must divide the MLP size {ffn} (model.ffn_hidden)")
    return out


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tp_choices(world: int, n_heads: int, kv_heads: int, vocab: int, ffn: int) -> list[int]:
    """The tensor-parallel degrees that divide ``world`` and pass ``tp_problems``."""
    return [t for t in divisors(world) if not tp_problems(t, n_heads, kv_heads, vocab, ffn)]


def world_problems(tp: int, pp: int, dp: int, world: int, n_heads: int, kv_heads: int,
                   vocab: int, ffn: int) -> list[str]:
    """pp*dp*tp must equal the world size; a tp that cannot divide it says which would."""
    if pp * dp * tp == world:
        return []
    msg = f"pp*dp*tp = {pp}*{dp}*{tp} = {pp * dp * tp} must equal the world size {world}"
    if world % tp:
        msg += (f" (tp={tp} does not divide {world}; on {world} devices tp can be "
                f"{tp_choices(world, n_heads, kv_heads, vocab, ffn)})")
    return [msg]


def pipeline_problems(pp: int, virtual_stages: int, n_layers: int) -> list[str]:
    """Every pipeline chunk needs at least one layer. (Tied embeddings split too: the last
    stage holds a copy of the embedding kept equal by the trainer, model.parallel.pipeline.)"""
    chunks = pp * virtual_stages
    if chunks > n_layers:
        return [(f"pp*virtual_stages = {pp}*{virtual_stages} = {chunks} must be at most "
                 f"model.n_layers={n_layers} (one layer per stage at least)")]
    return []


def batch_problems(micro_batch: int, grad_accum: int, dp: int, global_batch: int) -> list[str]:
    """dp must divide the global batch, and micro_batch*grad_accum*dp must make it up."""
    out = []
    if global_batch % dp:
        out.append(f"dp={dp} must divide train.global_batch={global_batch}")
    gb = micro_batch * grad_accum * dp
    if gb != global_batch:
        out.append(f"micro_batch*grad_accum*dp = {micro_batch}*{grad_accum}*{dp} = {gb} must "
                   f"equal train.global_batch={global_batch}")
    return out


def schedule_problems(schedule: str, pp: int, grad_accum: int, virtual_stages: int) -> list[str]:
    """The torch pipelining rules of each schedule."""
    out = []
    if schedule == "interleaved_1f1b":
        if virtual_stages < 2 or pp < 2:
            out.append(f"schedule interleaved_1f1b needs virtual_stages > 1 and pp > 1 "
                       f"(got virtual_stages={virtual_stages}, pp={pp}); use 1f1b")
        else:
            rounds = max(1, grad_accum // pp)
            if grad_accum % rounds:
                out.append(f"interleaved_1f1b needs grad_accum={grad_accum} to be a "
                           f"multiple of grad_accum//pp={rounds} (torch pipelining rule)")
    elif virtual_stages != 1:
        out.append(f"virtual_stages={virtual_stages} needs schedule interleaved_1f1b")
    if schedule == "1f1b" and pp > 1 and grad_accum < pp:
        out.append(f"schedule 1f1b needs grad_accum={grad_accum} >= pp={pp} "
                   f"(torch pipelining rule); raise grad_accum or use gpipe")
    return out


def sharding_problems(sharding: str, dp: int, tp: int) -> list[str]:
    """'none' needs dp == 1; 'ddp' cannot wrap a tensor-parallel model."""
    out = []
    if sharding == "none" and dp > 1:
        out.append(f"sharding 'none' needs dp=1 (got dp={dp}); use ddp, zero2 or zero3")
    if sharding == "ddp" and tp > 1:
        out.append(f"sharding 'ddp' cannot wrap a tp={tp} model (DTensor parameters); "
                   f"use zero2 (FSDP2 without reshard) or zero3")
    return out


def recompute_problems(recompute: str, recompute_layers: int, n_layers: int,
                       chunks: int) -> list[str]:
    """Partial recompute (recompute_layers N > 0) needs recompute full and N below the layers
    of the smallest pipeline chunk (N equal to them would be full recompute: use 0)."""
    if recompute_layers == 0:
        return []
    if recompute != "full":
        return [f"recompute_layers={recompute_layers} needs recompute=full (got "
                f"recompute={recompute}): set recompute=full or recompute_layers=0"]
    smallest = n_layers // max(chunks, 1)  # stage_layers's split: the last chunks are smallest
    if 0 < smallest <= recompute_layers:  # no layer per chunk: pipeline_problems says so
        return [f"recompute_layers={recompute_layers} must be smaller than the {smallest} layers "
                f"of the smallest pipeline chunk (model.n_layers={n_layers} over "
                f"pp*virtual_stages={chunks} chunks): use recompute_layers=0 to recompute "
                f"every block, or a smaller count"]
    return []


def sequence_parallel_problems(sequence_parallel: bool, tp: int, seq_len: int) -> list[str]:
    """Sequence parallelism needs tp > 1 dividing the sequence length."""
    if not sequence_parallel:
        return []
    if tp < 2:
        return ["sequence_parallel needs tp > 1"]
    if seq_len % tp:
        return [f"sequence_parallel needs tp={tp} to divide train.seq_len={seq_len}"]
    return []


def sequence_length_problems(seq_len: int, max_seq_len: int) -> list[str]:
    """Training sequences must fit the model's rotary table."""
    if seq_len > max_seq_len:
        return [(f"train.seq_len={seq_len} exceeds model.max_seq_len={max_seq_len}: lower "
                 f"train.seq_len or raise model.max_seq_len")]
    return []


def stage_layers(n_layers: int, n_chunks: int) -> list[list[int]]:
    """Split layer ids 0..n_layers-1 into n_chunks contiguous, near-equal chunks.

    The first (n_layers % n_chunks) chunks get one extra layer. Chunk c runs on pipeline
    rank c % pp (looped placement used by interleaved schedules; c == rank when v == 1).
    """
    if not 1 <= n_chunks <= n_layers:
        raise PlanError(f"cannot split {n_layers} layers into {n_chunks} pipeline chunks")
    base, extra = divmod(n_layers, n_chunks)
    out, start = [], 0
    for c in range(n_chunks):
        size = base + (1 if c < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


LAYOUT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Plan) if f.name != "predictions")
"""Every field of a layout, in Plan order: the one list the search, the CLI and the reports use."""
FIELD_TYPES: dict[str, type] = {f.name: {"int": int, "str": str, "bool": bool}[f.type]
                                for f in fields(Plan) if f.name in LAYOUT_FIELDS}
"""Each layout field's type (``--fix NAME=VALUE`` parses by it)."""
INTEGER_FIELDS: tuple[str, ...] = tuple(n for n, t in FIELD_TYPES.items() if t is int)
COUNT_FIELDS: tuple[str, ...] = ("recompute_layers",)
"""The integer fields for which 0 is allowed (a count; the other integers are degrees >= 1)."""
CONFIG_FIELDS: tuple[str, ...] = tuple(n for n in LAYOUT_FIELDS
                                       if n in {f.name for f in fields(ParallelConfig)})
"""The layout fields a config's ``parallel`` section can fix (grad_accum follows the batch)."""
