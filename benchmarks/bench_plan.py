"""How good is the planner? Measured against real runs on this machine, timed on Frontier.

1. Search speed: the full plan search for a 1T model on 3,072 Frontier GCDs (median of 5).
2. Frontier predictions: the chosen plan's TFLOPS per device and MFU for the 22B, 175B and
   1T presets at 1,024 and 3,072 GCDs.
3. Local truth: for the tiny preset (4 x 128) and a small model (4 x 256, 8 heads) on 2 and
   4 gloo ranks, every valid plan
   (recompute none, no sequence parallelism: on these models memory never binds, so
   recompute only costs time) is run for a few steps through stages.plan.measure_plan.
   --max-plans N keeps the N best predicted plus evenly spaced others per setting.
   The pick and the three fastest are run twice (the faster run counts: the machine may be
   shared). Reported: pick_ratio (measured tokens/s of the planner's pick / measured best), the
   step-time MAPE of the raw model and of the model calibrated leave-one-out (scales fitted on
   the other plans of the same setting, as the plan stage's refinement does).
   --repeats N (default 3) makes N independent runs, each in a fresh runs dir with a fresh
   microbenchmark; the figures are the worst run's, with every run's listed (``*_runs``).

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
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import RESULTS_DIR, write_results
from model.planner.calibration import fit_scales
from model.planner.cluster import load_cluster
from model.planner.microbench import load_measured_cluster
from model.planner.search import enumerate_plans, evaluate, search
from model.planner.shapes import Shapes, decode
from stages.config import load_config
from stages.plan import choose, measure_plan

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


def frontier_predictions() -> dict[str, dict]:
    cl = load_cluster("frontier")
    out = {}
    for name in ("22b", "175b", "1t"):
        cfg = load_config(ROOT / "configs" / f"frontier-{name}.yaml")
        for n in (1024, 3072):
            plan, _ = choose(cfg.model, cfg.train, cl, n, {})
            pred = plan.predictions
            out[f"{name}_{n}"] = {"plan": plan.describe(),
                                  "tflops_per_device": round(pred["tflops_per_device"], 2),
                                  "mfu": round(pred["mfu"], 4),
                                  "memory_gb": round(pred["memory_gb_per_device"], 1)}
            print(f"[frontier] {name} on {n} GCDs: {plan.describe()}  "
                  f"{plan.predictions['tflops_per_device']:.1f} TFLOPS/GCD, "
                  f"MFU {plan.predictions['mfu']:.1%}", flush=True)
    return out


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


def measure_setting(label: str, cfg, nproc: int, max_plans: int, work: Path, steps: int) -> dict:
    plans, n_valid = candidates(cfg, nproc, max_plans)
    print(f"[local] {label} on {nproc} ranks: {n_valid} valid plans, measuring {len(plans)}",
          flush=True)
    rows, t0 = [], time.perf_counter()
    for i, p in enumerate(plans):
        m = measure_plan(cfg, p, work / f"{label}-n{nproc}-{i}", steps=steps)
        done = i + 1
        eta = (time.perf_counter() - t0) / done * (len(plans) - done)
        if m["ok"]:
            rows.append({"plan": p.describe(), "pred": p.predictions, "meas": m["step_time_s"],
                         "meas_tps": m["tokens_per_s"]})
            print(f"  {done}/{len(plans)} {p.describe():<40} "
                  f"predicted {p.predictions['step_time_s']:.4f} s"
                  f"  measured {m['step_time_s']:.4f} s  ETA {eta:.0f} s", flush=True)
        else:
            print(f"  {done}/{len(plans)} {p.describe():<40} FAILED: {m['error'][-300:]}",
                  flush=True)
    if not rows:
        return {"label": label, "nproc": nproc, "ok": False}
    # the machine is shared: interference only adds time, so the planner's pick and the
    # three fastest are measured once more and each keeps its faster run
    recheck = {id(rows[0])} | {id(r) for r in sorted(rows, key=lambda r: r["meas"])[:3]}
    by_desc = {p.describe(): p for p in plans}
    for j, r in enumerate([r for r in rows if id(r) in recheck]):
        m = measure_plan(cfg, by_desc[r["plan"]], work / f"{label}-n{nproc}-re{j}", steps=steps)
        if m["ok"] and m["step_time_s"] < r["meas"]:
            r["meas"], r["meas_tps"] = m["step_time_s"], m["tokens_per_s"]
        print(f"  recheck {r['plan']:<40} measured {m.get('step_time_s', float('nan')):.4f} s"
              f" -> kept {r['meas']:.4f} s", flush=True)
    best = max(rows, key=lambda r: r["meas_tps"])
    pick = rows[0] if plans and rows[0]["plan"] == plans[0].describe() else None
    raw_ape = [abs(r["pred"]["step_time_s"] - r["meas"]) / r["meas"] for r in rows]
    loo_ape, loo_pred = [], []
    for i, r in enumerate(rows):
        others = [{"compute_s": o["pred"]["compute_s"], "comm_s": o["pred"]["comm_s"],
                   "measured_s": o["meas"]} for j, o in enumerate(rows) if j != i]
        sc = fit_scales(others)
        pred = sc["compute_scale"] * r["pred"]["compute_s"] + sc["comm_scale"] * r["pred"]["comm_s"]
        loo_pred.append(pred)
        loo_ape.append(abs(pred - r["meas"]) / r["meas"])
    cal_pick = rows[min(range(len(rows)), key=lambda i: loo_pred[i])]
    return {"label": label, "nproc": nproc, "ok": True, "n_valid": n_valid, "n_measured": len(rows),
            "pick": pick["plan"] if pick else None, "best": best["plan"],
            "pick_ratio": (pick["meas_tps"] / best["meas_tps"]) if pick else 0.0,
            "calibrated_pick_ratio": cal_pick["meas_tps"] / best["meas_tps"],
            "mape_raw": statistics.mean(raw_ape), "mape_calibrated_loo": statistics.mean(loo_ape)}


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


def local_run(max_plans: int, steps: int) -> tuple[dict, list[dict]]:
    """One independent measurement of the local settings, in a fresh runs dir (so with a
    fresh microbenchmark); return its figures ({} when no setting succeeded) and settings."""
    settings = []
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        work = Path(tmp)
        runs = ["tracking.runs_dir=" + str(work / "runs")]
        for label, over in (("tiny", []), ("small", SMALL)):
            cfg = load_config("tiny", runs + over)
            for nproc in (2, 4):
                cfg.parallel.nproc = nproc
                settings.append(measure_setting(label, cfg, nproc, max_plans, work, steps))
    ok = [s for s in settings if s["ok"]]
    for s in ok:
        print(f"[local] {s['label']} n={s['nproc']}: pick {s['pick']} / best {s['best']}: "
              f"ratio {s['pick_ratio']:.3f} (calibrated {s['calibrated_pick_ratio']:.3f}); "
              f"step-time MAPE raw {s['mape_raw']:.1%}, calibrated (leave-one-out) "
              f"{s['mape_calibrated_loo']:.1%}", flush=True)
    if not ok:
        return {}, settings
    return {
        "pick_ratio": round(min(s["pick_ratio"] for s in ok), 4),
        "calibrated_pick_ratio": round(min(s["calibrated_pick_ratio"] for s in ok), 4),
        "step_time_mape": round(statistics.mean(s["mape_calibrated_loo"] for s in ok), 4),
        "step_time_mape_raw": round(statistics.mean(s["mape_raw"] for s in ok), 4),
        "plans_measured": sum(s["n_measured"] for s in ok),
        "plans_valid": sum(s["n_valid"] for s in ok),
    }, settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-plans", type=int, default=8,
                    help="plans per setting (default 8: about 5 minutes a run on 2 cores; "
                         "0: all, about 45)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3,
                    help="independent local runs, each with a fresh microbenchmark; the worst "
                         "run's pick_ratio and step_time_mape are the figures (default 3)")
    ap.add_argument("--skip-local", action="store_true", help="only the search and Frontier parts")
    ap.add_argument("--results-dir", default=str(RESULTS_DIR),
                    help="where bench_plan.json (bench_plan_search.json with --skip-local) goes")
    ap.add_argument("--published", action="store_true",
                    help="only the fit to published GPU measurements (leave one source out)")
    args = ap.parse_args()
    if args.published:
        print(json.dumps(published(args.results_dir)))
        return
    speed = search_speed()
    print(f"[search] 1T on 3,072 Frontier GCDs: {speed:.3f} s (median of 5)", flush=True)
    frontier = frontier_predictions()
    result = {"search_seconds_1t_3072": round(speed, 4)}
    settings: list[dict] = []
    if not args.skip_local:
        runs = []
        for run in range(args.repeats):
            print(f"[local] run {run + 1}/{args.repeats} (fresh microbenchmark)", flush=True)
            figures, run_settings = local_run(args.max_plans, args.steps)
            runs.append(figures)
            settings.extend({**s, "run": run} for s in run_settings)
        if runs and all(runs):
            # The worst run is the figure: the planner must hold on every run.
            result.update(
                pick_ratio=min(r["pick_ratio"] for r in runs),
                step_time_mape=max(r["step_time_mape"] for r in runs),
                pick_ratio_runs=[r["pick_ratio"] for r in runs],
                step_time_mape_runs=[r["step_time_mape"] for r in runs],
                step_time_mape_raw_runs=[r["step_time_mape_raw"] for r in runs],
                calibrated_pick_ratio=min(r["calibrated_pick_ratio"] for r in runs),
                plans_measured=sum(r["plans_measured"] for r in runs),
                plans_valid=runs[0]["plans_valid"])
    result.update({f"{k}_tflops_per_device": v["tflops_per_device"] for k, v in frontier.items()})
    result.update({f"{k}_mfu": v["mfu"] for k, v in frontier.items()})
    name = "bench_plan_search" if args.skip_local else "bench_plan"
    path = write_results(name, result, {"args": vars(args), "frontier": frontier,
                                        "settings": settings}, args.results_dir)
    print(f"[results] written to {path}", file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
