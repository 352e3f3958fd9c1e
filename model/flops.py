"""The one parameter count and the one FLOP count of model.gpt.GPT (no torch needed).

Parameters, by part (``GPTParams``): per block the attention and MLP matrices, the neox
biases and the two norms; the input embedding (vocab x d_model, a lookup), the final norm
and the untied output head (vocab x d_model).

FLOPs per token (forward + backward, matmuls only; Kaplan et al. / PaLM appendix B):

    flops_per_token = 6 * N + 12 * n_layers * d_model * seq_len

where N is the number of non-embedding parameters (all transformer blocks, final norm and
the output head; the input embedding is a lookup, not a matmul) and the second term is
the attention score and value products (QK^T and AV: 2 matmuls x 2 FLOPs x 3 for
forward+backward = 12 per layer per d_model per key position). Recompute FLOPs from
activation checkpointing are NOT counted: this is model FLOPs utilisation (MFU), not
hardware FLOPs utilisation. The trainer's measured MFU and the planner's predicted MFU
both use this count.
"""
from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig

# Dense bf16 peak TFLOP/s per device (per GCD for MI250X). CPU: a nominal figure; pass the
# real number as spec["peak_tflops"] when it matters.
PEAK_TFLOPS = {"h200": 989.0, "h100": 989.0, "a100": 312.0, "mi250x": 191.5, "mi300x": 1307.0,
               "cpu": 0.1}


@dataclass(frozen=True)
class GPTParams:
    """Parameter counts of model.gpt.GPT by part (see module docstring)."""

    n_layers: int
    d_model: int
    block_matrices: int
    """Weights of one block's matrices: wq, wk, wv, wo and the MLP (split by tensor parallelism)."""
    block_biases: int
    """Biases of one block (neox: q, k, v, o and the MLP; llama: none)."""
    block_norms: int
    """Norm parameters of one block (two norms; replicated over tensor parallelism)."""
    final_norm: int
    """The norm after the last block."""
    embedding: int
    """The input token embedding (vocab x d_model)."""
    output: int
    """The untied output head (d_model x vocab)."""

    @classmethod
    def of(cls, *, n_layers: int, d_model: int, n_heads: int, kv_heads: int, ffn: int,
           vocab: int, family: str) -> GPTParams:
        """Counts for a GPT of these dimensions; ``family`` is 'llama' or 'neox'."""
        if family not in ("llama", "neox"):
            raise ValueError(f"model.family={family!r} is not one of ('llama', 'neox')")
        neox = family == "neox"
        hd = d_model // n_heads
        q_o, kv = n_heads * hd, kv_heads * hd
        matrices = 2 * d_model * q_o + 2 * d_model * kv + (2 if neox else 3) * d_model * ffn
        biases = (q_o + 2 * kv + d_model + ffn + d_model) if neox else 0
        norm = 2 * d_model if neox else d_model  # LayerNorm weight + bias, RMSNorm weight
        return cls(n_layers=n_layers, d_model=d_model, block_matrices=matrices,
                   block_biases=biases, block_norms=2 * norm, final_norm=norm,
                   embedding=vocab * d_model, output=vocab * d_model)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> GPTParams:
        """Counts for ``model.gpt.GPT(cfg)``."""
        return cls.of(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                      kv_heads=cfg.kv_heads, ffn=cfg.ffn_dim, vocab=cfg.vocab_size,
                      family=cfg.family)

    @property
    def block(self) -> int:
        """All parameters of one transformer block."""
        return self.block_matrices + self.block_biases + self.block_norms

    def total(self, include_embedding: bool = True) -> int:
        """All parameters (without the input embedding when ``include_embedding`` is False)."""
        body = self.n_layers * self.block + self.final_norm + self.output
        return body + (self.embedding if include_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training model FLOPs per token at ``seq_len`` (see module docstring)."""
        return (6.0 * self.total(include_embedding=False)
                + 12.0 * self.n_layers * self.d_model * seq_len)


def param_count(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Exact parameter count of model.gpt.GPT(cfg)."""
    return GPTParams.from_config(cfg).total(include_embedding)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training model FLOPs per token (see module docstring)."""
    return GPTParams.from_config(cfg).flops_per_token(seq_len)


def default_peak_tflops(device_type: str, device_name: str = "") -> float:
    """Best-known bf16 peak for a device name (falls back to the CPU nominal figure)."""
    name = device_name.lower().replace(" ", "")
    for key, value in PEAK_TFLOPS.items():
        if key != "cpu" and key in name:
            return value
    return PEAK_TFLOPS["cpu"] if device_type == "cpu" else 989.0
