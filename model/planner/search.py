"""Search over parallel plans: enumerate, filter by memory, rank by predicted tokens/s.

Candidates are built per (tp, pp, micro_batch, schedule) family and evaluated all at
once as numpy arrays, so a 1T-parameter model on 3,072 devices (~10^5 candidates)
takes well under a second. Families that cannot run are reported with grouped reasons.
"""
from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from model.parallel.layout import (
    LAYOUT_FIELDS,
    RECOMPUTES,
    SCHEDULES,
    SHARDINGS,
    Plan,
    PlanError,
    divisors,
    pipeline_problems,
    recompute_problems,
    schedule_problems,
    sequence_parallel_problems,
    sharding_problems,
    tp_choices,
    tp_problems,
)
from model.planner.memory_model import GB, memory_breakdown
from model.planner.shapes import (
    DDP,
    GPIPE,
    INTERLEAVED,
    NOSHARD,
    ONEF1B,
    REC_FULL,
    ZERO2,
    ZERO3,
    Shapes,
    columns,
    decode,
    encode,
)
from model.planner.time_model import predictions

FIXABLE = LAYOUT_FIELDS
PARTIAL_RECOMPUTE_FRACTIONS = (0.25, 0.5, 0.75)
"""Under recompute full the search also tries recomputing these fractions of each pipeline
chunk's blocks (``recompute_layers``), besides every block."""


@dataclass
class SearchResult:
    """Ranked plans that fit, with grouped reasons for the families that do not."""

    plans: list[Plan]
    """Fitting plans, best predicted tokens/s first (top_k of them)."""
    rejected: dict[str, list[str]]
    """Reason -> families (e.g. 'tp=8 pp=2') rejected for it."""
    n_candidates: int
    n_fit: int
    seconds: float
    memory_gb: float
    """Device memory the plans had to fit in."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> Plan:
        return self.plans[0]

    def table(self, top: int = 10) -> str:
        """The top plans and the rejected families as printable text."""
        head = (f"{'#':>3} {'plan':<44} {'mem GB':>7} {'step s':>9} {'tokens/s':>11} "
                f"{'TFLOPS':>7} {'MFU':>6} {'bubble':>6}")
        lines = [(f"{self.n_fit} of {self.n_candidates} candidate plans fit in "
                 f"{self.memory_gb:.1f} GB per device (searched in {self.seconds:.3f} s)"), head]
        for i, p in enumerate(self.plans[:top], 1):
            pr = p.predictions
            lines.append(f"{i:>3} {p.describe():<44} {pr['memory_gb_per_device']:>7.2f} "
                         f"{pr['step_time_s']:>9.4g} {pr['tokens_per_s']:>11.5g} "
                         f"{pr['tflops_per_device']:>7.3g} {pr['mfu']:>6.1%} "
                         f"{pr.get('bubble_frac', 0.0):>6.1%}")
        if self.rejected:
            lines.append("rejected families:")
            for reason, fams in sorted(self.rejected.items(), key=lambda kv: -len(kv[1])):
                more = f", ... ({len(fams)} in all)" if len(fams) > 6 else ""
                shown = ", ".join(fams[:6]) + more
                lines.append(f"  - {reason}: {shown}")
        return "\n".join(lines)


def _tp_dims(s: Shapes) -> tuple[int, int, int, int]:
    """(n_heads, kv_heads, vocab, ffn): what tensor parallelism must divide."""
    return s.n_heads, s.kv_heads, s.vocab, s.ffn


def _fixed_ok(fixed: dict[str, Any], name: str, value: Any) -> bool:
    return fixed.get(name) is None or fixed[name] == value


def recompute_layer_options(layers_per_chunk: int) -> list[int]:
    """The partial recompute counts the search tries for chunks of ``layers_per_chunk`` blocks:
    ``PARTIAL_RECOMPUTE_FRACTIONS`` of them, rounded, distinct, > 0 and below the chunk."""
    counts = {int(layers_per_chunk * f + 0.5) for f in PARTIAL_RECOMPUTE_FRACTIONS}
    return sorted(n for n in counts if 0 < n < layers_per_chunk)


def enumerate_plans(s: Shapes, world: int, global_batch: int, fixed: dict[str, Any] | None = None,
                    ) -> tuple[dict[str, np.ndarray], dict[str, list[str]]]:
    """All structurally valid candidates (encoded) and the grouped structural rejections."""
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    unknown = sorted(set(fixed) - set(FIXABLE))
    if unknown:
        raise PlanError(f"cannot fix plan fields {unknown}; fixable: {list(FIXABLE)}")
    rejected: dict[str, list[str]] = defaultdict(list)
    rows: list[tuple] = []
    shard_codes = {SHARDINGS.index(x) for x in SHARDINGS}
    if fixed.get("sharding") is not None:
        shard_codes = {SHARDINGS.index(fixed["sharding"])}
    rec_codes = [RECOMPUTES.index(fixed["recompute"])] if "recompute" in fixed else [0, 1, 2]
    fixed_layers = fixed.get("recompute_layers")
    if fixed_layers:  # partial recompute is a kind of full recompute
        broken = recompute_problems(fixed.get("recompute", "full"), fixed_layers, s.n_layers, 1)
        if broken:
            raise PlanError(broken[0])
        rec_codes = [REC_FULL]
    for tp in divisors(world):
        if not _fixed_ok(fixed, "tp", tp):
            continue
        broken = tp_problems(tp, *_tp_dims(s))
        if broken:  # grouped by rule: "tp must divide model.n_heads=6"
            rejected["; ".join(m.split(": ")[0].replace(f"tp={tp} ", "tp ") for m in broken)
                     ].append(f"tp={tp}")
            continue
        sp_opts = [sp for sp in (0, 1) if not sequence_parallel_problems(bool(sp), tp, s.seq_len)]
        if "sequence_parallel" in fixed:
            sp_opts = [sp for sp in sp_opts if sp == int(fixed["sequence_parallel"])]
        for pp in divisors(world // tp):
            if not _fixed_ok(fixed, "pp", pp):
                continue
            fam = f"tp={tp} pp={pp}"
            dp = world // (tp * pp)
            if not _fixed_ok(fixed, "dp", dp):
                continue
            if pipeline_problems(pp, 1, s.n_layers):
                rejected[f"pp exceeds the {s.n_layers} layers (model.n_layers)"].append(fam)
                continue
            if global_batch % dp:
                rejected[f"dp does not divide train.global_batch={global_batch}"].append(
                    f"{fam} dp={dp}")
                continue
            sched_opts: list[tuple[int, int]] = []
            if pp == 1:
                sched_opts = [(ONEF1B, 1)]
                if "schedule" in fixed and fixed["schedule"] != "interleaved_1f1b":
                    sched_opts = [(SCHEDULES.index(fixed["schedule"]), 1)]
            else:
                sched_opts = [(GPIPE, 1), (ONEF1B, 1)]
                sched_opts += [(INTERLEAVED, v) for v in range(2, 9)
                               if pp * v <= s.n_layers and s.n_layers % (pp * v) == 0]
            sched_opts = [(sc, v) for sc, v in sched_opts
                          if _fixed_ok(fixed, "schedule", SCHEDULES[sc])
                          and _fixed_ok(fixed, "virtual_stages", v)]
            if fixed_layers:
                short = [(sc, v) for sc, v in sched_opts
                         if recompute_problems("full", fixed_layers, s.n_layers, pp * v)]
                for v in sorted({v for _, v in short}):
                    rejected[f"recompute_layers={fixed_layers} is not below the layers of each "
                             "pipeline chunk (use 0 or fewer)"].append(f"{fam} v={v}")
                sched_opts = [o for o in sched_opts if o not in short]
                if not sched_opts:
                    continue
            shards = [NOSHARD] if dp == 1 else [ZERO3, ZERO2, DDP]
            shards = [x for x in shards
                      if x in shard_codes and not sharding_problems(SHARDINGS[x], dp, tp)]
            if not shards:
                rejected[f"sharding {fixed.get('sharding')} impossible at this dp/tp"].append(fam)
                continue
            per_rank = global_batch // dp
            for mb in divisors(per_rank):
                ga = per_rank // mb
                if not (_fixed_ok(fixed, "micro_batch", mb) and _fixed_ok(fixed, "grad_accum", ga)):
                    continue
                for sc, v in sched_opts:
                    if schedule_problems(SCHEDULES[sc], pp, ga, v):
                        continue
                    partial = ([fixed_layers] if fixed_layers else [0] if fixed_layers == 0
                               else [0, *recompute_layer_options(s.n_layers // (pp * v))])
                    for sh, rc, sp in itertools.product(shards, rec_codes, sp_opts):
                        for rl in (partial if rc == REC_FULL else (0,)):
                            rows.append((tp, pp, dp, mb, ga, sc, v, sh, rc, rl, sp))
            if not any(r[0] == tp and r[1] == pp for r in rows[-1:]):
                reason = ("no micro-batch/schedule combination allowed (1f1b needs grad_accum "
                          ">= pp; fixed fields)")
                rejected[reason].append(fam)
    return columns(rows), dict(rejected)


FRAMEWORK: str | None = None
"""None: the plans are priced as this project's trainer runs them, with the efficiency
factor of the published framework it resembles (time_model.TRAINER_FRAMEWORK); a published
framework's name prices them as that framework would run them."""


def evaluate(s: Shapes, cluster: Any, c: dict[str, np.ndarray], world: int, global_batch: int,
             calibration: dict[str, float] | None = None,
             framework: str | None = FRAMEWORK) -> dict[str, np.ndarray]:
    """Memory (GB, with its breakdown under ``memory``) and predictions for encoded candidates."""
    mem = memory_breakdown(s, c, cluster.reserved_gb, cluster.fragmentation)
    pred = predictions(s, cluster, c, world, global_batch, calibration, framework)
    return {"memory_gb": mem["peak"] / GB, "memory": mem, **pred}


def _attach(plan: Plan, ev: dict[str, np.ndarray], i: int) -> Plan:
    plan.predictions = {
        "step_time_s": float(ev["step_time_s"][i]), "tokens_per_s": float(ev["tokens_per_s"][i]),
        "tflops_per_device": float(ev["tflops_per_device"][i]), "mfu": float(ev["mfu"][i]),
        "memory_gb_per_device": float(ev["memory_gb"][i]),
        "bubble_frac": float(ev["parts"]["bubble_frac"][i]),
        "compute_s": float(ev["parts"]["compute"][i]), "comm_s": float(ev["parts"]["comm"][i]),
    }
    return plan


def predict_plan(s: Shapes, cluster: Any, plan: Plan, world: int, global_batch: int,
                 calibration: dict[str, float] | None = None,
                 framework: str | None = FRAMEWORK) -> Plan:
    """A copy of ``plan`` with predictions filled in (no validity check)."""
    out = Plan.from_dict({**plan.to_dict(), "predictions": {}})
    ev = evaluate(s, cluster, encode([out]), world, global_batch, calibration, framework)
    return _attach(out, ev, 0)


def explain(s: Shapes, cluster: Any, plan: Plan, world: int, global_batch: int,
            calibration: dict[str, float] | None = None,
            framework: str | None = FRAMEWORK) -> dict[str, dict[str, float]]:
    """The step-time breakdown (seconds per step; ``step`` terms add up to the step time,
    ``overlapped`` is communication hidden under compute) and the memory breakdown (GB per
    device of the first and last pipeline stage; ``parameters``: their parameter counts)."""
    ev = evaluate(s, cluster, encode([plan]), world, global_batch, calibration, framework)
    terms = {k: float(v[0]) for k, v in ev["parts"]["breakdown"].items()}
    hidden = {k: float(v[0]) for k, v in ev["parts"]["overlapped"].items()}
    mem = {k: float(v[0]) / GB for k, v in ev["memory"].items() if not k.startswith("params")}
    mem["reserved"] = float(cluster.reserved_gb)
    mem["fragmentation_fraction"] = float(cluster.fragmentation)
    params = {k: float(v[0]) for k, v in ev["memory"].items() if k.startswith("params")}
    return {"step": terms, "overlapped": hidden, "memory_gb": mem, "parameters": params,
            "step_time_s": float(ev["step_time_s"][0])}


def _more_devices_hint(s: Shapes, cluster: Any, world: int, global_batch: int,
                       fixed: dict[str, Any]) -> tuple[bool, str]:
    """(whether more devices help, what to say): the smallest power-of-two multiple of
    ``world`` (up to 1024x) at which some plan fits, or why no device count helps."""
    leanest, largest = float("inf"), world
    for k in range(1, 11):
        n = world * 2 ** k
        for gb in (global_batch, global_batch * 2 ** k):  # same batch first, then scaled
            c, _ = enumerate_plans(s, n, gb, fixed)
            if len(c["tp"]) == 0:
                continue
            mem = memory_breakdown(s, c, cluster.reserved_gb, cluster.fragmentation)["peak"] / GB
            if (mem <= cluster.memory_gb).any():
                return True, (f"about {n} devices"
                              + (f" with global batch {gb}" if gb != global_batch else ""))
            leanest, largest = min(leanest, float(mem.min())), n
    max_tp = max(tp_choices(largest, *_tp_dims(s)), default=1)
    floor = f"still needs {leanest:.1f} GB" if leanest < float("inf") else "cannot be formed"
    return False, (f"more devices do not help: on {largest} devices the leanest plan {floor}, "
                   f"since tp can be at most {max_tp} (it must divide the heads, vocabulary and "
                   f"MLP width) and pp at most model.n_layers={s.n_layers}")


def _no_candidates_message(s: Shapes, world: int, global_batch: int, fixed: dict[str, Any],
                           rejected: dict[str, list[str]]) -> str:
    """Why no plan can be formed at all, and which tp / pp / dp / batch would work."""
    tps = tp_choices(world, *_tp_dims(s))
    layouts = [(tp, pp) for tp in tps for pp in divisors(world // tp)
               if not pipeline_problems(pp, 1, s.n_layers)]
    hints = []
    if fixed.get("tp") is not None and fixed["tp"] not in tps:
        tp = fixed["tp"]
        why = (f"it does not divide the {world} devices" if world % tp else
               "; ".join(tp_problems(tp, *_tp_dims(s))))
        hints.append(f"parallel.tp={tp} is not possible ({why}); on {world} devices tp can be "
                     f"{tps}.")
    # what remains possible given the fixed degrees that are possible themselves
    usable = [(tp, pp) for tp, pp in layouts if fixed.get("tp") not in tps or tp == fixed["tp"]]
    pps = sorted({pp for _, pp in usable})
    if fixed.get("pp") is not None and fixed["pp"] not in pps:
        hints.append(f"parallel.pp={fixed['pp']} is not possible here: pp can be {pps}.")
    if fixed.get("pp") in pps:
        usable = [(tp, pp) for tp, pp in usable if pp == fixed["pp"]]
    dps = sorted({world // (tp * pp) for tp, pp in usable})
    if fixed.get("dp") is not None and fixed["dp"] not in dps:
        hints.append(f"parallel.dp={fixed['dp']} is not possible here: dp can be {dps}.")
    if any(r.startswith("dp does not divide") for r in rejected) and dps:
        near = sorted({d * -(-global_batch // d) for d in dps})
        hints.append(f"The data-parallel degree dp must divide train.global_batch={global_batch}; "
                     f"on {world} devices dp can be {dps}: use a global batch that is a multiple "
                     f"of one of them (e.g. {near[:4]}), or another device count.")
    if fixed:
        hints.append(f"Fixed fields {fixed} narrow the search: free some.")
    why = "; ".join(f"{r}: {', '.join(f[:4])}" for r, f in rejected.items())
    return (f"no parallel plan can be formed for {world} devices and global batch {global_batch}"
            + (f" ({why})" if why else "") + "." + "".join(" " + h for h in hints))


def search(s: Shapes, cluster: Any, world: int, global_batch: int,
           fixed: dict[str, Any] | None = None, top_k: int = 10,
           calibration: dict[str, float] | None = None,
           framework: str | None = FRAMEWORK) -> SearchResult:
    """Rank every plan that fits; raise PlanError saying what would make one fit."""
    t0 = time.perf_counter()
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    c, rejected = enumerate_plans(s, world, global_batch, fixed)
    n = len(c["tp"])
    if n == 0:
        raise PlanError(_no_candidates_message(s, world, global_batch, fixed, rejected))
    ev = evaluate(s, cluster, c, world, global_batch, calibration, framework)
    fits = ev["memory_gb"] <= cluster.memory_gb
    # memory-rejected families: every candidate of a (tp, pp) exceeds device memory
    fam_key = c["tp"] * 1_000_000 + c["pp"]
    for key in np.unique(fam_key[~fits]):
        sel = fam_key == key
        if not fits[sel].any():
            j = np.flatnonzero(sel)[np.argmin(ev["memory_gb"][sel])]
            rejected.setdefault(f"exceeds {cluster.memory_gb:g} GB per device", []).append(
                f"tp={c['tp'][j]} pp={c['pp'][j]} (leanest {ev['memory_gb'][j]:.1f} GB)")
    if not fits.any():
        j = int(np.argmin(ev["memory_gb"]))
        lean = decode(c, j)
        helps, hint = _more_devices_hint(s, cluster, world, global_batch, fixed)
        tips = []
        if fixed.get("recompute") not in (None, "full"):
            tips.append("recompute=full")
        if fixed.get("micro_batch", 1) != 1:
            tips.append("micro_batch=1")
        if fixed.get("sharding") not in (None, "zero3"):
            tips.append("sharding=zero3")
        other = ([f"free/alter fixed fields ({', '.join(tips)})"] if tips else []) + (
            [f"a shorter train.seq_len than {s.seq_len}"] if s.seq_len > 512 else [])
        if helps:
            advice = f"Use more devices ({hint})" + "".join(f", or {o}" for o in other)
        else:
            *first, last = other + ["a smaller model", "devices with more memory"]
            advice = f"{hint[0].upper()}{hint[1:]}; use {', '.join(first)} or {last}"
        raise PlanError(
            f"no plan fits in {cluster.memory_gb:g} GB per device on {world} devices of "
            f"{cluster.name}: the leanest plan ({lean.describe()}) needs "
            f"{ev['memory_gb'][j]:.1f} GB. {advice}.")
    idx = np.flatnonzero(fits)
    # best tokens/s first; ties broken by lower memory
    order = idx[np.lexsort((ev["memory_gb"][idx], -ev["tokens_per_s"][idx]))]
    plans = [_attach(decode(c, int(i)), ev, int(i)) for i in order[:top_k]]
    return SearchResult(plans=plans, rejected=rejected, n_candidates=n, n_fit=int(fits.sum()),
                        seconds=time.perf_counter() - t0, memory_gb=cluster.memory_gb)


def validate_plan(s: Shapes, cluster: Any, plan: Plan, model_cfg: Any, train_cfg: Any,
                  world: int, calibration: dict[str, float] | None = None) -> Plan:
    """Check a hand-given plan with the same rules and models as the search; predictions filled."""
    plan.check(model_cfg, train_cfg, world)
    out = predict_plan(s, cluster, plan, world, train_cfg.global_batch, calibration)
    mem = out.predictions["memory_gb_per_device"]
    if mem > cluster.memory_gb:
        fixes = ([] if plan.recompute == "full" and not plan.recompute_layers
                 else ["recompute=full"])
        fixes += ["a smaller micro_batch"] if plan.micro_batch > 1 else []
        fixes += [] if plan.sharding == "zero3" else ["zero3 sharding"]
        fixes += ["sequence_parallel=true"] if plan.tp > 1 and not plan.sequence_parallel else []
        raise PlanError(
            f"plan {plan.describe()} needs {mem:.1f} GB per device, more than the "
            f"{cluster.memory_gb:g} GB of {cluster.name}: use {', '.join(fixes)}, more pp/tp, "
            "or more devices")
    return out
