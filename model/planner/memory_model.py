"""Peak memory per rank of a training step of this project's trainer under a parallel plan.

The model counts the tensors ``model.training.trainer.Trainer`` keeps, term by term, and is
checked against rehearsals of the trainer's own ranks under fake tensors
(``model/training/rehearse.py``; ``tests/test_rehearse.py``,
``benchmarks/bench_rehearse.py``). c is the compute dtype's bytes (2 for bf16, 4 for fp32),
P the parameters a rank holds (its tp shard), u one block's parameters (the FSDP unit) and
R the parameters outside the blocks (embedding, output head and final norm: FSDP's root
unit).

Model states:

- FSDP2 (zero2/zero3 with dp > 1) keeps fp32 parameter shards and Adam's two moments,
  12 P / dp. What else lives through the step depends on when gradients are reduced:
  - pipelining (pp > 1): ``torch.distributed.pipelining`` turns gradient sync and
    reshard-after-backward off for every micro-batch but the last, so the stage's compute
    parameters stay unsharded (c P) and FSDP2 accumulates unsharded gradients in its
    ``reduce_dtype``, float32 (4 P), for zero2 and zero3 alike. At the last micro-batch's
    backward one block is reduce-scattered from a float32 buffer (4 u). On the first stage
    each new gradient is cast to float32 to be accumulated ((c + 4) u for a block), and
    the embedding's comes out at the full vocabulary on every tp rank ((c + 4) V h, not
    divided by tp: 3.8 GB at the 175B width, 7.9 GB at 1T's, measured at tp 8 and 16).
  - zero2 without pipelining and with grad_accum > 1: the trainer turns gradient sync off
    but for the last micro-batch, so the same unsharded parameters and float32 gradients
    (c P + 4 P), plus two blocks of all-gather buffers (2 c u: parameters are resharded
    after each backward and gathered again, one block ahead) and the reduce-scatter buffer.
  - zero3, or zero2 with one micro-batch: gradients are reduce-scattered per block as they
    are made and accumulate sharded (4 P / dp), so only the root's unsharded parameters
    (c R) and the buffers of the block in backward add to the shards: its float32
    reduce-scatter input (4 u), the output head's gradient in the compute dtype (the root
    reduces its gradients once, after the whole backward, and makes the embedding's last),
    and under zero3 the block's gathered parameters, the next block's prefetched ones and
    its new gradient (3 c u: rehearsed 1T and 22B ranks hold each beside the 4 u), under
    zero2 one block's gradient (c u); zero2 keeps every block's parameters gathered from
    its forward to its backward (c P: at the end of the forward all of them). At the loss's
    backward no root gradient exists yet.
- Without FSDP (sharding none or ddp, or dp == 1): float32 parameters, gradients and
  Adam moments (16 P); under bf16 autocast the bf16 copies of the weights that the
  forward saves for backward (2 P), each new bf16 gradient and its float32 cast on the
  first stage of a pipeline ((c + 4) u), and more activations (AUTOCAST_ACTIVATION_FACTOR);
  DDP's gradient buckets (4 P) without pipelining; under pipelining with ddp one flat
  float32 copy of the gradients for their all-reduce after the schedule (4 P, once the
  activations are gone).

Activations per block and micro-batch, as this trainer's blocks save them (Korthikanti et
al. 2022's count without dropout, with one change): the two norm inputs (s b h each,
divided by tp under sequence parallelism), the inputs of the QKV and first MLP linears
(s b h each, *not* divided by tp: DTensor's column-parallel linears save the all-gathered
input that sequence parallelism makes; without SP they are the norm outputs), q/k/v and
the attention output (divided by tp), the attention kernel's float32 log-sum-exp (a flash
or memory-efficient kernel; without one the s x s scores, a s^2 b / tp), and the MLP's
intermediates (2 or 4 of s b ffn / tp). Selective recompute drops the scores; full
recompute keeps each block's input and, while one block is recomputed, its activations.
Partial recompute (full with ``recompute_layers`` N > 0, ``chunk_activation_elems``): in each
pipeline chunk of L blocks the first N keep what full recompute keeps and the other L - N
what no recompute keeps. The recomputed block's activations come on top only where they
exceed what the chunk has freed by then: the backward reaches the first N blocks after the
L - N others have freed theirs, at least one block's worth, so they add nothing (rehearsed
at 175B width with 8 layers, zero3 dp8: the peaks of N = 4 and 6 fall while a recomputed
block runs and hold full recompute's activations, N = 2's in a kept block's backward).

In flight: the pipeline schedule decides how many micro-batches each stage holds. GPipe:
all m; 1F1B: pp - r on pipeline rank r; interleaved 1F1B (torch's ``_get_warmup_ops``):
(v - 1) x m_round + 2 (pp - 1 - r) + 1 chunk forwards of L / (pp v) layers before the
first backward (m_round = m / max(1, m // pp)), at most m v (``rank_counts.schedule_order``
replays torch's order). Each in-flight chunk also
keeps its output for the backward (s b h / tp under SP). The rank holding the output head
keeps, for the micro-batch in its loss, the logits gathered over the vocabulary (this
trainer computes the loss on full rows on every tp rank) with their float32 copy and
log-softmax, and in backward their float32 gradients: LOGIT_BYTES per logit. torch's
``PipelineStage`` allocates a receive buffer for every micro-batch of the step at each of
the rank's chunk boundaries (the activation in, the gradient back: 2v - 1 on the first and
last rank), s b h (/ tp under SP) each in the residual stream's dtype, kept through the step
(rehearsed: 640 micro-batches of the study's 175B plan hold 32 GB of them). A chunk's
input is such a buffer wherever it came from another rank (every chunk but the first
rank's first): what its first block saves of it is not counted twice.

Under pipelining a chunk's unsharded float32 gradients exist from its first backward
through its last micro-batch's, which reduce-scatters them and reshards the chunk, and
torch's multi-chunk schedules gather at most three of a rank's chunks at once, the next
three to compute. The rank's schedule is replayed (``rank_counts.held_by_accumulating``)
and the activations, the gradients and the gathered parameters are counted at the moment
their sum is largest, at chunk granularity: a backward begins with its micro-batch's
activations and none of its new gradients and ends with the chunk's gradients and those
activations freed (in between, block by block, the sum is no larger than at one of the
two). A rank whose forwards all come first (GPipe, few micro-batches) thus holds its
activations or its gradients at the peak, not both; and the first chunk's last backwards,
where the embedding's gradient is made, find it gathered alone (rehearsed: one chunk's
parameters at the 1T pick's rank-0 peak, where three were counted before).

The peak is the larger of two moments: the loss's backward (states + stored activations +
the logits; no block is being recomputed then, and in a step of one micro-batch no gradient
exists yet: rehearsed, the 1T tp16 mb8 zero3 plan's peak holds neither, +19.2 % before) and
the block backward where buffers peak (states + activations + the reduce-scatter and
all-gather buffers above). A pipeline's last stage has four, counted apart (their sum
never exists): the loss's backward, a recomputed block's backward, the end of a block's
backward, and the gradient reduction that torch's schedule runs after a chunk's last
backward (``REDUCE_GRAD``), whose float32 reduce-scatter input (4 u) comes when the rank's
chunks are resharded (rehearsed: none gathered then; the 1T pick's last rank +16.8 % ->
+4.0 %, 1T tp8 pp32 interleaved's last +6.0 % -> -0.4 %; ddp's flat copy comes after the
schedule's autocast region, whose bf16 weight copies are gone with it: the study's 22B last
rank +5.7 % -> -2.0 %). At the end of a block's backward under pipelined FSDP2 its new
compute-dtype gradient (c u) waits for FSDP2's cast into the float32 accumulator, beside the
full-width input gradients of its q, k, v linears (``QKV_INPUT_GRADS``), while the block's
own stored activations are freed; on the last rank the head's new gradient waits
too (the root is reduced after the whole backward), and the root's float32 gradient and
gathered parameters are held whole with the last chunk, not as a chunk's share (rehearsed:
the 1T pick's first rank -6.9 % -> +0.4 %, last -8.2 % -> -1.1 %). The first stage counts
the block's new gradient as the other of its pipelined moments, beside the embedding's.
Everything is multiplied by (1 + fragmentation) and the cluster's reserved memory is added.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from model.planner.rank_counts import (
    chunk_boundaries,
    held_by_accumulating,
)
from model.planner.shapes import (
    DDP,
    REC_FULL,
    REC_NONE,
    ZERO2,
    ZERO3,
    Shapes,
)

GB = 1e9

LOGIT_BYTES = {2: 16.0, 4: 20.0}
"""Bytes per logit (sequence x micro-batch x vocabulary) at the loss's backward, by compute
dtype bytes: the gathered logits (c), their float32 copy and log-softmax (4 + 4) and the
float32 gradients of both (4 + 4) less what is freed in between; measured 15-16 per logit in
bf16 rehearsals (logits of 1e8 values); fp32 keeps no separate copy but a larger gather."""


QKV_INPUT_GRADS = 4
"""Full-width (s b h) input gradients alive at the end of a block's backward, in the q, k, v
linears' backward: one each and their sum (rehearsed 1T ranks: 3 at wq, 4 at wk)."""

AUTOCAST_ACTIVATION_FACTOR = 2.9
"""Activations under bf16 autocast over float32 weights (sharding none or ddp, or dp == 1,
in bf16) relative to the same plan's count with bf16 parameters: rehearsals of 175B-wide
pipelines keep 2.4x (tp4, SP) to 2.9x (tp1) as much (float32 norm inputs and outputs kept
beside the bf16 casts the linears save). Measured on the CPU's autocast; a GPU's autocast
casts differently, so these plans are priced conservatively, not exactly."""


def stage_layer_counts(
    s: Shapes, pp: np.ndarray, v: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Layers on the first pipeline rank (the largest) and on the last one.

    The split is model.planner.plan.stage_layers's.
    """
    chunks = pp * v
    base, extra = np.divmod(s.n_layers, chunks)
    # Rank 0 owns chunks 0, pp, 2pp, ...: chunk c gets base+1 layers when c < extra.
    first = v * base + np.ceil(np.clip(extra, 0, None) / np.maximum(pp, 1)).astype(np.int64)
    # The last rank owns chunks pp-1, 2pp-1, ...; count those below `extra`.
    last = v * base + np.where(extra > pp - 1, (extra - pp) // pp + 1, 0)
    return first, last


def activation_elems_per_layer(s: Shapes, mb: np.ndarray, tp: np.ndarray, sp: np.ndarray,
                               rec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(stored elements per block per micro-batch, elements of one block while recomputed)."""
    sbh = s.seq_len * mb * s.d_model
    spf = np.where(sp == 1, 1.0 / tp, 1.0)
    hd = s.head_dim
    norm_inputs = 2 * sbh * spf
    linear_inputs = 2 * sbh  # all-gathered under SP, the norm outputs without it
    qkv = s.seq_len * mb * (s.n_heads * hd + 2 * s.kv_heads * hd) / tp
    attn_out = sbh / tp
    scores = 0.0 if s.flash_attention else s.n_heads * s.seq_len ** 2 * mb / tp
    # flash kernels keep a fp32 log-sum-exp per (head, position)
    lse = s.n_heads * s.seq_len * mb / tp * (4 / s.act_bytes) if s.flash_attention else 0.0
    mlp = (4 if s.llama else 2) * s.seq_len * mb * s.ffn / tp
    full = norm_inputs + linear_inputs + qkv + attn_out + lse + mlp + scores
    selective = full - scores
    stored = np.where(rec == REC_NONE, full, np.where(rec == REC_FULL, sbh * spf, selective))
    # under full recompute one block's activations exist again while it is recomputed
    transient = np.where(rec == REC_FULL, full, 0.0)
    return stored, transient


def chunk_activation_elems(s: Shapes, mb: np.ndarray, tp: np.ndarray, sp: np.ndarray,
                           rec: np.ndarray, rl: np.ndarray, layers: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
    """(stored elements of one pipeline chunk of ``layers`` blocks per micro-batch, elements
    the chunk in backward holds beyond them while a block is recomputed).

    Under partial recompute (rec full, ``rl`` = recompute_layers N > 0) the chunk's first N
    blocks store what full recompute stores and the other ``layers - N`` what no recompute
    stores; otherwise every block stores the same. A block is recomputed once the chunk's
    later blocks have freed their activations: the chunk then holds the N recomputed blocks'
    inputs and one block's activations, which under partial recompute is no more than at
    the start of its backward; under full recompute it is one block's activations more."""
    stored, transient = activation_elems_per_layer(s, mb, tp, sp, rec)
    kept, _ = activation_elems_per_layer(s, mb, tp, sp, np.full_like(rec, REC_NONE))
    recomputed = np.where((rec == REC_FULL) & (rl > 0), np.minimum(rl, layers), layers)
    chunk = recomputed * stored + (layers - recomputed) * kept
    return chunk, np.maximum(0.0, recomputed * stored + transient - chunk)


def memory_breakdown(s: Shapes, c: dict[str, np.ndarray], reserved_gb: float = 0.0,
                     fragmentation: float = 0.0) -> dict[str, np.ndarray]:
    """Per-rank bytes (arrays over candidates) of the first and last pipeline stages and the peak.

    c: encoded plans (model.planner.shapes.encode). Keys returned (bytes): params_first,
    params_last; states_first, states_last (model states kept through the step);
    act_first, act_last (stored activations); transient_first, transient_last (the
    buffers or the logits at the peak); first, last and peak (their sums with the margins).
    """
    tp, pp, dp, mb, ga = c["tp"], c["pp"], c["dp"], c["mb"], c["ga"]
    v, shard, rec, sp, rl = c["v"], c["shard"], c["rec"], c["sp"], c["rl"]
    cb = s.act_bytes
    mixed = s.dtype == "bfloat16"
    layer_p = s.layer_matrix_params / tp + s.layer_norm_params
    emb_p = s.embedding_params / tp
    n_first, n_last = stage_layer_counts(s, pp, v)
    single = pp == 1
    root_first = emb_p + np.where(single, emb_p + s.d_model, 0.0)
    root_last = emb_p + s.d_model + np.where(single, emb_p, 0.0)
    head = emb_p + s.d_model  # the output head and its norm
    params_first = n_first * layer_p + root_first
    params_last = n_last * layer_p + root_last
    fsdp = ((shard == ZERO2) | (shard == ZERO3)) & (dp > 1)
    u = layer_p

    def states(params: np.ndarray, root: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(states kept through the step, buffers at a block's backward peak)."""
        accumulate = ~single | ((shard == ZERO2) & (ga > 1))
        per_block = 4 * params / dp + np.where(shard == ZERO2, cb * params, cb * root)
        # gathered parameters (under pipelining counted at the replayed moments instead),
        # float32 gradients
        kept = (cb * np.where(single, 1.0, 0.0) + 4) * params
        sharded = 12 * params / dp + np.where(accumulate, kept, per_block)
        pipe_buf = 4 * u  # the last micro-batch's reduce-scatter
        gathered = np.where(shard == ZERO3, 3 * cb * u, cb * u)
        flat_buf = np.where((shard == ZERO2) & (ga > 1), 2 * cb * u,
                            gathered + cb * head) + 4 * u
        plain = 16 * params + (2 * params if mixed else 0.0)
        plain = plain + np.where((shard == DDP) & (dp > 1) & single, 4 * params, 0.0)
        plain_buf = np.where((shard == DDP) & (dp > 1) & ~single, 4 * params, 0.0)
        return (np.where(fsdp, sharded, plain),
                np.where(fsdp, np.where(single, flat_buf, pipe_buf), plain_buf))

    spf = np.where(sp == 1, 1.0 / tp, 1.0)
    chunk_out = s.seq_len * mb * s.d_model * spf * np.where(single, 0.0, 1.0)
    logits = s.seq_len * mb * s.vocab * LOGIT_BYTES[cb]

    autocast = ~fsdp & mixed  # bf16 autocast over float32 weights (no FSDP2 bf16 params)
    act_factor = np.where(autocast, AUTOCAST_ACTIVATION_FACTOR, 1.0)

    io_bytes = s.seq_len * mb * s.d_model * spf * np.where(fsdp, cb, 4)

    def replayed(table: np.ndarray, per_chunk: np.ndarray, grads: np.ndarray,
                 gathered: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(bytes, accumulating chunks, gathered chunks) at the largest moment of a replayed
        table (``held_by_accumulating``): held chunk forwards x their activations +
        accumulating chunks x their gradients + gathered chunks x their parameters."""
        n, size = table.shape[0], table.shape[1]
        k = np.arange(size)[None, :, None]
        g = np.arange(size)[None, None, :]
        v_ = np.maximum(v, 1)[:, None, None]
        moments = np.where(table >= 0, per_chunk[:, None, None] * table
                           + grads[:, None, None] / v_ * k + gathered[:, None, None] / v_ * g,
                           -np.inf).reshape(n, -1)
        best = np.argmax(moments, axis=1)
        return moments[np.arange(n), best], best // size, best % size

    def act(pp_rank: np.ndarray, layers: np.ndarray, grads: np.ndarray, gathered: np.ndarray,
            received: np.ndarray) -> tuple[np.ndarray, ...]:
        """(held activations, the recomputed block's activations beside them, gradients and
        gathered parameters held at the rank's peak, one chunk forward's activations, the
        gathered parameters among them). Under pipelining the schedule is replayed: a
        chunk's float32 gradients exist from its first backward through its last, and
        multi-chunk schedules gather a few chunks at a time, so the peak is the largest (held
        chunk forwards x their activations + accumulating chunks x their gradients + gathered
        chunks x their parameters) of the step; without, one chunk and all gradients."""
        stored, transient = chunk_activation_elems(s, mb, tp, sp, rec, rl,
                                                   layers / np.maximum(v, 1))
        # a chunk's input saved by its first norm is the receive buffer counted below
        per_chunk = (stored + chunk_out) * cb * act_factor - received * io_bytes
        held = held_by_accumulating(c, pp_rank)
        _, k, g = replayed(held, per_chunk, grads, gathered)
        rows = np.arange(len(k))
        acts = np.where(single, per_chunk, per_chunk * held[rows, k, g])
        v_ = np.maximum(v, 1)
        held_gathered = np.where(single, 0.0, gathered / v_ * g)
        kept = np.where(single, grads, grads / v_ * k) + held_gathered
        return acts, transient * cb * act_factor, kept, per_chunk, held_gathered

    # torch's PipelineStage allocates a receive buffer for every micro-batch at every chunk
    # boundary of the rank (activations in, gradients back), kept through the step
    recv = np.where(single, 0.0, ga * chunk_boundaries(v, True, False) * io_bytes)
    first_rank = np.zeros_like(pp)
    st_first, buf_first = states(params_first, root_first)
    st_last, buf_last = states(params_last, root_last)
    # the float32 gradients the states hold through a pipelined step: accumulated from the
    # first backward of each chunk on (4 P), counted at the moment of the peak instead
    grads_first = np.where(single, 0.0, 4 * params_first)
    grads_last = np.where(single, 0.0, 4 * params_last)
    # the share of held chunk forwards whose input came from another rank: all but the
    # first chunk's on the first rank, all on the last
    no_pipe = np.where(single, 0.0, 1.0)
    # the compute-dtype parameters of the chunks gathered at that moment (FSDP2; without it
    # the float32 parameters are the states'), the root's counted as a chunk's share
    gathered_first = np.where(fsdp & ~single, cb * params_first, 0.0)
    held_acts_first, recomputing_first, held_first, chunk_first, _ = act(
        first_rank, n_first, grads_first, gathered_first, no_pipe * (v - 1) / np.maximum(v, 1))
    # The last rank's root (the output head and final norm) belongs to its last chunk, the
    # first to go backward: its float32 gradient and gathered parameters are held through
    # every backward moment, not as a chunk's share (rehearsed at the 1T pick's last rank:
    # 1.3 + 0.7 GB beside the peak block's backward).
    blocks_last = params_last - root_last
    root_held = np.where(single, 0.0, (4 + np.where(fsdp, cb, 0.0)) * root_last)
    gathered_last = np.where(fsdp & ~single, cb * blocks_last, 0.0)
    held_acts_last, recomputing_last, held_last, _, gathered_at_last = act(
        pp - 1, n_last, np.where(single, 0.0, 4 * blocks_last), gathered_last, no_pipe)
    act_first = held_acts_first + recomputing_first + recv
    act_last = held_acts_last + recomputing_last + recv
    st_first = st_first - grads_first + np.where(single, 0.0, held_first)
    st_last = st_last - grads_last + np.where(single, 0.0, held_last) + root_held
    # A pipeline's first stage peaks in a backward with every micro-batch in flight, while a
    # block's (or the embedding's) new gradient is cast to float32 to be accumulated. The
    # ddp all-reduce copy comes after the schedule, when the activations are gone. Without
    # pipelining the buffers meet every stored activation at the start of the backward; the
    # head's rank peaks at the loss's backward or at a block's, whichever holds more.
    # the embedding's gradient comes out at the full vocabulary on every tp rank (DTensor's
    # vocab-parallel embedding backward), then is cast and accumulated like a block's
    cast = (cb + 4) * np.maximum(u, s.embedding_params)
    # Under FSDP the embedding's gradient is made and cast at the end of each backward of
    # the first chunk (its first layer): the schedule is replayed at those moments (held
    # forwards by accumulating chunks) and the largest is counted as what it adds over the
    # replayed peak (nothing when the peak holds more).
    ends = held_by_accumulating(c, first_rank, first_chunk_ends=True)
    at_ends, _, _ = replayed(ends, chunk_first, grads_first, gathered_first)
    at_embedding = (at_ends + recv + cast) - (act_first + held_first)
    # In a block's backward under pipelined FSDP2 its new gradient (compute dtype) exists
    # until FSDP2 casts it into the float32 accumulator (rehearsed: the 1T pick's rank-0 peak
    # holds a whole block's, 3.9 GB). It comes as the block's activations (or, recomputed,
    # the recomputed ones) go: what it adds is beyond one block's stored activations.
    # Beside it, the input gradients of the column-parallel q, k and v linears and their
    # sum, each full width (the all-gathered input under SP, the replicated one without):
    # rehearsed, three or four s b h at the 1T ranks' peaks, in the wq or wk backward.
    block_acts = activation_elems_per_layer(s, mb, tp, sp, rec)[0] * cb
    input_grads = QKV_INPUT_GRADS * s.seq_len * mb * s.d_model * cb
    new_grad = np.where(fsdp & ~single, cb * u + input_grads - block_acts, 0.0)
    fsdp_first = np.max(np.broadcast_arrays(at_embedding, new_grad - recomputing_first, 0.0),
                        axis=0)
    pipe_first = np.where(fsdp, fsdp_first,
                          np.maximum(np.where(autocast, cast, 0.0), buf_first - act_first))
    casts = np.where(fsdp | autocast, cast, 0.0)  # float32 gradients need no cast
    # Without pipelining the loss's backward and the blocks' backwards are two moments: at
    # the loss no block is being recomputed, and in a step of one micro-batch no gradient
    # exists yet (each step begins with zero_grad(set_to_none=True)).
    unmade = np.where(ga == 1, 4 * params_first / np.where(fsdp, dp, 1), 0.0)
    at_loss = logits - unmade
    at_block = np.maximum(buf_first, casts) + recomputing_first
    single_first = np.maximum(at_loss, at_block) - recomputing_first
    peak_first = np.where(single, single_first, pipe_first)
    # A pipeline's last stage: the loss's backward (the logits), a recomputed block's
    # backward (its activations, in act_last) and the gradient reduction after a chunk's last
    # backward are three moments, not one. The reduction's buffer (FSDP: a block's float32
    # reduce-scatter input; ddp: the flat all-reduce copy) comes when the schedule's
    # REDUCE_GRAD has resharded the rank's chunks (FSDP, rehearsed: none gathered) or the
    # activations are gone (ddp). Counted: the largest of the four beyond the replayed peak.
    # (ddp under autocast: the forwards' bf16 weight copies went with the activations)
    autocast_weights = np.where(autocast, 2 * params_last, 0.0)
    reduction = np.where(fsdp, buf_last - gathered_at_last,
                         buf_last - held_acts_last - autocast_weights)
    # (FSDP2 reduces the root's gradients after the whole backward: through the last rank's
    # block backwards the head's new compute-dtype gradient is still there)
    new_grad_last = new_grad + np.where(fsdp & ~single, cb * root_last, 0.0)
    moments_last = np.broadcast_arrays(logits, recomputing_last, new_grad_last, reduction)
    pipe_last = np.max(moments_last, axis=0) - recomputing_last
    peak_last = np.where(single, np.maximum(buf_last, logits), pipe_last)
    first = (st_first + peak_first + act_first) * (1 + fragmentation) + reserved_gb * GB
    last = (st_last + peak_last + act_last) * (1 + fragmentation) + reserved_gb * GB
    last = np.where(single, first, last)  # one stage: the first rank is also the last
    return {
        "params_first": params_first, "params_last": params_last,
        "states_first": st_first, "states_last": st_last,
        "act_first": act_first, "act_last": act_last,
        "transient_first": peak_first, "transient_last": peak_last,
        "first": first, "last": last, "peak": np.maximum(first, last),
    }


def peak_memory_gb(s: Shapes, plan: Any, cluster: Any = None) -> float:
    """Peak bytes (GB) per rank of one Plan; cluster supplies reserved memory and fragmentation."""
    from model.planner.shapes import encode

    res = memory_breakdown(s, encode([plan]), getattr(cluster, "reserved_gb", 0.0),
                           getattr(cluster, "fragmentation", 0.0))
    return float(res["peak"][0]) / GB
