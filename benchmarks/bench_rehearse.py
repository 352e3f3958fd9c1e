"""Rehearse Frontier plans on this box: time, host memory, rehearsed vs modeled peak memory.

For each preset (default: every one that plans for a GPU cluster, ``PRESETS``: configs/
frontier-22b.yaml, -175b, -1t, llama31-8b-continue.yaml and pythia-continue.yaml at their
``parallel.nproc`` GCDs) the planner picks the plan as the plan stage does
(``model.planner.choose.choose`` on the preset's cluster with the preset's fixed fields), then
with ``--top K`` the next best plans that differ in memory, and each of their busiest ranks
(the first and the last pipeline stage) is rehearsed by
``model.rehearsal.plans.rehearsal_records`` (``model.rehearsal.rehearse``: the real trainer,
one warm-up and one measured training step on fake tensors in a fake process group of the
plan's world size), each in a fresh process so that its host peak RSS is its own. Recorded per rank:
wall seconds of the rehearsal and of the whole process, host peak RSS and the RSS before
the rehearsal (after imports and the plan search), the rehearsed peak memory (tensor bytes,
and with the cluster's margins) beside the memory model's (with margins, and its states +
activations without), the rehearsed memory by category, FLOPs and collective bytes.
Written to benchmarks/results/bench_rehearse.json; the last line printed is the figures as
one JSON object.

    .venv/bin/python benchmarks/bench_rehearse.py [--presets frontier-175b,frontier-1t]
        [--devices N] [--top K] [--timeout 2400] [--study | --held-out | --tuning [--only NAME,...]]

``--study`` rehearses instead the Frontier study's own plans (configs/published/
dash2023.yaml: 22B on 16 GCDs, 175B on 128, 1T on 1,024) on the Frontier cluster file, as
this trainer would run them, into benchmarks/results/bench_rehearse_study.json.
``--remodel NAME`` recomputes the model's side of an earlier results file with this
checkout's memory model (the rehearsals are measurements and stay; the file keeps when and
where they were rehearsed under ``rehearsed_at``).

``--held-out`` rehearses instead the held-out plans of benchmarks/heldout_plans.yaml (chosen
before the memory model was tuned, never used to tune it: the model's out-of-sample error)
into benchmarks/results/bench_rehearse_heldout.json, each entry's busiest ranks (``--only
NAME[,NAME]`` or ``NAME:STAGE``: only these, keeping the file's records of the others), with
per rank the entry's name, model, cluster and plan, the model's peak (with margins) and
tensor memory, the rehearsed peak, the error ``memory_error_pct`` and the seconds and host
RSS, and as figures the error's min, max and mean magnitude, the ranks within 5 %, the
longest rehearsal, the largest RSS and ``complete`` (every entry's ranks are in the file).
``--remodel bench_rehearse_heldout`` recomputes the model's side of it. ``--tuning`` does
the same for benchmarks/tuning_plans.yaml (the plans the memory model's terms were read
from) into bench_rehearse_tuning.json.

The figures: per preset and stage the chosen plan's ranks, and over every rehearsed rank the
memory model's error against the rehearsal (``memory_error_pct_min``/``_max``, +: the
model holds more), the worst error of the planner's FLOP and collective counts
(``count_error_pct_max``, ``model.planner.rank_counts``), the longest rehearsal and the
largest host RSS, whether every chosen plan fits by the rehearsal, and ``complete``: the
file is rewritten after every rank, so a run stopped early keeps what it measured.
"""
from __future__ import annotations

import argparse
import functools
import json
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, get_args

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import (  # noqa: E402 (needs the repository on sys.path)
    code_record,
    measured_files,
    project_files,
    write_results,
)

PRESETS = ("frontier-22b", "frontier-175b", "frontier-1t", "llama31-8b-continue",
           "pythia-continue")
"""Every preset that plans for a GPU cluster (the others run on the local one)."""
STAGES = ("first", "last")
CODE_ROOTS = ("model", "data_prep")
"""The folders whose code a rehearsal runs (in child processes this one does not import)."""


def peak_rss_gb() -> float:
    """Peak resident memory so far of this process or of a child it waited for (GB; Linux
    reports KiB); the rehearsal itself runs in a process the rank server forks, whose peak
    the record carries (``rehearsal_host_peak_rss_gb``)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) * 1024 / 1e9


def ranked_plans(preset: str, devices: int | None, top: int) -> tuple[Any, Any, Any, list, int]:
    """(model config, train config, cluster, plans, devices): the plan stage's choice first,
    then the search's next best, skipping plans that hold the same memory as one already
    listed (selective recompute with a flash kernel stores what no recompute stores), up to
    ``top`` plans."""
    from model.planner.choose import choose, fixed_fields
    from model.planner.memory_model import memory_breakdown
    from model.planner.microbench import load_measured_cluster
    from model.planner.shapes import Shapes, encode
    from workflows.plan import load_model_file

    model_cfg, train_cfg, full = load_model_file(ROOT / "configs" / f"{preset}.yaml")
    world = devices or full.parallel.nproc
    cluster = load_measured_cluster(full.parallel.cluster, world)
    plan, result = choose(model_cfg, train_cfg, cluster, world, fixed_fields(full.parallel),
                          top_k=max(10, 3 * top))
    shapes = Shapes.from_configs(model_cfg, train_cfg, cluster)
    picked, seen = [], set()
    for p in [plan] + (result.plans if result is not None else []):
        mem = memory_breakdown(shapes, encode([p]))
        key = (round(float(mem["first"][0])), round(float(mem["last"][0])), p.tp, p.pp, p.dp)
        if key not in seen and len(picked) < top:
            seen.add(key)
            picked.append(p)
    return model_cfg, train_cfg, cluster, picked, world


STUDY = "dash2023"
"""The Frontier study's published plans (configs/published/dash2023.yaml), rehearsed with
``--study`` as this trainer would run them."""


def study_run(name: str) -> tuple[Any, Any, Any, Any, int]:
    """(model config, train config, cluster, plan, devices) of the study's run ``name``: its
    model as a neox GPT with a 4h MLP, its sequence, batch, GCDs and plan."""
    from model.config import ModelConfig, TrainConfig
    from model.planner.cluster import load_cluster
    from model.planner.published import load_published

    rows = [r for r in load_published() if r.source == STUDY and r.name == name]
    if not rows or rows[0].plan is None:
        raise SystemExit(f"no {STUDY} run named {name!r} with a plan")
    row = rows[0]
    s = row.shapes
    model_cfg = ModelConfig(family="llama" if s.llama else "neox", n_layers=s.n_layers,
                            d_model=s.d_model, n_heads=s.n_heads, n_kv_heads=s.kv_heads,
                            ffn_hidden=s.ffn, vocab_size=s.vocab, max_seq_len=s.seq_len)
    train_cfg = TrainConfig(seq_len=s.seq_len, global_batch=row.global_batch, dtype=s.dtype)
    return model_cfg, train_cfg, load_cluster(row.cluster), row.plan, row.devices


def study_names() -> list[str]:
    """The study's runs that have a plan."""
    from model.planner.published import load_published

    return [r.name for r in load_published() if r.source == STUDY and r.plan is not None]


HELDOUT = "heldout"
"""The source prefix of a held-out plan's records (``heldout:NAME``)."""
HELDOUT_PLANS = ROOT / "benchmarks" / "heldout_plans.yaml"
HELDOUT_RESULTS = "bench_rehearse_heldout"
TUNING = "tuning"
"""The source prefix of a tuning plan's records (``tuning:NAME``)."""
PLAN_SETS = {HELDOUT: (HELDOUT_PLANS, HELDOUT_RESULTS),
             TUNING: (ROOT / "benchmarks" / "tuning_plans.yaml", "bench_rehearse_tuning")}
"""Plan files of one entry format, by source prefix: (plans file, results name). The
held-out set tests the memory model; the tuning set is what its terms were read from."""
ENTRY_FIELDS = ("name", "model", "seq_len", "global_batch", "dtype", "cluster", "devices",
                "plan")


class HeldOutError(ValueError):
    """A held-out entry that cannot be rehearsed as written; the message names it."""


@dataclass
class HeldOut:
    """One held-out entry: its model, training batch, cluster name, devices and plan."""

    name: str
    model: Any
    train: Any
    cluster: str
    devices: int
    plan: Any


def load_heldout(path: Path = HELDOUT_PLANS) -> list[HeldOut]:
    """The held-out entries of ``path``, each checked as the trainer would (the plan's own
    rules for its model, batch and devices, a readable cluster); HeldOutError naming the
    first bad entry and what to fix."""
    import yaml

    from model.config import DType, ModelConfig, TrainConfig
    from model.parallel.layout import LAYOUT_FIELDS, Plan, PlanError
    from model.planner.cluster import ClusterError, load_cluster, read_cluster_file

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise HeldOutError(f"cannot read held-out plans {path}: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("plans"), list):
        raise HeldOutError(f"{path}: expected a mapping with a list under 'plans'")
    out: list[HeldOut] = []
    for i, entry in enumerate(raw["plans"]):
        where = f"{path}: entry {i} ({entry.get('name', '?') if isinstance(entry, dict) else '?'})"
        if not isinstance(entry, dict):
            raise HeldOutError(f"{where}: expected a mapping with {list(ENTRY_FIELDS)}")
        missing = [k for k in ENTRY_FIELDS if k not in entry]
        extra = sorted(set(entry) - set(ENTRY_FIELDS))
        if missing or extra:
            raise HeldOutError(f"{where}: missing {missing}, unknown {extra}; an entry has "
                               f"exactly {list(ENTRY_FIELDS)}")
        if any(e.name == entry["name"] for e in out):
            raise HeldOutError(f"{where}: the name is taken by an earlier entry; names are unique")
        plan_raw = entry["plan"] if isinstance(entry["plan"], dict) else {}
        lacking = [k for k in LAYOUT_FIELDS if k not in plan_raw]
        if lacking:
            raise HeldOutError(f"{where}: plan lacks {lacking}; write every plan field")
        if entry["dtype"] not in get_args(DType):
            raise HeldOutError(f"{where}: dtype {entry['dtype']!r} is not one of "
                               f"{get_args(DType)}")
        try:
            model_cfg = ModelConfig(**entry["model"])
            train_cfg = TrainConfig(seq_len=entry["seq_len"], global_batch=entry["global_batch"],
                                    dtype=entry["dtype"])
            plan = Plan.from_dict(plan_raw)
            plan.check(model_cfg, train_cfg, entry["devices"])
            _, cluster_raw = read_cluster_file(entry["cluster"])
            if not cluster_raw.get("measured"):  # a measured one is measured when rehearsed
                load_cluster(entry["cluster"])
        except (TypeError, ValueError, ClusterError, PlanError) as exc:
            raise HeldOutError(f"{where}: {exc}") from None
        out.append(HeldOut(entry["name"], model_cfg, train_cfg, entry["cluster"],
                           entry["devices"], plan))
    return out


@functools.cache
def heldout_entries(kind: str = HELDOUT) -> dict[str, HeldOut]:
    """The entries of plan set ``kind`` (``PLAN_SETS``) by name (read once per process)."""
    return {e.name: e for e in load_heldout(PLAN_SETS[kind][0])}


def heldout_entry(name: str, kind: str = HELDOUT) -> HeldOut:
    """The entry ``name`` of plan set ``kind``; SystemExit naming it where there is none."""
    entries = heldout_entries(kind)
    if name not in entries:
        raise SystemExit(f"no plan named {name!r} in {PLAN_SETS[kind][0]}")
    return entries[name]


def heldout_run(name: str, kind: str = HELDOUT) -> tuple[Any, Any, Any, Any, int]:
    """(model config, train config, cluster, plan, devices) of the entry ``name``."""
    from model.planner.microbench import load_measured_cluster

    e = heldout_entry(name, kind)
    return e.model, e.train, load_measured_cluster(e.cluster, e.devices), e.plan, e.devices


def source_run(source: str) -> tuple[Any, Any, Any, Any, int] | None:
    """The run of a study's (``dash2023:NAME``) or held-out (``heldout:NAME``) plan, or None
    for a preset's (which the planner chooses)."""
    kind, _, name = source.partition(":")
    if kind == STUDY:
        return study_run(name)
    if kind in PLAN_SETS:
        return heldout_run(name, kind)
    return None


def entry_fields(source: str) -> dict[str, Any]:
    """What a held-out rank's record says of its entry (nothing for other sources)."""
    kind, _, name = source.partition(":")
    if kind not in PLAN_SETS:
        return {}
    e = heldout_entry(name, kind)
    return {"name": name, "model": asdict(e.model), "seq_len": e.train.seq_len,
            "global_batch": e.train.global_batch, "dtype": e.train.dtype,
            "cluster": e.cluster}


def rehearse_stage(preset: str, stage: str, devices: int | None, index: int = 0) -> dict[str, Any]:
    """In this process: rehearse the first or last stage's rank of the preset's plan number
    ``index`` (0: the plan the stage chooses), or of a study's or held-out plan (``preset``
    ``dash2023:NAME`` or ``heldout:NAME``, index -1)."""
    t0 = time.perf_counter()
    from model.rehearsal.plans import rehearsal_records
    from model.rehearsal.rehearse import busiest_ranks
    run = source_run(preset)
    if run is not None:  # index -1: a study's or held-out plan as written
        model_cfg, train_cfg, cluster, plan, world = run
    else:
        model_cfg, train_cfg, cluster, plans, world = ranked_plans(preset, devices, index + 1)
        plan = plans[index]
    ranks = busiest_ranks(plan)
    if stage == "last" and len(ranks) == 1:
        return {"preset": preset, "stage": stage, "plan_index": index, "plan": plan.describe(),
                "skipped": "one pipeline stage: its first rank is also its last"}
    rank = ranks[0] if stage == "first" else ranks[-1]
    before = peak_rss_gb()
    record = rehearsal_records(model_cfg, train_cfg, plan, cluster, world, ranks=[rank])[0]
    return {"preset": preset, **entry_fields(preset), "plan_index": index,
            "plan": plan.describe(), "plan_fields": plan.to_dict(), "devices": world,
            "device_memory_gb": cluster.memory_gb, **record,
            "memory_error_pct": memory_error_pct(record),
            "process_seconds": time.perf_counter() - t0,
            "host_peak_rss_before_gb": before,
            "host_peak_rss_gb": max(peak_rss_gb(), record["rehearsal_host_peak_rss_gb"])}


def remodel(record: dict[str, Any]) -> dict[str, Any]:
    """The record with its model-side figures (``peak_memory_gb``, ``modeled_tensor_memory_gb``,
    ``rehearsed_over_modeled``) recomputed by this checkout's memory model; the rehearsed
    figures are measurements and stay."""
    from model.parallel.layout import Plan
    from model.planner.microbench import load_measured_cluster
    from model.rehearsal.plans import modeled_rank_memory
    from workflows.plan import load_model_file

    if "error" in record:
        return record
    run = source_run(record["preset"])
    if run is not None:
        model_cfg, train_cfg, cluster, plan, world = run
        entry = entry_fields(record["preset"])
        if entry and (entry["model"] != record["model"]
                      or plan.key() != Plan.from_dict(record["plan_fields"]).key()):
            raise SystemExit(f"{record['preset']}: the entry's model or plan is no longer the "
                             f"one rehearsed ({record['plan']}): rehearse it again")
    else:
        model_cfg, train_cfg, full = load_model_file(ROOT / "configs" / f"{record['preset']}.yaml")
        world = record["devices"]
        cluster = load_measured_cluster(full.parallel.cluster, world)
        plan = Plan.from_dict(record["plan_fields"])
    peak, tensors = modeled_rank_memory(model_cfg, train_cfg, plan, cluster, world,
                                        record["stage"])
    out = {**record, "peak_memory_gb": peak, "modeled_tensor_memory_gb": tensors,
           "rehearsed_over_modeled": record["rehearsed_peak_memory_gb"] / tensors}
    return {**out, "memory_error_pct": memory_error_pct(out)}


def run_child(preset: str, stage: str, devices: int | None, timeout: float,
              index: int = 0) -> dict[str, Any]:
    """``rehearse_stage`` in a fresh interpreter; its record, or the reason it has none."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", preset, stage, str(index)]
    if devices:
        cmd += ["--devices", str(devices)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"preset": preset, "stage": stage, "plan_index": index,
                "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"preset": preset, "stage": stage, "plan_index": index,
                "error": proc.stderr[-2000:]}
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    record["wall_seconds"] = time.perf_counter() - t0
    record["code_digest"] = run_code()["digest"]
    return record


@functools.cache
def run_code() -> dict[str, Any]:
    """The code this run rehearses with: this script, what it imported and every module of
    :data:`CODE_ROOTS`. Each rank it rehearses records the digest (``code_digest``), so a
    file that keeps ranks from an earlier run shows which ones other code measured."""
    return code_record(sorted(set(measured_files()) | set(project_files(CODE_ROOTS))))


def outcome_of(record: dict[str, Any]) -> str:
    """One line on a rehearsed rank: the plan, the peaks and the time, or the error."""
    if "error" in record:
        return record["error"][-300:]
    return (f"{record['plan']} rank {record['rank']}: rehearsed "
            f"{record['rehearsed_peak_memory_gb']:.2f} GB vs modeled "
            f"{record['modeled_tensor_memory_gb']:.2f} GB ({memory_error_pct(record):+.1f} %; "
            f"{record['peak_memory_gb']:.2f} GB with margins) in "
            f"{record['rehearsal_seconds']:.0f} s, host peak RSS "
            f"{record['host_peak_rss_gb']:.2f} GB")


def memory_error_pct(record: dict[str, Any]) -> float:
    """The model's tensor memory against the rehearsal's, in percent (+: the model holds more)."""
    return 100 * (record["modeled_tensor_memory_gb"] / record["rehearsed_peak_memory_gb"] - 1)


def figures_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline figures, one set per preset and stage."""
    out: dict[str, Any] = {}
    done = [r for r in records if "error" not in r]
    if done:
        errors = [memory_error_pct(r) for r in done]
        out["ranks_rehearsed"] = len(done)
        out["plans_rehearsed"] = len({(r["preset"], r["plan"]) for r in done})
        out["memory_error_pct_min"] = round(min(errors), 2)
        out["memory_error_pct_max"] = round(max(errors), 2)
        out["memory_within_5pct"] = all(abs(e) <= 5 for e in errors)
        picks = [r for r in done if r.get("plan_index", 0) == 0]
        if picks:
            out["picks_fit_by_rehearsal"] = all(r["rehearsed_fits_device"] for r in picks)
        counted = [r for r in done if "count_errors" in r]
        if counted:
            worst = max(abs(e) for r in counted for e in r["count_errors"].values())
            out["count_error_pct_max"] = round(100 * worst, 3)
            out["counts_within_2pct"] = worst <= 0.02
        out["rehearsal_seconds_max"] = round(max(r["rehearsal_seconds"] for r in done), 1)
        out["host_peak_rss_gb_max"] = round(max(r["host_peak_rss_gb"] for r in done), 3)
    for r in records:
        if r.get("plan_index", 0) not in (0, -1):  # the pick, or a study's own plan
            continue
        name = r["preset"].replace("frontier-", "").replace(f"{STUDY}:", "")
        key = f"{name}_{r['stage']}"
        if "error" in r:
            out[f"{key}_error"] = r["error"][:200]
            continue
        out.update({
            f"{key}_rank": r["rank"],
            f"{key}_rehearsal_seconds": round(r["rehearsal_seconds"], 1),
            f"{key}_host_peak_rss_gb": round(r["host_peak_rss_gb"], 3),
            f"{key}_rehearsed_peak_memory_gb": round(r["rehearsed_peak_memory_gb"], 2),
            f"{key}_rehearsed_with_margins_gb": round(
                r["rehearsed_peak_memory_gb_with_margins"], 2),
            f"{key}_modeled_peak_memory_gb": round(r["peak_memory_gb"], 2),
            f"{key}_modeled_tensor_memory_gb": round(r["modeled_tensor_memory_gb"], 2),
            f"{key}_rehearsed_over_modeled": round(r["rehearsed_over_modeled"], 3),
            f"{key}_memory_error_pct": round(memory_error_pct(r), 2),
            f"{key}_fits_device": r["rehearsed_fits_device"],
        })
    return out


def heldout_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The held-out figures: the memory model's out-of-sample error over the rehearsed ranks
    (min, max, mean magnitude, how many within 5 %, the worst rank), the ranks that failed,
    the longest rehearsal and the largest host RSS."""
    done = [r for r in records if "error" not in r]
    out: dict[str, Any] = {"ranks_rehearsed": len(done),
                           "plans_rehearsed": len({r["name"] for r in done}),
                           "ranks_failed": len(records) - len(done)}
    if done:
        errors = [memory_error_pct(r) for r in done]
        worst = max(done, key=lambda r: abs(memory_error_pct(r)))
        out.update({
            "memory_error_pct_min": round(min(errors), 2),
            "memory_error_pct_max": round(max(errors), 2),
            "memory_error_pct_mean_abs": round(sum(abs(e) for e in errors) / len(errors), 2),
            "memory_within_5pct_count": sum(abs(e) <= 5 for e in errors),
            "memory_worst_rank": f"{worst['name']}:{worst['stage']}",
            "rehearsal_seconds_max": round(max(r["rehearsal_seconds"] for r in done), 1),
            "host_peak_rss_gb_max": round(max(r["host_peak_rss_gb"] for r in done), 3),
        })
    return out


def heldout_jobs(only: list[str] | None, kind: str = HELDOUT) -> list[tuple[str, int, str]]:
    """(source, plan index, stage) of every held-out entry's busiest ranks, or of those named
    by ``only`` (``NAME`` or ``NAME:STAGE``, comma-separated); SystemExit naming an unknown
    one."""
    from model.rehearsal.rehearse import busiest_ranks

    jobs = [(f"{kind}:{e.name}", -1, stage) for e in load_heldout(PLAN_SETS[kind][0])
            for stage in STAGES[:len(busiest_ranks(e.plan))]]
    if not only:
        return jobs
    wanted = [item.strip() for value in only for item in value.split(",") if item.strip()]
    known = {j[0].split(":", 1)[1] for j in jobs}
    unknown = sorted({w.split(":")[0] for w in wanted} - known)
    if unknown:
        raise SystemExit(f"--only: no plan named {unknown} in {PLAN_SETS[kind][0]}")
    return [j for j in jobs if any(w in (j[0].split(":", 1)[1], f"{j[0].split(':', 1)[1]}:"
                                         f"{j[2]}") for w in wanted)]


def figures_for(name: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of results file ``name``: the held-out set's, or the presets' and study's."""
    plan_sets = {results for _, results in PLAN_SETS.values()}
    return heldout_figures(records) if name in plan_sets else figures_of(records)


def run_heldout(args: argparse.Namespace, kind: str = HELDOUT) -> int:
    """``--held-out`` (or ``--tuning``): rehearse the set's entries' busiest ranks (or
    ``--only`` these, keeping the file's records of the other current entries), each in a
    fresh process, rewriting the set's results file after every rank."""
    try:
        every = heldout_jobs(None, kind)
    except HeldOutError as exc:
        raise SystemExit(str(exc)) from None
    jobs = heldout_jobs(args.only, kind)
    results = PLAN_SETS[kind][1]
    path = ROOT / "benchmarks" / "results" / f"{results}.json"
    records: list[dict[str, Any]] = []
    if args.only and path.is_file():
        current = {(src, stage) for src, _, stage in every}
        redo = {(src, stage) for src, _, stage in jobs}
        records = [r for r in json.loads(path.read_text())["ranks"]
                   if (r["preset"], r["stage"]) in current - redo]

    def complete() -> bool:
        done = {(r["preset"], r["stage"]) for r in records if "error" not in r}
        return all((src, stage) in done for src, _, stage in every)

    t0 = time.perf_counter()
    for n, (source, index, stage) in enumerate(jobs, 1):
        record = run_child(source, stage, None, args.timeout, index)
        record.setdefault("name", source.split(":", 1)[1])
        records = [r for r in records if (r["preset"], r["stage"]) != (source, stage)]
        records.append(record)
        print(f"[bench_rehearse {kind} {n}/{len(jobs)}, ETA "
              f"{(time.perf_counter() - t0) / n * (len(jobs) - n) / 60:.0f} min] {source} "
              f"{stage}: {outcome_of(record)}", flush=True)
        # written after every rank, so a run stopped early keeps what it measured
        write_results(results, {**heldout_figures(records), "complete": complete()},
                      {"args": vars(args), "ranks": records}, code=run_code())
    print(json.dumps({**heldout_figures(records), "complete": complete()}))
    return 0


def only_job(only: str, study: bool) -> tuple[str, int | None, str]:
    """(source, plan index or None for any, stage) of an ``--only`` value: ``RUN:STAGE``
    with ``--study``, else ``PRESET[#INDEX]:STAGE`` (e.g. ``pythia-continue#1:first``)."""
    source, _, stage = only.rpartition(":")
    if not source or stage not in STAGES:
        raise SystemExit(f"--only {only!r}: expected NAME:STAGE with STAGE one of {STAGES}")
    if study:
        return f"{STUDY}:{source}", None, stage
    preset, _, index = source.partition("#")
    return preset, int(index) if index else None, stage


def matches(job: tuple[str, int, str], wanted: tuple[str, int | None, str]) -> bool:
    """Whether a (source, plan index, stage) job is the ``--only`` one."""
    return (job[0], job[2]) == (wanted[0], wanted[2]) and wanted[1] in (None, job[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS),
                    help="comma-separated config names under configs/")
    ap.add_argument("--devices", type=int, default=None,
                    help="GCDs to plan for (default: each preset's parallel.nproc)")
    ap.add_argument("--timeout", type=float, default=2400.0,
                    help="seconds per rehearsed rank (the study's 175B ranks take 16-20 "
                         "minutes here)")
    ap.add_argument("--top", type=int, default=1,
                    help="rehearse the K best plans of each preset that differ in memory "
                         "(1: the chosen plan only)")
    ap.add_argument("--study", action="store_true",
                    help=f"rehearse the Frontier study's own plans ({STUDY}) instead")
    ap.add_argument("--held-out", action="store_true",
                    help="rehearse the held-out plans of benchmarks/heldout_plans.yaml "
                         "instead (the memory model's out-of-sample error)")
    ap.add_argument("--tuning", action="store_true",
                    help="rehearse the memory model's tuning plans of "
                         "benchmarks/tuning_plans.yaml instead")
    ap.add_argument("--only", metavar="RUN:STAGE", action="append",
                    help="rehearse only these ranks, keeping the file's records of the "
                         "others (repeatable): PRESET[#INDEX]:STAGE (e.g. "
                         "pythia-continue#1:first); with --study RUN:STAGE (e.g. "
                         "gpt-22b:first); with --held-out NAME[,NAME] or NAME:STAGE")
    ap.add_argument("--remodel", metavar="NAME",
                    help="recompute the model-side figures of benchmarks/results/NAME.json "
                         "with this checkout's memory model (no rehearsal) and rewrite it")
    ap.add_argument("--child", nargs=3, metavar=("PRESET", "STAGE", "INDEX"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(rehearse_stage(args.child[0], args.child[1], args.devices,
                                        int(args.child[2]))))
        return 0
    if args.remodel:
        path = ROOT / "benchmarks" / "results" / f"{args.remodel}.json"
        old = json.loads(path.read_text())
        records = [remodel(r) for r in old["ranks"]]
        figures = {**figures_for(args.remodel, records),
                   "complete": old["figures"].get("complete", False)}
        write_results(args.remodel, figures, {
            "args": old.get("args"), "ranks": records,
            "rehearsed_at": old.get("rehearsed_at") or {"commit": old.get("commit"),
                                                         "date": old.get("date")}},
            code=run_code())
        print(json.dumps(figures))
        return 0
    if sum((args.held_out, args.tuning, args.study)) > 1:
        raise SystemExit("--held-out, --tuning and --study are sets of plans: give one")
    if args.held_out or args.tuning:
        return run_heldout(args, HELDOUT if args.held_out else TUNING)
    records = []
    # plan by plan across the presets, so that a run stopped early has each preset's best
    jobs = [(preset, index, stage) for index in range(args.top)
            for preset in args.presets.split(",") for stage in STAGES]
    if args.study:
        jobs = [(f"{STUDY}:{name}", -1, stage) for name in study_names() for stage in STAGES]
    name = "bench_rehearse_study" if args.study else "bench_rehearse"
    if args.only:
        wanted = [only_job(only, args.study) for only in args.only]
        jobs = [job for job in jobs if any(matches(job, w) for w in wanted)]
        path = ROOT / "benchmarks" / "results" / f"{name}.json"
        kept = json.loads(path.read_text())["ranks"] if path.is_file() else []
        records = [r for r in kept if not any(
            matches((r["preset"], r.get("plan_index", -1), r["stage"]), w) for w in wanted)]
    t0 = time.perf_counter()
    for n, (preset, index, stage) in enumerate(jobs, 1):
        record = run_child(preset, stage, args.devices, args.timeout, index)
        if "skipped" not in record:
            records = [r for r in records  # a kept record of this rank is replaced
                       if (r["preset"], r.get("plan_index"), r["stage"]) != (preset, index, stage)]
            records.append(record)
            print(f"[bench_rehearse {n}/{len(jobs)}, ETA "
                  f"{(time.perf_counter() - t0) / n * (len(jobs) - n) / 60:.0f} min] {preset} "
                  f"#{index} {stage}: {outcome_of(record)}", flush=True)
        # written after every rank, so a run stopped early keeps what it measured
        write_results(name, {**figures_of(records), "complete": n == len(jobs)},
                      {"args": vars(args), "ranks": records}, code=run_code())
    print(json.dumps({**figures_of(records), "complete": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
