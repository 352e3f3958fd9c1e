"""What one rank of this trainer computes and communicates in a training step: FLOPs and
collective bytes, per pipeline rank, for one plan (no torch needed).

These are the counts a rehearsal (``model.rehearsal.rehearse``: torch's FLOP formulas and
every collective's full buffer, as NCCL's tests size it) reads off the real trainer; the
tests hold the two together on every layout family. What this trainer does, and so what
is counted (sbh = seq_len x micro_batch x d_model elements, c = compute-dtype bytes):

FLOPs (torch.utils.flop_counter: matmuls, and attention as the full s x s products, causal
or not), per micro-batch: each block's matmuls three times (forward and a backward of
twice the work) and its attention core (4 s^2 hd per head) 3.5 times (torch prices the
fused backward at 2.5 forwards: it recomputes the scores); full recompute runs a block's forward
again but stops, as non-reentrant checkpointing does, once every tensor backward needs is
back: the MLP's output projection is not recomputed; selective recompute runs the
attention core again. The last stage adds the output projection (x3); the embedding is a
lookup.

Tensor parallelism (one collective of sbh elements per arrow, the logits gathered over the
vocabulary: s b V): with sequence parallelism a block all-gathers its two norm outputs
and reduce-scatters its two outputs in forward, the mirror in backward, and a recomputed
forward repeats the gathers and the first reduce-scatter; the first stage's embedding
output is reduce-scattered (its gradient gathered), the last stage gathers the final
norm's output (its gradient reduce-scattered) and the logits. Without it a block
all-reduces its two outputs in forward and its column-parallel inputs' gradients in
backward (q, k, v and the MLP's one or two input projections, each on its own), a
recomputed forward its attention output; the embedding's output and the head's input
gradient are all-reduced. Under bf16 autocast over float32 weights (no FSDP2) the residual
stream is float32, and so is every collective that carries it or its gradient: the norm
outputs' gathers and their gradients' reduce-scatters (without sequence parallelism the
input gradients' all-reduces), the embedding's output and the final norm's; the linears'
outputs and their gradients are bf16 (``float32_stream_ratio``).

Pipeline: each micro-batch's activation (sequence-sharded under sequence parallelism) is
sent forward and its gradient back at every chunk boundary; in the compute dtype under
FSDP2, in float32 otherwise (autocast keeps the residual stream in float32).

Tied embeddings under pipelining: the first and the last pipeline rank each all-reduce
their local float32 shard of the tied matrix's gradient once a step over the embedding
group (``model.parallel.dims.ParallelDims.tied_embedding_group``), counted under pp with
the pipeline's sends and receives (the rehearsal files that group under pp).

Data parallelism (FSDP2: parameters gathered in the compute dtype, gradients
reduce-scattered in float32; DDP: one float32 all-reduce): each FSDP unit (a block, and
the chunk's root) is gathered whenever a forward or backward finds it sharded. zero3
reshards after every forward, zero2 does not; without pipelining the trainer reshards
after every backward and (zero2) syncs gradients at the last micro-batch only, zero3 at
every one; torch's pipelining keeps the units gathered and gradients unsynced between
micro-batches and syncs once, and its multi-chunk schedules hold at most
``PIPELINE_ACTIVE_CHUNKS`` chunks gathered, gathering a chunk ahead of its turn and
resharding the one not needed soonest. ``unit_gathers`` replays a rank's schedule to
count the gathers.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from model.config import shards_with_fsdp
from model.parallel.layout import SCHEDULES, SHARDINGS, Plan, stage_layers
from model.planner.shapes import Shapes

GRADIENT_REDUCE_BYTES = 4
"""Bytes per gradient element the trainer reduces over dp: float32 (FSDP2's reduce_dtype in
model.parallel.parallelize; DDP's gradients are those of the float32 weights)."""

PIPELINE_ACTIVE_CHUNKS = 3
"""Chunks torch's multi-chunk pipeline schedules keep gathered at once
(torch.distributed.pipelining.schedules._add_unshard_reshard, max_active_stages)."""


ATTENTION_FWD_BWD = 3.5
"""An attention core's forward and backward FLOPs in forwards (torch.utils.flop_counter's
SDPA formulas: the backward 2.5 forwards)."""


def rank_chunks(plan: Plan, n_layers: int, pp_rank: int) -> list[list[int]]:
    """The layer ids of each pipeline chunk pipeline rank ``pp_rank`` holds, in order."""
    chunks = stage_layers(n_layers, plan.pp * plan.virtual_stages)
    return chunks[pp_rank::plan.pp]


def schedule_order(plan: Plan, pp_rank: int) -> list[tuple[str, int]]:
    """The compute actions of one step on a pipeline rank: ('F' or 'B', local chunk index),
    in torch's order (GPipe, 1F1B, interleaved 1F1B's depth-first rounds)."""
    pp, ga, v = plan.pp, plan.grad_accum, plan.virtual_stages
    if pp == 1 or plan.schedule == "gpipe":
        return [("F", c) for c in range(v) for _ in range(ga)] \
            + [("B", c) for c in reversed(range(v)) for _ in range(ga)]
    if plan.schedule == "1f1b":
        warmup = min(ga, pp - pp_rank)
        order = [("F", 0)] * warmup
        for _ in range(ga - warmup):
            order += [("B", 0), ("F", 0)]
        return order + [("B", 0)] * warmup
    rounds = max(1, ga // pp)
    per_round = ga // rounds
    total = v * ga
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), total)

    def forward_chunk(op: int) -> int:
        return (op // per_round) % v

    def backward_chunk(op: int) -> int:
        return v - 1 - ((op - warmup) // per_round) % v

    order = [("F", forward_chunk(op)) for op in range(warmup)]
    for op in range(warmup, total):
        order += [("F", forward_chunk(op)), ("B", backward_chunk(op))]
    return order + [("B", backward_chunk(op)) for op in range(total, total + warmup)]


def _with_prefetch(order: list[tuple[str, int]]) -> Iterator[tuple[str, int]]:
    """The order with torch's UNSHARD ('U') and RESHARD ('R') actions of multi-chunk
    schedules: before each action the next ``PIPELINE_ACTIVE_CHUNKS`` distinct chunks to
    compute are gathered and the others resharded."""
    # the next distinct chunks from each action on, built from the end (one pass)
    upcoming_at: list[list[int]] = [[] for _ in order]
    following: list[int] = []
    for i in range(len(order) - 1, -1, -1):
        chunk = order[i][1]
        following = ([chunk] + [c for c in following if c != chunk])[:PIPELINE_ACTIVE_CHUNKS]
        upcoming_at[i] = following
    active: list[int] = []
    for action, upcoming in zip(order, upcoming_at):
        for c in [c for c in active if c not in upcoming]:
            active.remove(c)
            yield ("R", c)
        for c in [c for c in upcoming if c not in active]:
            active.append(c)
            yield ("U", c)
        yield action


def unit_gathers(plan: Plan, pp_rank: int) -> list[int]:
    """All-gathers of each FSDP unit of each local chunk in one step (see module docstring)."""
    v = plan.virtual_stages
    if plan.pp == 1:  # the trainer's own accumulation: reshard after every backward
        return [plan.grad_accum * (2 if plan.sharding == "zero3" else 1)] * v
    order = schedule_order(plan, pp_rank)
    actions = _with_prefetch(order) if plan.schedule == "interleaved_1f1b" else iter(order)
    last_backward = {c: max(i for i, (k, cc) in enumerate(order) if k == "B" and cc == c)
                     for c in range(v)}
    gathered, gathers = [False] * v, [0] * v
    seen = -1
    for kind, c in actions:
        if kind == "R":
            gathered[c] = False
            continue
        if not gathered[c]:
            gathers[c] += 1
            gathered[c] = True
        if kind == "U":
            continue
        seen += 1
        if kind == "F" and plan.sharding == "zero3":
            gathered[c] = False
        if kind == "B" and seen == last_backward[c]:
            gathered[c] = False
    return gathers


ALL_MOMENTS, FIRST_CHUNK_ENDS, LAST_CHUNK_BEGINS = "all", "first_chunk_ends", "last_chunk_begins"
"""The moments ``held_by_accumulating`` replays: every one, or only those ending a backward of
the rank's first chunk (the first stage's embedding gradient), or only those beginning a
backward of its last chunk (the last stage's loss)."""


@functools.lru_cache(maxsize=4096)
def _held_by_accumulating(pp: int, v: int, ga: int, schedule: str, pp_rank: int,
                          moments: str, zero3: bool = False) -> np.ndarray:
    order = schedule_order(Plan(pp=pp, virtual_stages=v, grad_accum=ga, schedule=schedule),
                           pp_rank)
    # the chunk with the rank's root parameters: the first stage's embedding, the last's head
    root_chunk = 0 if pp_rank == 0 else v - 1 if pp_rank == pp - 1 else None
    interleaved = schedule == "interleaved_1f1b"
    actions = _with_prefetch(order) if interleaved else iter(order)
    best: dict[tuple[int, int, int, int], int] = {}  # (root holds, forward, k, g): held
    held, backwards = 0, [0] * v
    # zero3 reshards each block after its forward and the backward gathers it again (kept
    # gathered: the schedule does not reshard after backward); one chunk's zero2 schedules
    # keep it gathered all step, multi-chunk ones gather and reshard as they prefetch
    active = set() if interleaved or zero3 else set(range(v))

    def moment(forward: bool = False, chunks: set[int] | None = None,
               root_held: bool | None = None) -> None:
        """Record the moment, with only ``chunks`` (default: all) eligible as gathered and
        ``root_held`` (default: as the replay stands) for r."""
        root_holds = (root_chunk is not None and backwards[root_chunk] > 0
                      if root_held is None else root_held)
        accumulating = sum(1 for n in backwards if n > 0)
        # a chunk is resharded by its last micro-batch's backward, whatever the prefetch says
        gathered = sum(1 for c in active if backwards[c] >= 0 and (chunks is None or c in chunks))
        index = (int(root_holds), int(forward), accumulating, gathered)
        if held > best.get(index, -1):
            best[index] = held

    for kind, chunk in actions:
        if kind in ("U", "R"):
            (active.add if kind == "U" else active.discard)(chunk)
            continue
        if kind == "F":
            held += 1
            if zero3:
                active.discard(chunk)  # resharded block by block as the forward runs
            if moments == ALL_MOMENTS:
                moment(forward=True)  # its last block: the forward's activations held
            continue
        if moments == ALL_MOMENTS:
            moment()  # a backward begins: its forward's activations held, no new gradients
        elif moments == LAST_CHUNK_BEGINS and chunk == v - 1:
            # the loss's backward: under interleaved zero3 its chunk, resharded after its
            # forward, is gathered again only by its first block's backward, after the loss
            moment(chunks=set(range(v)) - {chunk} if zero3 and interleaved else None)
        backwards[chunk] += 1
        held -= 1
        if zero3:
            active.add(chunk)  # gathered again by its backward
        if moments == ALL_MOMENTS:
            moment()  # it ends: those activations freed, the chunk's gradients made
        elif moments == FIRST_CHUNK_ENDS and chunk == 0:
            # the embedding's gradient: under interleaved zero3 the rank's other chunks,
            # whose backwards ran before, are resharded by then; r says whether the
            # embedding held a gradient before this one
            moment(chunks={0} if zero3 and interleaved else None,
                   root_held=backwards[0] > 1)
        if backwards[chunk] == ga:  # its last micro-batch: reduce-scattered, then freed
            backwards[chunk] = -1
    table = np.full((2, 2, v + 1, v + 1), -1)  # [root holds][forward][accumulating][gathered]
    for index, held in best.items():
        table[index] = held
    table.flags.writeable = False  # cached: shared by every caller
    return table


def _per_distinct(keys: np.ndarray, value: Callable[..., Any]) -> tuple[list[Any], np.ndarray]:
    """``value(*row)`` once per distinct row of ``keys`` (candidates x fields, ints), and the
    index of each candidate's row: the schedule replays run once per distinct schedule."""
    unique, inverse = np.unique(keys, axis=0, return_inverse=True)
    return [value(*(int(x) for x in row)) for row in unique], np.asarray(inverse).reshape(-1)


def held_by_accumulating(c: dict[str, np.ndarray], pp_rank: np.ndarray,
                         moments: str = ALL_MOMENTS) -> np.ndarray:
    """[candidates, r, f, k, g]: the most chunk forwards pipeline rank ``pp_rank`` holds at
    the replayed moments (``schedule_order``) where k of its chunks hold unsharded gradients,
    g of its chunks are gathered, r = 1 if its root chunk (the first stage's chunk 0, with
    the embedding; the last stage's chunk v - 1, with the head) is among the k, and f = 1 at
    the end of a forward (its last block running: under zero3 the chunk's blocks, resharded
    one by one, are not among the g); k, g = 0 .. max v; -1 where a schedule never has
    (r, f, k, g). A chunk holds gradients from its first backward through its last
    micro-batch's, which reduce-scatters them (the sharded result is small: 1 / dp) and
    reshards the chunk. Under zero3 a chunk counts as gathered from its backward on until a
    forward or its last backward reshards it; otherwise one chunk's schedules keep it
    gathered all step and multi-chunk ones gather and reshard as ``_with_prefetch`` says,
    so fewer chunks are gathered as the step ends.

    ``moments``: ``FIRST_CHUNK_ENDS``, only the moments that end a backward of the rank's
    first chunk, where the first pipeline stage makes the embedding's gradient (its first
    layer, so the last of the chunk's backward); ``LAST_CHUNK_BEGINS``, only those that begin
    a backward of its last chunk, where the last stage's loss runs its backward. At both, r
    says whether the root chunk held gradients before that backward."""
    rank = np.broadcast_to(np.asarray(pp_rank), c["pp"].shape)
    zero3 = (c["shard"] == SHARDINGS.index("zero3")).astype(c["pp"].dtype)
    keys = np.stack([c["pp"], c["v"], c["ga"], c["sched"], rank, zero3], axis=1)
    rows, index = _per_distinct(keys, lambda pp, v, ga, sched, r, z3: _held_by_accumulating(
        pp, v, ga, SCHEDULES[sched], r, moments, bool(z3)))
    size = int(c["v"].max()) + 1 if len(c["v"]) else 1
    table = np.full((len(rows), 2, 2, size, size), -1.0)
    for i, row in enumerate(rows):
        table[i, :, :, :row.shape[2], :row.shape[3]] = row
    return table[index]


@functools.lru_cache(maxsize=4096)
def _forwards_first(pp: int, v: int, ga: int, schedule: str, pp_rank: int) -> bool:
    order = schedule_order(Plan(pp=pp, virtual_stages=v, grad_accum=ga, schedule=schedule),
                           pp_rank)
    first_backward = next(i for i, (kind, _) in enumerate(order) if kind == "B")
    return all(kind == "B" for kind, _ in order[first_backward:])


def forwards_first(c: dict[str, np.ndarray], pp_rank: np.ndarray) -> np.ndarray:
    """Whether pipeline rank ``pp_rank`` runs every forward of the step before its first
    backward (GPipe always; 1F1B when its warm-up covers all micro-batches), for encoded plans
    ``c`` (``schedule_order`` replayed)."""
    rank = np.broadcast_to(np.asarray(pp_rank), c["pp"].shape)
    keys = np.stack([c["pp"], c["v"], c["ga"], c["sched"], rank], axis=1)
    flags, index = _per_distinct(keys, lambda pp, v, ga, sched, r: _forwards_first(
        pp, v, ga, SCHEDULES[sched], r))
    return np.array(flags, dtype=bool)[index]


@functools.lru_cache(maxsize=4096)
def _mean_unit_gathers(pp: int, v: int, ga: int, schedule: str, sharding: str) -> float:
    return float(np.mean(unit_gathers(Plan(pp=pp, virtual_stages=v, grad_accum=ga,
                                           schedule=schedule, sharding=sharding), 0)))


def mean_unit_gathers(c: dict[str, np.ndarray]) -> np.ndarray:
    """Gathers per FSDP unit on the first pipeline rank in one step, the mean over its
    chunks, for encoded plans ``c`` (``unit_gathers`` replayed)."""
    keys = np.stack([c["pp"], c["v"], c["ga"], c["sched"], c["shard"]], axis=1)
    means, index = _per_distinct(keys, lambda pp, v, ga, sched, shard: _mean_unit_gathers(
        pp, v, ga, SCHEDULES[sched], SHARDINGS[shard]))
    return np.array(means)[index]


def _block_forward_flops(s: Shapes, plan: Plan) -> tuple[float, float, float]:
    """(matmul, attention-core, MLP output projection) forward FLOPs of one block and one
    micro-batch on one tp rank."""
    tokens = s.seq_len * plan.micro_batch
    matmul = 2.0 * tokens * s.layer_matrix_params / plan.tp
    core = 4.0 * plan.micro_batch * (s.n_heads / plan.tp) * s.seq_len ** 2 * s.head_dim
    out_projection = 2.0 * tokens * s.ffn * s.d_model / plan.tp
    return matmul, core, out_projection


def recomputed_blocks(plan: Plan, chunk_layers: int) -> int:
    """Blocks of a chunk whose forward runs again under full recompute."""
    if plan.recompute != "full":
        return 0
    return min(plan.recompute_layers, chunk_layers) if plan.recompute_layers else chunk_layers


def rank_flops(s: Shapes, plan: Plan, pp_rank: int) -> float:
    """FLOPs of one training step on a rank of pipeline rank ``pp_rank``."""
    matmul, core, out_projection = _block_forward_flops(s, plan)
    per_microbatch = 0.0
    for layers in rank_chunks(plan, s.n_layers, pp_rank):
        per_microbatch += len(layers) * (3 * matmul + ATTENTION_FWD_BWD * core)
        per_microbatch += recomputed_blocks(plan, len(layers)) * (matmul + core - out_projection)
        if plan.recompute == "selective":
            per_microbatch += len(layers) * core
    if pp_rank == plan.pp - 1:
        per_microbatch += 3 * 2.0 * s.seq_len * plan.micro_batch * s.d_model * s.vocab / plan.tp
    return plan.grad_accum * per_microbatch


def float32_stream_ratio(fsdp: Any, compute_bytes: int) -> Any:
    """4 / c where bf16 autocast runs over float32 weights (no FSDP2), else 1: the bytes of a
    collective on the float32 residual stream over one in the compute dtype."""
    return np.where(fsdp, 1.0, 4.0 / compute_bytes)


def tp_block_collectives(blocks: Any, recomputed: Any, sequence_parallel: Any,
                         llama: bool, stream_ratio: Any = 1.0) -> tuple[Any, Any, Any]:
    """(all-gathers, reduce-scatters, all-reduces) of sbh elements in the compute dtype that
    ``blocks`` blocks, of which ``recomputed`` run their forward again, issue over the tp
    group per micro-batch (scalars or arrays; module docstring); those on the residual
    stream weigh ``stream_ratio`` (``float32_stream_ratio``)."""
    input_projections = 3 + (2 if llama else 1)
    sp = np.asarray(sequence_parallel, dtype=bool)
    # forward (and recomputed) gathers of the norm outputs, backward gathers of the outputs'
    # gradients; forward scatters of the outputs, backward scatters of the norm outputs'
    gathers = np.where(sp, (2 * blocks + 2 * recomputed) * stream_ratio + 2 * blocks, 0)
    scatters = np.where(sp, 2 * blocks + recomputed + 2 * blocks * stream_ratio, 0)
    reduces = np.where(sp, 0, (2 * blocks + recomputed)
                       + input_projections * blocks * stream_ratio)
    return gathers, scatters, reduces


def _tp_bytes(s: Shapes, plan: Plan, pp_rank: int) -> dict[str, float]:
    """Tensor-parallel collective bytes of one step (module docstring)."""
    if plan.tp == 1:
        return {}
    c = s.act_bytes
    sbh = s.seq_len * plan.micro_batch * s.d_model * c
    logits = s.seq_len * plan.micro_batch * s.vocab * c
    chunks = rank_chunks(plan, s.n_layers, pp_rank)
    blocks = sum(len(layers) for layers in chunks)
    recomputed = sum(recomputed_blocks(plan, len(layers)) for layers in chunks)
    first, last = pp_rank == 0, pp_rank == plan.pp - 1
    fsdp = shards_with_fsdp(plan.sharding, plan.dp)
    ratio = float(float32_stream_ratio(fsdp, s.act_bytes))
    gathers, scatters, reduces = (float(n) for n in tp_block_collectives(
        blocks, recomputed, plan.sequence_parallel, s.llama, ratio))
    if plan.sequence_parallel:  # the embedding's output, the final norm's output
        gathers, scatters = gathers + (first + last) * ratio, scatters + (first + last) * ratio
    else:
        reduces += (first + last) * ratio
    out = {"all_gather": gathers * sbh, "reduce_scatter": scatters * sbh,
           "all_reduce": reduces * sbh}
    if last:
        out["all_gather"] += logits
    return {k: plan.grad_accum * v for k, v in out.items() if v}


def chunk_boundaries(v: Any, first: Any, last: Any) -> Any:
    """Chunk boundaries a pipeline rank of ``v`` chunks sends and receives across per
    micro-batch (activations in or out, gradients back): two a chunk, less the model's
    input on the first rank and its output on the last."""
    return 2 * v - np.asarray(first, dtype=int) - np.asarray(last, dtype=int)


def _pp_bytes(s: Shapes, plan: Plan, pp_rank: int) -> dict[str, float]:
    """Pipeline sends and receives of one step (each is the other's mirror)."""
    if plan.pp == 1:
        return {}
    fsdp = shards_with_fsdp(plan.sharding, plan.dp)
    c = s.act_bytes if fsdp else 4
    tokens = s.seq_len // plan.tp if plan.sequence_parallel else s.seq_len
    one = tokens * plan.micro_batch * s.d_model * c
    boundaries = chunk_boundaries(plan.virtual_stages, pp_rank == 0, pp_rank == plan.pp - 1)
    return {"send": plan.grad_accum * boundaries * one, "recv": plan.grad_accum * boundaries * one}


def _tied_bytes(s: Shapes, plan: Plan, pp_rank: int) -> dict[str, float]:
    """The tied embedding's gradient all-reduce over its embedding group (pipeline ranks 0
    and pp - 1): the local float32 shard of the [V, D] gradient, V / tp rows, and of those
    the first dp rank's FSDP2 share (dim 0 split in ceil(rows / dp) pieces)."""
    if not s.tied or plan.pp == 1 or pp_rank not in (0, plan.pp - 1):
        return {}
    rows = s.vocab / plan.tp
    if shards_with_fsdp(plan.sharding, plan.dp):
        rows = -(-int(rows) // plan.dp)
    return {"all_reduce": GRADIENT_REDUCE_BYTES * rows * s.d_model}


def _padded(rows: float, cols: float, dp: int) -> float:
    """Elements FSDP2 gathers for one parameter: dim 0 padded to a multiple of dp."""
    return -(-int(rows) // dp) * dp * cols


def rank_params(s: Shapes, plan: Plan, pp_rank: int) -> list[float]:
    """Elements of each local chunk's parameters on one tp rank, as FSDP2 holds them
    unsharded (each parameter's dim 0 padded to a multiple of dp): a block's matrices split
    over tp (column-parallel by rows, row-parallel by columns), its norms whole; the
    embedding on the first chunk, the final norm and head on the last (a tied head too, as
    its own copy, when the last chunk is not the first). The neox biases are left out, as
    everywhere in the planner (``Shapes.layer_matrix_params``)."""
    tp, dp, h = plan.tp, plan.dp, s.d_model
    q, kv = s.n_heads * s.head_dim / tp, s.kv_heads * s.head_dim / tp
    f = s.ffn / tp
    up = [(f, h)] * (2 if s.llama else 1)
    vector = (h, 1) if s.llama else (h, 2)  # RMSNorm weight; LayerNorm weight and bias
    block = [(q, h), (kv, h), (kv, h), (h, q), *up, (h, f), vector, vector]
    layer = sum(_padded(r, c, dp) for r, c in block)
    chunks = rank_chunks(plan, s.n_layers, pp_rank)
    n_chunks = plan.pp * plan.virtual_stages
    out = []
    for i, layers in enumerate(chunks):
        index = pp_rank + i * plan.pp
        params = len(layers) * layer
        if index == 0:
            params += _padded(s.vocab / tp, h, dp)
        if index == n_chunks - 1:  # a tied head is the embedding, or (pipelined) its copy
            params += _padded(*vector, dp) + (
                0 if s.tied and index == 0 else _padded(s.vocab / tp, h, dp))
        out.append(params)
    return out


def _dp_bytes(s: Shapes, plan: Plan, pp_rank: int) -> dict[str, float]:
    """Data-parallel collective bytes of one step (module docstring)."""
    if plan.dp == 1 or plan.sharding == "none":
        return {}
    params = rank_params(s, plan, pp_rank)
    if plan.sharding == "ddp":
        return {"all_reduce": GRADIENT_REDUCE_BYTES * sum(params)}
    gathers = unit_gathers(plan, pp_rank)
    syncs = plan.grad_accum if plan.pp == 1 and plan.sharding == "zero3" else 1
    return {"all_gather": s.act_bytes * sum(p * g for p, g in zip(params, gathers, strict=True)),
            "reduce_scatter": GRADIENT_REDUCE_BYTES * syncs * sum(params)}


def rank_collective_bytes(s: Shapes, plan: Plan, pp_rank: int) -> dict[str, dict[str, float]]:
    """Collective bytes of one step on a rank of pipeline rank ``pp_rank``, by mesh dim
    (dp, tp, pp) and kind, as the rehearsal counts them (module docstring); the scalar
    all-reduces (loss, norms) are left out."""
    dims = {"dp": _dp_bytes(s, plan, pp_rank), "tp": _tp_bytes(s, plan, pp_rank),
            "pp": {**_pp_bytes(s, plan, pp_rank), **_tied_bytes(s, plan, pp_rank)}}
    return {d: {kind: float(v) for kind, v in k.items()} for d, k in dims.items() if k}


def count_errors(flops: float, comm: dict[str, dict[str, float]], rehearsed_flops: float,
                 rehearsed_comm: dict[str, dict[str, int]],
                 min_share: float = 1e-3) -> dict[str, float]:
    """Relative errors (modeled / rehearsed - 1) of the FLOPs and of each collective kind
    per mesh dim ("dp.all_gather") that either side counts at ``min_share`` or more of the
    rank's collective bytes; below that are the scalar all-reduces of losses and norms and
    the norm weights' gradient all-reduce under sequence parallelism, which the counts leave
    out. A kind only one side counts is an error of +1 (modeled only) or -1 (rehearsed
    only)."""
    out = {"flops": flops / rehearsed_flops - 1 if rehearsed_flops else float(flops > 0)}
    total = max(sum(sum(k.values()) for k in comm.values()),
                sum(sum(k.values()) for k in rehearsed_comm.values()))
    for dim in sorted(set(comm) | set(rehearsed_comm)):
        ours, theirs = comm.get(dim, {}), rehearsed_comm.get(dim, {})
        for kind in sorted(set(ours) | set(theirs)):
            a, b = ours.get(kind, 0.0), theirs.get(kind, 0)
            if max(a, b) >= min_share * total:
                out[f"{dim}.{kind}"] = a / b - 1 if b else 1.0
    return out
