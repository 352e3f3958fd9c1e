"""Published training-throughput measurements (configs/published/*.yaml) and the fit of the
GPU time model to them.

Each file is one source (a paper or a framework's benchmark record): which cluster and
framework it ran on, whether it is used to fit (``role: fit``) or kept back to test
(``role: test``), how its figure is counted (``measure`` and ``flops_formula``) and one row per
run with the model shape, the plan and the measured figure. Every figure is turned into
tokens/s per device with the source's own FLOP formula, so predictions and measurements are
compared on the same quantity whatever the source reports.

The fitted parameters are the per-framework efficiency factors (``Cluster.framework_efficiency``):
the model's compute time is divided by the factor of the framework that ran (megatron,
megatron-deepspeed, pytorch). They are fitted by minimising the squared relative error of
tokens/s over the rows of the fitting sources; a framework with no fitting rows takes the mean
factor of the others. A cluster whose file carries ``stack_efficiency`` (Frontier) has one more
parameter, the efficiency of its software stack: its rows are left out of the framework fit and
fit that factor alone, given the framework factors (``fit_stack``); without fitting rows on it
the factor is 1 (the framework factor alone). Everything else (peak, maximum achievable matmul
efficiency, links) is a published per-hardware figure in the cluster file, never fitted.
A source file may say ``eager: true`` (its blocks' elementwise work runs as separate eager
PyTorch kernels; a row with ``compiled: true`` ran torch.compile'd blocks and is priced fused)
and ``eager_loss: true`` (an unfused fp32 cross-entropy); both default to false (hand-fused
kernels, as Megatron's and LLM Foundry's). These are physical terms (bytes over the cluster's
HBM bandwidth, ``time_model.eager_block_bytes``), not fitted.
``leave_one_source_out`` predicts each source from a fit on the other fitting sources;
``pick_versus_source`` prices the planner's own pick against a source's plan.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from model.parallel.layout import LAYOUT_FIELDS, Plan, PlanError
from model.planner.cluster import Cluster, load_cluster
from model.planner.shapes import Shapes, encode
from model.planner.time_model import step_time

PUBLISHED_DIR = Path(__file__).resolve().parents[2] / "configs" / "published"
SOURCE_FIELDS = ("id", "title", "arxiv", "table", "link")
FILE_FIELDS = ("source", "role", "cluster", "framework", "dtype", "flash_attention", "measure",
               "flops_formula", "rows")
ROW_FIELDS = ("name", "n_layers", "d_model", "n_heads", "seq_len", "vocab", "family",
              "global_batch", "devices", "measured")
PLAN_FIELDS = tuple(f for f in LAYOUT_FIELDS if f not in ("dp", "grad_accum", "recompute_layers"))
"""A published row's layout columns (dp and grad_accum follow from devices and batch;
recompute_layers is optional, 0 when absent: every block recomputed under recompute full)."""
MEASURES = ("tflops_per_device", "mfu", "pct_of_peak", "tokens_per_s_per_device")
FORMULAS = ("megatron_hardware", "megatron_model", "megatron_model_v16", "none")
BOUNDS = (0.3, 1.5)


@dataclass
class Row:
    """One published run: shape, plan, hardware and the measured tokens/s per device."""

    source: str
    role: str
    name: str
    cluster: str
    framework: str
    shapes: Shapes
    plan: Plan | None
    """None: the source's plan is unknown and the row is priced at the best plan under
    ``constraints``."""
    global_batch: int
    devices: int
    measured_tps: float
    """Measured tokens/s per device."""
    reported: float
    """The figure as published (in ``measure`` units)."""
    measure: str
    flops_per_token: float
    """FLOPs per token of the source's own formula (0: tokens/s reported directly)."""
    constraints: dict[str, Any] = field(default_factory=dict)


def flops_per_token(formula: str, s: Shapes) -> float:
    """FLOPs per token under a source's formula (Megatron's, with or without recompute)."""
    lay, h, seq, v = s.n_layers, s.d_model, s.seq_len, s.vocab
    if formula == "megatron_hardware":
        return 96.0 * lay * h * h * (1 + seq / (6 * h) + v / (16 * lay * h))
    if formula == "megatron_model":
        return 72.0 * lay * h * h * (1 + seq / (6 * h) + v / (12 * lay * h))
    if formula == "megatron_model_v16":
        return 72.0 * lay * h * h * (1 + seq / (6 * h) + v / (16 * lay * h))
    return 0.0


def _rows_of(path: Path) -> list[Row]:
    raw = yaml.safe_load(path.read_text()) or {}
    missing = [k for k in FILE_FIELDS if k not in raw]
    if missing:
        raise ValueError(f"{path}: missing field(s) {missing}; required: {list(FILE_FIELDS)}")
    src = raw["source"]
    lack = [k for k in SOURCE_FIELDS if not src.get(k)]
    if lack:
        raise ValueError(f"{path}: source lacks {lack}; required: {list(SOURCE_FIELDS)}")
    if raw["role"] not in ("fit", "test"):
        raise ValueError(f"{path}: role must be fit or test, got {raw['role']!r}")
    if raw["measure"] not in MEASURES or raw["flops_formula"] not in FORMULAS:
        raise ValueError(f"{path}: measure must be one of {MEASURES} and flops_formula one of "
                         f"{FORMULAS}")
    for key in ("eager", "eager_loss"):
        if not isinstance(raw.get(key, False), bool):
            raise ValueError(f"{path}: {key} must be true or false")
    eager, eager_loss = raw.get("eager", False), raw.get("eager_loss", False)
    cluster = load_cluster(raw["cluster"])
    dtype = "bfloat16" if raw["dtype"] in ("bfloat16", "float16") else "float32"
    out = []
    for i, r in enumerate(raw["rows"]):
        r = {**(raw.get("defaults") or {}), **r}
        where = f"{path}: row {i} ({r.get('name', '?')})"
        lack = [k for k in ROW_FIELDS if k not in r]
        best = r.get("plan") == "best"
        if not best:
            lack += [k for k in PLAN_FIELDS if k not in r]
        if lack:
            raise ValueError(f"{where}: missing field(s) {lack}")
        llama = r["family"] == "llama"
        ffn = r.get("ffn") or (4 * r["d_model"])
        if not isinstance(r.get("compiled", False), bool):
            raise ValueError(f"{where}: compiled must be true or false")
        s = Shapes(n_layers=r["n_layers"], d_model=r["d_model"], n_heads=r["n_heads"],
                   kv_heads=r.get("kv_heads", r["n_heads"]), ffn=ffn, vocab=r["vocab"],
                   seq_len=r["seq_len"], llama=llama, dtype=dtype,
                   flash_attention=bool(raw["flash_attention"]),
                   eager=eager and not r.get("compiled", False), eager_loss=eager_loss)
        plan = None
        if not best:
            dp = r.get("dp") or r["devices"] // (r["tp"] * r["pp"])
            ga = r["global_batch"] // (r["micro_batch"] * dp)
            if r["tp"] * r["pp"] * dp != r["devices"] or ga * r["micro_batch"] * dp != \
                    r["global_batch"]:
                raise ValueError(f"{where}: tp*pp*dp must equal devices and micro_batch*"
                                 f"grad_accum*dp the global batch")
            plan = Plan(tp=r["tp"], pp=r["pp"], dp=dp, micro_batch=r["micro_batch"],
                        grad_accum=ga, schedule=r["schedule"], virtual_stages=r["virtual_stages"],
                        sharding=r["sharding"], recompute=r["recompute"],
                        recompute_layers=int(r.get("recompute_layers", 0)),
                        sequence_parallel=bool(r["sequence_parallel"]))
        fpt = flops_per_token(raw["flops_formula"], s)
        value = float(r["measured"])
        peak = cluster.peak_for(dtype)
        if raw["measure"] == "tokens_per_s_per_device":
            tps = value
        elif not fpt:
            raise ValueError(f"{path}: measure {raw['measure']} needs a flops_formula")
        else:  # TFLOPS per device, or a fraction of the device's peak
            tps = value * (1e12 if raw["measure"] == "tflops_per_device" else peak) / fpt
        cons = {k: r[k] for k in ("sharding", "max_tp") if k in r} if best else {}
        out.append(Row(source=src["id"], role=raw["role"], name=r["name"], cluster=raw["cluster"],
                       framework=raw["framework"], shapes=s, plan=plan,
                       global_batch=r["global_batch"], devices=r["devices"], measured_tps=tps,
                       reported=value, measure=raw["measure"], flops_per_token=fpt,
                       constraints=cons))
    return out


def load_published(directory: str | Path = PUBLISHED_DIR) -> list[Row]:
    """Every row of every configs/published/*.yaml file (validated)."""
    files = sorted(Path(directory).glob("*.yaml"))
    if not files:
        raise ValueError(f"no published measurements in {directory}")
    return [row for f in files for row in _rows_of(f)]


def _base(name: str, cache: dict[str, Cluster]) -> Cluster:
    if name not in cache:
        cache[name] = load_cluster(name)
    return cache[name]


def _cluster(name: str, factors: dict[str, float], cache: dict[str, Cluster],
             stacks: dict[str, float] | None = None) -> Cluster:
    """The cluster with the given framework factors and, where it has a stack parameter, the
    fitted stack factor (1 when ``stacks`` does not fit it)."""
    cl = copy.copy(_base(name, cache))
    cl.framework_efficiency = dict(factors)
    if cl.stack_efficiency is not None:
        cl.stack_efficiency = (stacks or {}).get(name, 1.0)
    return cl


def has_stack(name: str, cache: dict[str, Cluster] | None = None) -> bool:
    """Whether a cluster's software-stack efficiency is a fitted parameter of its own."""
    return _base(name, {} if cache is None else cache).stack_efficiency is not None


def best_plan(row: Row, cluster: Cluster) -> Plan:
    """The fastest fitting plan under the row's constraints (tp at most max_tp, sharding)."""
    from model.planner.search import search

    best = None
    for tp in (1, 2, 4, 8, 16, 32):
        if tp > row.constraints.get("max_tp", 8):
            break
        fixed = {"tp": tp, "sharding": row.constraints.get("sharding")}
        try:
            res = search(row.shapes, cluster, row.devices, row.global_batch, fixed, top_k=1,
                         framework=row.framework)
        except PlanError:
            continue
        if best is None or res.best.predictions["tokens_per_s"] > \
                best.predictions["tokens_per_s"]:
            best = res.best
    if best is None:
        raise PlanError(f"{row.source}/{row.name}: no plan fits under {row.constraints}")
    return best


def _parts(row: Row, cluster: Cluster) -> tuple[float, float]:
    """(compute, comm) seconds per step of the row's plan at framework factor 1."""
    t = step_time(row.shapes, cluster, encode([row.plan]), framework=row.framework)
    return float(t["compute"][0]), float(t["comm"][0])


def predict_row(row: Row, factors: dict[str, float],
                cache: dict[str, Cluster] | None = None,
                stacks: dict[str, float] | None = None) -> dict[str, Any]:
    """Predicted tokens/s per device of a row under the given framework (and stack) factors."""
    cache = {} if cache is None else cache
    cl = _cluster(row.cluster, factors, cache, stacks)
    plan = row.plan if row.plan is not None else best_plan(row, cl)
    compute, comm = _parts(Row(**{**row.__dict__, "plan": plan}), cl)
    step = compute / cl.framework_factor(row.framework) + comm
    tps = row.global_batch * row.shapes.seq_len / step / row.devices
    out = {"source": row.source, "name": row.name, "plan": plan.describe(),
           "measured_tps": row.measured_tps, "predicted_tps": tps,
           "error": tps / row.measured_tps - 1}
    if row.flops_per_token:
        peak = cl.peak_for(row.shapes.dtype)
        out["measured_pct_peak"] = row.measured_tps * row.flops_per_token / peak
        out["predicted_pct_peak"] = tps * row.flops_per_token / peak
    return out


def _fit_grid(pts: list[tuple[float, float, float]]) -> float:
    """The factor f minimising sum((ideal / (compute / f + comm) - 1)^2) over (compute, comm,
    ideal) seconds: the squared relative error of tokens/s."""
    grid = np.linspace(*BOUNDS, 1201)
    a = np.array(pts)
    pred = a[None, :, 0] / grid[:, None] + a[None, :, 1]
    err = ((a[None, :, 2] / pred - 1) ** 2).sum(axis=1)
    return float(grid[int(np.argmin(err))])


def _point(r: Row, cache: dict[str, Cluster]) -> tuple[float, float, float]:
    compute, comm = _parts(r, _cluster(r.cluster, {}, cache))
    return compute, comm, r.global_batch * r.shapes.seq_len / r.devices / r.measured_tps


def fit_factors(rows: list[Row], cache: dict[str, Cluster] | None = None) -> dict[str, float]:
    """Per-framework efficiency factors minimising the squared relative tokens/s error over
    ``rows`` (their plans must be known); frameworks without rows are left out. Rows on a
    cluster with a stack parameter (``has_stack``) fit that instead (``fit_stack``)."""
    cache = {} if cache is None else cache
    out = {}
    for fw in sorted({r.framework for r in rows}):
        pts = [_point(r, cache) for r in rows if r.framework == fw and r.plan is not None
               and not has_stack(r.cluster, cache)]
        if pts:
            out[fw] = _fit_grid(pts)
    return out


def fit_stack(rows: list[Row], factors: dict[str, float],
              cache: dict[str, Cluster] | None = None) -> dict[str, float]:
    """Software-stack efficiency per cluster that has one, fitted on that cluster's ``rows``
    alone given the framework ``factors`` (the stack multiplies them); clusters without rows
    are left out (factor 1)."""
    cache = {} if cache is None else cache
    out = {}
    for name in sorted({r.cluster for r in rows if has_stack(r.cluster, cache)}):
        pts = []
        for r in rows:
            if r.cluster == name and r.plan is not None:
                compute, comm, ideal = _point(r, cache)
                pts.append((compute / factors.get(r.framework, 1.0), comm, ideal))
        if pts:
            out[name] = _fit_grid(pts)
    return out


def fit_all(rows: list[Row], cache: dict[str, Cluster] | None = None,
            frameworks: set[str] | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """(framework factors, stack factors) fitted on the rows of the fitting sources, as the
    cluster files carry them; frameworks (of ``rows``, or those given) without fitting rows take
    the mean of the others."""
    cache = {} if cache is None else cache
    fit = [r for r in rows if r.role == "fit"]
    factors = with_fallback(fit_factors(fit, cache), frameworks or {r.framework for r in rows})
    return factors, fit_stack(fit, factors, cache)


def with_fallback(factors: dict[str, float], frameworks: set[str]) -> dict[str, float]:
    """Fill frameworks without a fitted factor with the mean of the fitted ones."""
    mean = float(np.mean(list(factors.values()))) if factors else 1.0
    return {**{fw: mean for fw in frameworks}, **factors}


def pick_versus_source(row: Row, factors: dict[str, float],
                       cache: dict[str, Cluster] | None = None,
                       stacks: dict[str, float] | None = None) -> dict[str, Any]:
    """The planner's own pick for a row's model, devices and global batch (tp at most 8, any
    sharding) against the source's plan, both priced for the source's framework under
    ``factors``: predicted tokens/s per device of each, the speed-up and the terms (seconds per
    step) that the pick shortens most."""
    cache = {} if cache is None else cache
    cl = _cluster(row.cluster, factors, cache, stacks)
    if row.plan is None:
        raise PlanError(f"{row.source}/{row.name}: the source's plan is unknown")
    pick = best_plan(Row(**{**row.__dict__, "constraints": {}}), cl)
    terms = {}
    for name, plan in (("source", row.plan), ("pick", pick)):
        t = step_time(row.shapes, cl, encode([plan]), framework=row.framework)
        terms[name] = {k: float(v[0]) for k, v in t["breakdown"].items()}
        terms[name + "_step"] = float(t["step"][0])
    saved = {k: terms["source"][k] - terms["pick"][k] for k in terms["source"]}
    top = sorted(saved, key=saved.get, reverse=True)[:3]
    return {"name": row.name, "pick": pick, "source_plan": row.plan.describe(),
            "pick_plan": pick.describe(),
            "speedup": terms["source_step"] / terms["pick_step"],
            "source_step_s": terms["source_step"], "pick_step_s": terms["pick_step"],
            "saved_s": {k: saved[k] for k in top}}


def leave_one_source_out(rows: list[Row]) -> dict[str, Any]:
    """Predict each source from a fit on the other fitting sources.

    Returns {"rows": [...], "per_source": {id: mape}, "mape": overall, "factors": {id: fit},
    "stacks": {id: stack factors fitted}}: a held-out source's own rows fit neither.
    """
    cache: dict[str, Cluster] = {}
    results, per_source, factors_used, stacks_used = [], {}, {}, {}
    for src in sorted({r.source for r in rows}):
        factors, stacks = fit_all([r for r in rows if r.source != src], cache,
                                  {r.framework for r in rows})
        factors_used[src], stacks_used[src] = factors, stacks
        preds = [predict_row(r, factors, cache, stacks) for r in rows if r.source == src]
        results += preds
        per_source[src] = float(np.mean([abs(p["error"]) for p in preds]))
    mape = float(np.mean([abs(p["error"]) for p in results]))
    return {"rows": results, "per_source": per_source, "mape": mape, "factors": factors_used,
            "stacks": stacks_used}
