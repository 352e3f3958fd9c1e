"""Per-rank measurement of several plans in one launch: ``python -m stages.plan.measure_worker
--spec SPEC.json``.

Starting ranks costs seconds a launch on a small machine (interpreter, torch, the process
group), several times the steps of a small plan, and each launch lands differently on the
cores. So plans of one world size are measured here in one launch: the ranks join one process
group and build every plan of the spec's ``extra["plans"]`` (``Plan.to_dict()``s; the real
``Trainer`` in its own ``out_dir/plan<i>``, synthetic tokens, no checkpoint, no tracking), run
one warm-up step of each, then ``extra["rounds"]`` rounds of ``spec.steps`` steps of each,
the plans taking turns step by step (each step's order rotated). A box's load comes and goes
in spells of a few seconds, longer than a step and shorter than a plan's run of steps (its
step times move 10-30 % from spell to spell, ``docs/planner.md``); plans that take turns
every step meet the same spells, so their steps compare where runs of steps did not. Each
step starts and ends at a barrier, so it is timed from the first rank's start to the last
rank's end.

``measure_plans`` launches it from the caller's process and reads what the ranks leave.
Rank 0 appends one JSON line per (round, plan) to ``out_dir/MEASUREMENTS_FILE``: ``index``,
``round``, ``plan``, ``step_time_s`` (the median) and ``step_times_s`` (every timed step).
A plan the trainer refuses (a ``ValueError`` from ``Plan.check``, raised alike on every rank
before any collective) gets one line with ``error`` and the others go on; anything else ends
the launch.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from model.parallel.threads import CPU_RANK_THREADS, THREADS_VAR

MEASUREMENTS_FILE = "measurements.jsonl"
MEASURE_WORKER = "stages.plan.measure_worker"
MEASURE_TIMEOUT_S = 900.0
"""A launch that runs longer is killed (what it measured so far is kept)."""


def round_order(n_plans: int, turn: int) -> list[int]:
    """The plans' order in one turn (a step of each): rotated by the turn, so each plan is
    first once in every ``n_plans`` turns."""
    shift = turn % n_plans if n_plans else 0
    return list(range(shift, n_plans)) + list(range(shift))


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


def run_spec(spec: Any) -> None:
    """Measure every plan of ``spec`` in this (already launched) rank."""
    import os

    os.environ.setdefault(THREADS_VAR, str(CPU_RANK_THREADS))
    import torch.distributed as dist

    from model.parallel.dist_env import from_environ, init_distributed
    from model.parallel.layout import Plan
    from model.training.batches import synthetic_batch_factory
    from model.training.trainer import Trainer
    from stages.config import config_from_dict

    cfg = config_from_dict(spec.config)
    plans = [Plan.from_dict(raw) for raw in spec.extra["plans"]]
    rounds = int(spec.extra.get("rounds", 1))
    out = Path(spec.out_dir)
    records = out / MEASUREMENTS_FILE
    env = from_environ()
    device = init_distributed(env)
    train = cfg.train
    batches = synthetic_batch_factory(cfg.model.vocab_size, train)

    def timed_step(trainer: Trainer) -> float:
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(trainer.batches.next_batch())
        dist.barrier()
        return time.perf_counter() - start

    try:
        trainers: dict[int, Trainer] = {}
        for i, plan in enumerate(plans):
            try:
                plan.check(cfg.model, train, env.world_size)
            except ValueError as refused:
                if env.rank == 0:
                    _append(records, {"index": i, "round": 0, "error": str(refused)})
                continue
            trainers[i] = Trainer(cfg.model, train, plan, out / f"plan{i}", batches, device,
                                  peak_tflops=spec.peak_tflops)
            timed_step(trainers[i])  # the warm-up of a fresh build, left out
        built = list(trainers)
        for r in range(rounds):
            times: dict[int, list[float]] = {i: [] for i in built}
            for s in range(spec.steps):
                for k in round_order(len(built), r * spec.steps + s):
                    times[built[k]].append(timed_step(trainers[built[k]]))
            if env.rank == 0:
                for i in built:
                    _append(records, {"index": i, "round": r, "plan": plans[i].describe(),
                                      "step_time_s": statistics.median(times[i]),
                                      "step_times_s": times[i]})
    finally:
        dist.destroy_process_group()


def measure_plans(cfg: Any, plans: list[Any], out_dir: str | Path, steps: int, rounds: int,
                  timeout_s: float = MEASURE_TIMEOUT_S) -> dict[str, Any]:
    """Run every plan (one world size) for ``rounds`` rounds of ``steps`` steps of synthetic
    tokens, all in one launch of local ranks (``stages.plan.measure_worker``: one start-up, every
    plan built once, the plans taking turns step by step).

    Returns {"step_times": per plan, per round, the seconds of each step (each build's warm-up
    step left out), "errors": per plan the refusal or None, "seconds": the launch's,
    "failed": the launch's own error or None}; what a launch that failed midway measured is
    kept."""
    from stages.mechanism import launch
    from stages.mechanism.launch import SPEC_FILE, RankSpec

    worlds = {p.world_size for p in plans}
    if len(worlds) != 1:
        raise ValueError(f"plans measured in one launch share a world size; got {sorted(worlds)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MEASUREMENTS_FILE).unlink(missing_ok=True)
    raw = cfg.to_dict()
    raw["parallel"].update(nproc=plans[0].world_size, nodes=1)
    raw["train"].update(checkpoint_every=0, checkpoint_minutes=None)
    spec = RankSpec(worker=MEASURE_WORKER, nproc=plans[0].world_size, nodes=1,
                    out_dir=str(out_dir.resolve()), config=raw, steps=steps, timeout_s=timeout_s,
                    extra={"plans": [p.to_dict() for p in plans], "rounds": rounds})
    path = spec.write(out_dir / SPEC_FILE)
    t0 = time.perf_counter()
    failed = None
    try:
        launch.run_local(path, out_dir / "worker.log", what="measurement", echo=False)
    except launch.RanksFailed as error:
        failed = str(error)[-1500:]
    times: list[list[list[float]]] = [[] for _ in plans]
    errors: list[str | None] = [None] * len(plans)
    records = out_dir / MEASUREMENTS_FILE
    for line in records.read_text().splitlines() if records.exists() else []:
        record = json.loads(line)
        if "error" in record:
            errors[record["index"]] = record["error"]
        else:
            times[record["index"]].append(record["step_times_s"])
    return {"step_times": times, "errors": errors, "seconds": time.perf_counter() - t0,
            "failed": failed}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``--spec PATH``."""
    from stages.mechanism.launch import rank_main

    return rank_main(__doc__.splitlines()[0], run_spec, argv)


if __name__ == "__main__":
    sys.exit(main())
