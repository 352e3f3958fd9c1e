"""Model shapes and plan encodings shared by the memory model, time model and search.

``Shapes`` holds the few numbers of a GPT that the models need (layers, hidden size,
heads, vocabulary, sequence length, dtype). ``encode`` turns plans into numpy arrays so
that the models evaluate thousands of candidate plans at once.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from model.flops import GPTParams
from model.parallel.layout import RECOMPUTES, SCHEDULES, SHARDINGS, Plan

# Integer codes used in the vectorised models (index into the tuples in model.parallel.layout).
GPIPE, ONEF1B, INTERLEAVED = (SCHEDULES.index(s) for s in ("gpipe", "1f1b", "interleaved_1f1b"))
ZERO3, ZERO2, DDP, NOSHARD = (SHARDINGS.index(s) for s in ("zero3", "zero2", "ddp", "none"))
REC_NONE, REC_SEL, REC_FULL = (RECOMPUTES.index(s) for s in ("none", "selective", "full"))


def fsdp_sharded(c: dict[str, np.ndarray]) -> np.ndarray:
    """``model.config.shards_with_fsdp`` over encoded plans ``c``."""
    return ((c["shard"] == ZERO2) | (c["shard"] == ZERO3)) & (c["dp"] > 1)


@dataclass(frozen=True)
class Shapes:
    """The dimensions of a decoder-only GPT that memory and time depend on."""

    n_layers: int
    d_model: int
    n_heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    llama: bool = True
    """SwiGLU MLP (3 matrices) when True, GELU MLP (2 matrices) when False."""
    dtype: str = "bfloat16"
    """Compute dtype: 'bfloat16' (mixed precision, fp32 master weights) or 'float32'."""
    flash_attention: bool = True
    """Attention kernel keeps no s x s score matrix (SDPA flash/memory-efficient)."""
    eager: bool = False
    """The blocks' elementwise work runs as separate eager PyTorch kernels (not
    torch.compile'd, no hand-fused kernels): priced on GPU clusters by
    ``time_model.eager_block_bytes``."""
    eager_loss: bool = False
    """The loss is eager ``cross_entropy(logits.float(), ...)`` (fp32 cast, log-softmax and
    their backward as separate kernels): priced on GPU clusters by
    ``time_model.EAGER_LOSS_BYTES``."""
    on_cpu: bool = False
    """The ranks run on the CPU (the measured local cluster), whose loss backward keeps one
    more float32 s x b x V tensor than a GPU's (``memory_model.logit_bytes``)."""
    parallel_residual: bool = False
    """Attention and MLP read one normed input each from the same residual (GPT-NeoX's
    ``use_parallel_residual``): one saved norm input per block, not two."""
    partial_rotary: bool = False
    """Rotary embeddings turn only part of each head (neox ``rotary_fraction`` < 1): q is
    rebuilt by a concatenation in head-major layout, attention's output follows it, and the
    output projection saves a row-major copy (``memory_model.activation_elems_per_layer``)."""
    attention_head_dim: int = 0
    """Per-head width of q, k and v where it is not d_model / n_heads (0: it is)."""
    rotary_dim: int = 0
    """Dims of each head rotary embeddings turn, the width of its cos and sin tables (0:
    the whole head)."""
    qkv_bias: bool = False
    """Llama with q, k and v biases (``model.qkv_bias``; neox has every bias anyway)."""
    qk_norm: bool = False
    """An RMSNorm over each q and k head (``model.qk_norm``): two more norm weights a block."""
    tied: bool = False
    """The input embedding and the output head are one weight (``model.tie_embeddings``):
    one parameter without pipeline stages; with them the last stage holds a copy whose
    gradient is summed with the embedding's over an embedding group."""

    @classmethod
    def from_configs(cls, model_cfg: Any, train_cfg: Any, cluster: Any = None) -> Shapes:
        """Build from model.config.ModelConfig and TrainConfig, for this trainer on ``cluster``.

        This project's blocks run eager unless ``train.compile`` (which compiles the blocks,
        not the loss: model.training.trainer.cross_entropy stays eager). The attention
        kernel is the cluster's ``attention_kernel`` (flash when no cluster is given)."""
        flash_attention = getattr(cluster, "attention_kernel", "flash") == "flash"
        return cls(
            n_layers=model_cfg.n_layers, d_model=model_cfg.d_model, n_heads=model_cfg.n_heads,
            kv_heads=model_cfg.kv_heads, ffn=model_cfg.ffn_dim, vocab=model_cfg.vocab_size,
            seq_len=train_cfg.seq_len, llama=model_cfg.family == "llama", dtype=train_cfg.dtype,
            flash_attention=flash_attention, eager=not getattr(train_cfg, "compile", False),
            tied=bool(getattr(model_cfg, "tie_embeddings", False)),
            attention_head_dim=getattr(model_cfg, "attention_head_dim", None) or 0,
            qkv_bias=bool(getattr(model_cfg, "qkv_bias", False)),
            qk_norm=bool(getattr(model_cfg, "qk_norm", False)),
            parallel_residual=bool(getattr(model_cfg, "parallel_residual", False)),
            partial_rotary=getattr(model_cfg, "rotary_fraction", 1.0) < 1.0,
            rotary_dim=getattr(model_cfg, "rotary_dim", 0),
            on_cpu=getattr(cluster, "device_type", "cuda") == "cpu",
            eager_loss=True,
        )

    @property
    def head_dim(self) -> int:
        """Per-head width of q, k and v."""
        return self.attention_head_dim or self.d_model // self.n_heads

    @property
    def rope_width(self) -> int:
        """Width of the rotary cos and sin tables."""
        return self.rotary_dim or self.head_dim

    @property
    def act_bytes(self) -> int:
        """Bytes per activation / compute-copy element."""
        return 2 if self.dtype == "bfloat16" else 4

    @property
    def params(self) -> GPTParams:
        """Parameter counts by part (model.flops, the one parameter formula)."""
        return GPTParams.of(n_layers=self.n_layers, d_model=self.d_model, n_heads=self.n_heads,
                            kv_heads=self.kv_heads, ffn=self.ffn, vocab=self.vocab,
                            family="llama" if self.llama else "neox", head_dim=self.head_dim,
                            qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)

    @property
    def layer_matrix_params(self) -> int:
        """Weights of one block's matrices (split by tensor parallelism).

        The memory and time models leave out the neox biases (under 0.1% of a block).
        """
        return self.params.block_matrices

    @property
    def layer_norm_params(self) -> int:
        """Norm weights of one block (replicated over tensor parallelism)."""
        return self.params.block_norms

    @property
    def embedding_params(self) -> int:
        return self.params.embedding

    @property
    def total_params(self) -> int:
        """All parameters of the GPT: blocks, embedding, final norm and untied output layer."""
        return self.params.total()

    def model_flops_per_token(self) -> float:
        """Training model FLOPs per token without recompute (model.flops)."""
        return self.params.flops_per_token(self.seq_len)


COLUMNS: tuple[str, ...] = ("tp", "pp", "dp", "mb", "ga", "sched", "v", "shard", "rec", "rl",
                             "sp")
"""The encoded plan's columns, in row order: the Plan fields tp, pp, dp, micro_batch,
grad_accum, schedule (code), virtual_stages, sharding (code), recompute (code),
recompute_layers and sequence_parallel (0/1)."""


def columns(rows: list[tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Rows of ``COLUMNS`` values as a dict of int arrays, one per column."""
    arr = np.array(rows, dtype=np.int64).reshape(-1, len(COLUMNS))
    return {n: arr[:, i] for i, n in enumerate(COLUMNS)}


def encode(plans: Iterable[Plan]) -> dict[str, np.ndarray]:
    """Plans as a dict of int arrays keyed by ``COLUMNS``."""
    return columns([(p.tp, p.pp, p.dp, p.micro_batch, p.grad_accum, SCHEDULES.index(p.schedule),
                     p.virtual_stages, SHARDINGS.index(p.sharding), RECOMPUTES.index(p.recompute),
                     p.recompute_layers, int(p.sequence_parallel)) for p in plans])


def decode(c: dict[str, np.ndarray], i: int) -> Plan:
    """Row i of encoded candidates as a Plan."""
    return Plan(tp=int(c["tp"][i]), pp=int(c["pp"][i]), dp=int(c["dp"][i]),
                micro_batch=int(c["mb"][i]), grad_accum=int(c["ga"][i]),
                schedule=SCHEDULES[int(c["sched"][i])], virtual_stages=int(c["v"][i]),
                sharding=SHARDINGS[int(c["shard"][i])], recompute=RECOMPUTES[int(c["rec"][i])],
                recompute_layers=int(c["rl"][i]), sequence_parallel=bool(c["sp"][i]))
