"""Per-rank training entry: ``python -m stages.train.worker --spec SPEC.json``.

Launched by ``stages.mechanism.launch`` (its own ranks locally, srun under Slurm; rank identity
from either
environment). The ``RankSpec`` holds the pipeline config, the plan, the token store (or
None for synthetic tokens), the output directory, the tracking run and an optional step
override. Rank (last pipeline stage, dp 0, tp 0) writes ``out_dir/summary.json``.

Out of time: SIGUSR1 (what the training block asks Slurm to send ``site.save_before_end_s``
ahead of the walltime, ``#SBATCH --signal``) and SIGTERM (the walltime itself, a
``scancel``, a preemption) do not end the rank; they ask the trainer to stop. The handlers
are set first thing, before torch is imported, so a signal during start-up is kept too.
The ranks vote after every step, all stop after the same one with its checkpoint written,
the logger rank writes ``out-of-time.json`` and every rank ends with the out-of-time exit
(``stages.mechanism.launch.OutOfTime``). A rank stuck in a collective still ends: Slurm sends
SIGKILL ``KillWait`` seconds after its SIGTERM, the local launcher 30 s after its own
(``stages.mechanism.forked_ranks.FAILED_RANKS_GRACE_S``).

Each step is logged once in the stage's MLflow run, however often the ranks were started:
the logger rank's metrics thread asks which steps the run already holds (``logged_through``)
before it sends anything, and sends only the steps after them.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_asked: list[str] = []  # the names of the stop signals this rank received
_STARTED = time.time()


def _ask_to_stop(signum: int, frame: Any) -> None:
    _asked.append(signal.Signals(signum).name)


def stop_requested() -> bool:
    """Whether this rank received a stop signal."""
    return bool(_asked)


for _signum in STOP_SIGNALS:
    signal.signal(_signum, _ask_to_stop)

from model.parallel.threads import CPU_RANK_THREADS, THREADS_VAR  # noqa: E402

os.environ.setdefault(THREADS_VAR, str(CPU_RANK_THREADS))  # before torch starts its threads

import torch.distributed as dist  # noqa: E402

from data_prep.atomic import write_json_atomic  # noqa: E402
from data_prep.store import open_store  # noqa: E402, F401 - before the ranks fork (validation)
from model.parallel.dist_env import from_environ, init_distributed, launch_id  # noqa: E402
from model.parallel.layout import Plan  # noqa: E402
from model.training.batches import synthetic_batch_factory  # noqa: E402
from model.training.health import Faults  # noqa: E402
from model.training.metrics import SPOOL_FILE, BackgroundSink, spool_lines  # noqa: E402
from model.training.progress_record import (  # noqa: E402
    PROGRESS_DIR,
    close_record,
    explain_timeout,
    open_record,
)
from model.training.trainer import RunHooks, Trainer, logger_rank, logs_metrics  # noqa: E402
from model.training.validation import ValidationSet  # noqa: E402
from stages.config import config_from_dict  # noqa: E402
from stages.mechanism.launch import OUT_OF_TIME_FILE, OutOfTime, RankSpec, rank_main  # noqa: E402


def make_batch_factory(spec: RankSpec, cfg):
    """(dp_rank, dp_size) -> batch source: the token store's loader, or synthetic tokens."""
    train = cfg.train
    if not spec.store:
        return synthetic_batch_factory(cfg.model.vocab_size, train)

    def factory(dp_rank: int, dp_size: int):
        from data_prep.loader import TokenWindowLoader

        return TokenWindowLoader(spec.store, "train", train.seq_len, train.global_batch,
                                 dp_rank, dp_size, train.seed)

    return factory


def validation_set(spec: RankSpec, cfg) -> ValidationSet | None:
    """What the trainer validates on every train.eval_every steps: the store's validation
    split, or held-out synthetic sequences without a store; None when eval_every is 0."""
    train = cfg.train
    if not train.eval_every:
        return None
    if spec.store:
        return ValidationSet.from_store(spec.store)
    return ValidationSet.synthetic(cfg.model.vocab_size, train.seq_len, train.slice_tokens,
                                   train.seed)


def this_job(spec: RankSpec) -> dict[str, Any]:
    """This job for the job ledger: the Slurm job (its id, nodes and start: Slurm's
    SLURM_JOB_START_TIME, else squeue's StartTime, else this rank's start) or, launched on
    this machine, the local launch (the spec's nodes, this rank's start). Asked by one
    rank only (squeue)."""
    env = os.environ
    if not env.get("SLURM_JOB_ID"):
        launch = env.get("TORCHELASTIC_RUN_ID") or str(os.getppid())
        return {"id": f"local-{launch}", "nodes": spec.nodes, "started": _STARTED}
    job_id = env["SLURM_JOB_ID"]
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or spec.nodes)
    started = env.get("SLURM_JOB_START_TIME", "")
    if started.isdigit():
        return {"id": job_id, "nodes": nodes, "started": float(started)}
    return {"id": job_id, "nodes": nodes, "started": _slurm_start(job_id) or _STARTED}


def _slurm_start(job_id: str) -> float | None:
    """The job's start (epoch seconds) by squeue, or None."""
    import subprocess
    from datetime import datetime

    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-O", "StartTime"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return datetime.fromisoformat(out.strip()).timestamp()
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


LOGGED_METRIC = "loss"  # logged at every logged step: its last step is the run's


def logged_through(uri: str, run_id: str, spool: Path) -> int:
    """The last step of run ``run_id`` whose metrics are already logged: the highest step at
    which the store holds ``loss``, or at which the metrics spool (records kept while the
    store was away, which the sink sends before anything new) holds it for this run.

    A resumed training recomputes the steps after its checkpoint bitwise, so the steps up to
    this one are not logged again (the sink drops them: ``BackgroundSink``). The logger rank
    asks at its own start rather than the driver writing it into the rank spec: the spec is
    written once per attempt (``stages.train.prepare``), before Parsl retries the ranks
    within the same pipeline run, so only a rank that asks when it starts sees what the try
    before it logged; one rule then covers a rerun of the pipeline and a retry. Where the
    store cannot be read the spool alone decides, and one line says so (steps already in the
    store may then be logged twice)."""
    from stages.mechanism.tracking import last_step

    spooled = [record["step"] for record in map(json.loads, spool_lines(spool))
               if record.get("run_id") == run_id and LOGGED_METRIC in record.get("metrics", {})]
    try:
        stored = last_step(uri, run_id, LOGGED_METRIC)
    except Exception as error:  # noqa: BLE001 - the store's errors vary; training goes on
        from model.training.metrics import short_reason

        print(f"[train] could not read which steps MLflow run {run_id} holds "
              f"({short_reason(error)}); going by the metrics spool", flush=True)
        stored = 0
    return max([stored, *spooled])


def run_spec(spec: RankSpec) -> dict[str, Any] | None:
    """Train as described by ``spec`` in this (already launched) rank; ``OutOfTime`` when
    the ranks stopped at a checkpoint before their steps were done."""
    cfg = config_from_dict(spec.config)
    if spec.plan is None:
        raise ValueError(f"{spec.out_dir}: the training rank spec has no plan")
    plan = Plan.from_dict(spec.plan)
    env = from_environ()
    plan.check(cfg.model, cfg.train, env.world_size)
    timeout_s = cfg.train.collective_timeout_s  # a hang fails fast, naming who did not arrive
    device = init_distributed(env, timeout_s, Path(spec.out_dir) / PROGRESS_DIR)
    open_record(spec.out_dir, env.rank, env.world_size, launch_id(env), timeout_s, stop_requested)
    sampler = None
    try:
        logger = logs_metrics(plan, env.rank)  # the one rank that logs and keeps the ledger
        hooks = RunHooks(stop_requested=stop_requested, job=this_job(spec) if logger else None,
                         faults=Faults.from_environ(), validation=validation_set(spec, cfg))
        tracking, sink = spec.tracking, None
        if tracking and logger:
            from stages.mechanism.tracking import Tracker

            # A lost tracking server must not stall training: one short try per write (MLflow
            # retries for minutes by default); what fails is spooled and sent later.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
            spool = Path(spec.out_dir) / SPOOL_FILE
            uri, run_id = tracking["uri"], tracking["run_id"]
            # Metric writes happen on a background thread, off the training step; so do
            # opening the store and asking which steps it holds (seconds of MLflow imports,
            # which the other ranks would wait for at the first collective).
            sink = BackgroundSink(Tracker(uri, run_id), spool=spool,
                                  logged_through=lambda: logged_through(uri, run_id, spool))
        trainer = Trainer(cfg.model, cfg.train, plan, spec.out_dir, make_batch_factory(spec, cfg),
                          device, tracker=sink, peak_tflops=spec.peak_tflops, hooks=hooks)
        from stages.mechanism.tracking import samples_node, start_node_sampler

        # one per node: the logger rank on its node (its MLflow client open already)
        here = samples_node(env.rank, env.local_rank, env.world_size // spec.nodes,
                            logger_rank(plan))
        sampler = start_node_sampler(cfg, tracking, here)
        # A measurement (the plan stage's refinement) keeps no weights: no final save.
        summary = trainer.fit(spec.steps, save_final=spec.extra.get("save_final", True))
        if trainer.out_of_time is not None and trainer.is_logger:
            write_json_atomic(Path(spec.out_dir) / OUT_OF_TIME_FILE,
                              {**trainer.out_of_time, "signals": sorted(set(_asked)),
                               "job": trainer.job["id"]})
    except RuntimeError as error:  # a collective that timed out: say who did not arrive
        explained = explain_timeout(error)
        if explained is None:
            raise
        raise explained from error
    finally:
        close_record()
        if sampler is not None:
            sampler.stop()
        dist.destroy_process_group()
    if trainer.out_of_time is not None:
        raise OutOfTime(f"stopped after step {trainer.out_of_time['step']}")
    return summary


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``--spec PATH``.

    Once the rank's work is over, a stop signal has nothing left to stop and is ignored:
    Slurm's signal ahead of the walltime can land after the last step, while the
    interpreter shuts down, and by then Python has put the default handlers back, which
    would end a finished rank by the signal (a failed attempt, a spent retry)."""
    try:
        return rank_main(__doc__.splitlines()[0], run_spec, argv)
    finally:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)  # Python leaves SIG_IGN in place at exit


if __name__ == "__main__":
    sys.exit(main())
