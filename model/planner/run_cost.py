"""The price of a whole training run from one plan's predicted step.

Given the planner's predictions for a plan (``step_time_s`` and ``tokens_per_s`` at the
plan's world size), the global batch, the sequence length and either a token budget N or a
number of optimizer steps:

- ``steps = ceil(N / (global_batch * seq_len))`` (the last step is whole, so the run trains
  ``steps * global_batch * seq_len >= N`` tokens);
- wall-clock ``steps * step_time_s`` in seconds, hours and days on the plan's devices;
- node-hours (whole nodes: ``ceil(devices / devices_per_node)`` x hours; devices per node is
  the cluster's ``ranks_per_node``, 8 GCDs on Frontier) and device-hours (GCD-hours);
- training compute ``6 * N * P`` (Kaplan et al. 2020) with P the non-embedding parameter
  count of ``model.flops`` (all blocks, the final norm and the untied output head; the input
  embedding is a lookup, not a matmul), in FLOPs and in exaflops (1e18 FLOPs), beside the
  planner's full model-FLOP count (``flops_per_token`` x N, which adds the attention
  products). For the 1T preset P is 1.008e12 (1.009e12 with the embedding), so 20T tokens
  cost 1.21e26 FLOPs, the Frontier study's 1.2e26 (120 million exaflops).
- where the machine's size is known (``MACHINE_NODES``), the days on the whole machine at
  the plan's predicted tokens/s per device: linear scaling from the plan's devices, a lower
  bound (a larger dp needs a larger global batch, and communication grows);
- checkpoints, where the cluster file gives the file system's write bandwidth
  (``checkpoint_seconds``): ``CHECKPOINT_BYTES_PER_PARAM`` bytes per parameter (what the
  trainer saves: float32 weights and AdamW's two float32 moments) over
  ``min(nodes x node_write_gbps, filesystem_write_gbps)``, once every ``checkpoint_every``
  steps; the wall-clock includes them (written synchronously, the trainer's default) and
  ``checkpoint_s_per_step`` is their cost amortized over the steps.

No torch: this is arithmetic on the planner's figures.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from model.flops import GPTParams

EXA = 1e18
"""FLOPs in one exaflop (as a count of operations, not a rate)."""

MACHINE_NODES = {"frontier": 9408}
"""Compute nodes of a whole machine by cluster name (OLCF Frontier User Guide: 9,408 nodes)."""

CHECKPOINT_BYTES_PER_PARAM = 12
"""Bytes a checkpoint holds per parameter: float32 weights and AdamW's exp_avg and
exp_avg_sq, float32 each (model.training.checkpoint saves the model and optimizer state)."""


def checkpoint_seconds(params: int, nodes: int, cluster: Any) -> float | None:
    """Seconds to write one checkpoint of ``params`` parameters from ``nodes`` nodes: its
    bytes over ``min(nodes x node_write_gbps, filesystem_write_gbps)``; None when the
    cluster file gives no write bandwidth."""
    per_node = getattr(cluster, "node_write_gbps", 0.0)
    if not per_node:
        return None
    bandwidth = nodes * per_node
    if getattr(cluster, "filesystem_write_gbps", 0.0):
        bandwidth = min(bandwidth, cluster.filesystem_write_gbps)
    return CHECKPOINT_BYTES_PER_PARAM * params / (bandwidth * 1e9)


@dataclass(frozen=True)
class RunCost:
    """The predicted cost of one training run (see module docstring)."""

    tokens: float
    """The token budget N (steps x tokens per step when priced from a step count)."""
    steps: int
    """Optimizer steps: ceil(N / tokens_per_step)."""
    tokens_per_step: int
    """global_batch x seq_len."""
    tokens_trained: int
    """steps x tokens_per_step (>= N)."""
    step_time_s: float
    """The plan's predicted seconds per step."""
    tokens_per_s: float
    """The plan's predicted tokens per second over all its devices."""
    devices: int
    """The plan's world size (ranks: GCDs on Frontier)."""
    devices_per_node: int
    """The cluster's ranks per node."""
    nodes: int
    """Whole nodes the devices occupy: ceil(devices / devices_per_node)."""
    wall_s: float
    wall_hours: float
    wall_days: float
    node_hours: float
    device_hours: float
    """Device-hours (GCD-hours on Frontier): devices x wall hours."""
    params: int
    """P of 6NP."""
    params_counted: str
    """Which parameters P counts ('non-embedding': blocks, final norm, output head)."""
    params_with_embedding: int
    """The whole parameter count, for reference."""
    train_flops: float
    """6 x N x P."""
    train_exaflops: float
    """train_flops / 1e18."""
    model_flops: float
    """The planner's model-FLOP count for N tokens (6P plus attention, per token, x N)."""
    machine_devices: int | None = None
    """Devices of the whole machine (None: not known for this cluster)."""
    machine_days: float | None = None
    """Days on the whole machine at the plan's tokens/s per device (linear scaling)."""
    checkpoint_s: float | None = None
    """Seconds to write one checkpoint (None: the cluster's file system is not known)."""
    checkpoints: int = 0
    """Checkpoints written: one every ``checkpoint_every`` steps (0 when not priced)."""
    checkpoint_s_per_step: float = 0.0
    """Checkpoint writing amortized per step (included in ``wall_s``)."""

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready."""
        return asdict(self)

    def lines(self) -> list[str]:
        """The cost as printable lines."""
        out = [
            f"run cost: {self.tokens:.4g} tokens = {self.steps:,} steps x "
            f"{self.tokens_per_step:,} tokens/step ({self.tokens_trained:,} trained)",
            f"  at {self.step_time_s:.4g} s/step, {self.tokens_per_s:.4g} tokens/s on "
            f"{self.devices:,} devices ({self.nodes:,} nodes x {self.devices_per_node})",
            f"  wall-clock {self.wall_s:.4g} s = {self.wall_hours:,.1f} h = "
            f"{self.wall_days:,.4g} days on the plan's {self.devices:,} devices",
            f"  {self.node_hours:,.0f} node-hours, {self.device_hours:,.0f} device-hours",
            f"  compute 6NP = {self.train_flops:.4g} FLOPs = {self.train_exaflops:,.0f} "
            f"exaflops (P = {self.params:,} {self.params_counted} parameters; "
            f"{self.params_with_embedding:,} with the embedding); with attention "
            f"{self.model_flops:.4g} FLOPs",
        ]
        if self.checkpoint_s is not None:
            out.append(f"  {self.checkpoints:,} checkpoints x {self.checkpoint_s:.4g} s "
                       f"({self.checkpoint_s_per_step:.3g} s per step, in the wall-clock)")
        if self.machine_days is not None:
            out.append(f"  {self.machine_days:,.4g} days on the whole machine "
                       f"({self.machine_devices:,} devices) at the same tokens/s per device "
                       "(linear scaling: a lower bound)")
        return out


def run_cost(*, step_time_s: float, tokens_per_s: float, global_batch: int, seq_len: int,
             devices: int, devices_per_node: int, params: GPTParams,
             tokens: float | None = None, steps: int | None = None,
             machine_nodes: int | None = None, checkpoint_s: float | None = None,
             checkpoint_every: int = 0) -> RunCost:
    """The cost of training ``tokens`` tokens (or ``steps`` steps, when tokens is None).

    ``params`` gives P (non-embedding) and the planner's per-token FLOPs at ``seq_len``;
    ``checkpoint_s`` the seconds of one checkpoint, written every ``checkpoint_every``
    steps (0: none). Raises ValueError for a non-positive budget or a missing one.
    """
    per_step = global_batch * seq_len
    if tokens is None:
        if steps is None:
            raise ValueError("run_cost needs a token budget or a step count")
        if steps <= 0:
            raise ValueError(f"steps must be positive, got {steps}")
        tokens = float(steps * per_step)
    if not math.isfinite(tokens) or tokens <= 0:
        raise ValueError(f"the token budget must be a positive number, got {tokens}")
    n_steps = math.ceil(tokens / per_step)
    checkpoints = n_steps // checkpoint_every if checkpoint_s and checkpoint_every > 0 else 0
    wall = n_steps * step_time_s + checkpoints * (checkpoint_s or 0.0)
    hours = wall / 3600.0
    nodes = math.ceil(devices / devices_per_node)
    p = params.total(include_embedding=False)
    flops = 6.0 * tokens * p
    machine_devices = machine_days = None
    if machine_nodes:
        machine_devices = machine_nodes * devices_per_node
        machine_days = wall / 86400.0 * devices / machine_devices
    return RunCost(
        tokens=float(tokens), steps=n_steps, tokens_per_step=per_step,
        tokens_trained=n_steps * per_step, step_time_s=float(step_time_s),
        tokens_per_s=float(tokens_per_s), devices=devices, devices_per_node=devices_per_node,
        nodes=nodes, wall_s=wall, wall_hours=hours, wall_days=wall / 86400.0,
        node_hours=nodes * hours, device_hours=devices * hours, params=p,
        params_counted="non-embedding", params_with_embedding=params.total(),
        train_flops=flops, train_exaflops=flops / EXA,
        model_flops=params.flops_per_token(seq_len) * tokens,
        machine_devices=machine_devices, machine_days=machine_days,
        checkpoint_s=checkpoint_s, checkpoints=checkpoints,
        checkpoint_s_per_step=checkpoints * (checkpoint_s or 0.0) / n_steps)


def plan_run_cost(predictions: dict[str, Any], model_cfg: Any, global_batch: int, seq_len: int,
                  cluster: Any, devices: int, tokens: float | None = None,
                  steps: int | None = None, checkpoint_every: int = 0) -> RunCost:
    """``run_cost`` for a plan's ``predictions`` (``Plan.predictions``) on ``cluster``, with
    a checkpoint every ``checkpoint_every`` steps priced from the cluster's file system."""
    params = GPTParams.from_config(model_cfg)
    nodes = math.ceil(devices / cluster.ranks_per_node)
    return run_cost(step_time_s=float(predictions["step_time_s"]),
                    tokens_per_s=float(predictions["tokens_per_s"]),
                    global_batch=global_batch, seq_len=seq_len, devices=devices,
                    devices_per_node=cluster.ranks_per_node, params=params, tokens=tokens,
                    steps=steps, machine_nodes=MACHINE_NODES.get(cluster.name),
                    checkpoint_s=checkpoint_seconds(params.total(), nodes, cluster),
                    checkpoint_every=checkpoint_every)


__all__ = ["CHECKPOINT_BYTES_PER_PARAM", "EXA", "MACHINE_NODES", "RunCost",
           "checkpoint_seconds", "plan_run_cost", "run_cost"]
