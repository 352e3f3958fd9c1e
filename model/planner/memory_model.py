"""Peak memory per rank of a training step of this project's trainer under a parallel plan.

The model counts the tensors ``model.training.trainer.Trainer`` keeps, term by term, and is
checked against rehearsals of the trainer's own ranks under fake tensors
(``model/rehearsal/rehearse.py``; ``tests/test_rehearse.py``, ``benchmarks/bench_rehearse.py``).
Every term is a function below whose docstring gives its formula; ``memory_breakdown``
adds them up for the first and the last pipeline rank, and docs/planner.md tables them.

Symbols: c the compute dtype's bytes (2 for bf16, 4 for fp32); P the parameters a rank
holds (its tp shard); u one block's parameters (an FSDP unit); R the parameters outside the
blocks (embedding, output head, final norm: FSDP's root unit); s, b, h, V the sequence,
micro-batch, width and vocabulary; m = grad_accum micro-batches; v chunks per pipeline
rank; SP sequence parallelism, which divides the residual stream by tp.

The four parts of a rank's bytes:

- **Model states**, kept through the step: FSDP2 (zero2/zero3 with dp > 1) keeps fp32
  shards and Adam's moments, and unsharded gradients wherever gradient sync waits for the
  last micro-batch (pipelining, or zero2 with m > 1); without FSDP2, fp32 parameters,
  gradients and moments, bf16 autocast copies and DDP's buckets.
- **Activations**: per block and micro-batch as the trainer's blocks save them, times the
  chunk forwards the schedule holds, plus torch pipelining's receive buffers.
- **The transient** at the peak moment: the reduce-scatter and all-gather buffers, the
  logits at the loss's backward, or a block's new gradient waiting for its fp32 cast.
- **Margins**: x (1 + fragmentation), + the cluster's reserved memory.

Under pipelining a chunk's unsharded float32 gradients exist from its first backward through
its last micro-batch's (the root's with its own chunk's: the first rank's first, the last
rank's last), multi-chunk schedules gather at most three of a rank's chunks and zero3
forwards reshard theirs block by block:
the rank's schedule is replayed (``rank_counts.held_by_accumulating``) and activations,
gradients and gathered parameters are counted at the moment their sum is largest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from model.planner.rank_counts import (
    FIRST_CHUNK_ENDS,
    LAST_CHUNK_BEGINS,
    chunk_boundaries,
    forwards_first,
    held_by_accumulating,
)
from model.planner.shapes import (
    DDP,
    GPIPE,
    REC_FULL,
    REC_NONE,
    ZERO2,
    ZERO3,
    Shapes,
    fsdp_sharded,
)

GB = 1e9

LOGIT_BYTES = {c: c + 12.0 for c in (2, 4)}
"""Bytes per logit at the loss's backward, by c: the logits the stage keeps (c), the float32
log-softmax the loss saves (4) and the two float32 gradients of its backward (4 + 4)."""

QKV_INPUT_GRADS = 4
"""Full-width (s b h) input gradients alive in the q, k, v linears' backward: one each and
their sum (rehearsed at 1T width: 3 at wq, 4 at wk)."""



# --- the plan's shape --------------------------------------------------------------------


def stage_layer_counts(
    s: Shapes, pp: np.ndarray, v: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Layers on the first pipeline rank (the largest) and on the last one.

    The split is model.parallel.layout.stage_layers's.
    """
    chunks = pp * v
    base, extra = np.divmod(s.n_layers, chunks)
    # Rank 0 owns chunks 0, pp, 2pp, ...: chunk c gets base+1 layers when c < extra.
    first = v * base + np.ceil(np.clip(extra, 0, None) / np.maximum(pp, 1)).astype(np.int64)
    # The last rank owns chunks pp-1, 2pp-1, ...; count those below `extra`.
    last = v * base + np.where(extra > pp - 1, (extra - pp) // pp + 1, 0)
    return first, last


@dataclass(frozen=True)
class _Layout:
    """Encoded plans (arrays over candidates) and the flags every term reads."""

    s: Shapes
    plans: dict[str, np.ndarray]
    compute_bytes: int
    """c: bytes of an activation or a gathered compute-dtype parameter."""
    one_stage: np.ndarray
    """pp == 1: no pipeline."""
    fsdp: np.ndarray
    """FSDP2 shards the states: zero2 or zero3 with dp > 1."""
    autocast: np.ndarray
    """bf16 autocast over fp32 weights: bf16 without FSDP2's bf16 parameters."""
    sp_share: np.ndarray
    """The share of the residual stream a rank keeps: 1 / tp under SP, else 1."""
    chunks: np.ndarray
    """v, at least 1: the model chunks a pipeline rank holds."""

    @classmethod
    def of(cls, s: Shapes, plans: dict[str, np.ndarray]) -> _Layout:
        fsdp = fsdp_sharded(plans)
        return cls(s, plans, s.act_bytes, plans["pp"] == 1, fsdp,
                   ~fsdp & (s.dtype == "bfloat16"),
                   np.where(plans["sp"] == 1, 1.0 / plans["tp"], 1.0),
                   np.maximum(plans["v"], 1))

    def pipelined(self, value: Any) -> np.ndarray:
        """``value`` on a pipelined rank, 0 without a pipeline."""
        return np.where(self.one_stage, 0.0, value)

    @property
    def residual_elems(self) -> np.ndarray:
        """s b h x SP share: one micro-batch of the residual stream on a rank."""
        return self.s.seq_len * self.plans["mb"] * self.s.d_model * self.sp_share


# --- parameters --------------------------------------------------------------------------


def block_params(s: Shapes, tp: np.ndarray) -> np.ndarray:
    """u = a block's matrices / tp + its norms: one block's parameters, an FSDP unit."""
    return s.layer_matrix_params / tp + s.layer_norm_params


def root_params(s: Shapes, tp: np.ndarray, one_stage: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """R on the first and last rank: embedding V h / tp first; head V h / tp + final norm h
    last; all of them on a single stage."""
    embedding = s.embedding_params / tp
    first = embedding + np.where(one_stage, embedding + s.d_model, 0.0)
    last = embedding + s.d_model + np.where(one_stage, embedding, 0.0)
    return first, last


# --- model states ------------------------------------------------------------------------


def fsdp_states(lay: _Layout, params: np.ndarray, root: np.ndarray) -> np.ndarray:
    """12 P / dp (fp32 shards, Adam) + (c [pp = 1] + 4) P where gradients accumulate
    unsharded (pipelined, or zero2 with m > 1), else 4 P / dp + c P (zero2) or c R (zero3)."""
    shard, dp, c = lay.plans["shard"], lay.plans["dp"], lay.compute_bytes
    accumulating = accumulates_unsharded(lay)
    # sharded fp32 gradients; zero2 keeps every block gathered from forward to backward
    per_block = 4 * params / dp + np.where(shard == ZERO2, c * params, c * root)
    # gathered parameters (under pipelining counted at the replayed moments instead) and
    # unsharded fp32 gradients
    unsharded = (c * np.where(lay.one_stage, 1.0, 0.0) + 4) * params
    return 12 * params / dp + np.where(accumulating, unsharded, per_block)


def fsdp_buffers(lay: _Layout, unit: np.ndarray, head: np.ndarray) -> np.ndarray:
    """Pipelined: 4 u (the last micro-batch's fp32 reduce-scatter input). Else 4 u + 2 c u
    (zero2, m > 1: two blocks gathered) or + 3 c u (zero3) / c u (zero2) + c head."""
    shard, c = lay.plans["shard"], lay.compute_bytes
    # zero3: the block's gathered parameters, the next block's and its new gradient
    in_backward = np.where(shard == ZERO3, 3 * c * unit, c * unit)
    flat = np.where((shard == ZERO2) & (lay.plans["ga"] > 1), 2 * c * unit,
                    in_backward + c * head) + 4 * unit
    return np.where(lay.one_stage, flat, 4 * unit)


def plain_states(lay: _Layout, params: np.ndarray, cached_copies: np.ndarray) -> np.ndarray:
    """16 P (fp32 parameters, gradients, Adam) + autocast's cached bf16 weight copies
    (``autocast_cached_copies``) + 4 P (DDP's buckets, dp > 1, no pipeline)."""
    ddp = (lay.plans["shard"] == DDP) & (lay.plans["dp"] > 1)
    return 16 * params + cached_copies + np.where(ddp & lay.one_stage, 4 * params, 0.0)


def plain_buffers(lay: _Layout, params: np.ndarray) -> np.ndarray:
    """4 P: the flat fp32 gradient copy DDP all-reduces after a pipelined step (dp > 1)."""
    ddp = (lay.plans["shard"] == DDP) & (lay.plans["dp"] > 1)
    return np.where(ddp & ~lay.one_stage, 4 * params, 0.0)


def model_states(lay: _Layout, params: np.ndarray, root: np.ndarray, unit: np.ndarray,
                 head: np.ndarray, cached_copies: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(states kept through the step, buffers at a block's backward): FSDP2's or plain."""
    return (np.where(lay.fsdp, fsdp_states(lay, params, root),
                     plain_states(lay, params, cached_copies)),
            np.where(lay.fsdp, fsdp_buffers(lay, unit, head), plain_buffers(lay, params)))


# --- autocast's weight copies ------------------------------------------------------------


def recast_forwards(lay: _Layout, held: np.ndarray, all_forwards_first: np.ndarray
                    ) -> np.ndarray:
    """[autocast, pipelined, recompute, a forward after a backward] held chunk forwards with
    weight copies of their own beyond the cached set: a backward that recomputes runs, on a
    GPU, on the autograd engine's device thread, whose autocast exit empties autocast's
    weight-cast cache, so of H held forwards the min(H, m v - H) made after a backward each
    cast anew and the warm-up's (H > m v - H) share one; the newest set is the cache's. A
    rank that runs every forward before its first backward (GPipe, a short 1F1B) shares one."""
    p = lay.plans
    recasting = (lay.autocast & ~lay.one_stage & (p["rec"] != REC_NONE)
                 & ~all_forwards_first)
    after_backward = np.minimum(held, np.maximum(p["ga"] * lay.chunks - held, 0))
    sets = after_backward + (held > after_backward)
    return np.where(recasting, np.maximum(sets - 1, 0), 0)


def blocks_in_mode(rec: np.ndarray, rl: np.ndarray, chunk_layers: Any) -> np.ndarray:
    """Blocks of a chunk of ``chunk_layers`` that run the plan's recompute mode: the first
    ``recompute_layers`` N under partial recompute (full with N > 0), else all of them; the
    rest keep everything."""
    return np.where((rec == REC_FULL) & (rl > 0), np.minimum(rl, chunk_layers), chunk_layers)


def kept_blocks(lay: _Layout, chunk_layers: Any) -> np.ndarray:
    """Blocks of a chunk of ``chunk_layers`` whose saved tensors hold their weights' bf16
    copies: all but the fully recomputed ones."""
    p = lay.plans
    recomputed = np.where(p["rec"] == REC_FULL, blocks_in_mode(p["rec"], p["rl"], chunk_layers),
                          0)
    return chunk_layers - recomputed


def weight_copies(lay: _Layout, blocks: Any) -> np.ndarray:
    """c x block matrices / tp x ``blocks``: bf16 copies of those blocks' weights."""
    return lay.compute_bytes * lay.s.layer_matrix_params / lay.plans["tp"] * blocks


def kept_weight_copies(lay: _Layout, chunk_layers: Any) -> np.ndarray:
    """``weight_copies`` of a chunk's ``kept_blocks``: one forward's bf16 weight copies that
    its saved tensors hold."""
    return weight_copies(lay, kept_blocks(lay, chunk_layers))


def autocast_cached_copies(lay: _Layout, layers: np.ndarray, head: Any) -> np.ndarray:
    """[bf16 autocast over fp32 weights] c x (matrices of the rank's blocks / tp + its output
    head): the cast weights autocast caches (the embedding is looked up, not cast); after a
    backward they may be emptied (``emptied_cache``) or stand for the gradients waiting on
    their casts (``pending_weight_grads``), and under 1F1B held forwards add sets of their
    own (``recast_forwards``)."""
    return np.where(lay.autocast, weight_copies(lay, layers) + lay.compute_bytes * head, 0.0)


def emptied_cache(lay: _Layout, layers: np.ndarray, cached: np.ndarray,
                  all_forwards_first: np.ndarray) -> np.ndarray:
    """[autocast, pipelined, recompute, every forward before the first backward] kept blocks'
    and head's copies - ``cached``: after the rank's first backward, which recomputed and so
    emptied the cache, only the copies its held forwards' saved tensors hold are left (the
    kept blocks' and the head's), since no forward casts anew (GPipe, a short 1F1B)."""
    head_copy = cached - weight_copies(lay, layers)
    kept = kept_weight_copies(lay, layers) + head_copy
    emptied = (lay.autocast & ~lay.one_stage & (lay.plans["rec"] != REC_NONE)
               & all_forwards_first)
    return np.where(emptied, kept - cached, 0.0)


def waiting_weight_grads(lay: _Layout, cached: np.ndarray, all_forwards_first: np.ndarray
                         ) -> np.ndarray:
    """[autocast, pipelined, casts shared] cached / v: a forward that reused an earlier
    forward's cached cast has no cast node of its own, and the shared one (its autograd
    sequence number the earliest forward's) runs after every other node of the later
    backward, so that backward's bf16 weight gradients, one chunk's cache, wait to its end
    (the first chunk's: past the embedding's gradient). Casts are shared across the step
    without recompute, and among the warm-up's forwards when all run before a recomputing
    backward; otherwise each backward's forward cast anew."""
    shared = (lay.plans["rec"] == REC_NONE) | all_forwards_first
    return np.where(lay.autocast & ~lay.one_stage & shared, cached / lay.chunks, 0.0)


def pending_weight_grads(lay: _Layout, cached: np.ndarray, per_chunk: np.ndarray,
                         recomputing: np.ndarray, all_forwards_first: np.ndarray
                         ) -> np.ndarray:
    """max(0, ``waiting_weight_grads`` - one chunk forward - a recomputed block's
    activations): what the waiting gradients add over the moment a backward ends, by which
    its forward's activations and its last recomputed block's are freed."""
    waiting = waiting_weight_grads(lay, cached, all_forwards_first)
    return np.maximum(0.0, waiting - per_chunk - recomputing)


# --- activations -------------------------------------------------------------------------


def norm_input_elems(s: Shapes, mb: np.ndarray, tp: np.ndarray, sp: np.ndarray) -> np.ndarray:
    """(2, or 1 with a parallel residual, whose two norms read one input) x s b h x SP share:
    the norms' saved inputs per block, the residual stream's dtype (float32 under autocast)."""
    return (1 if s.parallel_residual else 2) * s.seq_len * mb * s.d_model * np.where(
        sp == 1, 1.0 / tp, 1.0)


def activation_elems_per_layer(s: Shapes, mb: np.ndarray, tp: np.ndarray, sp: np.ndarray,
                               rec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(stored elements per block per micro-batch, elements of one block while recomputed).

    Korthikanti et al. 2022 without dropout: 2 norm inputs s b h (/ tp under SP; 1 with a
    parallel residual), 2 linear inputs s b h (all-gathered under SP, so never / tp), q k v
    and attention output / tp (twice under partial rotary), flash's fp32 log-sum-exp (else
    the s^2 scores), the MLP's 2 or 4 s b ffn / tp. Selective recompute drops the scores and
    partial rotary's layout copy; full keeps the block's input."""
    sbh = s.seq_len * mb * s.d_model
    spf = np.where(sp == 1, 1.0 / tp, 1.0)
    hd = s.head_dim
    norm_inputs = norm_input_elems(s, mb, tp, sp)
    linear_inputs = 2 * sbh  # all-gathered under SP, the norm outputs without it
    qkv = s.seq_len * mb * (s.n_heads * hd + 2 * s.kv_heads * hd) / tp
    attn_out = s.seq_len * mb * s.n_heads * hd / tp
    scores = 0.0 if s.flash_attention else s.n_heads * s.seq_len ** 2 * mb / tp
    # flash kernels keep a fp32 log-sum-exp per (head, position)
    lse = s.n_heads * s.seq_len * mb / tp * (4 / s.act_bytes) if s.flash_attention else 0.0
    mlp = (4 if s.llama else 2) * s.seq_len * mb * s.ffn / tp
    # partial rotary: attention's output comes in head-major layout (q's, rebuilt by a
    # concatenation) and the output projection saves a row-major copy beside it
    layout_copy = attn_out if s.partial_rotary else 0.0
    full = norm_inputs + linear_inputs + qkv + attn_out + layout_copy + lse + mlp + scores
    # selective recompute keeps the core's output only as the output projection's input
    selective = full - scores - layout_copy
    stored = np.where(rec == REC_NONE, full, np.where(rec == REC_FULL, sbh * spf, selective))
    # under full recompute one block's activations exist again while it is recomputed
    transient = np.where(rec == REC_FULL, full, 0.0)
    return stored, transient


def chunk_activation_elems(s: Shapes, mb: np.ndarray, tp: np.ndarray, sp: np.ndarray,
                           rec: np.ndarray, rl: np.ndarray, layers: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
    """(N x full recompute's + (L - N) x no recompute's stored elements per micro-batch of a
    chunk of L = ``layers`` blocks, what a recomputed block adds beyond them).

    N = ``rl`` under partial recompute (rec full, recompute_layers > 0), else L. A block is
    recomputed once the chunk's later blocks have freed theirs, so only full recompute
    (N = L) adds one block's activations."""
    stored, transient = activation_elems_per_layer(s, mb, tp, sp, rec)
    kept, _ = activation_elems_per_layer(s, mb, tp, sp, np.full_like(rec, REC_NONE))
    recomputed = blocks_in_mode(rec, rl, layers)
    chunk = recomputed * stored + (layers - recomputed) * kept
    return chunk, np.maximum(0.0, recomputed * stored + transient - chunk)


def boundary_bytes(lay: _Layout) -> np.ndarray:
    """s b h x SP share x (c under FSDP2, else 4): one tensor crossing a chunk boundary."""
    return lay.residual_elems * np.where(lay.fsdp, lay.compute_bytes, 4)


def receive_buffers(lay: _Layout) -> np.ndarray:
    """m x (2v - 1) x boundary bytes on a pipelined end rank: torch's ``PipelineStage``
    keeps a receive buffer per micro-batch at each chunk boundary through the step."""
    return lay.pipelined(lay.plans["ga"] * chunk_boundaries(lay.plans["v"], True, False)
                         * boundary_bytes(lay))


def logit_bytes(lay: _Layout) -> np.ndarray:
    """s b V x (LOGIT_BYTES[c], + 4 on the CPU, whose log-softmax backward makes one more
    float32 tensor): the loss's backward, on full vocabulary rows on every tp rank."""
    per_logit = LOGIT_BYTES[lay.compute_bytes] + (4 if lay.s.on_cpu else 0)
    return lay.s.seq_len * lay.plans["mb"] * lay.s.vocab * per_logit


def held_loss_graph(lay: _Layout) -> np.ndarray:
    """[GPipe, pp > 1] s b V x (c + 4): under GPipe every forward runs before the first
    backward, so each forward the last stage holds keeps its loss graph (its logits, which
    the stage keeps for backward, and the float32 log-softmax) until its backward; the
    backward's own is part of ``logit_bytes``."""
    p = lay.plans
    per_graph = lay.s.seq_len * p["mb"] * lay.s.vocab * (lay.compute_bytes + 4)
    return np.where((p["sched"] == GPIPE) & ~lay.one_stage, per_graph, 0.0)


def autocast_extra_elems(lay: _Layout, rec: np.ndarray) -> np.ndarray:
    """[bf16 autocast over fp32 weights] the saved elements of one block that stay float32,
    (4 - c) bytes each beyond the c counted: the residual stream is float32 there, so the
    norms' inputs are (a fully recomputed block keeps only its input, s b h x SP share);
    everything after a linear's autocast cast is bf16."""
    p = lay.plans
    fp32 = np.where(rec == REC_FULL, lay.residual_elems,
                    norm_input_elems(lay.s, p["mb"], p["tp"], p["sp"]))
    return np.where(lay.autocast, fp32, 0.0)


def autocast_input_casts(lay: _Layout) -> np.ndarray:
    """[bf16 autocast over fp32 weights] (3 + 2 llama / 1 neox - 2) x s b h per kept block:
    each projection casts the float32 norm output it reads and saves its own bf16 copy
    (q, k and v read one; llama's w1 and w3 another), where the 2 linear inputs counted
    are one per norm. All-gathered under SP, so never / tp."""
    reads = 3 + (2 if lay.s.llama else 1)
    sbh = lay.s.seq_len * lay.plans["mb"] * lay.s.d_model
    return np.where(lay.autocast, (reads - 2) * sbh, 0.0)


def rope_table_copies(lay: _Layout, blocks: Any) -> np.ndarray:
    """[FSDP2 in bf16] 2 s x rotary width x c per block: FSDP2's mixed precision casts each
    block's float32 cos and sin tables, forward inputs, to bf16 afresh, and the block keeps
    them (rotary's products save them; a checkpoint holds its inputs) until its backward."""
    return np.where(lay.fsdp & (lay.compute_bytes == 2),
                    blocks * 2 * lay.s.seq_len * lay.s.rope_width * lay.compute_bytes, 0.0)


def forward_gathered(lay: _Layout) -> np.ndarray:
    """[pipelined zero3] 2 c u: the parameters gathered as a forward's last blocks run, its
    own and the next one's (prefetched), the chunk's earlier blocks resharded after theirs."""
    unit = block_params(lay.s, lay.plans["tp"])
    zero3 = lay.fsdp & (lay.plans["shard"] == ZERO3) & ~lay.one_stage
    return np.where(zero3, 2 * lay.compute_bytes * unit, 0.0)


def chunk_forward_bytes(lay: _Layout, layers: np.ndarray, received_share: Any
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(one held chunk forward: stored x c + float32 extras x (4 - c) + autocast's input
    casts of the kept blocks x c + FSDP2's rotary table copies + [pipelined] output boundary
    bytes - received share x boundary bytes, what a recomputed block adds).

    A chunk's input that came from another rank is a receive buffer, counted there:
    ``received_share`` is the share of held chunk forwards whose input did."""
    p = lay.plans
    c = lay.compute_bytes
    chunk_layers = layers / lay.chunks
    stored, transient = chunk_activation_elems(lay.s, p["mb"], p["tp"], p["sp"], p["rec"],
                                               p["rl"], chunk_layers)
    # float32 extras under autocast: N recomputed blocks keep their input, the rest their norms'
    recomputed = blocks_in_mode(p["rec"], p["rl"], chunk_layers)
    kept_rec = np.full_like(p["rec"], REC_NONE)
    extra = (recomputed * autocast_extra_elems(lay, p["rec"])
             + (chunk_layers - recomputed) * autocast_extra_elems(lay, kept_rec))
    output = lay.pipelined(boundary_bytes(lay))
    received = received_share * boundary_bytes(lay)
    casts = autocast_input_casts(lay)
    per_chunk = (stored * c + extra * (4 - c) + kept_blocks(lay, chunk_layers) * casts * c
                 + rope_table_copies(lay, chunk_layers) + output - received)
    # a recomputed block has its float32 norm inputs and its input casts again
    recomputing = (transient * c + np.where(transient > 0, autocast_extra_elems(lay, kept_rec)
                                            * (4 - c) + casts * c, 0.0))
    return per_chunk, recomputing


# --- the replayed schedule ---------------------------------------------------------------


class _Moment(NamedTuple):
    """The largest moment of a replayed schedule."""

    total: np.ndarray
    root_holds: np.ndarray
    """r: whether the rank's root chunk holds its gradients."""
    forward: np.ndarray
    """f: whether a forward's last block is running."""
    accumulating: np.ndarray
    """k: chunks holding unsharded gradients."""
    gathered: np.ndarray
    """g: chunks whose parameters are gathered."""
    held: np.ndarray
    """Chunk forwards held."""


def largest_moment(lay: _Layout, table: np.ndarray, per_chunk: np.ndarray,
                   grads: np.ndarray, gathered: np.ndarray, after_backward: Any = 0.0,
                   root_grad: Any = 0.0, in_forward: Any = 0.0) -> _Moment:
    """max over (r, f, k, g) of held chunk forwards x per_chunk + k grads / v + g gathered / v
    + r root_grad + f in_forward (+ ``after_backward`` where k > 0) (``table``:
    ``held_by_accumulating``'s, -1 where the schedule never is)."""
    n, size = table.shape[0], table.shape[-1]
    r = np.arange(2)[None, :, None, None, None]
    f = np.arange(2)[None, None, :, None, None]
    k = np.arange(size)[None, None, None, :, None]
    g = np.arange(size)[None, None, None, None, :]

    def per_candidate(value: Any) -> np.ndarray:
        return np.broadcast_to(np.asarray(value, dtype=float), (n,))[:, None, None, None, None]

    v = per_candidate(lay.chunks)
    moments = np.where(table >= 0, per_candidate(per_chunk) * table
                       + per_candidate(grads) / v * k + per_candidate(gathered) / v * g
                       + np.where(k > 0, per_candidate(after_backward), 0.0)
                       + per_candidate(root_grad) * r + per_candidate(in_forward) * f,
                       -np.inf).reshape(n, -1)
    best = np.argmax(moments, axis=1)
    rows = np.arange(n)
    rb, fb, kb, gb = np.unravel_index(best, (2, 2, size, size))
    return _Moment(moments[rows, best], rb, fb, kb, gb, table.reshape(n, -1)[rows, best])


class _RankPeak(NamedTuple):
    """What a rank holds at its replayed peak, in bytes."""

    activations: np.ndarray
    """Held chunk forwards x their activations (one chunk without a pipeline), with the
    weight copies and pending gradients that change after a backward."""
    recomputing: np.ndarray
    """A recomputed block's activations beside them."""
    grads_and_gathered: np.ndarray
    """k / v of the gradients + g / v of the gathered parameters (all gradients unpipelined)."""
    per_chunk: np.ndarray
    """One chunk forward's activations."""
    gathered: np.ndarray
    """g / v of the gathered parameters."""
    end_over_peak: np.ndarray
    """The largest moment of the rank's end of the step (``rank_peak``'s ``end``) less the
    peak's, 0 where none is asked for."""


def rank_peak(lay: _Layout, pp_rank: np.ndarray, layers: np.ndarray, grads: np.ndarray,
              gathered: np.ndarray, received_share: Any, cached: np.ndarray,
              held_extra: Any = 0.0, root_grad: Any = 0.0, end: str | None = None,
              root_grad_at_end: Any = 0.0) -> _RankPeak:
    """Activations, gradients and gathered parameters at the rank's largest replayed moment;
    without a pipeline one chunk forward and all ``grads``. ``cached``: autocast's cached
    weight copies; ``held_extra``: bytes each held forward keeps beyond its chunk's
    activations (the last GPipe stage's loss graph); ``root_grad``: the root chunk's
    gradient (the first rank's embedding's, the last rank's head's), held from that chunk's
    first backward on;
    ``end``: the rank's end of the model whose moments are replayed apart
    (``_RankPeak.end_over_peak``): ``LAST_CHUNK_BEGINS`` on the last rank, where the loss
    runs its backward (no weight gradient pending yet), ``FIRST_CHUNK_ENDS`` on the first,
    where the embedding's gradient is made; there the root chunk's gradient counts where it
    was held before that backward, but ``root_grad_at_end`` of it always."""
    per_chunk, recomputing = chunk_forward_bytes(lay, layers, received_share)
    per_chunk = per_chunk + held_extra
    in_forward = forward_gathered(lay)
    all_first = forwards_first(lay.plans, pp_rank)
    pending = pending_weight_grads(lay, cached, per_chunk, recomputing, all_first)
    after = emptied_cache(lay, layers, cached, all_first) + pending
    table = held_by_accumulating(lay.plans, pp_rank)
    moment = largest_moment(lay, table, per_chunk, grads, gathered, after, root_grad,
                            in_forward)
    end_over_peak = np.zeros_like(moment.total)
    if end is not None:
        # the loss's backward begins with no weight gradient waiting; the embedding's
        # gradient comes before its chunk's waiting ones are cast, where the backward's
        # forward reused the first one's casts (so not in the first backward, r = 0)
        waiting = (waiting_weight_grads(lay, cached, all_first) if end == FIRST_CHUNK_ENDS
                   else 0.0)
        end_table = held_by_accumulating(lay.plans, pp_rank, end)
        end_over_peak = largest_moment(lay, end_table, per_chunk, grads, gathered,
                                       after - pending + root_grad_at_end,
                                       root_grad - root_grad_at_end + waiting
                                       ).total - moment.total
    copies = (kept_weight_copies(lay, layers / lay.chunks)
              * recast_forwards(lay, moment.held, all_first)
              + np.where(moment.accumulating > 0, after, 0.0))
    activations = np.where(lay.one_stage, per_chunk, per_chunk * moment.held + copies)
    held_gathered = lay.pipelined(gathered / lay.chunks * moment.gathered
                                  + in_forward * moment.forward)
    grads_and_gathered = (np.where(lay.one_stage, grads, grads / lay.chunks
                                   * moment.accumulating + root_grad * moment.root_holds)
                          + held_gathered)
    return _RankPeak(activations, recomputing, grads_and_gathered, per_chunk, held_gathered,
                     end_over_peak)


# --- transients at the peak moment -------------------------------------------------------


def accumulates_unsharded(lay: _Layout) -> np.ndarray:
    """FSDP2 keeps unsharded fp32 gradients through the step: pipelined, or zero2 with m > 1."""
    p = lay.plans
    return lay.fsdp & (~lay.one_stage | ((p["shard"] == ZERO2) & (p["ga"] > 1)))


def full_vocab_embedding_grad(s: Shapes, lay: _Layout) -> np.ndarray:
    """4 V h (1 - 1/tp) with tp > 1 where FSDP2 accumulates unsharded or without FSDP2: the
    embedding's gradient comes out of DTensor's vocab-parallel backward at the full
    vocabulary on every tp rank, and is kept so (float32) until the step's reduction."""
    tp = lay.plans["tp"]
    return np.where((accumulates_unsharded(lay) | ~lay.fsdp) & (tp > 1),
                    4 * s.embedding_params * (1 - 1 / tp), 0.0)


def _cast_bytes_per_param(lay: _Layout) -> np.ndarray:
    """c + 4 (a new gradient and its fp32 cast), or c where FSDP2 accumulates into a kept
    float32 gradient."""
    return np.where(accumulates_unsharded(lay), lay.compute_bytes, lay.compute_bytes + 4)


def block_gradient_cast(lay: _Layout, unit: np.ndarray) -> np.ndarray:
    """(c + 4) u, or c u where FSDP2 accumulates into a kept float32 gradient: a block's new
    gradient and its fp32 cast."""
    return _cast_bytes_per_param(lay) * unit


def gradient_cast(s: Shapes, lay: _Layout, unit: np.ndarray) -> np.ndarray:
    """max(``block_gradient_cast``, the same per parameter x V h): the embedding's new
    gradient comes out at the full vocabulary on every tp rank (DTensor's vocab-parallel
    backward). Under autocast the embedding is looked up in float32, not cast, so its
    gradient is 4 V h, uncast."""
    embedding = np.where(lay.autocast, 4.0, _cast_bytes_per_param(lay)) * s.embedding_params
    return np.maximum(block_gradient_cast(lay, unit), embedding)


def new_block_gradient(lay: _Layout, unit: np.ndarray) -> np.ndarray:
    """[pipelined FSDP2] c u + QKV_INPUT_GRADS x s b h x c - one block's stored activations:
    a block's new gradient awaiting its fp32 cast, as the block's activations are freed."""
    p, c = lay.plans, lay.compute_bytes
    block_acts = activation_elems_per_layer(lay.s, p["mb"], p["tp"], p["sp"], p["rec"])[0] * c
    input_grads = QKV_INPUT_GRADS * lay.s.seq_len * p["mb"] * lay.s.d_model * c
    return np.where(lay.fsdp & ~lay.one_stage, c * unit + input_grads - block_acts, 0.0)


def unmade_gradients(lay: _Layout, params: np.ndarray) -> np.ndarray:
    """4 P (/ dp under FSDP2) with one micro-batch: no gradient exists at the loss's backward
    (each step begins with zero_grad(set_to_none=True))."""
    p = lay.plans
    return np.where(p["ga"] == 1, 4 * params / np.where(lay.fsdp, p["dp"], 1), 0.0)


def after_the_schedule(lay: _Layout, states_buffers: np.ndarray, cached_copies: np.ndarray,
                       peak: _RankPeak) -> np.ndarray:
    """Bytes over states + activations at the gradient reduction after a pipelined schedule:
    FSDP2's buffers once REDUCE_GRAD has resharded the rank's chunks; without FSDP2 the flat
    gradient copy, with the activations gone and, since the schedule's autocast has exited,
    autocast's cached bf16 weight copies too."""
    return np.where(lay.fsdp, states_buffers - peak.gathered,
                    states_buffers - peak.activations - peak.recomputing - cached_copies)


def first_stage_transient(lay: _Layout, states_buffers: np.ndarray, cached_copies: np.ndarray,
                          peak: _RankPeak, at_embedding: np.ndarray, new_gradient: np.ndarray,
                          cast: np.ndarray, block_cast: np.ndarray, logits: np.ndarray,
                          unmade: np.ndarray) -> np.ndarray:
    """Bytes over states + activations at the first rank's peak, the largest of its moments.

    Pipelined FSDP2: the embedding's gradient cast or a block's new gradient (0 at least);
    pipelined without: under autocast a block's gradient cast or the embedding's (at the
    moments it is made), or the gradient reduction after the schedule
    (``after_the_schedule``). One stage: the loss's backward (logits - unmade gradients) or
    a block's (buffers or the cast, and the recomputed block's activations, which the
    loss's backward does not hold)."""
    recomputing = peak.recomputing
    fsdp_pipelined = np.max(np.broadcast_arrays(at_embedding, new_gradient - recomputing, 0.0),
                            axis=0)
    reduction = after_the_schedule(lay, states_buffers, cached_copies, peak)
    pipelined = np.where(lay.fsdp, fsdp_pipelined,
                         np.maximum(np.where(lay.autocast, np.maximum(block_cast, at_embedding),
                                             0.0), reduction))
    casts = np.where(lay.fsdp | lay.autocast, cast, 0.0)  # fp32 gradients need no cast
    at_loss = logits - unmade
    at_block = np.maximum(states_buffers, casts) + recomputing
    one_stage = np.maximum(at_loss, at_block) - recomputing
    return np.where(lay.one_stage, one_stage, pipelined)


def last_stage_transient(lay: _Layout, states_buffers: np.ndarray, cached_copies: np.ndarray,
                         root: np.ndarray, peak: _RankPeak, new_gradient: np.ndarray,
                         logits: np.ndarray) -> np.ndarray:
    """Bytes over states + activations at the last rank's peak: the largest of the loss's
    backward (logits at the replayed moments a backward of the loss's chunk begins:
    ``_RankPeak.end_over_peak``), a recomputed block's, a block's new gradient + c R (the
    head's, reduced after the whole backward) and the gradient reduction after the
    schedule."""
    reduction = after_the_schedule(lay, states_buffers, cached_copies, peak) + peak.recomputing
    with_head = new_gradient + np.where(lay.fsdp & ~lay.one_stage, lay.compute_bytes * root, 0.0)
    at_loss = logits + peak.end_over_peak
    moments = np.broadcast_arrays(at_loss, peak.recomputing, with_head, reduction)
    pipelined = np.max(moments, axis=0) - peak.recomputing
    return np.where(lay.one_stage, np.maximum(states_buffers, logits), pipelined)


def with_margins(bytes_: np.ndarray, reserved_gb: float, fragmentation: float) -> np.ndarray:
    """bytes x (1 + fragmentation) + reserved."""
    return bytes_ * (1 + fragmentation) + reserved_gb * GB


# --- the sum -----------------------------------------------------------------------------


def memory_breakdown(s: Shapes, c: dict[str, np.ndarray], reserved_gb: float = 0.0,
                     fragmentation: float = 0.0) -> dict[str, np.ndarray]:
    """Per-rank bytes (arrays over candidates) of the first and last pipeline stages and the peak.

    c: encoded plans (model.planner.shapes.encode). Keys returned (bytes): params_first,
    params_last; states_first, states_last (model states kept through the step);
    act_first, act_last (stored activations); transient_first, transient_last (the
    buffers or the logits at the peak); first, last and peak (their sums with the margins).
    """
    lay = _Layout.of(s, c)
    tp, pp, v = c["tp"], c["pp"], c["v"]
    cb = lay.compute_bytes
    unit = block_params(s, tp)
    layers_first, layers_last = stage_layer_counts(s, pp, v)
    root_first, root_last = root_params(s, tp, lay.one_stage)
    head = s.embedding_params / tp + s.d_model  # the output head and its norm
    params_first = layers_first * unit + root_first
    params_last = layers_last * unit + root_last
    head_first = np.where(lay.one_stage, head, 0.0)  # the first rank's root is the embedding
    cached_first = autocast_cached_copies(lay, layers_first, head_first)
    cached_last = autocast_cached_copies(lay, layers_last, head)
    states_first, buffers_first = model_states(lay, params_first, root_first, unit, head,
                                               cached_first)
    states_last, buffers_last = model_states(lay, params_last, root_last, unit, head,
                                             cached_last)
    received = receive_buffers(lay)
    logits = logit_bytes(lay)

    # Under pipelining the fp32 gradients (4 P) and FSDP2's gathered parameters (c P) are
    # counted at the replayed moment, not whole through the step.
    first_rank = np.zeros_like(pp)
    embedding_grad = full_vocab_embedding_grad(s, lay)
    states_first = states_first + np.where(lay.one_stage, embedding_grad, 0.0)
    grads_first = lay.pipelined(4 * (params_first - root_first))
    # FSDP2 never reshards a root unit after its forward, and a pipeline chunk is one: on a
    # one-chunk rank (whose schedule reshards nothing itself) and under zero3 (whose
    # forwards reshard only the blocks) the embedding stays gathered whole, the blocks as
    # the replay says.
    fsdp_pipelined = lay.fsdp & ~lay.one_stage
    root_stays = (lay.chunks == 1) | (c["shard"] == ZERO3)
    root_gathered_first = np.where(fsdp_pipelined & root_stays, cb * root_first, 0.0)
    gathered_first = np.where(fsdp_pipelined, cb * params_first, 0.0) - root_gathered_first
    # The embedding's gradient: without FSDP2 its first backward's is the kept one, a later
    # one's is added to it (two at once); FSDP2 accumulates even the first into a float32
    # copy of its own, so the kept one exists at every such moment.
    root_grad_first = lay.pipelined(4 * root_first + embedding_grad)
    # every held chunk forward's input but the first chunk's came from another rank
    peak_first = rank_peak(lay, first_rank, layers_first, grads_first, gathered_first,
                           lay.pipelined(1.0) * (v - 1) / lay.chunks, cached_first,
                           root_grad=root_grad_first, end=FIRST_CHUNK_ENDS,
                           root_grad_at_end=np.where(lay.fsdp, root_grad_first, 0.0))
    # The last rank's root belongs to its last chunk, the first to go backward: its fp32
    # gradient (from the first backward on) and gathered parameters are held whole, not as
    # a chunk's share.
    blocks_last = params_last - root_last
    root_held = lay.pipelined(np.where(lay.fsdp, cb, 0.0) * root_last)
    gathered_last = np.where(lay.fsdp & ~lay.one_stage, cb * blocks_last, 0.0)
    loss_graph = held_loss_graph(lay)
    peak_last = rank_peak(lay, pp - 1, layers_last, lay.pipelined(4 * blocks_last),
                          gathered_last, lay.pipelined(1.0), cached_last, loss_graph,
                          lay.pipelined(4 * root_last), end=LAST_CHUNK_BEGINS)
    act_first = peak_first.activations + peak_first.recomputing + received
    act_last = peak_last.activations + peak_last.recomputing + received
    states_first = (states_first - lay.pipelined(4 * params_first)
                    + lay.pipelined(peak_first.grads_and_gathered) + root_gathered_first)
    states_last = (states_last - lay.pipelined(4 * params_last)
                   + lay.pipelined(peak_last.grads_and_gathered) + root_held)

    # The first chunk's backwards end with the embedding's gradient made and cast: the
    # largest such moment, counted as what it adds over the replayed peak.
    cast = gradient_cast(s, lay, unit)
    at_embedding = peak_first.end_over_peak + cast - peak_first.recomputing
    new_gradient = new_block_gradient(lay, unit)
    transient_first = first_stage_transient(
        lay, buffers_first, cached_first, peak_first, at_embedding, new_gradient, cast,
        block_gradient_cast(lay, unit), logits,
        unmade_gradients(lay, params_first))
    transient_last = last_stage_transient(lay, buffers_last, cached_last, root_last, peak_last,
                                          new_gradient, logits - loss_graph)

    first = with_margins(states_first + transient_first + act_first, reserved_gb, fragmentation)
    last = with_margins(states_last + transient_last + act_last, reserved_gb, fragmentation)
    last = np.where(lay.one_stage, first, last)  # one stage: the first rank is also the last
    return {
        "params_first": params_first, "params_last": params_last,
        "states_first": states_first, "states_last": states_last,
        "act_first": act_first, "act_last": act_last,
        "transient_first": transient_first, "transient_last": transient_last,
        "first": first, "last": last, "peak": np.maximum(first, last),
    }


def peak_memory_gb(s: Shapes, plan: Any, cluster: Any = None) -> float:
    """Peak bytes (GB) per rank of one Plan; cluster supplies reserved memory and fragmentation."""
    from model.planner.shapes import encode

    res = memory_breakdown(s, encode([plan]), getattr(cluster, "reserved_gb", 0.0),
                           getattr(cluster, "fragmentation", 0.0))
    return float(res["peak"][0]) / GB
