"""The per-rank training loop: build the parallel model, step, log, checkpoint, summarise.

``Trainer`` is created in every rank after the process group is up. It builds the model
on the meta device, applies the plan (pipeline split -> TP -> activation checkpointing ->
FSDP2, or DDP), initialises identical weights in every layout, then runs optimizer steps
of ``global_batch`` sequences. Metrics come from one rank (last pipeline stage, dp 0,
tp 0). With tied embeddings under pipelining the first stage's embedding and the last stage's
head copy have their gradients summed over their embedding group before clipping (which
counts the matrix once), so the copies stay equal (``model.parallel.pipeline``). Checkpoints
go to ``out_dir/checkpoints`` (every ``checkpoint_every`` steps or
``checkpoint_minutes`` minutes, whichever comes first; optionally written in the background;
older ones pruned by ``keep_last``/``keep_every``) and training resumes from the latest
complete one.

Stopping before the walltime: given ``stop_requested`` (the rank worker passes whether
SIGUSR1 or SIGTERM arrived; Slurm sends the first ahead of the job's end), the ranks vote on
it after every step (one small all-reduce of a flag, with the clock's vote), so they all stop
at the same step boundary: the checkpoint of that step is written and published, and ``fit``
returns with ``out_of_time`` set instead of writing the summary. The next job resumes there.

Given ``job`` (its id, node count and start), the logger rank keeps ``jobs.json`` beside the
checkpoints: one entry per job the training ran in, across attempts, updated at every save
and at the end; the summary counts the jobs and the node-hours they spent.

Step health (``model.training.health``, ``train.step_checks``): inside ``fit`` a step whose
loss or gradient norm is not finite on any rank applies no update, a loss spike or a run of
bad steps rolls back to the newest checkpoint and skips the batches since, and every
``train.slow_rank_every`` steps the ranks' busy times are compared and slow ranks named.
"""
from __future__ import annotations

import contextlib
import json
import math
import socket
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from data_prep.atomic import write_json_atomic
from model.config import ModelConfig, TrainConfig, shards_with_fsdp
from model.flops import default_peak_tflops, flops_per_token
from model.gpt import GPT, HEAD_NAME, TIED_NAME
from model.parallel.dims import ParallelDims
from model.parallel.layout import Plan
from model.parallel.parallelize import (
    allreduce_gradients,
    allreduce_tied_gradient,
    apply_ddp,
    parallelize_chunk,
)
from model.parallel.pipeline import build_chunk, build_schedule, chunk_ids
from model.training import checkpoint as ckpt
from model.training.files import CHECKPOINTS_DIR, HEALTH_FILE, SUMMARY_FILE
from model.training.health import (
    Faults,
    SlowRanks,
    StepHealth,
    TrainingDiverged,
    Verdict,
    written_in_bad_streak,
)
from model.training.metrics import (
    MEDIAN_SUFFIX,
    median_step_time,
    peak_memory_gb,
    progress_line,
    rollback_metrics,
    skip_metrics,
    slow_rank_metrics,
    throughput,
)
from model.training.optim import build_optimizer, build_scheduler, clip_grad_norm_
from model.training.progress_record import mark
from model.training.validation import ValidationSet, validate, validation_metrics

JOBS_FILE = "jobs.json"
"""The jobs a training ran in, beside its checkpoints (``record_job``, ``job_totals``)."""


def record_job(path: Path, job: dict[str, Any], **fields: Any) -> list[dict[str, Any]]:
    """Add or update ``job``'s entry (by its ``id``) in the ledger at ``path``; return it all.

    ``job`` holds ``id``, ``nodes`` and ``started`` (epoch seconds); ``fields`` the rest
    (``ended``, ``first_step``, ``last_step``, ``outcome``). A job whose ranks ran twice (a
    retry in the same job) keeps one entry: its first start, its last end.
    """
    try:
        ledger = json.loads(path.read_text())
    except (OSError, ValueError):
        ledger = []
    entry = next((e for e in ledger if e.get("id") == job["id"]), None)
    if entry is None:
        entry = {**job}
        ledger.append(entry)
    for key, value in fields.items():
        if key == "first_step" and "first_step" in entry:
            continue
        entry[key] = value
    write_json_atomic(path, ledger)
    return ledger


def job_totals(ledger: list[dict[str, Any]]) -> dict[str, Any]:
    """``jobs`` (how many) and ``node_hours`` (each job's nodes x its start to its last
    record) of a job ledger."""
    hours = sum(e["nodes"] * max(0.0, e.get("ended", e["started"]) - e["started"]) / 3600
                for e in ledger)
    return {"jobs": len(ledger), "node_hours": hours}


def _refuse_bad_streak(path: Path) -> str | None:
    """Why a rollback passes over the checkpoint at ``path``, or None: one saved inside a run
    of bad steps (``health.written_in_bad_streak``)."""
    if written_in_bad_streak(ckpt.load_extra(path)):
        return "saved inside a run of bad steps (its weights led to them)"
    return None


class BatchSource(Protocol):
    """What the trainer needs from a data loader (TokenWindowLoader or SyntheticBatches)."""

    def next_batch(self) -> torch.Tensor: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class MetricSink(Protocol):
    """The subset of stages.mechanism.tracking.Tracker the trainer uses."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def flush(self) -> None: ...


class RankModel(nn.Module):
    """All model chunks held by one pipeline rank, under the full model's parameter names.

    It shares (does not copy) the chunks' submodules; the optimizer and checkpoints use it so
    that keys are FQNs of the unsharded GPT whatever the layout.
    """

    def __init__(self, chunks: list[GPT]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for chunk in chunks:
            self.layers.update(chunk.layers)
            for name in ("tok_embeddings", "norm", "output"):
                if getattr(chunk, name) is not None:
                    setattr(self, name, getattr(chunk, name))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token loss: logits [B, T, V], targets [B, T] -> scalar (float32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


@dataclass(frozen=True)
class BuildSeam:
    """How a trainer's parts are made: the one seam the rehearsal (``model.rehearsal.rehearse``)
    builds a trainer through; training uses the defaults.

    ``materialize`` is the context in which the parallelised meta-device chunks get storage
    and everything built on them is made (weights, DDP, optimizer, pipeline stages): a no-op
    for training, a FakeTensorMode in the rehearsal, so that one rank of a large plan is built
    without its memory. ``wrap_ddp`` wraps a chunk for sharding ddp without pipelining (the
    rehearsal's stand-in replaces DistributedDataParallel, which fake tensors cannot build)."""

    materialize: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    wrap_ddp: Callable[[nn.Module, DeviceMesh], nn.Module] = apply_ddp


@dataclass
class RunHooks:
    """What the launching worker tells a trainer about the run around it (all optional).

    ``stop_requested``: whether this rank was asked to stop (out of time), voted on after
    every step; ``job``: this job's ``id``, ``nodes`` and ``started`` for the job ledger;
    ``faults``: injected faults, for tests and drills only; ``validation``: the split scored
    every train.eval_every steps (``model.training.validation``). A resumed training sends
    the steps it recomputes as well; its tracker drops those the run already holds
    (``model.training.metrics.BackgroundSink``)."""

    stop_requested: Callable[[], bool] | None = None
    job: dict[str, Any] | None = None
    faults: Faults | None = None
    validation: ValidationSet | None = None


def logger_rank(plan: Plan) -> int:
    """The global rank that logs: the last pipeline stage's first dp and tp rank."""
    return (plan.pp - 1) * plan.dp * plan.tp


def logs_metrics(plan: Plan, rank: int) -> bool:
    """Whether global ``rank`` is the one that logs (``logger_rank``), known before the
    trainer is built."""
    return rank == logger_rank(plan)


class Trainer:
    """Builds this rank's share of the model and runs the optimisation loop."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        plan: Plan,
        out_dir: str | Path,
        make_batches: Callable[[int, int], BatchSource],
        device: torch.device,
        tracker: MetricSink | None = None,
        peak_tflops: float | None = None,
        hooks: RunHooks | None = None,
        build: BuildSeam | None = None,
    ) -> None:
        """This rank's chunks, parallelised, with their optimizer, scheduler and pipeline
        schedule; ``tracker`` receives the logger rank's metrics, ``peak_tflops`` is what MFU
        is reported against (default: the device's), ``hooks`` come from the launching worker
        (``RunHooks``) and ``build`` is the rehearsal's seam (``BuildSeam``)."""
        hooks, build = hooks or RunHooks(), build or BuildSeam()
        self.model_cfg, self.cfg, self.plan, self.device = model_cfg, train_cfg, plan, device
        self.out_dir, self.tracker = Path(out_dir), tracker
        self._build_mesh(plan, model_cfg, train_cfg, device)
        self._build_model(plan, model_cfg, train_cfg, device, build)
        self.is_logger = self.has_last and self.dp_rank == 0 and self.tp_rank == 0
        self.logger_rank = logger_rank(plan)  # global rank of (last, 0, 0)
        self.batches = make_batches(self.dp_rank, plan.dp)
        self.flops_per_token = flops_per_token(model_cfg, train_cfg.seq_len)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        self.peak_tflops = peak_tflops or default_peak_tflops(device.type, name, train_cfg.dtype)
        self.losses: list[float] = []
        self.step = 0
        self.iteration_times: list[float] = []
        self.resumed_from: Path | None = None  # never pruned during this attempt
        self.pending: ckpt.PendingSave | None = None  # a background save not yet published
        self._ckpt_group: dist.ProcessGroup | None = None  # made at the first async save
        self.checkpoint_seconds: list[float] = []  # time each save held training up
        self._clock = time.monotonic()  # when the last save gave training back (or the start)
        self.stop_requested, self.job = hooks.stop_requested, hooks.job
        self.out_of_time: dict[str, Any] | None = None  # set when fit stopped before its steps
        self._stopping = False
        self._save_waiting = False  # a scheduled save put off by a run of bad steps
        # Step health (model.training.health): bad steps skipped, spikes rolled back, slow
        # ranks named. ``checking`` is on only inside fit (train.step_checks): a bare
        # train_step (the rehearsal's fake tensors, the plan's measurement) always updates.
        self.health, self.slow_ranks = StepHealth(train_cfg, device), SlowRanks(train_cfg, device)
        self.faults = hooks.faults
        self._step_events: dict[str, float] = {}  # events of the step being finished
        self.checking = False
        self.batch_index: int | None = None  # the global batch of the step in fit
        self.verdict: Verdict | None = None  # the last checked step's
        # Validation in the loop (train.eval_every): each result, and the checkpoint whose
        # validation loss is the lowest (kept by the retention rules, tagged by the stage).
        self.validation = hooks.validation if train_cfg.eval_every else None
        self.val_history: list[dict[str, Any]] = []
        self.val_slice: dict[str, int] = {}  # the slice's tokens, windows and seq_len
        self.best: dict[str, Any] | None = None

    def _build_mesh(self, plan: Plan, model_cfg: ModelConfig, train_cfg: TrainConfig,
                    device: torch.device) -> None:
        """The device mesh, this rank's place in it, and the groups and flags of its layout."""
        self.dims = ParallelDims(plan.pp, plan.dp, plan.tp, dist.get_world_size())
        self.mesh = mesh = self.dims.build_mesh(device.type)
        self.pp_rank, self.dp_rank, self.tp_rank = (
            mesh[d].get_local_rank() for d in ("pp", "dp", "tp")
        )
        self.dp_group, self.pp_group = mesh["dp"].get_group(), mesh["pp"].get_group()
        # Tied embeddings under pipelining: the first chunk's embedding and the last chunk's
        # head copy have their gradients summed over this group (model.parallel.pipeline).
        self.tied_split = model_cfg.tie_embeddings and plan.pp > 1
        self.tied_group = self.dims.tied_embedding_group(mesh) if self.tied_split else None
        self.param_dtype = torch.bfloat16 if train_cfg.dtype == "bfloat16" else None
        self.fsdp = shards_with_fsdp(plan.sharding, plan.dp)
        # DDP wraps the model without pipelining; under pipelining gradients are averaged
        # by one flat all-reduce after the schedule (see allreduce_gradients).
        self.ddp = plan.sharding == "ddp" and plan.dp > 1 and plan.pp == 1
        self.grad_allreduce = plan.sharding == "ddp" and plan.dp > 1 and plan.pp > 1
        self.dp_mesh = mesh["dp"]

    def _build_model(self, plan: Plan, model_cfg: ModelConfig, train_cfg: TrainConfig,
                     device: torch.device, build: BuildSeam) -> None:
        """This rank's chunks, parallelised and initialised, with the optimizer, scheduler
        and pipeline schedule built on them (each inside ``build.materialize``)."""
        mesh = self.mesh
        n_chunks = plan.pp * plan.virtual_stages
        ids = chunk_ids(self.pp_rank, plan.pp, plan.virtual_stages)
        self.chunks = [build_chunk(model_cfg, c, n_chunks) for c in ids]
        for chunk in self.chunks:
            with build.materialize():
                parallelize_chunk(chunk, mesh, plan.tp, plan.dp, plan.sharding, plan.recompute,
                                  plan.sequence_parallel, self.param_dtype, train_cfg.compile,
                                  plan.recompute_layers)
                chunk.to_empty(device=device)
                chunk.init_weights(train_cfg.seed)
                chunk.keep_rope_rows(train_cfg.seq_len)
        self.model: nn.Module = self.chunks[0] if len(self.chunks) == 1 else RankModel(self.chunks)
        self.has_first, self.has_last = 0 in ids, n_chunks - 1 in ids
        # This rank's copy of the tied matrix (pp rank 0: the embedding; pp - 1: the head),
        # and whether it is the head copy (clipped, not counted in the norm; resumed from
        # the embedding's optimizer state)
        self.tied_param: torch.Tensor | None = None
        self.tied_head = self.tied_split and self.has_last and not self.has_first
        if self.tied_split and (self.has_first or self.has_last):
            self.tied_param = dict(self.model.named_parameters())[
                HEAD_NAME if self.tied_head else TIED_NAME]
        self.schedule = None
        with build.materialize():
            self.runners = [build.wrap_ddp(c, mesh["dp"]) if self.ddp else c
                            for c in self.chunks]
            self.params = [p for p in self.model.parameters() if p.requires_grad]
            has_dtensor = any(isinstance(p, DTensor) for p in self.params)
            self.optimizer = build_optimizer(self.model, train_cfg, has_dtensor)
            self.scheduler = build_scheduler(self.optimizer, train_cfg)
            if plan.pp > 1:
                self.schedule = build_schedule(self.runners, ids, n_chunks, device,
                                               self.pp_group, plan.schedule, plan.grad_accum,
                                               cross_entropy)

    # ---------------------------------------------------------------- one optimizer step
    def _autocast(self):
        """bf16 autocast when mixed precision is not already carried by FSDP2."""
        if self.param_dtype is None or self.fsdp:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.param_dtype)

    def _accumulate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """grad_accum micro-batches through the (single) chunk; returns the mean loss."""
        runner, accum = self.runners[0], self.plan.grad_accum
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum))):
            last = i == accum - 1
            if self.fsdp and self.plan.sharding == "zero2":
                runner.set_requires_gradient_sync(last)  # reduce-scatter once per step
            sync = runner.no_sync() if self.ddp and not last else contextlib.nullcontext()
            with sync:
                with self._autocast():
                    logits = runner(x)  # [mb, T, V]
                loss = cross_entropy(logits, y) / accum
                loss.backward()
            total += loss.detach()
        return total

    def _pipeline(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One schedule step (grad_accum micro-batches); mean loss on the last stage."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        with self._autocast():
            # return_outputs=False: the last stage would otherwise keep every micro-batch's
            # logits until the step ends (grad_accum x seq x vocab values) only to merge them
            self.schedule.step(*args, return_outputs=False, **kwargs)
        return torch.stack([x.detach().float() for x in losses]).mean() if self.has_last else None

    def train_step(self, batch: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """batch [b, T+1] -> (dp-mean loss on last-stage ranks else None, global grad norm)."""
        batch = batch.to(self.device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [b, T] each
        self.optimizer.zero_grad(set_to_none=True)
        if self.schedule is not None:
            loss = self._pipeline(inputs, targets)
            if self.grad_allreduce:
                allreduce_gradients(self.params, self.dp_mesh)
            if self.tied_param is not None:  # both copies get the one weight's gradient
                allreduce_tied_gradient(self.tied_param, self.tied_group)
        else:
            loss = self._accumulate(inputs, targets)
        mark("loss/norm all-reduce", self.step + 1)  # what each rank did last: a hang names it
        if self.faults is not None and self.batch_index is not None:
            loss = self.faults.poison(self.batch_index, loss, self.params)
        norm = clip_grad_norm_(self.params, self.cfg.grad_clip,
                               self.pp_group if self.plan.pp > 1 else None,
                               uncounted=[self.tied_param] if self.tied_head else ())
        self.verdict = None
        if self.checking:
            # Every rank agrees whether to apply the step (a non-finite loss or norm anywhere,
            # or a loss spike, skips it) in the all-reduce that takes the dp mean of the loss.
            mean, self.verdict = self.health.judge(loss, norm, self.tp_rank == 0, self.plan.dp)
            loss = mean if loss is not None else None
        elif loss is not None and self.plan.dp > 1:
            dist.all_reduce(loss, group=self.dp_group)  # gloo has no AVG
            loss = loss / self.plan.dp
        if self.verdict is None or self.verdict.update:  # the schedule advances either way
            self.optimizer.step()
        self.scheduler.step()
        return loss, norm

    # ---------------------------------------------------------------- checkpoints
    @property
    def ckpt_root(self) -> Path:
        return self.out_dir / CHECKPOINTS_DIR

    def save(self) -> Path | None:
        """Checkpoint the current state (collective); return the newest published checkpoint.

        A background save (train.async_checkpoint) only stages the state and returns (it is
        published by ``publish`` once written): the path returned is then the previous
        save's, or None. A background save still in progress is waited for (and published)
        first, so at most one is ever in flight.
        """
        mark("checkpoint save", self.step)
        done = self.publish()
        # Rank 0 writes extra.pt, but the loss history lives on the logging rank.
        history = [list(self.losses), self.health.state_dict()]
        dist.broadcast_object_list(history, src=self.logger_rank)
        extra = {"step": self.step, "scheduler": self.scheduler.state_dict(),
                 "loader": self.batches.state_dict(), "rng": torch.get_rng_state(),
                 "losses": history[0], "health": history[1],
                 "validation": {"history": self.val_history, "best": self.best}}
        self.health.saved()  # a later rollback comes back here
        asynchronous = self.cfg.async_checkpoint
        if asynchronous and self._ckpt_group is None:
            # Its own gloo group: the writer thread's collectives must not interleave with
            # the training's, and async_save needs a CPU backend (NCCL/RCCL is not one).
            self._ckpt_group = dist.new_group(backend="gloo")
        pending = ckpt.start_save(self.ckpt_root, self.step, self.model, self.optimizer,
                                  extra, self.model_cfg, self._ckpt_group, asynchronous)
        if asynchronous:
            self.pending = pending
            return done
        return self._published(ckpt.finish_save(pending))

    def publish(self) -> Path | None:
        """Wait for the background save in flight, if any, and publish it (collective)."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        return self._published(ckpt.finish_save(pending))

    def _published(self, path: Path) -> Path:
        """After a save is complete on every rank: rank 0 applies the retention rules (the
        checkpoint of the best validation loss is kept too)."""
        self._note_best(path)
        if dist.get_rank() == 0:
            best = self.best["checkpoint"] if self.best else None
            keep = [p for p in (self.resumed_from, path, self.cfg.init_from, best) if p]
            ckpt.prune_checkpoints(self.ckpt_root, self.cfg.keep_last, self.cfg.keep_every,
                                   protect=keep)
        return path

    def resume(self) -> Path | None:
        """Load the latest complete checkpoint, if any (collective); return its path."""
        latest = ckpt.latest_checkpoint(self.ckpt_root)
        if latest is None:
            return None
        self._restore(latest)
        return latest

    def _restore(self, path: Path, rollback: bool = False) -> None:
        """Load the checkpoint at ``path`` (collective). A ``rollback`` leaves the data stream
        where it is: the batches drawn since that checkpoint are skipped."""
        ckpt.check_model_shape(path, self.model_cfg)
        extra = ckpt.load_checkpoint(path, self.model, self.optimizer,
                                     tied_head=self.tied_head)
        self.scheduler.load_state_dict(extra["scheduler"])
        if not rollback:
            self.batches.load_state_dict(extra["loader"])
        torch.set_rng_state(extra["rng"])
        self.step, self.losses = int(extra["step"]), list(extra["losses"])
        self.health.load_state_dict(extra.get("health"), rollback=rollback)
        validation = extra.get("validation") or {}
        self.val_history = list(validation.get("history") or [])
        self.best = validation.get("best")

    # ---------------------------------------------------------------- the loop
    def fit(self, steps: int | None = None, save_final: bool = True) -> dict[str, Any] | None:
        """Train until ``steps`` (default train.steps) are done.

        The logger rank returns the summary.

        Checkpoints every train.checkpoint_every steps, once train.checkpoint_minutes have
        passed since the last save (or the start), and, if ``save_final``, at the end.

        When a stop is requested (``stop_requested`` on any rank), every rank stops after the
        same step, that step's checkpoint is written, ``out_of_time`` is set ({"step",
        "checkpoint"}) and None is returned: no summary, the training is not done.
        """
        steps = steps or self.cfg.steps
        last_ckpt = self.resume()
        self.resumed_from = last_ckpt
        self._record_job(first_step=self.step, last_step=self.step, outcome="running")
        if last_ckpt is not None and self.is_logger:
            print(f"[train] resumed from step {self.step} ({last_ckpt})", flush=True)
        if last_ckpt is None and self.cfg.init_from:
            ckpt.load_initial_weights(self.cfg.init_from, self.model, self.model_cfg)
            if self.is_logger:
                print(f"[train] initialised from {self.cfg.init_from}", flush=True)
        first_step = self.step
        self.step_times: list[float] = []  # each step's seconds (the summary's median)
        step_times = self.step_times
        tokens_per_step = self.cfg.global_batch * self.cfg.seq_len
        self.iteration_times = []  # whole iterations incl. logging (for loop-overhead checks)
        self.checkpoint_seconds = []
        self._clock = time.monotonic()
        self._stopping, self.out_of_time = False, None
        self.checking = self.cfg.step_checks
        self.slow_ranks.restart()
        while self.step < steps:
            start = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]
            mark("forward/backward", self.step + 1)
            loss, norm = self.train_step(self._next_batch())
            if self.is_logger:
                loss_value, norm_value = float(loss), float(norm)  # waits for the step
                self.losses.append(loss_value)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            step_times.append(time.perf_counter() - start)
            self.step += 1
            mark("step end", self.step)
            if self._watch(loss, norm):  # rolled back to a checkpoint: go on from there
                self._send_step({})
                continue
            record: dict[str, float] = {}
            if self.is_logger:
                median = {}
                if self.step % max(1, steps // 10) == 0 or self.step == steps:
                    median = self._progress(loss_value, step_times, steps, tokens_per_step)
                # the attempt's first step is logged in full whatever train.log_every: every
                # chart, the health counters' zeros included, starts there
                full = self.step % self.cfg.log_every == 0 or self.step == first_step + 1
                record = self._step_metrics(loss_value, norm_value, lr, step_times[-1],
                                            tokens_per_step, median, full=full)
            if self.validation is not None and (self.step % self.cfg.eval_every == 0
                                                or self.step == steps):
                self._validate(steps)
            self._send_step(record)  # one record a step: its metrics and its events
            self.iteration_times.append(time.perf_counter() - start)
            last_ckpt = self._checkpoint_if_due(steps, save_final) or last_ckpt
            if self._stopping:
                break
        if self.pending is not None:  # nothing may be left writing at exit
            started = time.perf_counter()
            last_ckpt = self.publish()
            self.checkpoint_seconds.append(time.perf_counter() - started)
        if self._stopping and self.step < steps:
            return self._stop(last_ckpt)
        self._record_job(last_step=self.step, outcome="completed")
        self.checking = False
        return self._finish(step_times, first_step, tokens_per_step, last_ckpt)

    # ---------------------------------------------------------------- step health
    def _next_batch(self) -> torch.Tensor:
        """The next batch of the stream, counted (``health.batches_drawn``); the fault
        switch's dropped batches are drawn and thrown away, its slow rank stalls."""
        while True:
            batch = self.batches.next_batch()
            self.batch_index = self.health.drew()
            if self.faults is None or self.batch_index not in self.faults.drop_batches:
                break
        if self.faults is not None:
            self.faults.stall()
        return batch

    def _watch(self, loss: torch.Tensor | None, norm: torch.Tensor) -> bool:
        """After a step: act on its verdict (skip or roll back) and gather the ranks' busy
        times when due. True when the step was rolled back (``self.step`` is then the
        checkpoint's)."""
        verdict = self.verdict
        if verdict is None or verdict.update:
            self.health.last_good_step = self.step
        if verdict is not None and not verdict.update:
            loss_value = float(loss) if loss is not None else None
            if verdict.rollback and self._roll_back(verdict, loss_value):
                return True
            record = self.health.record_skip(self.step, self.batch_index, loss_value,
                                             float(norm))
            if self.is_logger:
                why = "a loss spike" if verdict.spike else "not finite on some rank"
                print(f"[train] step {self.step} skipped ({why}; loss {loss_value:.4g}, grad "
                      f"norm {float(norm):.4g}): no update; batch {record['batch']} (sequences "
                      f"{record['first_sequence']}-{record['last_sequence']}) recorded",
                      flush=True)
                self._log_event(skip_metrics(record, len(self.health.skipped)), self.step)
        report = self.slow_ranks.after_step(self.step)
        if report is not None and self.is_logger:
            self._log_event(slow_rank_metrics(report.ratio, report.seconds), self.step)
            if report.slow and not report.first:  # a first step's start-up is not slowness
                print(self.slow_ranks.describe(report), flush=True)
        return False

    def _roll_back(self, verdict: Verdict, loss: float | None) -> bool:
        """Restore the newest checkpoint, skipping the batches drawn since (collective);
        False when there is none to go back to."""
        self.publish()  # a background save in flight is the newest good state
        # A checkpoint saved inside a run of bad steps holds the weights that led to it.
        latest = ckpt.latest_checkpoint(self.ckpt_root, refuse=_refuse_bad_streak)
        reason = ("loss spike" if verdict.spike
                  else f"{self.health.bad_streak} bad steps in a row")
        good = self.health.good
        if verdict.spike and loss is not None and good:  # the ranks holding the loss
            reason += (f" ({loss:.4g} against a median of {statistics.median(good):.4g} over "
                       f"the last {len(good)} good steps)")
        if latest is None:
            if self.is_logger:
                print(f"[train] step {self.step}: {reason}, but no checkpoint before the "
                      "trouble to roll back to", flush=True)
            self._diverged_unless(lambda: self.health.record_rollback(
                self.step, None, reason, None, []))
            if self.is_logger:
                self._log_event({"rollbacks_total": float(len(self.health.rollbacks))},
                                self.step)
            return False
        step, batches = self.step, list(self.health.since_checkpoint)
        self._restore(latest, rollback=True)
        self._save_waiting = False  # the state now is the checkpoint's
        record = self._diverged_unless(lambda: self.health.record_rollback(
            step, self.step, reason, str(latest), batches))
        self.slow_ranks.restart()
        if self.is_logger:
            print(f"[train] step {step}: {reason}: rolled back to step {self.step} ({latest}), "
                  f"skipping batches {batches[0]}-{batches[-1]} (sequences "
                  f"{record['first_sequence']}-{record['last_sequence']})", flush=True)
            self._log_event(rollback_metrics(record, len(self.health.rollbacks)), step)
        return True

    def _validate(self, steps: int) -> None:
        """Score the fixed validation slice now (collective; every rank gets the figures) and
        log them from the logger rank."""
        result = validate(self, self.validation)
        entry = {"step": self.step, **{k: result[k] for k in ("val_loss", "val_bpb",
                                                              "per_source", "seconds")
                                       if k in result}}
        self.val_history.append(entry)
        self.val_slice = {k: result[k] for k in ("tokens", "windows", "seq_len")}
        if self.is_logger:
            bpb = f" val_bpb {result['val_bpb']:.4f}" if "val_bpb" in result else ""
            print(f"[train] step {self.step}/{steps} val_loss {result['val_loss']:.4f}{bpb} "
                  f"over {result['tokens']:,} validation tokens ({result['seconds']:.2f} s)",
                  flush=True)
            self._log_event(validation_metrics(result), self.step)

    def _validation_summary(self) -> dict[str, Any] | None:
        """The summary's ``validation``: the slice (``eval_tokens`` asked, ``tokens``,
        ``windows``, ``seq_len`` scored), every result, the last and the best checkpoint."""
        if self.validation is None:
            return None
        return {"every": self.cfg.eval_every, "eval_tokens": self.cfg.slice_tokens,
                **self.val_slice, "history": self.val_history,
                "last": self.val_history[-1] if self.val_history else None, "best": self.best}

    def _note_best(self, path: Path) -> None:
        """A checkpoint is published: if it was validated at its step and its validation loss
        is the lowest of the published ones, it is the best so far."""
        step = ckpt.checkpoint_step(path)
        scored = next((e for e in reversed(self.val_history) if e["step"] == step), None)
        if scored is None or not math.isfinite(scored["val_loss"]):
            return
        if self.best is None or scored["val_loss"] < self.best["val_loss"]:
            self.best = {"step": step, "val_loss": scored["val_loss"],
                         "val_bpb": scored.get("val_bpb"), "checkpoint": str(path)}

    def _diverged_unless(self, record: Callable[[], dict]) -> dict:
        """``record()`` (a rollback's record); when it raises ``TrainingDiverged`` the logger
        rank first sends the metrics it holds and writes ``health.json`` (every skipped step
        and rollback), which the error then names."""
        try:
            return record()
        except TrainingDiverged as error:
            path = self.out_dir / HEALTH_FILE
            if self.is_logger:
                if self.tracker is not None:
                    self.tracker.flush()
                self.out_dir.mkdir(parents=True, exist_ok=True)
                write_json_atomic(path, self.health.summary())
            raise TrainingDiverged(f"{error}; every skipped step and rollback: {path}") from None

    def _log_event(self, metrics: dict[str, float], step: int) -> None:
        """Send a step-health or validation metric (the logger rank); one of the step being
        finished joins that step's record (``_send_step``)."""
        if self.tracker is None:
            return
        if step == self.step:
            self._step_events.update(metrics)
            return
        self.tracker.log_metrics(metrics, step=step)

    def _send_step(self, record: dict[str, float]) -> None:
        """Send this step's metrics and the events of the step as one record (the logger
        rank; nothing when both are empty)."""
        merged, self._step_events = {**record, **self._step_events}, {}
        if merged and self.tracker is not None:
            self.tracker.log_metrics(merged, step=self.step)  # buffered by the tracker

    def _stop(self, last_ckpt: Path | None) -> None:
        """Out of time: the step's checkpoint is published; say so and record the job."""
        self.out_of_time = {"step": self.step, "checkpoint": str(last_ckpt) if last_ckpt else None}
        self._record_job(last_step=self.step, outcome="out of time")
        if self.is_logger:
            if self.tracker is not None:
                self.tracker.flush()
            print(f"[train] out of time: stopped after step {self.step} with checkpoint "
                  f"{last_ckpt}; the next job resumes there", flush=True)
        return None

    def _record_job(self, **fields: Any) -> list[dict[str, Any]] | None:
        """The logger rank updates this job's entry in the job ledger (``jobs.json``)."""
        if self.job is None or not self.is_logger:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return record_job(self.out_dir / JOBS_FILE, self.job, ended=time.time(), **fields)

    def _checkpoint_if_due(self, steps: int, save_final: bool) -> Path | None:
        """After a step: save if the step count, rank 0's clock or a stop says so, and
        publish a background save that every rank has finished writing. Collective, and every
        rank reaches the same decisions: the clock, the writers' states and the stop requests
        are voted on (``checkpoint.agree``, one small all-reduce, only when one is in play).
        A stop sets ``_stopping`` after its save."""
        every, minutes = self.cfg.checkpoint_every, self.cfg.checkpoint_minutes
        # A scheduled save inside a run of bad steps waits for the run to end: the weights
        # then are those that led to it (every rank counts the same streak).
        scheduled = self._save_waiting or bool(every and self.step % every == 0)
        self._save_waiting = scheduled and self.health.bad_streak > 0
        due = (scheduled and not self._save_waiting) or (save_final and self.step == steps)
        finished = False
        if minutes is not None or self.pending is not None or self.stop_requested is not None:
            late = minutes is not None and time.monotonic() - self._clock >= minutes * 60
            writing = self.pending is not None and not self.pending.written()
            asked = self.stop_requested is not None and bool(self.stop_requested())
            late, writing, stop = ckpt.agree(late, writing, asked, device=self.device)
            self._stopping = stop
            late = late and self.health.bad_streak == 0  # the clock waits too
            due, finished = due or late or stop, self.pending is not None and not writing
        if not (due or finished):
            return None
        if due and self.is_logger and self.tracker is not None:
            # Before the save, so that a checkpoint on disk implies every metric up to it is in
            # the store (or the spool): a training resumed from it leaves no gap in the run.
            self.tracker.flush()
        started = time.perf_counter()
        saved = self.save() if due else self.publish()
        self.checkpoint_seconds.append(time.perf_counter() - started)  # training held up
        if due:
            self._clock = time.monotonic()  # minutes count from when the save gave training back
            self._record_job(last_step=self.step)
        return saved

    def _job_summary(self) -> dict[str, Any]:
        """The summary's ``jobs``, ``node_hours`` and ``job_ledger`` (None without a ledger)."""
        path = self.out_dir / JOBS_FILE
        if self.job is None or not path.is_file():
            return {"jobs": None, "node_hours": None, "job_ledger": None}
        ledger = json.loads(path.read_text())
        return {**job_totals(ledger), "job_ledger": ledger}

    def _throughput(self, step_time: float, tokens_per_step: int,
                    suffix: str = "") -> dict[str, float]:
        return throughput(tokens_per_step, step_time, self.flops_per_token,
                          self.dims.world_size, self.peak_tflops, suffix)

    def _progress(self, loss: float, step_times: list[float], steps: int,
                  tokens: int) -> dict[str, float]:
        """Print the progress line; its ``_median`` figures (for MLflow, at this step)."""
        dt = median_step_time(step_times)
        median = self._throughput(dt, tokens, MEDIAN_SUFFIX)
        print(progress_line(self.step, steps, loss, self._throughput(step_times[-1], tokens),
                            median, dt), flush=True)
        return median

    def _step_metrics(self, loss: float, norm: float, lr: float, dt: float, tokens: int,
                      median: dict[str, float], full: bool = True) -> dict[str, float]:
        """This step's metrics (``full``) and the progress line's ``median`` figures, as one
        record; empty when nothing tracks them."""
        if self.tracker is None:
            return {}
        metrics = dict(median)
        if full:
            metrics.update({"loss": loss, "lr": lr, "grad_norm": norm, "step_time_s": dt,
                            **self._throughput(dt, tokens),
                            "peak_memory_gb": peak_memory_gb(self.device),
                            # the health counters from step 1, zeros included: a chart that
                            # exists before anything goes wrong
                            "skipped_steps_total": float(len(self.health.skipped)),
                            "rollbacks_total": float(len(self.health.rollbacks))})
        return metrics

    def _finish(self, step_times: list[float], first_step: int, tokens: int,
                last_ckpt: Path | None) -> dict[str, Any] | None:
        peak = torch.tensor(peak_memory_gb(self.device), dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the busiest rank's memory
        hosts: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())  # where each rank ran, by rank
        if not self.is_logger:
            return None
        # No step ran (already trained to ``steps``): no timing to report.
        step_time = median_step_time(step_times) if step_times else None
        rates = (self._throughput(step_time, tokens) if step_time
                 else dict.fromkeys(("tokens_per_s", "tflops_per_device", "mfu")))
        summary = {"losses": self.losses, "final_loss": self.losses[-1] if self.losses else None,
                   "steps_done": self.step, "step_time_s": step_time,
                   **rates, "peak_memory_gb": float(peak),
                   "checkpoint": str(last_ckpt) if last_ckpt else None,
                   "checkpoint_seconds": sum(self.checkpoint_seconds),
                   "plan": self.plan.to_dict(), "world_size": self.dims.world_size,
                   "hosts": hosts, **self._job_summary(), "health": self.health.summary(),
                   "validation": self._validation_summary()}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.tracker is not None:
            self.tracker.flush()  # waits for queued metrics
        write_json_atomic(self.out_dir / SUMMARY_FILE, summary)
        return summary
