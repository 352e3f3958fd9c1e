"""Predicted time of one optimizer step under a parallel plan.

Compute: every GEMM of a block (QKV, attention scores and values, output projection, MLP,
and the logits on the last stage) is timed with a roofline,
``max(flops / (peak * gemm_efficiency), bytes / hbm_bandwidth) + kernel_overhead``, so
small GEMMs (small micro-batches, wide tensor parallelism) run below peak. Norms,
activations, rotary and residual adds are memory bound; on GPUs, eager PyTorch's unfused
kernels move more bytes than fused ones (``eager_block_bytes``, ``EAGER_LOSS_BYTES``).
Backward costs twice the forward; full recompute adds a forward, selective recompute the
attention core; partial recompute (``recompute_layers`` N of each chunk's blocks) adds the
forward of those N blocks (``recompute_fraction``). Fused (flash) attention skips the masked
half of the causal scores; unfused attention computes them all.

Communication (ring collectives, ``2(n-1)/n * bytes / bw + 2(n-1) * latency`` for an
all-reduce, half for reduce-scatter or all-gather) runs on the link the mesh places the
group on. The mesh is ("pp", "dp", "tp") with tp fastest varying, so a tp group is
consecutive ranks (tp=2: one MI250X on Frontier, tp<=8: one node), a dp group has stride
tp and a pp group stride tp*dp (usually the network). A group crossing nodes shares each node's
NICs with the other groups that have ranks there (``_group_bandwidth``). Per block and
micro-batch tensor parallelism costs 2 all-reduces forward and 2 backward (2 more with full
recompute, for the recomputed blocks); with sequence parallelism each becomes an all-gather
+ reduce-scatter of the same volume. This project's trainer (``framework`` None) also
all-gathers the logits per micro-batch and computes the loss on full vocabulary rows on
every tp rank. On measured
CPU clusters the tp communication is scaled by ``tp_comm_scale`` (a real tp block waits for
its partner's GEMMs before each collective).

Pipeline: the stage time per micro-batch times (m + (pp-1)/v) (bubble (pp-1)/m, divided
by the virtual stages for interleaved 1F1B when m >= pp; the fill and drain cost the stages'
mean time, the steady state the slowest stage's), plus activation send/recv on the critical
path (twice as many blocking transfers under DeepSpeed's pipeline engine,
``PIPELINE_P2P_PER_MICROBATCH``, each a 1/tp slice gathered over tp on arrival,
``PIPELINE_PARTITIONED``). On CPUs with more ranks than cores (``cores_per_node``)
the bubble is partly filled by other ranks' work. Data parallelism: gradient reduce-scatter
(all-reduce for DDP) and parameter all-gathers, hidden under backward/forward up to the
cluster's comm_overlap. FSDP under torch pipelining keeps gradients unsharded until the last
micro-batch (one reduce-scatter per step); without pipelining zero2 reduce-scatters once per
step and re-gathers parameters each micro-batch, zero3 does both every micro-batch (twice
gathering). The optimizer step is memory bound (fp32 params, grads and Adam moments read
and written).

Fixed host costs (cluster.layer_overhead_us per block and micro-batch,
microbatch_overhead_us, optimizer_overhead_us per parameter tensor, fsdp_unit_overhead_us
per FSDP unit and micro-batch, tp_layer_overhead_us / tp_microbatch_overhead_us for DTensor
tensor parallelism) dominate tiny models on CPUs; the local cluster measures them.

GPU terms, off on CPU clusters (cluster fields): tile and wave quantisation of GEMMs
(``gemm_sms``, ``gemm_tile``), a fused flash-attention kernel at its own efficiency whose
backward recomputes the scores (``attention_efficiency``), the exposed part of tensor-parallel
communication (``tp_comm_overlap``) and a per-framework efficiency factor
(``framework_efficiency``, fitted to published runs by model.planner.published) that divides
the compute time of the framework that runs the plan.

``step_time`` also returns ``breakdown``: seconds per step by term (compute by kind, bubble,
optimizer, exposed tp / pp / dp communication) that add up to ``step``, and ``overlapped``:
the communication hidden under compute.

Every prediction is split into ``compute`` and ``comm`` seconds so that measured runs can
calibrate two scales (``calibration = {"compute_scale", "comm_scale"}``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from model.planner.memory_model import stage_layer_counts
from model.planner.rank_counts import (
    GRADIENT_REDUCE_BYTES,
    float32_stream_ratio,
    mean_unit_gathers,
    tp_block_collectives,
)
from model.planner.shapes import (
    DDP,
    INTERLEAVED,
    NOSHARD,
    REC_FULL,
    REC_SEL,
    ZERO2,
    ZERO3,
    Shapes,
    fsdp_sharded,
)

TRAINER_FRAMEWORK = "pytorch"
"""The published framework whose fitted efficiency factor prices this trainer (framework
None everywhere in the planner): PyTorch-native FSDP2 / DTensor / pipelining, as in
torchtitan's and LLM Foundry's runs. Everything else about a step (the gathered logits, the
tensor-parallel collectives, float32 gradient reductions) is priced as this trainer runs it."""

PIPELINE_P2P_PER_MICROBATCH: dict[str, int] = {"megatron-deepspeed": 4}
"""Blocking point-to-point transfers per micro-batch on a pipeline stage's critical path, by
framework (2 when not listed). Megatron-LM's (and this project's) 1F1B pairs every send with the
opposite receive in one batched exchange (send_forward_recv_backward,
send_backward_recv_forward); DeepSpeed's pipeline engine (deepspeed/runtime/pipe/schedule.py,
TrainSchedule) issues SendActivation, RecvActivation, SendGrad and RecvGrad as four separate
blocking instructions, so each stage waits for twice as many transfers."""

PIPELINE_PARTITIONED: frozenset[str] = frozenset({"megatron-deepspeed"})
"""Frameworks whose pipeline sends split the activation over the tensor-parallel ranks.
DeepSpeed's pipeline engine (deepspeed/runtime/pipe/engine.py, ``is_pipe_partitioned`` and
``is_grad_partitioned``, on by default whenever the model-parallel group has more than one
rank) sends each tp rank's 1/tp slice of the activation and of its gradient as a
PartitionedTensor and all-gathers it over the tp group on the receiving stage, so a
cross-node transfer carries 1/tp of the bytes (as sequence parallelism does) and each receive
adds an in-node all-gather."""


EAGER_LOSS_BYTES = 24.0
"""Bytes per logit (forward and backward together) that eager
``F.cross_entropy(logits.float(), targets)`` moves beyond the 12 the logits term already
charges (a fused loss: read the bf16 logit, write its gradient, one fp32 pass). Kernel by kernel
for one bf16 logit: the fp32 cast reads 2 and writes 4 bytes (6); log-softmax reads the fp32
logit and writes the fp32 log-probability (8); backward, nll_loss writes the fp32 gradient of the
log-probabilities (4), log-softmax's backward reads that gradient and its saved output and writes
the fp32 gradient (12), and the cast's backward reads it and writes bf16 (6): 36 bytes, 24 more
than a fused loss. torchtitan (its loss is never compiled) and this project's trainer
(model.training.trainer.cross_entropy; ``train.compile`` compiles the blocks only) run it."""


def eager_block_bytes(s: Shapes, tp: Any, spf: Any) -> np.ndarray:
    """Bytes per token of one block's forward that eager PyTorch moves through HBM beyond what
    the compiled (or hand-fused) block does, the kernels that compile fuses away; backward moves
    twice as much (the time model's ``3 x forward``: each unfused kernel's backward reads the
    output gradient and the saved input and writes the input gradient). ``spf`` is 1/tp under
    sequence parallelism (norms and residual adds run on a 1/tp slice of the sequence), else 1.

    Per token, bf16 activations (2 bytes), fp32 intermediates (4), h = d_model, kvd = kv_heads *
    head_dim, f = ffn, "r/w" = bytes read/written per element:

    llama (torchtitan's and this project's block: RMSNorm, rotary, repeat_kv, SwiGLU):

    - RMSNorm, eager (``nn.RMSNorm``/torchtitan's RMSNorm are composite ops: upcast to fp32,
      pow, mean, x * rsqrt, cast back, * weight): cast r2 w4 (6), pow r4 w4 (8), mean r4 (4),
      mul r4 w4 (8), cast r4 w2 (6), weight mul r2 w2 (4): 36h per norm, two per block: 72h.
    - residual adds, eager: r2 + r2, w2: 6h each, two: 12h. Compiled, each residual add fuses
      with the norm after it: the block's input norm r2 w2 (4h), add + ffn norm r2 r2 w2 w2
      (8h), the closing add r2 r2 w2 (6h): 18h for norms and adds. Extra: 84h - 18h = 66h.
    - rotary on q (h) and k (kvd), eager: upcast r2 w4 (6), complex or cos/sin multiply
      (rotate_half: mul, neg-and-cat, mul, add) r4 w4 (8), cast back r4 w2 (6): 20 per element;
      compiled one kernel r2 w2 (4). repeat_kv (grouped-query attention only, g = 1 when
      kv_heads < heads): k and v copied out to h wide, eager r2kvd w2h each (4kvd + 4h in
      all); compiled, k's copy is the rotary kernel writing h wide (r2kvd w2h) and v's copy
      stays (r2kvd w2h). Eager 20(h + kvd) + g(4h + 4kvd), compiled 4(h + kvd) + g 4h:
      extra 16h + 16kvd + g 4kvd, split by tp.
    - SwiGLU, eager: silu r2f w2f (4f), multiply r2f r2f w2f (6f): 10f; compiled one kernel
      r4f w2f (6f): extra 4f, split by tp.
    - no dropout (torchtitan and this project's GPT have none).

    So llama: 66h spf + (16h + 16kvd + g 4kvd + 4f) / tp. Llama 3.1 8B (h 4096, kvd 1024,
    f 14336, tp 1): 270,336 + 86,016 + 57,344 = 413,696 bytes per token and block forward.

    neox (LayerNorm, GELU MLP): ``F.layer_norm`` and ``F.gelu`` are single kernels in eager
    too (r2 w2 each); what compile fuses is the two residual adds into the next norm, 20h
    eager (2 x 4h + 2 x 6h) against 18h: extra 2h spf. (Rotary in this project's neox blocks
    is not counted.)

    The parameters' fp32 -> bf16 casts (FSDP's mixed precision casts the 1/dp shard before the
    all-gather) move 6 bytes per parameter / dp per micro-batch and are left out (under 0.1 %
    of a block's traffic at the published runs' micro-batches).
    """
    h, kvd, f = s.d_model, s.kv_heads * s.head_dim, s.ffn
    if not s.llama:
        return 2.0 * h * spf + 0.0 * tp
    gqa = 1.0 if s.kv_heads < s.n_heads else 0.0
    return 66.0 * h * spf + (16.0 * h + 16.0 * kvd + gqa * 4.0 * kvd + 4.0 * f) / tp


def gemm_time(cluster: Any, dtype: str, m: Any, n: Any, k: Any, batch: Any = 1) -> np.ndarray:
    """Roofline time (s) of ``batch`` GEMMs [m,k] x [k,n]; efficiency falls for small shapes.

    With ``cluster.gemm_sms`` > 0 the output is cut into gemm_tile x gemm_tile tiles that run
    in waves of gemm_sms: a partial tile or a partial last wave costs as much as a full one
    (tile and wave quantisation), which is what makes narrow per-rank shapes slow.
    """
    cb = 2 if dtype == "bfloat16" else 4
    flops = 2.0 * m * n * k * batch
    nbytes = cb * (m * k + k * n + m * n) * batch
    rate = cluster.peak_for(dtype) * cluster.gemm_efficiency
    if getattr(cluster, "gemm_sms", 0):
        tile, sms = cluster.gemm_tile, cluster.gemm_sms
        tiles = np.ceil(np.asarray(m) / tile) * np.ceil(np.asarray(n) / tile) * batch
        waves = np.ceil(tiles / sms)
        flops = 2.0 * waves * sms * tile * tile * k
    return np.maximum(flops / rate, nbytes / (cluster.hbm_bandwidth_gbps * 1e9)) \
        + cluster.kernel_overhead_us * 1e-6


def _group_bandwidth(cluster: Any, link: Any, stride: int) -> float:
    """Bus bandwidth (bytes/s) per rank of a collective group at this rank stride on ``link``.

    Across the network a node's NICs are shared by the groups that have ranks on it: with
    stride s < ranks_per_node a group holds ranks_per_node/s ranks of every node and shares the
    NICs with s - 1 other groups. NCCL/RCCL run one ring (or tree) channel per NIC and move
    the node-local part over the in-node links, so what crosses the network per node is about
    the group's whole buffer, spread over the node's NICs: the group's bus bandwidth is the
    node's network bandwidth / s, capped by the in-node link the rest of the ring runs on.
    With stride >= ranks_per_node (one rank per node, e.g. dp groups under tp = 8) every rank
    has 1/ranks_per_node of the node's NICs.
    """
    if link.name != "network" or stride >= cluster.ranks_per_node:
        return cluster.rank_bandwidth(link)
    inner = [lk for lk in cluster.links if lk.name != "network"]
    cap = inner[-1].bandwidth_gbps * 1e9 if inner else float("inf")
    return min(cluster.rank_bandwidth(link, concurrent=stride), cap)


def _coll(cluster: Any, kind: str, nbytes: Any, n: Any, stride: Any, calls: Any = 1) -> np.ndarray:
    """Ring collective time (s) of ``nbytes`` per rank over n ranks at the given rank stride,
    split into ``calls`` collectives (each pays the latency)."""
    n = np.asarray(n)
    stride = np.asarray(stride)
    out = np.zeros(np.broadcast(n, stride, np.asarray(nbytes), np.asarray(calls)).shape)
    factor = 2.0 if kind == "all_reduce" else 1.0
    # one link level per distinct (n, stride) pair; few distinct pairs, so loop over them
    pairs = np.unique(np.stack(np.broadcast_arrays(n, stride)).reshape(2, -1), axis=1)
    for size, st in pairs.T:
        if size <= 1:
            continue
        link = cluster.link_for(int(st), int(size))
        bw = _group_bandwidth(cluster, link, int(st))
        lat = link.latency_us * 1e-6
        meas = cluster.collectives.get(kind) if cluster.collectives else None
        if meas:  # measured bus bandwidth and per-hop latency of this collective
            bw, lat = meas["bandwidth_gbps"] * 1e9, meas["latency_us"] * 1e-6
        mask = (n == size) & (stride == st)
        t = factor * (size - 1) / size * np.asarray(nbytes) / bw \
            + np.asarray(calls) * factor * (size - 1) * lat
        out = np.where(mask, t, out)
    return out


def _p2p(cluster: Any, nbytes: Any, stride: Any) -> np.ndarray:
    """Point-to-point send/recv time (s) between pipeline neighbours at this rank stride."""
    stride = np.asarray(stride)
    out = np.zeros(np.broadcast(stride, np.asarray(nbytes)).shape)
    for st in np.unique(stride):
        meas = cluster.collectives.get("send_recv") if cluster.collectives else None
        if meas:
            bw, lat = meas["bandwidth_gbps"] * 1e9, meas["latency_us"] * 1e-6
        else:
            link = cluster.link_for(int(st), 2)
            bw, lat = cluster.rank_bandwidth(link), link.latency_us * 1e-6
        out = np.where(stride == st, np.asarray(nbytes) / bw + lat, out)
    return out


def layer_parts(s: Shapes, cluster: Any, mb: np.ndarray, tp: np.ndarray, sp: np.ndarray) \
        -> dict[str, np.ndarray]:
    """Forward seconds of one block per micro-batch on one tp rank, by kind: ``gemm`` (QKV,
    output projection, MLP), ``attention`` (the core: scores and weighted values) and
    ``elementwise`` (norms, activations, rotary, residual adds: memory bound), plus
    ``attention_bwd_extra``: what a flash backward adds beyond twice the forward (it
    recomputes the scores)."""
    dt = s.dtype
    tokens = s.seq_len * mb
    h, hd, f = s.d_model, s.head_dim, s.ffn
    qkv_out = (s.n_heads + 2 * s.kv_heads) * hd
    t = gemm_time(cluster, dt, tokens, qkv_out / tp, h)
    t = t + gemm_time(cluster, dt, tokens, h, s.n_heads * hd / tp)
    up = 2 if s.llama else 1
    t = (t + up * gemm_time(cluster, dt, tokens, f / tp, h)
         + gemm_time(cluster, dt, tokens, h, f / tp))
    # attention core: scores and weighted values per head; causal kernels do half the work
    heads = mb * s.n_heads / tp
    bwd_extra = np.zeros_like(np.asarray(t, dtype=float))
    att_eff = getattr(cluster, "attention_efficiency", 0.0)
    if s.flash_attention and att_eff > 0:  # one fused kernel at its own efficiency
        core = 0.5 * 4.0 * s.seq_len ** 2 * hd * heads / (cluster.peak_for(dt) * att_eff) \
            + cluster.kernel_overhead_us * 1e-6
        bwd_extra = 0.5 * core
    else:
        # A fused (flash) kernel skips the masked upper triangle; unfused attention computes
        # the full s x s scores and applies the causal mask in the softmax.
        causal = 0.5 if s.flash_attention else 1.0
        core = causal * (gemm_time(cluster, dt, s.seq_len, s.seq_len, hd, heads)
                         + gemm_time(cluster, dt, s.seq_len, hd, s.seq_len, heads))
    if not s.flash_attention:  # softmax over the stored score matrix
        core = core + 3 * s.act_bytes * heads * s.seq_len ** 2 / (cluster.hbm_bandwidth_gbps * 1e9)
    spf = np.where(sp == 1, 1.0 / tp, 1.0)
    elem_bytes = s.act_bytes * tokens * (14 * h * spf + 4 * h / tp + (5 if s.llama else 2) * f / tp)
    if s.eager and getattr(cluster, "gemm_sms", 0):  # GPU: unfused kernels (CPU: measured)
        elem_bytes = elem_bytes + tokens * eager_block_bytes(s, tp, spf)
    elem = elem_bytes / (cluster.hbm_bandwidth_gbps * 1e9)
    return {"gemm": t, "attention": core, "elementwise": elem + 0 * t,
            "attention_bwd_extra": bwd_extra}


@dataclass
class _Blocks:
    """Per micro-batch and tp rank: one transformer block's time and the stages' layers."""

    parts: dict[str, np.ndarray]  # layer_parts: gemm, attention, elementwise, bwd extra
    recompute: np.ndarray  # seconds recomputed in backward
    host: np.ndarray  # the fixed host cost of a block
    block: np.ndarray  # forward + backward + recompute + host
    n_first: np.ndarray  # layers on the first pipeline stage
    n_last: np.ndarray  # layers on the last pipeline stage

    @property
    def n_widest(self) -> np.ndarray:
        """Layers of the stage holding the most."""
        return np.maximum(self.n_first, self.n_last)


def recompute_fraction(s: Shapes, plans: dict[str, np.ndarray]) -> np.ndarray:
    """The share of blocks whose forward runs again in backward under full recompute: 1, or
    with recompute_layers N > 0, N over the layers of a pipeline chunk (their mean,
    n_layers / (pp v); 0 for plans without full recompute)."""
    chunk_layers = s.n_layers / (plans["pp"] * plans["v"])
    partial = np.minimum(plans["rl"] / chunk_layers, 1.0)
    return np.where(plans["rec"] == REC_FULL, np.where(plans["rl"] > 0, partial, 1.0), 0.0)


def _block_time(s: Shapes, cluster: Any, plans: dict[str, np.ndarray]) -> _Blocks:
    """Forward (1x), backward (2x) and recompute of one block, plus its fixed host cost."""
    tp, mb, rec, sp = plans["tp"], plans["mb"], plans["rec"], plans["sp"]
    n_first, n_last = stage_layer_counts(s, plans["pp"], plans["v"])
    parts = layer_parts(s, cluster, mb, tp, sp)
    forward = parts["gemm"] + parts["attention"] + parts["elementwise"]
    full = recompute_fraction(s, plans)  # a block's share of the recomputed forwards
    recompute = np.where(rec == REC_FULL, full * forward,
                         np.where(rec == REC_SEL, parts["attention"], 0.0))
    host = (cluster.layer_overhead_us + np.where(tp > 1, cluster.tp_layer_overhead_us, 0.0)) * 1e-6
    host = host * (1 + full / 3)  # a recomputed forward repeats the block's host work
    block = 3 * forward + parts["attention_bwd_extra"] + recompute + host
    return _Blocks(parts, recompute, host, block, n_first, n_last)


def _tp_collective(cluster: Any, kind: str, nbytes: Any, tp: np.ndarray) -> np.ndarray:
    """One collective over the tp group, at the cluster's measured tp scale."""
    return cluster.tp_comm_scale * _coll(cluster, kind, nbytes, tp, 1)


def _logits_time(s: Shapes, cluster: Any, tokens: np.ndarray, tp: np.ndarray,
                 gathered: bool) -> np.ndarray:
    """The output projection (forward and backward) and the loss of one micro-batch.

    This project's trainer (framework None: ``gathered``) gathers the vocab-parallel logits
    and computes the loss on full rows on every tp rank (model.parallel.parallelize.apply_tp);
    the published frameworks compute a vocab-parallel loss."""
    projection = 3 * gemm_time(cluster, s.dtype, tokens, s.vocab / tp, s.d_model)
    loss_bytes = 12.0 + (EAGER_LOSS_BYTES if s.eager_loss and getattr(cluster, "gemm_sms", 0)
                         else 0.0)
    loss_vocab = s.vocab if gathered else s.vocab / tp
    return projection + tokens * loss_vocab * loss_bytes / (cluster.hbm_bandwidth_gbps * 1e9)


def _p2p_time(cluster: Any, plans: dict[str, np.ndarray], act_bytes: np.ndarray,
              framework: str | None) -> np.ndarray:
    """Pipeline sends and receives of one step (activations forward, gradients back)."""
    tp, pp, dp, ga, v, sp = (plans[k] for k in ("tp", "pp", "dp", "ga", "v", "sp"))
    partitioned = (framework or "") in PIPELINE_PARTITIONED
    p2p_bytes = act_bytes * np.where((sp == 1) | partitioned, 1.0 / tp, 1.0)
    per_microbatch = PIPELINE_P2P_PER_MICROBATCH.get(framework or "", 2)
    one = _p2p(cluster, p2p_bytes, tp * dp)
    if partitioned:  # the receiving stage all-gathers the tp slices (activation, gradient)
        one = one + 0.5 * _coll(cluster, "all_gather", act_bytes, tp, 1)
    return np.where(pp == 1, 0.0, per_microbatch * (ga * v + pp - 1) * one)


def _dp_comm(s: Shapes, cluster: Any, plans: dict[str, np.ndarray], blocks: _Blocks,
             stage_compute: np.ndarray, framework: str | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(exposed, raw) seconds of data-parallel communication per step, and the stage's
    parameters per rank.

    Without pipelining FSDP2 re-gathers parameters every micro-batch (zero2: once, in
    forward; zero3: forward and backward) and zero3 reduce-scatters every micro-batch;
    torch pipelining keeps them unsharded between micro-batches and syncs once, except that
    zero3 reshards after each forward and multi-chunk schedules keep three chunks gathered
    (``rank_counts.mean_unit_gathers`` replays the schedule). This trainer reduces float32
    gradients (``GRADIENT_REDUCE_BYTES``), the published frameworks the compute
    dtype. What overlaps hides behind the backward (reductions) or forward (gathers)
    window, up to ``comm_overlap``. FSDP's measured cost per unit (``fsdp_unit_overhead_us``,
    every rank of the node in one group) is paid in part, dp / ranks, where ranks share
    cores: one group waits while the node's other ranks compute."""
    tp, dp, ga, shard = plans["tp"], plans["dp"], plans["ga"], plans["shard"]
    single = plans["pp"] == 1
    layer_params = s.layer_matrix_params / tp + s.layer_norm_params
    params = blocks.n_widest * layer_params + s.embedding_params / tp
    param_bytes = params * s.act_bytes
    grad_bytes = params * (GRADIENT_REDUCE_BYTES if framework is None else s.act_bytes)
    units = blocks.n_widest + 1  # FSDP: one collective per block + the rest
    all_reduce = _coll(cluster, "all_reduce", grad_bytes, dp, tp)
    reduce_scatter = _coll(cluster, "reduce_scatter", grad_bytes, dp, tp, units)
    all_gather = _coll(cluster, "all_gather", param_bytes, dp, tp, units)
    overlap = cluster.comm_overlap
    backward_window, forward_window = 2 * stage_compute / 3, stage_compute / 3

    def hidden(t: np.ndarray, window: np.ndarray) -> np.ndarray:
        return np.maximum(t - overlap * window, (1 - overlap) * t)

    gathers = mean_unit_gathers(plans)
    zero2_gathers = zero3_gathers = gathers
    zero3_syncs = np.where(single, ga, 1)
    exposed = np.where(
        shard == DDP, hidden(all_reduce, backward_window),
        np.where(shard == ZERO2, hidden(reduce_scatter, backward_window)
                 + zero2_gathers * hidden(all_gather, forward_window),
                 np.where(shard == ZERO3, zero3_syncs * hidden(reduce_scatter, backward_window)
                          + zero3_gathers * hidden(all_gather, forward_window), 0.0)))
    fsdp = fsdp_sharded(plans)
    # measured with every rank of the node in one group; on shared cores a group of dp of
    # the ranks waits while the others compute, so it pays its share of the wait
    ranks, share = _core_share(cluster, plans)
    lockstep = np.where(share > 1, dp / ranks, 1.0)
    exposed = exposed + np.where(fsdp, ga * units * cluster.fsdp_unit_overhead_us * 1e-6
                                 * lockstep, 0.0)
    exposed = np.where((dp == 1) | (shard == NOSHARD), 0.0, exposed)
    raw = np.where(shard == DDP, all_reduce, np.where(
        shard == ZERO2, reduce_scatter + zero2_gathers * all_gather,
        np.where(shard == ZERO3, zero3_syncs * reduce_scatter + zero3_gathers * all_gather, 0.0)))
    raw = np.where((dp == 1) | (shard == NOSHARD), 0.0, raw)
    return exposed, raw, params


def _optimizer_time(s: Shapes, cluster: Any, plans: dict[str, np.ndarray], blocks: _Blocks,
                    params: np.ndarray) -> np.ndarray:
    """AdamW over this rank's parameters (36 bytes moved per parameter) plus a fixed cost per
    tensor."""
    shard = plans["shard"]
    optimized = np.where((shard == ZERO3) | (shard == ZERO2), params / plans["dp"], params)
    tensors = blocks.n_widest * (9 if s.llama else 16) + 3
    return optimized * 36.0 / (cluster.hbm_bandwidth_gbps * 1e9) \
        + tensors * cluster.optimizer_overhead_us * 1e-6


def _core_share(cluster: Any, plans: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(ranks on a node, ranks per core): the share is 1 with a core per rank (GPUs, or
    a site that gives no core count)."""
    ranks = np.minimum(plans["tp"] * plans["pp"] * plans["dp"], cluster.ranks_per_node)
    cores = cluster.cores_per_node
    share = np.maximum(1.0, ranks / cores) if cores else np.ones(np.shape(ranks))
    return ranks, share


def _shared_cores_compute(cluster: Any, plans: dict[str, np.ndarray], slots: np.ndarray,
                          stage_compute: np.ndarray, mean_stage: np.ndarray) -> np.ndarray:
    """Compute seconds of a step before the optimizer, on ranks that may share cores.

    The figures were measured with every rank busy, but a rank idle in the pipeline bubble
    lends its core, so the step takes the larger of the busy work (all ranks' micro-batches
    spread over the cores) and the critical path at the speed of a rank that has a core to
    itself (``alone_speedup`` faster, measured; else ranks/cores). The busy work is the mean
    stage's: a rank idle behind a slower stage lends its core too. With fewer micro-batches
    than stages only min(ga, pp) of the pp stages hold one at a time; when those ranks fit
    the cores, none waits for a core and the critical path alone sets the time. Ranks
    crowded onto the cores also stall at each wait on another rank (``crowded_stall``).
    With a core per rank (GPUs) it is the critical path."""
    pp, ga = plans["pp"], plans["ga"]
    ranks, share = _core_share(cluster, plans)
    cores = cluster.cores_per_node
    speedup = np.where(share > 1, cluster.alone_speedup or share, 1.0)
    crowded = (share > 1) & (ranks * np.minimum(ga, pp) / pp > cores)
    busy = ga * np.where(share > 1, mean_stage, stage_compute) \
        + np.where(crowded, crowded_stall(cluster, plans, mean_stage), 0.0)
    busy = np.where((share > 1) & ~crowded, 0.0, busy)
    return np.maximum(busy, _critical_path(plans, slots, stage_compute, mean_stage) / speedup)


def crowded_stall(cluster: Any, plans: dict[str, np.ndarray],
                  stage_compute: np.ndarray | float = np.inf) -> np.ndarray:
    """Seconds a step's waits on other ranks cost a rank crowded onto shared cores, beyond
    the transfers priced elsewhere: a stage's receives (an activation forward and a gradient
    back per micro-batch and chunk, none at the pipeline's ends: 2 (pp - 1) / pp of them on
    average, ``receive_stall_us`` each) and DDP's gradient all-reduce (``ddp_stall_us``).

    A woken rank queues behind the ranks still computing, so a receive stalls in proportion
    to the compute it follows: a chunk's forward or backward of one micro-batch, on average
    ``stage_compute`` (one micro-batch's forward + backward on the stage) / (2 v), against the
    reference step the stall was measured after (``stall_after_us``), at most the whole
    measured stall. Tensor-parallel and FSDP collectives are left out: their costs
    (``tp_comm_scale``, ``fsdp_unit_overhead_us``) are measured with every rank busy."""
    pp, dp, v = plans["pp"], plans["dp"], plans["v"]
    receives = 2 * plans["ga"] * v * (pp - 1) / pp
    after = cluster.stall_after_us * 1e-6
    follows = np.minimum(1.0, stage_compute / (2 * v) / after) if after > 0 else 1.0
    ddp = (dp > 1) & (plans["shard"] == DDP)
    return (receives * follows * cluster.receive_stall_us
            + np.where(ddp, cluster.ddp_stall_us, 0.0)) * 1e-6


def _critical_path(plans: dict[str, np.ndarray], slots: np.ndarray, stage_compute: np.ndarray,
                   mean_stage: np.ndarray) -> np.ndarray:
    """The slowest stage's micro-batches plus the fill and drain of the pipeline."""
    ga = plans["ga"]
    return ga * stage_compute + (slots - ga) * np.minimum(mean_stage, stage_compute)


def step_time(s: Shapes, cluster: Any, c: dict[str, np.ndarray],
              calibration: dict[str, float] | None = None,
              framework: str | None = None) -> dict[str, np.ndarray]:
    """Predicted seconds per optimizer step for encoded plans ``c`` (arrays over candidates).

    Returns compute, comm, step (calibrated) and the parts: stage, bubble_frac, tp_comm,
    p2p, dp_exposed, optimizer, and ``breakdown``: a dict of terms (seconds per step) that
    add up to ``step`` (see :func:`breakdown_terms`). ``framework`` picks the cluster's
    per-framework efficiency factor (compute time is divided by it); None is this trainer
    (``TRAINER_FRAMEWORK``'s factor).
    """
    plans = c
    tp, pp, mb, ga = plans["tp"], plans["pp"], plans["mb"], plans["ga"]
    single = pp == 1
    blocks = _block_time(s, cluster, plans)
    tokens = s.seq_len * mb
    act_bytes = tokens * s.d_model * s.act_bytes

    # tensor parallelism, partly overlapped, in all-reduces of a micro-batch's activation (an
    # all-gather or a reduce-scatter is half of one): this trainer's collectives per block
    # (model.planner.rank_counts), the published frameworks' fused projections 4 (6 for a
    # recomputed block)
    recomputed = recompute_fraction(s, plans)
    if framework is None:
        gathers, scatters, reduces = tp_block_collectives(
            1, recomputed, plans["sp"], s.llama,
            float32_stream_ratio(fsdp_sharded(plans), s.act_bytes))
        tp_ops = (gathers + scatters) / 2 + reduces
    else:
        tp_ops = 4 + 2 * recomputed
    tp_block_raw = tp_ops * _tp_collective(cluster, "all_reduce", act_bytes, tp)
    tp_block = (1 - cluster.tp_comm_overlap) * tp_block_raw  # the exposed part
    gathered = framework is None
    logits = _logits_time(s, cluster, tokens, tp, gathered)

    # one micro-batch through the slowest stage; the per-micro-batch host cost (embedding,
    # head, loss) splits between the first and the last stage
    first_stage = blocks.n_first * blocks.block
    last_stage = blocks.n_last * blocks.block + logits
    microbatch_host = (cluster.microbatch_overhead_us
                       + np.where(tp > 1, cluster.tp_microbatch_overhead_us, 0.0)) * 1e-6
    stage_compute = np.where(single, blocks.n_first * blocks.block + logits + microbatch_host,
                             np.maximum(first_stage, last_stage) + microbatch_host / 2)
    stage_tp = blocks.n_widest * tp_block + np.where(tp > 1, 2, 0) * \
        _tp_collective(cluster, "all_reduce", tokens * 4.0, tp)  # loss/vocab-parallel reductions
    if gathered:  # the logits all-gather, once per micro-batch on the last stage
        stage_tp = stage_tp + _tp_collective(cluster, "all_gather", tokens * s.vocab * s.act_bytes,
                                             tp)
    # Interleaving shortens the bubble only when micro-batches fill every stage: with fewer
    # than pp of them a micro-batch still passes all pp*v chunks one after another.
    chunks = np.where((plans["sched"] == INTERLEAVED) & (ga >= pp), plans["v"], 1)
    slots = ga + np.where(single, 0.0, (pp - 1) / chunks)
    # The fill and drain of the pipeline (the bubble) is one micro-batch passing every stage
    # once, forward and backward: it costs the stages' mean time, not pp - 1 times the slowest
    # one (the steady state runs at the slowest stage: 1F1B takes about
    # (m - 1) t_max + pp t_mean). The last stage's logits, say, lengthen the steady state but
    # enter the fill and drain once. Equal stages give the textbook (m + pp - 1) t.
    mean_stage = np.where(single, stage_compute,
                          (s.n_layers * blocks.block + logits + microbatch_host) / pp)

    p2p = _p2p_time(cluster, plans, act_bytes, framework)
    dp_exposed, dp_raw, params = _dp_comm(s, cluster, plans, blocks, stage_compute, framework)
    optimizer = _optimizer_time(s, cluster, plans, blocks, params)
    critical = _critical_path(plans, slots, stage_compute, mean_stage)
    compute = _shared_cores_compute(cluster, plans, slots, stage_compute, mean_stage) + optimizer
    comm = slots * stage_tp + p2p + dp_exposed
    scales = calibration or {}
    compute_scale = scales.get("compute_scale", 1.0) / cluster.framework_factor(
        framework or TRAINER_FRAMEWORK)
    comm_scale = scales.get("comm_scale", 1.0)
    step = compute_scale * compute + comm_scale * comm

    # The breakdown: per-micro-batch work of the critical stage by kind, times the
    # micro-batches; the bubble and the core-sharing adjustment (CPUs) close the compute sum.
    critical_is_last = single | (last_stage >= first_stage)
    n_critical = np.where(critical_is_last, blocks.n_last, blocks.n_first)
    parts = blocks.parts
    per_microbatch = {
        "gemm": n_critical * 3 * parts["gemm"],
        "attention": n_critical * (3 * parts["attention"] + parts["attention_bwd_extra"]),
        "elementwise": n_critical * 3 * parts["elementwise"],
        "recompute": n_critical * blocks.recompute,
        "logits": np.where(critical_is_last, logits, 0.0),
        "host_overhead": n_critical * blocks.host
        + np.where(single, microbatch_host, microbatch_host / 2),
    }
    terms = {f"compute_{kind}": compute_scale * ga * seconds
             for kind, seconds in per_microbatch.items()}
    terms["bubble"] = compute_scale * (slots - ga) * np.minimum(mean_stage, stage_compute)
    terms["core_sharing"] = compute_scale * (compute - optimizer - critical)
    terms["optimizer"] = compute_scale * optimizer
    terms["tp_comm_exposed"] = comm_scale * slots * stage_tp
    terms["pp_p2p"] = comm_scale * p2p
    terms["dp_comm_exposed"] = comm_scale * dp_exposed
    overlapped = {"tp_comm_overlapped": comm_scale * slots * blocks.n_widest
                  * (tp_block_raw - tp_block),
                  "dp_comm_overlapped": comm_scale * np.maximum(dp_raw - dp_exposed, 0.0)}
    return {"step": step, "breakdown": terms, "overlapped": overlapped, "compute": compute,
            "comm": comm, "stage": stage_compute + stage_tp,
            "bubble_frac": np.where(single, 0.0, (slots - ga) / ga), "tp_comm": slots * stage_tp,
            "p2p": p2p, "dp_exposed": dp_exposed, "optimizer": optimizer}


def predictions(s: Shapes, cluster: Any, c: dict[str, np.ndarray], world: int,
                global_batch: int, calibration: dict[str, float] | None = None,
                framework: str | None = None) -> dict[str, np.ndarray]:
    """Step time, tokens/s, model TFLOP/s per device and MFU for encoded plans."""
    t = step_time(s, cluster, c, calibration, framework)
    tokens = global_batch * s.seq_len
    tps = tokens / t["step"]
    tflops = s.model_flops_per_token() * tps / world / 1e12
    return {"step_time_s": t["step"], "tokens_per_s": tps, "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / cluster.peak_for(s.dtype), "parts": t}


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Pipeline bubble as a fraction of the ideal time: (pp-1)/(m*v)."""
    return (pp - 1) / (micro_batches * virtual_stages)
