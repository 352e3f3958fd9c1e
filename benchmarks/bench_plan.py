"""How good is the planner? Measured against real runs on this machine, timed on Frontier.

1. Search speed: the full plan search for a 1T model on 3,072 Frontier GCDs (median of 5).
2. Frontier predictions: the chosen plan's TFLOPS per device and MFU for the 22B, 175B and
   1T presets at 1,024 and 3,072 GCDs, each beside its rehearsal (``rehearsal`` per pick:
   the first and last pipeline stage's rank rehearsed on fake tensors, its seconds, its
   peak memory and the memory model's error against it; ``rehearsal_*`` figures). By
   default the rehearsals are read from ``bench_rehearse.py``'s results files where they
   rehearsed the same plan on as many GCDs (the model's side recomputed by this checkout,
   when and where they were rehearsed kept); ``--rehearse`` rehearses every pick afresh
   (tens of minutes: a 1T rank takes minutes).
3. Local truth: for the tiny preset (4 x 128) and a small model (4 x 256, 8 heads) on 2 and
   4 gloo ranks, every valid plan
   (recompute none, no sequence parallelism: on these models memory never binds, so
   recompute only costs time) is run for a few steps on synthetic tokens.
   --max-plans N keeps the N/2 best predicted plus evenly spaced others per setting.
   A setting is measured in two launches of its ranks
   (``stages.plan.measure_worker.measure_plans``: the
   ranks start once and build every plan once, so the seconds of starting ranks, several
   times a small plan's steps, are paid once; then the plans take turns step by step, so a
   spell of load on the box falls on all of them alike): a survey, every plan for 2 rounds
   of --steps steps; then a contest, the pick and the two fastest (when within 10 % of the
   fastest) for --rounds rounds of --contest-steps steps more, and a further contest (two at
   most) beside the pick and the fastest for plans only the survey measured that come within
   10 % of the fastest after it (``unmatched``). A plan's figure is the median
   of all its steps (each build's warm-up step left out), with its 95 % interval.
   Reported: pick_ratio (measured tokens/s of the planner's pick / measured best, and what the
   survey alone gave, ``pick_ratio_survey``), the step-time MAPE of the raw
   model and of the model calibrated leave-one-out (``model.planner.calibration.calibrate``
   fitted on the other plans of the same setting, as the plan stage's calibration does; and the
   plain two-scale fit it replaced, ``..._unshrunk``), how well each plan's figure is known
   (the 95 % interval of its median, and the spread of its rounds' medians, (max - min) /
   median) beside the gaps between the plans compared, and the launches' cost (seconds per
   launch and beyond the timed steps).
   --repeats N (default 3) makes N independent runs, each in a fresh runs dir with a fresh
   microbenchmark; the figures are the worst run's, with every run's listed (``*_runs``), every
   run's microbenchmark figures (``microbench_runs``) and how much each moved from run to run,
   with the raw predictions and the measurements of the plans measured in every run
   (``across_runs``).

--published: instead, the GPU time model against published measurements (configs/published):
for each source, the framework factors are fitted on the other fitting sources and the source
is predicted (leave one source out); printed per row, the tokens/s per device MAPE per source
and overall (``published_mape``), and for the Frontier study its % of peak, measured and
predicted by the model fitted on every fitting source (``frontier_<model>_points_off``, the
planner's own figures: the MI250X stack factor is fitted on the study) and with the study held
out (``..._points_off_loso``). Written to benchmarks/results/bench_plan_published.json.

The last line printed is one JSON object; the same figures, with the commit and machine, go to
benchmarks/results/bench_plan.json (bench_plan_search.json with --skip-local).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import RESULTS_DIR, write_results
from model.planner.calibration import calibrate, fit_scales, predict, unshrunk_scales
from model.planner.choose import choose, fixed_fields
from model.planner.cluster import load_cluster
from model.planner.microbench import cache_file, load_measured_cluster
from model.planner.search import enumerate_plans, evaluate, search
from model.planner.shapes import Shapes, decode
from stages.config import load_config
from stages.plan.measure_worker import measure_plans

SMALL = ["model.n_layers=4", "model.d_model=256", "model.n_heads=8", "train.global_batch=8"]


def search_speed() -> float:
    cfg = load_config(ROOT / "configs" / "frontier-1t.yaml")
    cl = load_cluster("frontier")
    s = Shapes.from_configs(cfg.model, cfg.train, cl)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        search(s, cl, 3072, cfg.train.global_batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def frontier_predictions(rehearse: bool = False, timeout: float = 1800.0) -> dict[str, dict]:
    """The plan stage's pick per preset on 1,024 and 3,072 Frontier GCDs, its predictions
    and its rehearsal (stored, or afresh with ``rehearse``)."""
    cl = load_cluster("frontier")
    out = {}
    for name in ("22b", "175b", "1t"):
        cfg = load_config(ROOT / "configs" / f"frontier-{name}.yaml")
        for n in (1024, 3072):
            plan, _ = choose(cfg.model, cfg.train, cl, n, fixed_fields(cfg.parallel))
            pred = plan.predictions
            pick = {"plan": plan.describe(),
                    "tflops_per_device": round(pred["tflops_per_device"], 2),
                    "mfu": round(pred["mfu"], 4),
                    "memory_gb": round(pred["memory_gb_per_device"], 1)}
            if rehearse:
                records, source = rehearse_pick(name, n, plan.describe(), timeout), {}
            else:
                records, source = stored_rehearsals(f"frontier-{name}", n, plan.describe())
            if records:
                pick.update(rehearsal=rehearsal_of(records), rehearsed_at=source)
            out[f"{name}_{n}"] = pick
            rehearsed = " ".join(
                f"{st}: {r['rehearsed_peak_memory_gb']:.1f} GB rehearsed "
                f"({r['memory_error_pct']:+.1f} % modeled) in {r['rehearsal_seconds']:.0f} s"
                for st, r in pick.get("rehearsal", {}).items()) or "not rehearsed"
            print(f"[frontier] {name} on {n} GCDs: {plan.describe()}  "
                  f"{plan.predictions['tflops_per_device']:.1f} TFLOPS/GCD, "
                  f"MFU {plan.predictions['mfu']:.1%}; {rehearsed}", flush=True)
    return out


REHEARSAL_FILES = ("bench_rehearse",)
"""bench_rehearse.py's results files, searched in this order for a pick's rehearsal."""


def stored_rehearsals(preset: str, devices: int, plan: str) -> tuple[list[dict], dict]:
    """The first and last stage's rehearsal records of ``plan`` on ``devices`` GCDs from
    bench_rehearse.py's results files, and where they came from ({} when none has them)."""
    for name in REHEARSAL_FILES:
        path = RESULTS_DIR / f"{name}.json"
        if not path.is_file():
            continue
        stored = json.loads(path.read_text())
        found = [r for r in stored.get("ranks", [])
                 if r.get("preset") == preset and r.get("devices") == devices
                 and r.get("plan") == plan and "error" not in r and "skipped" not in r]
        if found:
            return found, {"file": path.name,
                           **stored.get("rehearsed_at", {"commit": stored.get("commit"),
                                                         "date": stored.get("date")})}
    return [], {}


def rehearse_pick(name: str, devices: int, plan: str, timeout: float) -> list[dict]:
    """Rehearse the busiest ranks of the plan the plan stage picks for the preset on
    ``devices`` GCDs, each in a process of its own (bench_rehearse.run_child)."""
    from benchmarks.bench_rehearse import run_child

    records = [run_child(f"frontier-{name}", stage, devices, timeout) for stage in ("first",
                                                                                  "last")]
    done = [r for r in records if "error" not in r and "skipped" not in r]
    for r in done:
        if r["plan"] != plan:
            raise SystemExit(f"[frontier] {name} on {devices}: the rehearsal's plan "
                             f"{r['plan']} is not the pick {plan}")
    return done


def rehearsal_of(records: list[dict]) -> dict[str, dict]:
    """Per rehearsed stage: seconds, rehearsed and modeled peak memory (GB, the model this
    checkout's), the model's error in percent and whether the rank fits with the margins."""
    from benchmarks.bench_rehearse import memory_error_pct, remodel

    out = {}
    for record in map(remodel, records):
        out[record["stage"]] = {
            "rank": record["rank"],
            "rehearsal_seconds": round(record["rehearsal_seconds"], 1),
            "rehearsed_peak_memory_gb": round(record["rehearsed_peak_memory_gb"], 2),
            "modeled_tensor_memory_gb": round(record["modeled_tensor_memory_gb"], 2),
            "memory_error_pct": round(memory_error_pct(record), 2),
            "fits_device": record["rehearsed_fits_device"]}
    return out


def rehearsal_figures(frontier: dict[str, dict]) -> dict[str, Any]:
    """The rehearsal figures over the picks that have one: how many, the longest rehearsal
    and the memory model's error range."""
    stages = [st for pick in frontier.values() for st in pick.get("rehearsal", {}).values()]
    if not stages:
        return {"rehearsal_picks": 0}
    errors = [st["memory_error_pct"] for st in stages]
    return {
        "rehearsal_picks": sum(1 for p in frontier.values() if p.get("rehearsal")),
        "rehearsal_seconds_max": max(st["rehearsal_seconds"] for st in stages),
        "rehearsal_memory_error_pct_min": min(errors),
        "rehearsal_memory_error_pct_max": max(errors),
        "rehearsal_picks_fit": all(st["fits_device"] for st in stages)}


def candidates(cfg, nproc: int, max_plans: int):
    """Valid plans of one setting, best predicted first (optionally thinned)."""
    cl = load_measured_cluster("local", nproc, cache_dir=cfg.runs_dir / "cache" / "microbench")
    s = Shapes.from_configs(cfg.model, cfg.train, cl)
    c, _ = enumerate_plans(s, nproc, cfg.train.global_batch,
                           {"recompute": "none", "sequence_parallel": False})
    ev = evaluate(s, cl, c, nproc, cfg.train.global_batch)
    order = list(ev["tokens_per_s"].argsort()[::-1])
    if max_plans and len(order) > max_plans:
        top = order[: max_plans // 2]
        rest = order[max_plans // 2:]
        step = len(rest) / (max_plans - len(top))
        order = top + [rest[int(i * step)] for i in range(max_plans - len(top))]
    plans = []
    for i in order:
        p = decode(c, int(i))
        p.predictions = {"step_time_s": float(ev["step_time_s"][i]),
                         "tokens_per_s": float(ev["tokens_per_s"][i]),
                         "compute_s": float(ev["parts"]["compute"][i]),
                         "comm_s": float(ev["parts"]["comm"][i])}
        plans.append(p)
    return plans, len(c["tp"])


SURVEY_ROUNDS = 2
"""Rounds in which every plan of a setting is measured (one launch)."""
CONTEND = 0.10
"""After the survey, plans within this fraction of the fastest (and the pick) are the
contenders, measured again (a second launch)."""
MAX_CONTENDERS = 2
"""At most this many of the fastest are contenders (the pick besides)."""
MAX_RECONTESTS = 2
"""Further contest launches at most, each for the plans the contests left unmatched
(``unmatched``)."""
TOLERANCE = 0.05
"""What a pick may lose (1 - the pick_ratio target): a gap under it needs no resolving."""
Z95 = 1.96


def median_ci(samples: list[float]) -> tuple[float, float]:
    """The median of ``samples`` and the relative half-width of its distribution-free 95 %
    confidence interval (the order statistics n/2 -+ 1.96 sqrt(n)/2); inf under 6 samples."""
    xs = sorted(samples)
    n, med = len(xs), statistics.median(xs)
    if n < 6:
        return med, math.inf
    reach = Z95 * math.sqrt(n) / 2
    lo = xs[max(0, math.floor(n / 2 - reach))]
    hi = xs[min(n - 1, math.ceil(n / 2 + reach) - 1)]
    return med, (hi - lo) / (2 * med)


def _spread(times: list[float]) -> float | None:
    """Relative spread of repeated measurements of one plan: (max - min) / median."""
    return (max(times) - min(times)) / statistics.median(times) if len(times) > 1 else None


def paired_gap(a: list[float], b: list[float]) -> tuple[float, float] | None:
    """How much slower ``a`` is than ``b`` (median of the step-by-step ratios - 1) and the
    relative half-width of that median's 95 % interval (``median_ci``), when the two were
    measured in the same launches, taking turns step by step (as many steps each, the k-th of
    each in the same turn, so a spell of load falls on both); else None."""
    if len(a) != len(b) or not a:
        return None
    med, width = median_ci([x / y for x, y in zip(a, b)])
    return med - 1, width


def _resolved(samples: list[list[float]], i: int, best: int) -> bool:
    """Whether plan i is set apart from the fastest, or within TOLERANCE of it: the interval
    of their step-by-step gap (``paired_gap``), or where they did not take turns both medians'
    intervals (``median_ci``), narrower than half of the larger of their gap and TOLERANCE."""
    paired = paired_gap(samples[i], samples[best])
    if paired is not None:
        gap, width = paired
        return width < max(abs(gap), TOLERANCE) / 2
    (mi, wi), (mb, wb) = median_ci(samples[i]), median_ci(samples[best])
    return max(wi, wb) < max(abs(mi / mb - 1), TOLERANCE) / 2


def unmatched(samples: list[list[float]], ok: list[int], contested: set[int]) -> list[int]:
    """Plans measured only in the survey whose median is within CONTEND of the fastest
    contested plan's: a survey's few steps, from another launch, cannot set them apart from
    plans measured since, so they contest too (at most MAX_CONTENDERS, fastest first)."""
    medians = {i: statistics.median(samples[i]) for i in ok}
    fastest = min(medians[i] for i in contested)
    near = sorted((i for i in ok if i not in contested
                   and medians[i] <= (1 + CONTEND) * fastest), key=medians.get)
    return near[:MAX_CONTENDERS]


def measure_setting(label: str, cfg, nproc: int, max_plans: int, work: Path, steps: int,
                    rounds: int = 3, contest_steps: int = 20) -> dict:
    """Measure a setting's plans in two launches or more
    (``stages.plan.measure_worker.measure_plans``:
    one start-up each, the plans taking turns step by step, so a spell of load hits them
    alike): a survey, every plan for SURVEY_ROUNDS rounds of ``steps`` steps; then a contest,
    the contenders (the pick and the plans within CONTEND of the fastest, at most
    MAX_CONTENDERS of them) for ``rounds`` rounds of ``contest_steps`` more; then, at most
    MAX_RECONTESTS times, the same for the plans the contests left ``unmatched``, beside the
    pick and the fastest contested plan. A plan's figure is the median of all its steps (each
    build's first step, the warm-up, left out), with a 95 % interval (``median_ci``)."""
    plans, n_valid = candidates(cfg, nproc, max_plans)
    print(f"[local] {label} on {nproc} ranks: {n_valid} valid plans, measuring {len(plans)}",
          flush=True)
    samples: list[list[float]] = [[] for _ in plans]  # every timed step
    round_medians: list[list[float]] = [[] for _ in plans]
    launches: list[dict] = []
    failed: dict[int, str] = {}
    t0 = time.perf_counter()

    def measure(indices: list[int], n_rounds: int, n_steps: int, phase: str) -> None:
        m = measure_plans(cfg, [plans[i] for i in indices], work / f"{label}-n{nproc}-{phase}",
                          n_steps, n_rounds)
        for j, i in enumerate(indices):
            for times in m["step_times"][j]:
                samples[i].extend(times)
                round_medians[i].append(statistics.median(times))
            if m["errors"][j] or not m["step_times"][j]:
                failed[i] = (m["errors"][j] or m["failed"] or "no measurement")[-300:]
            med, width = median_ci(samples[i]) if samples[i] else (math.nan, math.inf)
            print(f"  {phase:<7} {plans[i].describe():<40} predicted "
                  f"{plans[i].predictions['step_time_s']:.4f} s  measured {med:.4f} s "
                  f"+-{width:.1%} ({len(samples[i])} steps)"
                  + (f"  FAILED: {failed[i]}" if i in failed else ""), flush=True)
        launches.append({"phase": phase, "seconds": m["seconds"], "plans": len(indices),
                         "timed_s": sum(sum(t) for ts in m["step_times"] for t in ts)})
        print(f"  {phase} launch: {m['seconds']:.0f} s, {time.perf_counter() - t0:.0f} s in",
              flush=True)

    measure(list(range(len(plans))), SURVEY_ROUNDS, steps, "survey")
    ok = [i for i in range(len(plans)) if samples[i] and i not in failed]
    survey = {i: statistics.median(samples[i]) for i in ok}
    if ok:
        best = min(ok, key=survey.get)
        near = sorted((i for i in ok if survey[i] <= (1 + CONTEND) * survey[best]),
                      key=survey.get)
        contenders = sorted(set(near[:MAX_CONTENDERS]) | ({0} if 0 in ok else set()))
        if len(contenders) > 1 and rounds > 0:
            measure(contenders, rounds, contest_steps, "contest")
            contested = set(contenders)
            for k in range(1, MAX_RECONTESTS + 1):
                newcomers = unmatched(samples, ok, contested)
                if not newcomers:
                    break
                lead = min(contested, key=lambda i: statistics.median(samples[i]))
                again = sorted(set(newcomers) | {lead} | ({0} if 0 in ok else set()))
                measure(again, rounds, contest_steps, f"recontest{k}")
                contested |= set(again)
    ok = [i for i in range(len(plans)) if samples[i]]
    if not ok:
        return {"label": label, "nproc": nproc, "ok": False, "errors": list(failed.values())}
    rows = []
    for i in ok:
        med, width = median_ci(samples[i])
        rows.append({"index": i, "plan": plans[i].describe(), "pred": plans[i].predictions,
                     "meas": med, "ci": width, "survey": survey.get(i, med),
                     "round_medians": round_medians[i], "steps": len(samples[i]),
                     "samples": samples[i],
                     "spread": _spread(round_medians[i])})
    best = min(rows, key=lambda r: r["meas"])
    pick = rows[0] if ok[0] == 0 else None
    by_meas = sorted(rows, key=lambda r: r["meas"])
    survey_best = min(r["survey"] for r in rows)
    points = [{"compute_s": r["pred"]["compute_s"], "comm_s": r["pred"]["comm_s"],
               "measured_s": r["meas"]} for r in rows]
    raw_ape = [abs(r["pred"]["step_time_s"] - r["meas"]) / r["meas"] for r in rows]
    loo = {"new": [], "unshrunk": []}
    loo_ape = {"new": [], "unshrunk": []}
    for i, r in enumerate(rows):
        others = points[:i] + points[i + 1:]
        for name, sc in (("new", fit_scales(others)), ("unshrunk", unshrunk_scales(others))):
            pred = predict(sc, points[i])
            loo[name].append(pred)
            loo_ape[name].append(abs(pred - r["meas"]) / r["meas"])

    def loo_pick_ratio(name: str) -> float:
        return best["meas"] / rows[min(range(len(rows)), key=lambda i: loo[name][i])]["meas"]

    cal = calibrate(points)
    spreads = [r["spread"] for r in rows if r["spread"] is not None]
    compared = [r for r in rows if r is not best
                and (r is pick or r["meas"] <= (1 + CONTEND) * best["meas"])]
    gaps = [r["meas"] / best["meas"] - 1 for r in compared]
    seconds = sum(x["seconds"] for x in launches)
    timed = sum(x["timed_s"] for x in launches)
    return {
        "label": label, "nproc": nproc, "ok": True, "n_valid": n_valid, "n_measured": len(rows),
        "pick": pick["plan"] if pick else None, "best": best["plan"],
        "pick_ratio": best["meas"] / pick["meas"] if pick else 0.0,
        "pick_ratio_survey": survey_best / pick["survey"] if pick else 0.0,
        "calibrated_pick_ratio": loo_pick_ratio("new"),
        "calibrated_pick_ratio_unshrunk": loo_pick_ratio("unshrunk"),
        "mape_raw": statistics.mean(raw_ape),
        "mape_calibrated_loo": statistics.mean(loo_ape["new"]),
        "mape_calibrated_loo_unshrunk": statistics.mean(loo_ape["unshrunk"]),
        "calibration": {k: v for k, v in cal.items()
                        if not (isinstance(v, float) and not math.isfinite(v))},
        "gap_pick_best": pick["meas"] / best["meas"] - 1 if pick else None,
        "gap_runner_up": by_meas[1]["meas"] / by_meas[0]["meas"] - 1 if len(rows) > 1 else None,
        # the plans compared with the fastest: their gaps to it beside how well their medians
        # are known (95 % interval half-widths) and how far their rounds' medians spread
        "gaps_compared": gaps,
        "median_ci_compared": [r["ci"] for r in (best, *compared)],
        # the same gaps step by step, with their intervals, for plans that took turns
        "paired_gaps_compared": [paired_gap(r["samples"], best["samples"]) for r in compared],
        "repeat_spread_median": statistics.median(spreads) if spreads else None,
        "repeat_spread_max": max(spreads) if spreads else None,
        # the pick and every plan within CONTEND of the fastest set apart from it (or within
        # TOLERANCE of it) by their steps
        "resolved": all(_resolved([r_["samples"] for r_ in rows], i, rows.index(best))
                        for i, r in enumerate(rows) if r in compared),
        "launches": len(launches), "seconds": time.perf_counter() - t0,
        "launch_seconds": [round(x["seconds"], 1) for x in launches],
        "step_time_mean_s": statistics.mean(r["meas"] for r in rows),
        "rounds": {"survey": SURVEY_ROUNDS, "contest": rounds},
        "steps": {"survey": steps, "contest": contest_steps},
        # what the launches cost beyond their timed steps: starting ranks, building each plan
        "launch_overhead_s": (seconds - timed) / len(launches),
        "plans": [{"plan": r["plan"], "predicted_s": r["pred"]["step_time_s"],
                   "compute_s": r["pred"]["compute_s"], "comm_s": r["pred"]["comm_s"],
                   "median_s": r["meas"], "median_ci": r["ci"], "steps": r["steps"],
                   "round_medians_s": r["round_medians"], "survey_s": r["survey"]}
                  for r in rows],
    }


def microbench_figures(cfg, nproc: int) -> dict:
    """The figures a run's fresh microbenchmark gave (from its cache file)."""
    path = cache_file(nproc, cfg.runs_dir / "cache" / "microbench")
    data = json.loads(path.read_text())
    f = data["fields"]
    keep = ("peak_tflops", "hbm_bandwidth_gbps", "layer_overhead_us", "microbatch_overhead_us",
            "optimizer_overhead_us", "fsdp_unit_overhead_us", "tp_layer_overhead_us",
            "tp_microbatch_overhead_us", "tp_comm_scale", "alone_speedup", "receive_stall_us",
            "ddp_stall_us", "stall_after_us", "kernel_overhead_us")
    out = {k: f[k] for k in keep if k in f}
    ar = f.get("collectives", {}).get("all_reduce")
    if ar:
        out["all_reduce_gbps"] = ar["bandwidth_gbps"]
        out["all_reduce_latency_us"] = ar["latency_us"]
    out["seconds"] = data.get("seconds")
    return out


def _rel_spread(values: list[float]) -> float | None:
    vals = [v for v in values if v]
    return max(vals) / min(vals) - 1 if len(vals) > 1 else None


def published(results_dir: str) -> dict:
    """Leave-one-source-out fit and prediction of the published measurements, and the Frontier
    study predicted by the model fitted on every fitting source (the planner's own)."""
    from model.planner.published import (
        fit_all,
        leave_one_source_out,
        load_published,
        pick_versus_source,
        predict_row,
    )

    rows = load_published()
    loo = leave_one_source_out(rows)
    print(f"{'source':<16} {'row':<32} {'plan':<44} {'measured':>9} {'predicted':>9} {'error':>7}")
    for r in loo["rows"]:
        print(f"{r['source']:<16} {r['name']:<32} {r['plan']:<44} {r['measured_tps']:>9.1f} "
              f"{r['predicted_tps']:>9.1f} {r['error']:>+7.1%}"
              + (f"  ({r['measured_pct_peak']:.1%} of peak measured, "
                 f"{r['predicted_pct_peak']:.1%} predicted)" if "measured_pct_peak" in r else ""))
    for src, m in loo["per_source"].items():
        print(f"[published] {src}: MAPE {m:.1%} (factors fitted on the others: "
              f"{ {k: round(v, 3) for k, v in loo['factors'][src].items()} }, stack "
              f"{ {k: round(v, 3) for k, v in loo['stacks'][src].items()} })")
    full_fit, full_stack = fit_all(rows)
    print(f"[published] fitted on every fitting source (the cluster files' values): "
          f"{ {k: round(v, 3) for k, v in full_fit.items()} }, stack "
          f"{ {k: round(v, 3) for k, v in full_stack.items()} }")
    in_sample = [predict_row(r, full_fit, stacks=full_stack) for r in rows]
    mape_in = sum(abs(p["error"]) for p in in_sample) / len(in_sample)
    print(f"[published] in-sample (every fitting source): MAPE {mape_in:.1%}")

    def points(p: dict) -> float:
        return round(100 * (p["predicted_pct_peak"] - p["measured_pct_peak"]), 2)

    frontier = {r["name"]: {"measured_pct_peak": round(r["measured_pct_peak"], 4),
                            "predicted_pct_peak_loso": round(r["predicted_pct_peak"], 4),
                            "points_off_loso": points(r), "plan": r["plan"]}
                for r in loo["rows"] if r["source"] == "dash2023"}
    for p in (p for p in in_sample if p["source"] == "dash2023"):
        frontier[p["name"]].update(predicted_pct_peak=round(p["predicted_pct_peak"], 4),
                                   points_off=points(p))
        print(f"[frontier] {p['name']}: measured {p['measured_pct_peak']:.2%} of peak, "
              f"predicted {p['predicted_pct_peak']:.2%} (fitted model), "
              f"{frontier[p['name']]['predicted_pct_peak_loso']:.2%} (study held out)")
    # the planner's own pick for the study's models, devices and batches, priced the same way
    for row in (r for r in rows if r.source == "dash2023"):
        cmp = pick_versus_source(row, full_fit, stacks=full_stack)
        frontier[row.name].update(pick_plan=cmp["pick_plan"], speedup=round(cmp["speedup"], 3),
                                  source_step_s=round(cmp["source_step_s"], 1),
                                  pick_step_s=round(cmp["pick_step_s"], 1),
                                  saved_s={k: round(v, 2) for k, v in cmp["saved_s"].items()})
        saves = ", ".join(f"{k} {v:.1f} s" for k, v in cmp["saved_s"].items())
        print(f"[frontier] {row.name}: study {cmp['source_plan']} {cmp['source_step_s']:.1f} s, "
              f"planner {cmp['pick_plan']} {cmp['pick_step_s']:.1f} s per step: "
              f"x{cmp['speedup']:.2f} (saves {saves})")
    result = {"published_mape": round(loo["mape"], 4),
              "published_mape_by_source": round(
                  sum(loo["per_source"].values()) / len(loo["per_source"]), 4),
              "published_mape_in_sample": round(mape_in, 4),
              **{f"mape_{k}": round(v, 4) for k, v in loo["per_source"].items()},
              "frontier_max_points_off": round(max(
                  abs(v["points_off"]) for v in frontier.values()), 2) if frontier else None,
              **{f"frontier_{k}_points_off": v["points_off"] for k, v in frontier.items()},
              "frontier_max_points_off_loso": round(max(
                  abs(v["points_off_loso"]) for v in frontier.values()), 2) if frontier else None,
              **{f"frontier_{k}_points_off_loso": v["points_off_loso"]
                 for k, v in frontier.items()}}
    path = write_results("bench_plan_published", result,
                         {"rows": loo["rows"], "factors": loo["factors"], "stacks": loo["stacks"],
                          "frontier": frontier, "factors_all_fit_sources": full_fit,
                          "stack_all_fit_sources": full_stack, "rows_in_sample": in_sample},
                         results_dir)
    print(f"[results] written to {path}", file=sys.stderr, flush=True)
    return result


def local_run(max_plans: int, steps: int, rounds: int,
              contest_steps: int) -> tuple[dict, list[dict], dict]:
    """One independent measurement of the local settings, in a fresh runs dir (so with a
    fresh microbenchmark); return its figures ({} when no setting succeeded), its settings
    and its microbenchmarks' figures by rank count."""
    settings, micro = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        work = Path(tmp)
        runs = ["tracking.runs_dir=" + str(work / "runs")]
        for label, over in (("tiny", []), ("small", SMALL)):
            cfg = load_config("tiny", runs + over)
            for nproc in (2, 4):
                cfg.parallel.nproc = nproc
                settings.append(measure_setting(label, cfg, nproc, max_plans, work, steps,
                                                rounds, contest_steps))
                micro.setdefault(str(nproc), microbench_figures(cfg, nproc))
    ok = [s for s in settings if s["ok"]]
    for s in ok:
        print(f"[local] {s['label']} n={s['nproc']}: pick {s['pick']} / best {s['best']}: "
              f"ratio {s['pick_ratio']:.3f} (survey only "
              f"{s['pick_ratio_survey']:.3f}, calibrated {s['calibrated_pick_ratio']:.3f}"
              f"); step-time MAPE raw {s['mape_raw']:.1%}, calibrated (leave-one-out) "
              f"{s['mape_calibrated_loo']:.1%} ({s['calibration']['model']}; unshrunk "
              f"two scales {s['mape_calibrated_loo_unshrunk']:.1%}); repeat spread "
              f"{s['repeat_spread_median'] or 0:.1%} (max {s['repeat_spread_max'] or 0:.1%}), "
              f"gap pick/best {s['gap_pick_best'] or 0:.1%}, runner-up "
              f"{s['gap_runner_up'] or 0:.1%}; {s['launches']} launches in {s['seconds']:.0f} s",
              flush=True)
    if not ok:
        return {}, settings, micro
    return {
        "pick_ratio": round(min(s["pick_ratio"] for s in ok), 4),
        "pick_ratio_survey": round(min(s["pick_ratio_survey"] for s in ok), 4),
        "calibrated_pick_ratio": round(min(s["calibrated_pick_ratio"] for s in ok), 4),
        "calibrated_pick_ratio_unshrunk": round(
            min(s["calibrated_pick_ratio_unshrunk"] for s in ok), 4),
        "step_time_mape": round(statistics.mean(s["mape_calibrated_loo"] for s in ok), 4),
        "step_time_mape_raw": round(statistics.mean(s["mape_raw"] for s in ok), 4),
        "step_time_mape_unshrunk": round(
            statistics.mean(s["mape_calibrated_loo_unshrunk"] for s in ok), 4),
        "repeat_spread_max": round(max(s["repeat_spread_max"] or 0 for s in ok), 4),
        "plans_measured": sum(s["n_measured"] for s in ok),
        "launches": sum(s["launches"] for s in ok),
        "plans_valid": sum(s["n_valid"] for s in ok),
    }, settings, micro


def across_runs(settings: list[dict], micro: list[dict]) -> dict:
    """How the same setting's figures moved from run to run: each microbenchmark field's
    spread (max / min - 1), and per setting the spread of the raw prediction and of the
    measurement of each plan measured in every run."""
    fields = sorted({k for m in micro for n in m.values() for k in n if k != "seconds"})
    micro_spread = {n: {k: _rel_spread([m[n].get(k) for m in micro if n in m]) for k in fields}
                    for n in sorted({n for m in micro for n in m})}
    per_setting = {}
    for key in sorted({(s["label"], s["nproc"]) for s in settings if s["ok"]}):
        runs = [s for s in settings if s["ok"] and (s["label"], s["nproc"]) == key]
        common = set.intersection(*({p["plan"] for p in s["plans"]} for s in runs))
        pred, meas = [], []
        for plan in sorted(common):
            rows = [next(p for p in s["plans"] if p["plan"] == plan) for s in runs]
            pred.append(_rel_spread([r["predicted_s"] for r in rows]))
            meas.append(_rel_spread([r["median_s"] for r in rows]))
        pred = [v for v in pred if v is not None]
        meas = [v for v in meas if v is not None]
        per_setting[f"{key[0]}_n{key[1]}"] = {
            "plans_in_every_run": len(common),
            "raw_prediction_spread_median": statistics.median(pred) if pred else None,
            "raw_prediction_spread_max": max(pred) if pred else None,
            "measured_spread_median": statistics.median(meas) if meas else None,
            "measured_spread_max": max(meas) if meas else None,
            "mape_raw_runs": [round(s["mape_raw"], 4) for s in runs],
            "mape_calibrated_runs": [round(s["mape_calibrated_loo"], 4) for s in runs],
            "mape_unshrunk_runs": [round(s["mape_calibrated_loo_unshrunk"], 4) for s in runs],
            "pick_ratio_runs": [round(s["pick_ratio"], 4) for s in runs],
            "pick_ratio_survey_runs": [round(s["pick_ratio_survey"], 4)
                                                for s in runs],
            "calibration_runs": [s["calibration"]["model"] for s in runs],
            "pick_runs": [s["pick"] for s in runs], "best_runs": [s["best"] for s in runs]}
    return {"microbench_spread": micro_spread, "settings": per_setting}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-plans", type=int, default=6,
                    help="plans per setting (default 6: about 7 minutes a run on 2 cores; "
                         "0: all, about an hour)")
    ap.add_argument("--steps", type=int, default=6,
                    help="training steps of a plan in each survey round (the first is the "
                         "build's warm-up; the others count)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of the contest launch, where the contenders are measured "
                         "again (default 3; 0: the survey only)")
    ap.add_argument("--contest-steps", type=int, default=20,
                    help="training steps of a contender in each contest round (default 20)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="independent local runs, each with a fresh microbenchmark; the worst "
                         "run's pick_ratio and step_time_mape are the figures (default 3)")
    ap.add_argument("--skip-local", action="store_true", help="only the search and Frontier parts")
    ap.add_argument("--results-dir", default=str(RESULTS_DIR),
                    help="where bench_plan.json (bench_plan_search.json with --skip-local) goes")
    ap.add_argument("--rehearse", action="store_true",
                    help="rehearse every Frontier pick afresh (else read bench_rehearse.py's "
                         "results files)")
    ap.add_argument("--published", action="store_true",
                    help="only the fit to published GPU measurements (leave one source out)")
    args = ap.parse_args()
    if args.published:
        print(json.dumps(published(args.results_dir)))
        return
    speed = search_speed()
    print(f"[search] 1T on 3,072 Frontier GCDs: {speed:.3f} s (median of 5)", flush=True)
    frontier = frontier_predictions(args.rehearse)
    result = {"search_seconds_1t_3072": round(speed, 4), **rehearsal_figures(frontier)}
    settings: list[dict] = []
    extra: dict = {}
    if not args.skip_local:
        runs, micro = [], []
        t_local = time.perf_counter()
        for run in range(args.repeats):
            print(f"[local] run {run + 1}/{args.repeats} (fresh microbenchmark)", flush=True)
            figures, run_settings, run_micro = local_run(args.max_plans, args.steps,
                                                         args.rounds,
                                                         args.contest_steps)
            runs.append(figures)
            micro.append(run_micro)
            settings.extend({**s, "run": run} for s in run_settings)
        extra = {"microbench_runs": micro, "across_runs": across_runs(settings, micro),
                 "local_seconds": round(time.perf_counter() - t_local, 1)}
        if runs and all(runs):
            # The worst run is the figure: the planner must hold on every run.
            result.update(
                pick_ratio=min(r["pick_ratio"] for r in runs),
                step_time_mape=max(r["step_time_mape"] for r in runs),
                pick_ratio_runs=[r["pick_ratio"] for r in runs],
                step_time_mape_runs=[r["step_time_mape"] for r in runs],
                step_time_mape_raw_runs=[r["step_time_mape_raw"] for r in runs],
                step_time_mape_unshrunk_runs=[r["step_time_mape_unshrunk"] for r in runs],
                pick_ratio_survey_runs=[r["pick_ratio_survey"] for r in runs],
                calibrated_pick_ratio=min(r["calibrated_pick_ratio"] for r in runs),
                calibrated_pick_ratio_runs=[r["calibrated_pick_ratio"] for r in runs],
                calibrated_pick_ratio_unshrunk_runs=[r["calibrated_pick_ratio_unshrunk"]
                                                     for r in runs],
                repeat_spread_max_runs=[r["repeat_spread_max"] for r in runs],
                plans_measured=sum(r["plans_measured"] for r in runs),
                launches=sum(r["launches"] for r in runs),
                plans_valid=runs[0]["plans_valid"],
                local_seconds=extra["local_seconds"])
    result.update({f"{k}_tflops_per_device": v["tflops_per_device"] for k, v in frontier.items()})
    result.update({f"{k}_mfu": v["mfu"] for k, v in frontier.items()})
    name = "bench_plan_search" if args.skip_local else "bench_plan"
    path = write_results(name, result, {"args": vars(args), "frontier": frontier,
                                        "settings": settings, **extra}, args.results_dir)
    print(f"[results] written to {path}", file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
