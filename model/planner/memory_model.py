"""Peak memory per rank of a training step under a parallel plan.

Model states (bytes per parameter held by a rank; c = 2 for bf16 mixed precision,
4 for fp32; mixed precision adds a 4-byte fp32 master copy):

- none / ddp: params c + grads c + master + Adam m, v (8) = 16 B, all replicated;
  DDP adds its gradient buckets (another c).
- zero2 (FSDP2, reshard_after_forward=False, gradients accumulated unsharded and
  reduce-scattered once per step): unsharded params c + unsharded grads c, plus sharded
  fp32 params/master 4 + fp32 grads 4 + Adam 8 over dp.
- zero3 (FSDP2 resharding after forward, reduce-scatter per micro-batch): the same 16 B
  sharded over dp, plus the unsharded params of two blocks (one computing, one prefetched)
  and the unsharded grads of one block.

Activations per block and micro-batch follow Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models"), counted per stored tensor and
without dropout masks (this GPT has no dropout): norm inputs and the attention/MLP inputs
(s*b*h each, divided by tp under sequence parallelism), q/k/v and the attention output
(divided by tp), the s*s score matrix a*s^2*b/tp unless a flash kernel is used (selective
recompute drops it), and the MLP's intermediate tensors (2 or 4 of s*b*ffn/tp). Full
recompute keeps only each block's input, plus one block's activations while it is
recomputed. Backward adds transients: the activation gradients of the block being
differentiated (about its full activation set) and, on the last stage, the logits'
gradient. The pipeline schedule decides how many micro-batches are in flight on the first
stage: all m for GPipe, pp for 1F1B, and for interleaved 1F1B (pp-1)*2 + (v-1)*pp + 1
chunks of L/(pp*v) layers (Megatron's warm-up count). The last stage also keeps logits (c)
and their fp32 log-softmax for every in-flight micro-batch (and once more for the gradient).
Everything is multiplied by (1 + fragmentation) and the cluster's reserved memory is added.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from model.planner.shapes import (
    DDP,
    GPIPE,
    INTERLEAVED,
    NOSHARD,
    REC_FULL,
    REC_NONE,
    ZERO2,
    ZERO3,
    Shapes,
)

GB = 1e9


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


def in_flight(pp: np.ndarray, ga: np.ndarray, sched: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Micro-batch activations (in units of a full stage's layers) held by the first stage."""
    gpipe = ga.astype(float)
    onef = np.minimum(pp, ga).astype(float)
    chunks = np.minimum(ga * v, (pp - 1) * 2 + (v - 1) * pp + 1)
    inter = chunks / np.maximum(v, 1)
    out = np.where(sched == GPIPE, gpipe, np.where(sched == INTERLEAVED, inter, onef))
    return np.where(pp == 1, 1.0, out)


def activation_elems_per_layer(s: Shapes, mb: np.ndarray, tp: np.ndarray, sp: np.ndarray,
                               rec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(stored elements per block per micro-batch, elements of one block while recomputed)."""
    sbh = s.seq_len * mb * s.d_model
    spf = np.where(sp == 1, 1.0 / tp, 1.0)
    hd = s.head_dim
    norms_and_inputs = 4 * sbh * spf  # 2 norm inputs + attention input + MLP input
    qkv = s.seq_len * mb * (s.n_heads * hd + 2 * s.kv_heads * hd) / tp
    attn_out = sbh / tp
    scores = 0.0 if s.flash_attention else s.n_heads * s.seq_len ** 2 * mb / tp
    # flash kernels keep a fp32 log-sum-exp per (head, position)
    lse = s.n_heads * s.seq_len * mb / tp * (4 / s.act_bytes) if s.flash_attention else 0.0
    mlp = (4 if s.llama else 2) * s.seq_len * mb * s.ffn / tp
    full = norms_and_inputs + qkv + attn_out + lse + mlp + scores
    selective = full - scores
    stored = np.where(rec == REC_NONE, full, np.where(rec == REC_FULL, sbh * spf, selective))
    # backward of one block holds gradients of its activations (about its full set), and
    # under full recompute also the recomputed activations themselves
    transient = np.where(rec == REC_FULL, 2 * full, full)
    return stored, transient


def memory_breakdown(s: Shapes, c: dict[str, np.ndarray], reserved_gb: float = 0.0,
                     fragmentation: float = 0.0) -> dict[str, np.ndarray]:
    """Per-rank bytes (arrays over candidates) of the first and last pipeline stages and the peak.

    c: encoded plans (model.planner.shapes.encode). Keys returned: params_first, params_last,
    states_first, states_last, act_first, act_last, first, last, peak (all bytes).
    """
    tp, pp, dp, mb, ga = c["tp"], c["pp"], c["dp"], c["mb"], c["ga"]
    sched, v, shard, rec, sp = c["sched"], c["v"], c["shard"], c["rec"], c["sp"]
    cb = s.act_bytes
    mixed = s.dtype == "bfloat16"
    layer_p = s.layer_matrix_params / tp + s.layer_norm_params
    emb_p = s.embedding_params / tp
    n_first, n_last = stage_layer_counts(s, pp, v)
    single = pp == 1
    params_first = n_first * layer_p + emb_p + np.where(single, emb_p + s.d_model, 0.0)
    params_last = n_last * layer_p + emb_p + s.d_model

    full_state = 2 * cb + (4 if mixed else 0) + 8  # = 16 B/param either way
    sharded_state = 4 + 4 + 8  # fp32 params/master, fp32 grads, Adam m and v
    unit = np.maximum(layer_p, emb_p)  # largest FSDP unit (a block or the embedding/output)

    def states(params: np.ndarray) -> np.ndarray:
        replicated = params * full_state + np.where(shard == DDP, params * cb, 0.0)
        zero2 = params * 2 * cb + params * sharded_state / dp
        zero3 = params * sharded_state / dp + unit * 3 * cb
        out = np.where(shard == ZERO3, zero3, np.where(shard == ZERO2, zero2, replicated))
        return np.where(shard == NOSHARD, params * full_state, out)

    stored, transient = activation_elems_per_layer(s, mb, tp, sp, rec)
    flight = in_flight(pp, ga, sched, v)
    act_first = (flight * n_first * stored + transient) * cb
    logits = s.seq_len * mb * s.vocab / tp * (cb + 4)
    last_flight = np.where(sched == GPIPE, ga, 1)
    last_flight = np.where(single, 1, last_flight)
    # logits and their fp32 log-softmax per in-flight micro-batch, plus their gradients
    act_last = (last_flight * n_last * stored + transient) * cb + (last_flight + 1) * logits
    act_first = act_first + np.where(single, 2 * logits, 0.0)

    st_first, st_last = states(params_first), states(params_last)
    first = (st_first + act_first) * (1 + fragmentation) + reserved_gb * GB
    last = (st_last + act_last) * (1 + fragmentation) + reserved_gb * GB
    last = np.where(single, first, last)  # one stage: the first rank is also the last
    return {
        "params_first": params_first, "params_last": params_last,
        "states_first": st_first, "states_last": st_last,
        "act_first": act_first, "act_last": act_last,
        "first": first, "last": last, "peak": np.maximum(first, last),
    }


def peak_memory_gb(s: Shapes, plan: Any, cluster: Any = None) -> float:
    """Peak bytes (GB) per rank of one Plan; cluster supplies reserved memory and fragmentation."""
    from model.planner.shapes import encode

    res = memory_breakdown(s, encode([plan]), getattr(cluster, "reserved_gb", 0.0),
                           getattr(cluster, "fragmentation", 0.0))
    return float(res["peak"][0]) / GB
