"""Model FLOPs per token and device peaks, for tokens/s -> TFLOP/s -> MFU.

Formula (per token, forward + backward, matmuls only; Kaplan et al. / PaLM appendix B):

    flops_per_token = 6 * N + 12 * n_layers * d_model * seq_len

where N is the number of non-embedding parameters (all transformer blocks, final norm and
the output head; the input embedding is a lookup, not a matmul) and the second term is
the attention score and value products (QK^T and AV: 2 matmuls x 2 FLOPs x 3 for
forward+backward = 12 per layer per d_model per key position). Recompute FLOPs from
activation checkpointing are NOT counted: this is model FLOPs utilisation (MFU), not
hardware FLOPs utilisation.
"""
from __future__ import annotations

from model.config import ModelConfig

# Dense bf16 peak TFLOP/s per device (per GCD for MI250X). CPU: a nominal figure; pass the
# real number as spec["peak_tflops"] when it matters.
PEAK_TFLOPS = {"h200": 989.0, "h100": 989.0, "a100": 312.0, "mi250x": 191.5, "mi300x": 1307.0, "cpu": 0.1}


def param_count(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Exact parameter count of model.gpt.GPT(cfg)."""
    d, f, hd = cfg.d_model, cfg.ffn_dim, cfg.head_dim
    neox = cfg.family == "neox"
    attn = d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2
    if neox:
        attn += cfg.n_heads * hd + 2 * cfg.kv_heads * hd + d  # q, k, v, o biases
    mlp = 2 * d * f + (d * f if not neox else f + d)
    norm = 2 * d if neox else d
    block = attn + mlp + 2 * norm
    total = cfg.n_layers * block + norm + d * cfg.vocab_size
    return total + (d * cfg.vocab_size if include_embedding else 0)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training model FLOPs per token (see module docstring)."""
    return 6.0 * param_count(cfg, include_embedding=False) + 12.0 * cfg.n_layers * cfg.d_model * seq_len


def default_peak_tflops(device_type: str, device_name: str = "") -> float:
    """Best-known bf16 peak for a device name (falls back to the CPU nominal figure)."""
    name = device_name.lower().replace(" ", "")
    for key, value in PEAK_TFLOPS.items():
        if key != "cpu" and key in name:
            return value
    return PEAK_TFLOPS["cpu"] if device_type == "cpu" else 989.0
