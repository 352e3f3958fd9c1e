"""Per-rank held-out evaluation: ``python -m stages.evaluate.worker --spec SPEC.json``.

Launched by ``stages.mechanism.launch`` locally or srun under Slurm (rank identity from either
environment,
``model.parallel.dist_env.from_environ``); with no launcher it runs as a single process. Every rank
loads the checkpoint, computes the loss over its round-robin share of the validation
windows (``model.training.heldout.heldout_loss``, sums all-reduced), and rank 0 writes
``<out_dir>/loss.json`` atomically.

With the training layout (``extra["layout"]`` = {"tp", "pp", "dp"}, ``eval.layout=training``)
no rank loads the whole model: each builds its tp shard of its pipeline stage
(``model.evaluation.layout.LayoutModel``, loaded straight from the DCP checkpoint), the dp
replicas split the windows, and every rank also runs the greedy and sampled generations of
``eval.prompts`` (the same tokens on every rank); rank 0 writes ``generations.json``, then
``loss.json``.

The ``stages.mechanism.launch.RankSpec`` (written by ``stages.evaluate.prepare``) carries the
config, the store and the output directory; its ``extra`` holds "checkpoint" (the one
prepare chose: the train outputs', or the newest intact one before it when that one is
damaged), "split", "sources" ([[start, stop, name], ...]), "tokenizer" and "layout" (None:
every rank holds the model).
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from data_prep.atomic import write_json_atomic
from data_prep.store import SplitReader, open_store
from model.evaluation.generate import generate_text
from model.parallel.dist_env import DistEnv, from_environ, start_process_group
from model.training.checkpoint import load_for_inference
from model.training.heldout import heldout_loss
from stages.config import config_from_dict
from stages.mechanism.launch import RankSpec, rank_main

LOSS_FILE = "loss.json"
GENERATIONS_FILE = "generations.json"  # training layout: the ranks' generations


def evaluate_spec(spec: RankSpec, rank: int = 0, world: int = 1,
                  local_rank: int = 0) -> dict[str, Any]:
    """This rank's share of the held-out loss (totals all-reduced when world > 1).

    The model runs on this rank's GPU when there is one (``local_rank``), else on the CPU.
    Returns heldout_loss's dict plus "ranks", "device", "load_seconds" and "eval_seconds".
    """
    cfg = config_from_dict(spec.config)
    t0 = time.perf_counter()
    model = load_for_inference(spec.extra["checkpoint"], cfg.model)
    if torch.cuda.is_available():
        model = model.to(f"cuda:{local_rank % torch.cuda.device_count()}")
    store = open_store(spec.store)
    t1 = time.perf_counter()
    result = score_split(spec, cfg, model, store, rank, world)
    # Ends after the all-reduce, so rank 0's time is the slowest rank's.
    eval_s = time.perf_counter() - t1
    return {**result, "ranks": world, "device": str(next(model.parameters()).device),
            "load_seconds": t1 - t0, "eval_seconds": eval_s}


def score_split(spec: RankSpec, cfg: Any, model: Any, store: Any, rank: int | None = None,
                world: int | None = None) -> dict[str, Any]:
    """The held-out loss of the spec's split (``eval.max_tokens`` of it, per source) and,
    under "train_slice", the training's validation slice scored again."""
    reader = SplitReader(store, spec.extra["split"])
    sources = [(int(a), int(b), str(name)) for a, b, name in spec.extra["sources"]]
    token_bytes = store.token_bytes()
    result = heldout_loss(model, reader, cfg.train.seq_len, cfg.eval.max_tokens,
                          cfg.eval.batch_size, rank=rank, world=world, sources=sources,
                          token_bytes=token_bytes)
    result["train_slice"] = train_slice(spec, model, reader, token_bytes, rank, world)
    return result


def train_slice(spec: RankSpec, model: Any, reader: SplitReader, token_bytes: Any,
                rank: int | None = None, world: int | None = None) -> dict[str, Any] | None:
    """The training's in-loop validation slice (``train.eval_tokens`` of the split, the same
    windows) scored for this checkpoint, beside the figures the training logged last
    (``trained_*``): one figure, seen in two places. None when the training did not
    validate."""
    trained = spec.extra.get("train_slice")
    if not trained:
        return None
    cfg = config_from_dict(spec.config)
    again = heldout_loss(model, reader, cfg.train.seq_len, int(trained["eval_tokens"]),
                         cfg.eval.batch_size, rank=rank, world=world, token_bytes=token_bytes)
    return {"val_loss": again["val_loss"], "val_bpb": again.get("val_bpb"),
            "tokens": again["tokens"], "trained_step": trained["step"],
            "trained_val_loss": trained["val_loss"], "trained_val_bpb": trained.get("val_bpb")}


def write_loss(out_dir: str | Path, result: dict[str, Any]) -> Path:
    """Write ``loss.json`` atomically."""
    return write_json_atomic(Path(out_dir) / LOSS_FILE, result)


def _init_gloo(env: DistEnv) -> None:
    # gloo even on GPU nodes: model.training.heldout all-reduces its sums as CPU tensors.
    start_process_group(env, "gloo")


def run_single(spec: RankSpec) -> dict[str, Any]:
    """Evaluate the whole split in this process (no process group); write loss.json."""
    with _node_metrics(spec, 0):
        result = evaluate_spec(spec)
    result["windows_per_rank"] = [result["local_windows"]]
    write_loss(spec.out_dir, result)
    return result


def _node_metrics(spec: RankSpec, local_rank: int):
    """This node's system metrics in the stage run while the block runs (local rank 0)."""
    from stages.mechanism.tracking import node_system_metrics

    return node_system_metrics(config_from_dict(spec.config), spec.tracking, local_rank == 0)


def run_spec(spec: RankSpec) -> dict[str, Any]:
    """Evaluate as described by ``spec`` in this (already launched) rank; return the result."""
    env = from_environ()
    expected = spec.nproc
    if env.world_size != expected:
        # A launch that does not match the spec (e.g. Slurm variables leaking into a local
        # run) would wait forever for ranks that never come: stop with a clear error.
        raise ValueError(f"{spec.out_dir}: launched on {env.world_size} rank(s) but the spec "
                         f"asks for eval.ranks={expected}: launch exactly that many ranks")
    if spec.extra.get("layout"):
        with _node_metrics(spec, env.local_rank):
            return run_layout(spec, env)
    if env.world_size == 1:
        return run_single(spec)
    _init_gloo(env)
    try:
        with _node_metrics(spec, env.local_rank):
            result = evaluate_spec(spec, env.rank, env.world_size, env.local_rank)
        per_rank: list[Any] = [None] * env.world_size
        dist.all_gather_object(per_rank, result["local_windows"])
        result["windows_per_rank"] = per_rank
        if env.rank == 0:
            write_loss(spec.out_dir, result)
            print(f"[eval] val_loss {result['val_loss']:.4f} over {result['tokens']:,} tokens on "
                  f"{env.world_size} ranks in {result['eval_seconds']:.1f}s", flush=True)
        return result
    finally:
        dist.destroy_process_group()


def _init_layout(env: DistEnv) -> torch.device:
    """The process group of the training layout and this rank's device: on GPUs the model's
    collectives go over nccl and the loss sums (CPU tensors) over gloo."""
    os.environ["MASTER_ADDR"] = env.master_addr
    os.environ["MASTER_PORT"] = str(env.master_port)
    device, backend = torch.device("cpu"), "gloo"
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(minutes=10))
    return device


def evaluate_layout(spec: RankSpec, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Held-out loss and generations with the model spread over the training layout.

    Call on every rank of an initialised process group of tp*pp*dp ranks. Returns
    heldout_loss's dict (the same on every rank but "local_windows") plus "ranks",
    "layout", "device", "load_seconds", "eval_seconds", "generate_seconds" and
    "generations" (with token ids).
    """
    from tokenizers import Tokenizer

    from model.evaluation.layout import LayoutModel

    cfg, layout = config_from_dict(spec.config), spec.extra["layout"]
    t0 = time.perf_counter()
    model = LayoutModel(spec.extra["checkpoint"], cfg.model, layout["tp"], layout["pp"], device)
    store = open_store(spec.store)
    t1 = time.perf_counter()
    result = score_split(spec, cfg, model, store)
    t2 = time.perf_counter()
    tokenizer = Tokenizer.from_file(spec.extra["tokenizer"])
    generations = generate_text(model, tokenizer, cfg.eval.prompts, cfg.eval.generate_tokens,
                                cfg.eval.temperature, cfg.train.seed, store.eos_id,
                                with_ids=True)
    return {**result, "ranks": dist.get_world_size(), "layout": layout, "device": str(device),
            "load_seconds": t1 - t0, "eval_seconds": t2 - t1,
            "generate_seconds": time.perf_counter() - t2, "generations": generations}


def run_layout(spec: RankSpec, env: DistEnv) -> dict[str, Any]:
    """This rank's part of a training-layout evaluation; rank 0 writes generations.json,
    then loss.json (the file finalize waits for)."""
    device = _init_layout(env)
    try:
        result = evaluate_layout(spec, device)
        per_rank: list[Any] = [None] * env.world_size
        dist.all_gather_object(per_rank, result["local_windows"])
        result["windows_per_rank"] = per_rank
        if env.rank == 0:
            generations = result.pop("generations")
            write_json_atomic(Path(spec.out_dir) / GENERATIONS_FILE,
                              {"generations": generations, "layout": result["layout"],
                               "seconds": result["generate_seconds"]})
            write_loss(spec.out_dir, result)
            lay = result["layout"]
            print(f"[eval] val_loss {result['val_loss']:.4f} over {result['tokens']:,} tokens on "
                  f"tp{lay['tp']} x pp{lay['pp']} x dp{lay['dp']} ranks in "
                  f"{result['eval_seconds']:.1f}s; generations in "
                  f"{result['generate_seconds']:.1f}s", flush=True)
        return result
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``--spec PATH``."""
    return rank_main(__doc__.splitlines()[0], run_spec, argv)


if __name__ == "__main__":
    sys.exit(main())
