"""Rehearsing a plan: its busiest ranks run on fake tensors (``model.rehearsal.rehearse``,
imported only when asked: torch), their memory, FLOPs and collective bytes set beside the
planner's models; and the give-way rule, by which a plan whose rehearsal does not fit the
device gives way to the next best."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from model.config import ModelConfig, TrainConfig
from model.flops import flops_per_token
from model.parallel.layout import Plan, PlanError
from model.planner.cluster import Cluster
from model.planner.rank_counts import count_errors, rank_collective_bytes, rank_flops
from model.planner.search import explain
from model.planner.shapes import Shapes

REHEARSE_TRIES = 5
"""Plans rehearsed, best first, before giving up on finding one that fits: the chosen plan
and the search's next four."""


def modeled_rank_memory(model_cfg: ModelConfig, train_cfg: TrainConfig, plan: Plan,
                        cluster: Cluster, world: int, stage: str,
                        calibration: dict[str, float] | None = None) -> tuple[float, float]:
    """(peak GB with the cluster's margins, tensor GB without) the memory model gives a rank
    of ``stage`` (first, middle or last; a middle stage is priced as the first)."""
    mem = explain(Shapes.from_configs(model_cfg, train_cfg, cluster), cluster, plan, world,
                  train_cfg.global_batch, calibration)["memory_gb"]
    modeled = "last" if stage == "last" else "first"  # the model bounds others by the first
    tensors = mem[f"states_{modeled}"] + mem[f"act_{modeled}"] + mem[f"transient_{modeled}"]
    return mem[modeled], tensors


def rehearsal_records(model_cfg: ModelConfig, train_cfg: TrainConfig, plan: Plan,
                      cluster: Cluster, world: int,
                      calibration: dict[str, float] | None = None,
                      ranks: list[int] | None = None) -> list[dict[str, Any]]:
    """Rehearse ``plan``'s first and last pipeline stage (``model.rehearsal.rehearse``; or the
    given ``ranks``) and set each rank's rehearsed figures beside the memory model's.

    Per rank (``stage`` first, middle or last; the model prices a middle stage as the
    first): ``peak_memory_gb`` (the model's, with the cluster's margins, as the search
    uses it), ``modeled_tensor_memory_gb`` (the model's states, activations and peak buffers, no
    margins),
    ``rehearsed_peak_memory_gb`` (tensor bytes at the rehearsed peak), the same with the
    cluster's margins and whether that fits the device, the rehearsed memory by category,
    FLOPs and collective bytes per step beside the planner's counts of them
    (``model.planner.rank_counts``: ``modeled_flops_per_step``,
    ``modeled_collective_bytes_by_dim``, their relative errors in ``count_errors``), and the
    model-FLOP count per device for scale.
    Each rank runs in a process of its own (``rehearse_isolated``). Raises RehearsalError
    (a RuntimeError) for a plan that cannot be rehearsed.
    """
    from model.rehearsal.rank_server import rehearse_isolated  # torch: when asked
    from model.rehearsal.rehearse import busiest_ranks

    shapes = Shapes.from_configs(model_cfg, train_cfg, cluster)
    model_flops = (flops_per_token(model_cfg, train_cfg.seq_len) * train_cfg.global_batch
                   * train_cfg.seq_len / world)
    margin = 1 + cluster.fragmentation
    records = []
    for rank in ranks if ranks is not None else busiest_ranks(plan):
        pp_rank = rank // (plan.dp * plan.tp)
        stage = "first" if pp_rank == 0 else "last" if pp_rank == plan.pp - 1 else "middle"
        peak, tensors = modeled_rank_memory(model_cfg, train_cfg, plan, cluster, world, stage,
                                            calibration)
        result = rehearse_isolated(model_cfg, train_cfg, plan, rank,
                                   device_type=cluster.device_type)
        with_margins = result.peak_memory_gb * margin + cluster.reserved_gb
        flops = rank_flops(shapes, plan, pp_rank)
        comm = rank_collective_bytes(shapes, plan, pp_rank)
        records.append({
            "rank": rank, "stage": stage, "coords": result.coords,
            "peak_memory_gb": peak,
            "modeled_tensor_memory_gb": tensors,
            "rehearsed_peak_memory_gb": result.peak_memory_gb,
            "rehearsed_over_modeled": result.peak_memory_gb / tensors if tensors else None,
            "rehearsed_peak_memory_gb_with_margins": with_margins,
            "rehearsed_fits_device": with_margins <= cluster.memory_gb,
            "rehearsed_memory_gb_by_category": {
                k: v / 1e9 for k, v in result.peak_memory_by_category.items()},
            "rehearsed_flops_per_step": result.flops_per_step[-1],
            "model_flops_per_device_per_step": model_flops,
            "rehearsed_collective_bytes_per_step": result.collective_bytes_per_step[-1],
            "rehearsed_collective_bytes_by_dim": result.collective_bytes_by_dim,
            "modeled_flops_per_step": flops, "modeled_collective_bytes_by_dim": comm,
            "count_errors": count_errors(flops, comm, result.flops_per_step[-1],
                                         result.collective_bytes_by_dim),
            "rehearsal_seconds": result.seconds, "rehearsal_notes": result.notes,
            "rehearsal_host_peak_rss_gb": result.host_peak_rss_bytes / 1e9,
            "device_type": cluster.device_type,
        })
    return records


def rehearsal_text(plan: Plan, records: list[dict[str, Any]], device_gb: float) -> str:
    """The rehearsed ranks beside the memory model, as printable lines."""
    device = records[0].get("device_type", "cpu") if records else "cpu"
    extrapolated = any("extrapolated" in n for r in records for n in r.get("rehearsal_notes", []))
    steps = ("two shorter steps extrapolated to the plan's micro-batches" if extrapolated
             else "one step measured after one warm-up step")
    lines = [f"rehearsal of {plan.describe()} (fake {device} tensors; {steps}):",
             f"  {'rank':>6} {'stage':<6} {'modeled GB':>11} {'(tensors)':>10} "
             f"{'rehearsed GB':>13} {'ratio':>6} {'+margins':>9} {'device':>7}  FLOPs/step"]
    for r in records:
        ratio = r["rehearsed_over_modeled"]
        lines.append(
            f"  {r['rank']:>6} {r['stage']:<6} {r['peak_memory_gb']:>11.4g} "
            f"{r['modeled_tensor_memory_gb']:>10.4g} {r['rehearsed_peak_memory_gb']:>13.4g} "
            f"{ratio if ratio is not None else float('nan'):>6.2f} "
            f"{r['rehearsed_peak_memory_gb_with_margins']:>9.4g} {device_gb:>7g}  "
            f"{r['rehearsed_flops_per_step']:.3g}"
            + ("" if r["rehearsed_fits_device"] else "  (does not fit)"))
        cats = sorted(r["rehearsed_memory_gb_by_category"].items(), key=lambda kv: -kv[1])
        lines.append("         at the peak (GB): " + ", ".join(f"{k} {v:.4g}" for k, v in cats))
        comm = r["rehearsed_collective_bytes_per_step"]
        lines.append("         collectives per step (GB): "
                     + ", ".join(f"{k} {v / 1e9:.3g}" for k, v in sorted(comm.items())))
        errors = r.get("count_errors") or {}
        if errors:
            worst = max(errors, key=lambda k: abs(errors[k]))
            lines.append("         planner's counts vs rehearsed: FLOPs "
                         f"{100 * errors['flops']:+.2f} %, worst {worst} "
                         f"{100 * errors[worst]:+.2f} %")
    return "\n".join(lines)


@dataclass
class GiveWay:
    """What rehearsing plans in order found: the kept ``plan``, its rehearsal ``records``
    (None with ``error``: it could not be rehearsed, and stands) and the plans that gave way
    before it (``rejected``: each one's label, fields, worst rehearsed peak and ranks)."""

    plan: Plan
    records: list[dict[str, Any]] | None
    error: str | None = None
    rejected: list[dict[str, Any]] = field(default_factory=list)


def give_way(plans: list[Plan], rehearse: Callable[[Plan], list[dict[str, Any]]],
             device_gb: float, log: Callable[[str], None] = print) -> GiveWay:
    """Rehearse ``plans`` in order (``rehearse``: ``rehearsal_records`` of one plan) and keep
    the first whose rehearsed ranks fit the device with the cluster's margins. A plan that
    cannot be rehearsed (RehearsalError) stands. PlanError, with every plan's rehearsed peak
    and the fix, when none fits."""
    from model.rehearsal.rehearse import RehearsalError  # torch: only when rehearsing

    rejected: list[dict[str, Any]] = []
    for plan in plans:
        try:
            records = rehearse(plan)
        except RehearsalError as exc:
            log(f"[plan] {plan.describe()} not rehearsed: {exc}")
            return GiveWay(plan, None, str(exc), rejected)
        log(rehearsal_text(plan, records, device_gb))
        if all(r["rehearsed_fits_device"] for r in records):
            return GiveWay(plan, records, None, rejected)
        worst = max(r["rehearsed_peak_memory_gb_with_margins"] for r in records)
        log(f"[plan] {plan.describe()} needs {worst:.1f} GB per device by its rehearsal, "
            f"more than {device_gb:g} GB: trying the next plan")
        rejected.append({"plan": plan.describe(), "plan_fields": plan.to_dict(),
                         "rehearsed_peak_memory_gb_with_margins": worst, "ranks": records})
    sizes = "; ".join(f"{r['plan']}: {r['rehearsed_peak_memory_gb_with_margins']:.1f} GB"
                      for r in rejected)
    raise PlanError(
        f"no plan fits in {device_gb:g} GB per device by its rehearsal ({sizes}, "
        "with the cluster's margins): fix recompute=full or a smaller micro_batch, or use "
        "more devices")


def rehearsal_candidates(plan: Plan, ranked: list[Plan]) -> list[Plan]:
    """The plans the give-way rule tries, in order: ``plan`` (the chosen one), then the
    search's next best (``ranked``, best first), ``REHEARSE_TRIES`` in all."""
    others = [p for p in ranked if p.key() != plan.key()]
    return [plan] + others[:REHEARSE_TRIES - 1]


def rehearse_until_one_fits(model_cfg: ModelConfig, train_cfg: TrainConfig, cluster: Cluster,
                            world: int, plan: Plan, ranked: list[Plan],
                            calibration: dict[str, float] | None = None,
                            log: Callable[[str], None] = print) -> GiveWay:
    """The plan stage's and the CLI's rehearsal: ``give_way`` over ``rehearsal_candidates``,
    each plan's busiest ranks rehearsed by ``rehearsal_records`` on the cluster's device
    type, and, when the kept plan is not the chosen one, a line that says so."""
    def rehearse(candidate: Plan) -> list[dict[str, Any]]:
        return rehearsal_records(model_cfg, train_cfg, candidate, cluster, world, calibration)

    kept = give_way(rehearsal_candidates(plan, ranked), rehearse, cluster.memory_gb, log=log)
    if kept.rejected:
        log(f"[plan] kept {kept.plan.describe()} (by its rehearsal), not the model's choice "
            f"{plan.describe()}: {len(kept.rejected)} plan(s) gave way")
    return kept
