"""Measure this machine for the planner: matmul rate, memory bandwidth, gloo collectives.

All ``nproc`` ranks run at once (one thread each), so the figures include the
contention a real run of that many ranks sees. Measured per rank: matmul FLOP/s at a few
shapes (the fastest gives the achievable rate, the small ones the per-kernel overhead),
copy bandwidth, the fixed host costs of a GPT block, a micro-batch, an AdamW step per
tensor, an FSDP2 unit and DTensor tensor parallelism (per block and per micro-batch), a
small real GPT's forward + backward (which scales the kernel rates down to what a real
block reaches, see ``block_rate_scale``; with more ranks than cores, timed again with one
rank per core running, ``alone_speedup``, and the stalls of waits on other ranks while they
all compute, ``receive_stall_us`` and ``ddp_stall_us``, with the step they follow,
``stall_after_us``; and under tp=2, ``tp_comm_scale``), and
all-reduce / all-gather / reduce-scatter / send-recv time at a small and a large size over
gloo (latency from the small, bus bandwidth from the difference).
The figures are cached per machine (``model.planner.microbench_cache``): a plan made
from them does not depend on the load of the moment.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from model.parallel.host_memory import retain_freed_memory
from model.parallel.threads import rank_threads_env
from model.planner.cluster import (
    Cluster,
    ClusterError,
    cluster_from_dict,
    load_cluster,
    read_cluster_file,
)
from model.planner.microbench_cache import cache_file, locked, read_cached, write_cached

__all__ = ["cache_file", "load_measured_cluster", "measured_cluster_fields", "run_microbench",
           "summarise"]

MATMUL_SHAPES = ((64, 64, 64), (256, 64, 256), (512, 256, 256), (1024, 512, 512))
SIZES = (4 * 1024, 1024 * 1024, 8 * 1024 * 1024)  # bytes per rank for the collectives
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def _time(fn, repeat: int, rounds: int = 1) -> float:
    """Seconds per call of ``fn``: the mean over ``repeat`` calls, the median over ``rounds``."""
    fn()  # warm-up
    # the mean, not the best: all ranks run together and the contention is what we want;
    # the median of rounds keeps one descheduled round from moving a small difference
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        means.append((time.perf_counter() - t0) / repeat)
    return float(np.median(means))


def _collective(kind: str, rank: int, nproc: int, n_el: int):
    """A no-argument function running one ``kind`` collective on n_el floats per rank."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(n_el)
    if kind in ("all_reduce", "reduce_scatter"):
        # gloo has no reduce_scatter: the process group runs it as an all-reduce
        return lambda: dist.all_reduce(buf)
    if kind == "all_gather":
        part = torch.ones(n_el // nproc)
        shards = [torch.empty(n_el // nproc) for _ in range(nproc)]
        return lambda: dist.all_gather(shards, part)
    peer = rank ^ 1  # pairs (0,1), (2,3), ... exchange a message each way

    def send_recv() -> None:
        if peer >= nproc:
            return
        first, second = (dist.send, dist.recv) if rank % 2 == 0 else (dist.recv, dist.send)
        first(buf, peer)
        second(buf, peer)

    return send_recv


TINY_GPT = {"n_layers": 1, "d_model": 16, "n_heads": 2, "vocab_size": 32, "max_seq_len": 8}


HOST_ROUNDS = 5
"""Rounds (median) of the GPT timings: the host costs are small differences of them, and the
reference GPT sets the block rate every prediction scales with."""


def _gpt_fwd_bwd_seconds(model: Any, micro_batch: int, repeat: int, rounds: int = 1,
                         then: Any = None) -> float:
    """Mean seconds of one forward + backward (cross-entropy) of ``model`` (a GPT, or one
    wrapped in DistributedDataParallel) on random tokens, each followed by ``then()`` when
    given."""
    import torch
    import torch.nn.functional as F

    cfg = getattr(model, "module", model).cfg
    vocab, seq = cfg.vocab_size, cfg.max_seq_len
    x = torch.randint(0, vocab, (micro_batch, seq + 1))

    def run() -> None:
        logits = model(x[:, :-1])
        F.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1)).backward()
        if then is not None:
            then()

    return _time(run, repeat, rounds)


def _host_overheads(repeat: int = 5) -> dict[str, float]:
    """Fixed host costs of eager PyTorch training at negligible tensor sizes (seconds).

    A GPT of 1 and of 3 tiny blocks runs forward+backward: the difference per block is the
    per-block cost (op dispatch, autograd), the rest the per-micro-batch cost (embedding,
    head, loss). AdamW (foreach=False, as used with DTensor) gives the cost per tensor.
    """
    import torch

    from model.config import ModelConfig
    from model.gpt import GPT

    t1 = _gpt_fwd_bwd_seconds(GPT(ModelConfig(**TINY_GPT)), 1, repeat, HOST_ROUNDS)
    model = GPT(ModelConfig(**{**TINY_GPT, "n_layers": 3}))
    t3 = _gpt_fwd_bwd_seconds(model, 1, repeat, HOST_ROUNDS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    t_opt = _time(opt.step, repeat)
    n_tensors = sum(1 for _ in model.parameters())
    per_block = max((t3 - t1) / 2, 1e-6)
    return {"layer_overhead_s": per_block, "microbatch_overhead_s": max(t1 - per_block, 1e-6),
            "plain3_s": t3,
            "optimizer_overhead_per_tensor_s": t_opt / n_tensors}


def _fsdp_overhead(nproc: int, plain_s: float, repeat: int = 5) -> float:
    """Extra seconds per FSDP2 unit per micro-batch (hooks, copies, collectives) at tiny sizes.

    The same 3-block GPT as in _host_overheads, each block and the root sharded over all
    ranks (ZeRO-3 style); compared with its unsharded time ``plain_s``, per unit.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from model.config import ModelConfig
    from model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**TINY_GPT, "n_layers": 3}))
    mesh = init_device_mesh("cpu", (nproc,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    units = len(model.layers) + 1
    return max(_gpt_fwd_bwd_seconds(model, 1, repeat, HOST_ROUNDS) - plain_s, 0.0) / units


REFERENCE_GPT = {"n_layers": 2, "d_model": 128, "n_heads": 4, "vocab_size": 512,
                 "max_seq_len": 128}
REFERENCE_MICRO_BATCH = 4


def _reference_gpt(rank: int, alone_ranks: int, repeat: int = 5) -> dict[str, float]:
    """Seconds of one forward + backward of a small real GPT (REFERENCE_GPT, float32) with
    every rank busy (``reference_gpt_s``) and, when ``alone_ranks`` (the cores) is set, on
    the first ``alone_ranks`` ranks while the others wait (``reference_gpt_alone_s``, these
    ranks only).

    The two are measured in alternating rounds (HOST_ROUNDS of each) and the alone time is
    the busy median over the median of the rounds' busy / alone ratios: a spell of load on
    the box falls on a busy round and the alone round next to it alike, where measured one
    after the other their ratio (``alone_speedup``) moved 19 % from run to run."""
    import statistics

    import torch
    import torch.distributed as dist

    from model.config import ModelConfig
    from model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(**REFERENCE_GPT))
    synced = torch.nn.parallel.DistributedDataParallel(model) if alone_ranks else None
    busy, ratios, stalls = [], [], []
    for _ in range(HOST_ROUNDS):
        dist.barrier()
        busy.append(_gpt_fwd_bwd_seconds(model, REFERENCE_MICRO_BATCH, repeat))
        if alone_ranks:
            dist.barrier()
            if rank < alone_ranks:
                ratios.append(busy[-1] / _gpt_fwd_bwd_seconds(model, REFERENCE_MICRO_BATCH,
                                                              repeat))
            stalls.append(_stalls(rank, model, synced, busy[-1], repeat))
    dist.barrier()
    out = {"reference_gpt_s": statistics.median(busy)}
    if ratios:
        out["reference_gpt_alone_s"] = out["reference_gpt_s"] / statistics.median(ratios)
        for kind in stalls[0]:
            out[f"{kind}_stall_s"] = max(statistics.median(s[kind] for s in stalls), 0.0)
    return out


def _stalls(rank: int, model: Any, synced: Any, busy_s: float, repeat: int) -> dict[str, float]:
    """What a wait on other ranks costs beyond its transfer when every rank computes on
    shared cores: the ranks that arrive first idle until the last one's time slice comes
    round, and a woken rank queues behind the ranks still computing.

    Each is the reference forward + backward followed by a wait, less the step alone
    (``busy_s``, measured just before) and the transfer with nothing else running:
    ``receive``, an activation exchanged with a neighbour rank (a pipeline stage's receive);
    ``ddp``, the step under DistributedDataParallel (``synced``) over every rank, whose
    gradient all-reduce runs beside the backward."""
    import torch
    import torch.distributed as dist

    cfg = model.cfg
    activation = torch.zeros(REFERENCE_MICRO_BATCH * cfg.max_seq_len * cfg.d_model)
    exchange = _collective("send_recv", rank, dist.get_world_size(), activation.numel())
    gradients = torch.zeros(sum(p.numel() for p in model.parameters()))
    dist.barrier()
    received = _gpt_fwd_bwd_seconds(model, REFERENCE_MICRO_BATCH, repeat, then=exchange)
    dist.barrier()
    exchanged = _time(exchange, repeat)
    dist.barrier()
    in_ddp = _gpt_fwd_bwd_seconds(synced, REFERENCE_MICRO_BATCH, repeat)
    dist.barrier()
    reduced = _time(lambda: dist.all_reduce(gradients), repeat)
    return {"receive": received - busy_s - exchanged, "ddp": in_ddp - busy_s - reduced}


def _reference_shapes() -> Any:
    """The time model's Shapes of REFERENCE_GPT (float32)."""
    from types import SimpleNamespace

    from model.config import ModelConfig
    from model.planner.shapes import Shapes

    return Shapes.from_configs(ModelConfig(**REFERENCE_GPT), SimpleNamespace(
        seq_len=REFERENCE_GPT["max_seq_len"], dtype="float32"))


def _solve_growing(predicted, target: float, lo: float, hi: float) -> float:
    """The x in [lo, hi] at which the increasing function ``predicted`` reaches ``target``
    (geometric bisection; the bound when the target lies outside)."""
    if predicted(hi) <= target:
        return hi
    if predicted(lo) >= target:
        return lo
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if predicted(mid) < target else (lo, mid)
    return (lo * hi) ** 0.5


def block_rate_scale(fields: dict[str, Any], reference_s: float) -> float:
    """How much slower a real block runs than the kernel rates predict.

    The time model is evaluated for REFERENCE_GPT on one rank with these fields, with the
    matmul and memory rates divided by a factor X; returns the X at which it predicts the
    measured ``reference_s`` (host costs stay as measured). X > 1 on CPUs: eager PyTorch's
    GEMMs of transformer shapes, softmax and norms reach less than the best matmul rate.
    """
    from model.parallel.layout import Plan
    from model.planner.shapes import encode
    from model.planner.time_model import step_time

    shapes = _reference_shapes()
    plan = encode([Plan(micro_batch=REFERENCE_MICRO_BATCH, grad_accum=1, sharding="none")])

    def predicted(x: float) -> float:
        scaled = {**fields, "peak_tflops": fields["peak_tflops"] / x,
                  "fp32_tflops": fields["fp32_tflops"] / x,
                  "hbm_bandwidth_gbps": fields["hbm_bandwidth_gbps"] / x}
        t = step_time(shapes, cluster_from_dict(scaled, "microbenchmark"), plan)
        return float(t["compute"][0] - t["optimizer"][0])

    return _solve_growing(predicted, reference_s, 0.1, 50.0)


def _reference_gpt_tp(nproc: int, repeat: int = 5) -> float:
    """Seconds of REFERENCE_GPT's forward + backward under tensor parallelism over rank pairs
    (tp=2, as in _tp_overhead), every rank busy."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from model.config import ModelConfig
    from model.gpt import GPT
    from model.parallel.parallelize import apply_tp

    mesh = init_device_mesh("cpu", (nproc // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = GPT(ModelConfig(**REFERENCE_GPT))
    apply_tp(model, mesh["tp"])
    return _gpt_fwd_bwd_seconds(model, REFERENCE_MICRO_BATCH, repeat, HOST_ROUNDS)


def tp_comm_scale(fields: dict[str, Any], reference_tp_s: float) -> float:
    """How much longer tensor-parallel communication takes in a real block than modelled.

    The microbenchmark's collectives run back to back; in a block each waits for its partner
    to finish its share of the GEMMs first, and DTensor adds redistributions and the gathered
    logits (gloo on CPU: 2-3x the modelled time). The time model is evaluated for REFERENCE_GPT
    at tp=2 with these fields and its tensor-parallel communication multiplied by a factor Y;
    returns the Y at which it predicts the measured ``reference_tp_s`` (within [0.25, 50]).
    """
    from model.parallel.layout import Plan
    from model.planner.shapes import encode
    from model.planner.time_model import step_time

    shapes = _reference_shapes()
    plan = encode([Plan(tp=2, micro_batch=REFERENCE_MICRO_BATCH, grad_accum=1, sharding="none")])

    def predicted(y: float) -> float:
        t = step_time(shapes, cluster_from_dict({**fields, "tp_comm_scale": y}, "microbenchmark"),
                      plan)
        return float(t["step"][0] - t["optimizer"][0])

    return _solve_growing(predicted, reference_tp_s, 0.25, 50.0)


def _tp_overhead(nproc: int, repeat: int = 5) -> tuple[float, float]:
    """(seconds per block, per micro-batch) of a tp=2 GPT at tiny sizes, forward + backward.

    The same tiny GPT as in _host_overheads under DTensor tensor parallelism over rank
    pairs (vocab-parallel embedding and head included), 1 and 3 blocks: the difference per
    block is the per-block cost, the rest the per-micro-batch cost. Its collectives are
    included; summarise() takes their modelled latency off.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from model.config import ModelConfig
    from model.gpt import GPT
    from model.parallel.parallelize import apply_tp

    mesh = init_device_mesh("cpu", (nproc // 2, 2), mesh_dim_names=("dp", "tp"))

    def fwd_bwd(n_layers: int) -> float:
        torch.manual_seed(0)
        model = GPT(ModelConfig(**{**TINY_GPT, "n_layers": n_layers}))
        apply_tp(model, mesh["tp"])
        return _gpt_fwd_bwd_seconds(model, 1, repeat, HOST_ROUNDS)

    t1, t3 = fwd_bwd(1), fwd_bwd(3)
    per_block = max((t3 - t1) / 2, 1e-6)
    return per_block, max(t1 - per_block, 1e-6)


def _worker(rank: int, nproc: int, store_path: str, out_path: str) -> None:
    os.environ.update(rank_threads_env())
    retain_freed_memory()  # as a training rank does (model.parallel.dist_env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, nproc)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=nproc)
    import psutil

    # resident memory of a rank before any model exists: torch, gloo, the interpreter
    res: dict[str, Any] = {"matmul": [], "collectives": {},
                           "base_rss_gb": psutil.Process().memory_info().rss / 1e9}
    for m, n, k in MATMUL_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        reps = max(3, int(1e8 / (m * n * k)))
        dist.barrier()
        t = _time(lambda a=a, b=b, reps=reps: [a @ b for _ in range(reps)], 3) / reps
        res["matmul"].append({"m": m, "n": n, "k": k, "seconds": t, "flops": 2.0 * m * n * k})
    dist.barrier()
    res["host"] = _host_overheads()
    dist.barrier()
    cores = len(os.sched_getaffinity(0))
    # with more ranks than cores, also the block with only one rank per core running: what a
    # rank gains when the others wait (a pipeline bubble), context switches included
    res["host"].update(_reference_gpt(rank, cores if nproc > cores else 0))
    if nproc > 1:
        dist.barrier()
        res["host"]["fsdp_unit_overhead_s"] = _fsdp_overhead(nproc, res["host"]["plain3_s"])
    if nproc % 2 == 0:
        dist.barrier()
        res["host"]["tp_block_s"], res["host"]["tp_microbatch_s"] = _tp_overhead(nproc)
        dist.barrier()
        res["host"]["reference_gpt_tp2_s"] = _reference_gpt_tp(nproc)
    x = torch.randn(8 * 1024 * 1024)  # 32 MB
    y = torch.empty_like(x)
    dist.barrier()
    res["copy_gbps"] = 2 * x.numel() * 4 / _time(lambda: y.copy_(x), 5) / 1e9
    if nproc > 1:
        for kind in COLLECTIVES:
            times = []
            for size in SIZES:
                fn = _collective(kind, rank, nproc, size // 4)
                dist.barrier()
                times.append(_time(fn, 5))
            res["collectives"][kind] = times
    gathered = [None] * nproc
    dist.all_gather_object(gathered, res)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _ranks(nproc: int, store_path: str, out_path: str) -> int:
    """Rank 0 of a measurement, a fresh interpreter that has imported no torch: fork ranks
    1 .. nproc-1 (``fork_server.fork_child``, as every forked rank is made; each dies with
    rank 0), measure, wait for them. The exit code: the first failed peer's, else 0 (rank
    0's own failure raises)."""
    from model.parallel.fork_server import exit_after, fork_child

    peers = []
    for rank in range(1, nproc):
        pid = fork_child()
        if pid == 0:
            exit_after(lambda rank=rank: _worker(rank, nproc, store_path, out_path))
        peers.append(pid)
    _worker(0, nproc, store_path, out_path)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in peers]
    return next((code for code in codes if code != 0), 0)


def run_microbench(nproc: int) -> dict[str, Any]:
    """Measure on ``nproc`` gloo ranks and return the raw per-rank results. The ranks start
    as the local launcher's do: a fresh interpreter as rank 0 (``python -m
    model.planner.microbench --ranks``), which forks the others."""
    import subprocess
    import sys

    from model.parallel.fork_server import REPO

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        code = subprocess.run([sys.executable, "-m", "model.planner.microbench", "--ranks",
                               str(nproc), str(Path(tmp) / "store"), str(out)],
                              cwd=REPO, check=False).returncode
        if code != 0:
            raise RuntimeError(f"the microbenchmark's {nproc} ranks failed (exit code {code}); "
                               "their error is printed above")
        return {"ranks": json.loads(out.read_text())}


def summarise(raw: dict[str, Any], nproc: int) -> dict[str, Any]:
    """Cluster fields (see model.planner.cluster) from raw per-rank measurements.

    The slowest rank counts.
    """
    ranks = raw["ranks"]
    n_shapes = len(ranks[0]["matmul"])
    mm = [max(r["matmul"][i]["seconds"] for r in ranks) for i in range(n_shapes)]
    flops = [ranks[0]["matmul"][i]["flops"] for i in range(n_shapes)]
    rate = max(f / t for f, t in zip(flops, mm))
    overhead = max(1e-6, mm[0] - flops[0] / rate)  # the smallest GEMM is mostly overhead
    copy = min(r["copy_gbps"] for r in ranks)
    collectives: dict[str, dict[str, float]] = {}
    if nproc > 1:
        sizes = np.array(SIZES, dtype=float)
        for kind in COLLECTIVES:
            t = np.array([max(r["collectives"][kind][i] for r in ranks) for i in range(len(SIZES))])
            # least-squares line t = a + b * size; a noisy, non-increasing fit falls back to
            # the large-message rate (bandwidth) and the small-message time (latency)
            b, a = np.polyfit(sizes, t, 1)
            if b <= 0 or a <= 0:
                b, a = t[-1] / sizes[-1], t[0]
            if kind == "send_recv":  # a round trip: two messages
                bw, lat = 2 / b, a / 2
            else:
                ring = (2.0 if kind == "all_reduce" else 1.0) * (nproc - 1)
                bw, lat = ring / nproc / b, a / ring
            collectives[kind] = {"bandwidth_gbps": bw / 1e9, "latency_us": lat * 1e6}
    host = {k: max(r["host"][k] for r in ranks if k in r["host"])
            for k in ranks[0].get("host", {})}
    link_bw = collectives.get("all_reduce", {}).get("bandwidth_gbps", copy)
    link_lat = collectives.get("all_reduce", {}).get("latency_us", 1.0)
    tp_layer_us = tp_mb_us = 0.0
    if "tp_block_s" in host:
        # a tp=2 all-reduce: two ring hops of the measured per-hop latency
        ar2 = 2 * collectives.get("all_reduce", {}).get("latency_us", 0.0) * 1e-6
        # per block: 4 all-reduces (2 forward, 2 backward); per micro-batch: the embedding
        # and head reductions (2 forward, 2 backward) and the loss's gathered logits
        tp_layer_us = float(max(host["tp_block_s"] - host["layer_overhead_s"] - 4 * ar2, 0.0)) * 1e6
        tp_mb_us = float(max(host["tp_microbatch_s"] - host["microbatch_overhead_s"] - 4 * ar2,
                             0.0)) * 1e6
    import psutil

    fields = {
        "name": "local", "measured": True, "ranks_per_node": nproc,
        "memory_gb": round(0.8 * psutil.virtual_memory().total / 1e9 / nproc, 3),
        "peak_tflops": rate / 1e12, "fp32_tflops": rate / 1e12,
        "hbm_bandwidth_gbps": copy, "gemm_efficiency": 1.0,
        "kernel_overhead_us": overhead * 1e6,
        "reserved_gb": round(max(r.get("base_rss_gb", 0.35) for r in ranks), 3),
        "fragmentation": 0.10,
        # the block measurement includes its 21 GEMM launches, which gemm_time already counts
        "layer_overhead_us": max(host.get("layer_overhead_s", 0.0) - 21 * overhead, 0.0) * 1e6,
        "microbatch_overhead_us": host.get("microbatch_overhead_s", 0.0) * 1e6,
        "optimizer_overhead_us": host.get("optimizer_overhead_per_tensor_s", 0.0) * 1e6,
        "fsdp_unit_overhead_us": host.get("fsdp_unit_overhead_s", 0.0) * 1e6,
        "tp_layer_overhead_us": tp_layer_us,
        "tp_microbatch_overhead_us": tp_mb_us,
        "comm_overlap": 0.0,  # gloo runs on the same cores as the compute
        "cores_per_node": float(len(os.sched_getaffinity(0))),
        "alone_speedup": (host["reference_gpt_s"] / host["reference_gpt_alone_s"]
                          if "reference_gpt_alone_s" in host else 0.0),
        "receive_stall_us": host.get("receive_stall_s", 0.0) * 1e6,
        "ddp_stall_us": host.get("ddp_stall_s", 0.0) * 1e6,
        # the stalls follow a whole reference step: the compute a rank waits behind
        "stall_after_us": (host["reference_gpt_s"] * 1e6 if "receive_stall_s" in host
                           else 0.0),
        "links": {"node": {"group": nproc, "bandwidth_gbps": link_bw, "latency_us": link_lat}},
        "collectives": collectives,
    }
    if "reference_gpt_s" in host:
        # Kernel rates -> the rates a real block reaches (all ranks busy, like the rest).
        x = block_rate_scale(fields, host["reference_gpt_s"])
        fields.update(peak_tflops=rate / x / 1e12, fp32_tflops=rate / x / 1e12,
                      hbm_bandwidth_gbps=copy / x,
                      notes=f"kernel rates divided by {x:.2f} to match a real block")
    if "reference_gpt_tp2_s" in host:
        fields["tp_comm_scale"] = tp_comm_scale(fields, host["reference_gpt_tp2_s"])
    return fields


def measured_cluster_fields(
    nproc: int,
    cache_path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    refresh: bool = False,
    read_first: str | Path | None = None,
) -> dict[str, Any]:
    """Cluster fields for this machine with ``nproc`` ranks: a trusted cache file's
    (``microbench_cache.read_cached``), else measured now and written to the cache.

    The cache file is ``cache_path``, else ``cache_file(nproc, cache_dir)`` (the per-user
    cache dir by default). ``read_first``, a directory, is read before it and never written
    (a runs dir's own copy). ``refresh`` measures whatever is cached. The fields carry
    ``source`` (the file) and ``figures`` (``cached`` or ``measured``)."""
    target = Path(cache_path) if cache_path else cache_file(nproc, cache_dir)
    candidates = [target]
    if read_first is not None and cache_path is None:
        candidates.insert(0, cache_file(nproc, read_first))

    def cached() -> dict[str, Any] | None:
        for path in candidates:
            data, why = read_cached(path, nproc)
            if data is not None:
                return {**data["fields"], "source": str(path), "figures": "cached"}
            if path.exists():
                print(f"[microbench] not trusting {path}: {why}", flush=True)
        return None

    if not refresh and (found := cached()) is not None:
        return found
    with locked(target):
        # another planner may have measured while this one waited for the lock
        if not refresh and (found := cached()) is not None:
            return found
        print(f"[microbench] measuring this machine with {nproc} ranks (cached in {target})",
              flush=True)
        t0 = time.perf_counter()
        raw = run_microbench(nproc)
        fields = summarise(raw, nproc)
        seconds = time.perf_counter() - t0
        write_cached(target, nproc, fields, raw, seconds)
    print(f"[microbench] done in {seconds:.1f} s: {fields['peak_tflops'] * 1e3:.1f} "
          f"GFLOP/s per rank, all-reduce {fields['links']['node']['bandwidth_gbps']:.2f} GB/s",
          flush=True)
    return {**fields, "source": str(target), "figures": "measured"}


def load_measured_cluster(name_or_path: str | Path, nproc: int | None,
                          cache_path: str | Path | None = None,
                          cache_dir: str | Path | None = None,
                          read_first: str | Path | None = None) -> Cluster:
    """Load a cluster file; one that says ``measured: true`` gets this machine's figures for
    ``nproc`` ranks (``measured_cluster_fields``: cached, or measured now)."""
    path, raw = read_cluster_file(name_or_path)
    if not raw.get("measured"):
        return load_cluster(path)
    if not nproc:
        raise ClusterError(f"{path} is measured at plan time: give the number of ranks (nproc)")
    fields = measured_cluster_fields(nproc, cache_path=cache_path, cache_dir=cache_dir,
                                     read_first=read_first)
    return cluster_from_dict({**raw, **fields}, str(path))


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--ranks"]:  # run_microbench's rank 0: --ranks N STORE OUT
        raise SystemExit(_ranks(int(sys.argv[2]), sys.argv[3], sys.argv[4]))
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    print(json.dumps(measured_cluster_fields(n, refresh="--refresh" in sys.argv), indent=2))
