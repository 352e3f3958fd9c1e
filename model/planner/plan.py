"""The parallel plan: how a training step is laid out over ranks (plan.json).

A ``Plan`` fixes the mesh (pp, dp, tp; tp varies fastest), the batch split
(micro_batch sequences per micro-batch per data-parallel rank, grad_accum micro-batches
per step), the pipeline schedule, data-parallel sharding and activation recompute.
``Plan.check`` enforces every rule the trainer relies on and raises ``PlanError``
(a ``ValueError``) naming the factors involved and what to change.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
SHARDINGS = ("zero3", "zero2", "ddp", "none")
RECOMPUTES = ("none", "selective", "full")
PREDICTION_KEYS = ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "memory_gb_per_device")


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
    sequence_parallel: bool = False
    """Shard norm/dropout activations along the sequence over the tp group (needs tp > 1)."""
    predictions: dict[str, float] = field(default_factory=dict)
    """Model predictions: step_time_s, tokens_per_s, tflops_per_device, mfu, memory_gb_per_device."""

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

    def to_json(self, path: str | Path) -> Path:
        """Write plan.json atomically (temp file, then os.replace)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".plan-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(self.to_dict(), fh, indent=2, sort_keys=True)
                fh.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def from_json(cls, path: str | Path) -> Plan:
        """Read a plan.json written by ``to_json``."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"cannot read plan file {path}: {exc}") from exc
        try:
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
                self.virtual_stages, self.sharding, self.recompute, self.sequence_parallel)

    def describe(self) -> str:
        """A short one-line label, e.g. 'tp2 pp4 dp8 mb1 ga16 1f1b zero2 sel'."""
        sched = self.schedule if self.pp > 1 else "-"
        if self.schedule == "interleaved_1f1b":
            sched = f"il{self.virtual_stages}"
        sp = " sp" if self.sequence_parallel else ""
        return (f"tp{self.tp} pp{self.pp} dp{self.dp} mb{self.micro_batch} ga{self.grad_accum} "
                f"{sched} {self.sharding} {self.recompute}{sp}")

    # --- validation ----------------------------------------------------------------------
    def validate_fields(self) -> None:
        """Check each field on its own (types and allowed values)."""
        for name in ("tp", "pp", "dp", "micro_batch", "grad_accum", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"plan.{name} must be an integer >= 1, got {value!r}")
        for name, allowed in (("schedule", SCHEDULES), ("sharding", SHARDINGS),
                              ("recompute", RECOMPUTES)):
            if getattr(self, name) not in allowed:
                raise PlanError(f"plan.{name}={getattr(self, name)!r} is not one of {allowed}")
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"plan.sequence_parallel must be true/false, got {self.sequence_parallel!r}")
        if not isinstance(self.predictions, dict):
            raise PlanError("plan.predictions must be a mapping")

    def problems(self, model_cfg: Any, train_cfg: Any, world_size: int) -> list[str]:
        """Every rule this plan breaks for the model, training batch and world size."""
        try:
            self.validate_fields()
        except PlanError as exc:
            return [str(exc)]
        out: list[str] = []
        p, d, t = self.pp, self.dp, self.tp
        if p * d * t != world_size:
            out.append(f"pp*dp*tp = {p}*{d}*{t} = {p * d * t} must equal the world size "
                       f"{world_size}")
        kv = getattr(model_cfg, "kv_heads", None) or getattr(model_cfg, "n_kv_heads", None) \
            or model_cfg.n_heads
        if model_cfg.n_heads % t:
            out.append(f"tp={t} must divide model.n_heads={model_cfg.n_heads}")
        elif kv % t:
            out.append(f"tp={t} must divide the key/value heads ({kv})")
        chunks = p * self.virtual_stages
        if chunks > model_cfg.n_layers:
            out.append(f"pp*virtual_stages = {p}*{self.virtual_stages} = {chunks} must be at "
                       f"most model.n_layers={model_cfg.n_layers} (one layer per stage at least)")
        gb = self.micro_batch * self.grad_accum * d
        if gb != train_cfg.global_batch:
            out.append(f"micro_batch*grad_accum*dp = {self.micro_batch}*{self.grad_accum}*{d} "
                       f"= {gb} must equal train.global_batch={train_cfg.global_batch}")
        if self.schedule == "interleaved_1f1b":
            if self.virtual_stages < 2 or p < 2:
                out.append(f"schedule interleaved_1f1b needs virtual_stages > 1 and pp > 1 "
                           f"(got virtual_stages={self.virtual_stages}, pp={p}); use 1f1b")
            else:
                rounds = max(1, self.grad_accum // p)
                if self.grad_accum % rounds:
                    out.append(f"interleaved_1f1b needs grad_accum={self.grad_accum} to be a "
                               f"multiple of grad_accum//pp={rounds} (torch pipelining rule)")
        elif self.virtual_stages != 1:
            out.append(f"virtual_stages={self.virtual_stages} needs schedule interleaved_1f1b")
        if self.schedule == "1f1b" and p > 1 and self.grad_accum < p:
            out.append(f"schedule 1f1b needs grad_accum={self.grad_accum} >= pp={p} "
                       f"(torch pipelining rule); raise grad_accum or use gpipe")
        if self.sharding == "none" and d > 1:
            out.append(f"sharding 'none' needs dp=1 (got dp={d}); use ddp, zero2 or zero3")
        if self.sharding == "ddp" and t > 1:
            out.append(f"sharding 'ddp' cannot wrap a tp={t} model (DTensor parameters); "
                       f"use zero2 (FSDP2 without reshard) or zero3")
        if self.sequence_parallel:
            if t < 2:
                out.append("sequence_parallel needs tp > 1")
            elif train_cfg.seq_len % t:
                out.append(f"sequence_parallel needs tp={t} to divide train.seq_len="
                           f"{train_cfg.seq_len}")
        return out

    def check(self, model_cfg: Any, train_cfg: Any, world_size: int) -> None:
        """Raise PlanError listing every broken rule (factor names and values)."""
        found = self.problems(model_cfg, train_cfg, world_size)
        if found:
            raise PlanError(f"plan {self.describe()} is invalid: " + "; ".join(found))


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
