"""The one parameter count and the one FLOP count of model.gpt.GPT (no torch needed).

Parameters, by part (``GPTParams``): per block the attention and MLP matrices, the neox
biases and the two norms; the input embedding (vocab x d_model, a lookup), the final norm
and the untied output head (vocab x d_model).

FLOPs per token (forward + backward, matmuls only; Kaplan et al. / PaLM appendix B, with
causal attention counted as the model computes it):

    flops_per_token = 6 * N + 6 * n_layers * n_heads * head_dim * seq_len

where N is the number of non-embedding parameters (all transformer blocks, final norm and
the output head; the input embedding is a lookup, not a matmul) and the second term is
the attention score and value products (QK^T and AV: 2 matmuls x 2 FLOPs x 3 for
forward+backward = 12 per layer per query width, n_heads x head_dim (d_model unless
``attention_head_dim`` says otherwise), per key position), halved because the model's
attention is causal: a token attends to the keys up to its own, seq_len / 2 of them on
average, and the fused kernel (``scaled_dot_product_attention(is_causal=True)``) skips the
masked half, as the planner's time model prices it. PaLM's full 12 counts the masked
products as work done: with attention dominating a long sequence the "MFU" would then
approach twice the kernels' efficiency and pass 100 %. Recompute FLOPs from activation
checkpointing are NOT counted: this is model FLOPs utilisation (MFU), not hardware FLOPs
utilisation. The trainer's measured MFU and the planner's predicted MFU both use this count.
"""
from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig
from model.parallel.threads import THREADS_VAR

# Dense bf16 peak TFLOP/s per device (per GCD for MI250X), from the vendors' data sheets.
# A CPU's peak is computed from the machine (``cpu_peak_tflops``).
PEAK_TFLOPS = {"h200": 989.0, "h100": 989.0, "a100": 312.0, "mi250x": 191.5, "mi300x": 1307.0}

CPU_FLOPS_PER_CYCLE = (("amx_bf16", True, 1024), ("avx512_bf16", True, 128),
                       ("avx512f", False, 64), ("avx2", False, 32), ("avx", False, 16))
"""(cpuinfo flag, bf16 only, FLOPs per cycle per core), widest first: two FMA units of the
vector width (avx512f: 2 x 16 fp32 lanes x 2), AMX's bf16 tiles 1,024. The first flag a CPU
has gives its rate (no flag known: 64); a bf16 row counts only for bfloat16 training."""

CPU_CLOCK_FALLBACK_GHZ = 5.0
"""Clock assumed when the machine does not say (above any CPU's): the peak stays a bound."""


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
    attention_width: int = 0
    """n_heads x head_dim: the width of the attention's products (d_model when 0)."""

    @classmethod
    def of(cls, *, n_layers: int, d_model: int, n_heads: int, kv_heads: int, ffn: int,
           vocab: int, family: str, head_dim: int | None = None, qkv_bias: bool = False,
           qk_norm: bool = False) -> GPTParams:
        """Counts for a GPT of these dimensions; ``family`` is 'llama' or 'neox';
        ``head_dim`` defaults to d_model / n_heads; ``qkv_bias`` (llama: q, k and v biases;
        neox has all its biases) and ``qk_norm`` (one RMSNorm weight of head_dim for q and
        one for k) as ``model.config.ModelConfig`` has them."""
        if family not in ("llama", "neox"):
            raise ValueError(f"model.family={family!r} is not one of ('llama', 'neox')")
        neox = family == "neox"
        hd = head_dim or d_model // n_heads
        q_o, kv = n_heads * hd, kv_heads * hd
        matrices = 2 * d_model * q_o + 2 * d_model * kv + (2 if neox else 3) * d_model * ffn
        if neox:
            biases = q_o + 2 * kv + d_model + ffn + d_model
        else:
            biases = q_o + 2 * kv if qkv_bias else 0
        norm = 2 * d_model if neox else d_model  # LayerNorm weight + bias, RMSNorm weight
        return cls(n_layers=n_layers, d_model=d_model, block_matrices=matrices,
                   block_biases=biases, block_norms=2 * norm + (2 * hd if qk_norm else 0),
                   final_norm=norm, embedding=vocab * d_model, output=vocab * d_model,
                   attention_width=q_o)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> GPTParams:
        """Counts for ``model.gpt.GPT(cfg)``."""
        return cls.of(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                      kv_heads=cfg.kv_heads, ffn=cfg.ffn_dim, vocab=cfg.vocab_size,
                      family=cfg.family, head_dim=cfg.head_dim, qkv_bias=cfg.qkv_bias,
                      qk_norm=cfg.qk_norm)

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
        width = self.attention_width or self.d_model
        return (6.0 * self.total(include_embedding=False)
                + 6.0 * self.n_layers * width * seq_len)  # causal: half of PaLM's 12


def param_count(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Exact parameter count of model.gpt.GPT(cfg)."""
    return GPTParams.from_config(cfg).total(include_embedding)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training model FLOPs per token (see module docstring)."""
    return GPTParams.from_config(cfg).flops_per_token(seq_len)


def default_peak_tflops(device_type: str, device_name: str = "",
                        dtype: str = "bfloat16") -> float:
    """The peak MFU is measured against: a GPU's dense bf16 peak by its name (989 for an
    unknown GPU), a CPU's from this machine at ``dtype`` (``cpu_peak_tflops``)."""
    if device_type == "cpu":
        return cpu_peak_tflops(dtype)
    name = device_name.lower().replace(" ", "")
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    return 989.0


def cpu_peak_tflops(dtype: str = "float32", threads: int | None = None,
                    cpuinfo: str | None = None) -> float:
    """Peak TFLOP/s of one CPU rank: its cores (``threads``, default OMP_NUM_THREADS capped by
    the cores this process may use) x the fastest clock the machine reports x the FLOPs per
    cycle of its widest vector unit for ``dtype`` (``CPU_FLOPS_PER_CYCLE``). A bound no run
    can pass, where the planner's measured rate (a block's speed with every rank busy,
    ``configs/clusters/local.yaml``) is one a quieter machine beats: MFU against it read
    108 % on this machine. ``cpuinfo``: /proc/cpuinfo's text (read when None)."""
    import os
    import re

    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as file:
                cpuinfo = file.read()
        except OSError:
            cpuinfo = ""
    found = re.search(r"^flags\s*:(.*)$", cpuinfo, re.M)
    flags = set(found.group(1).split()) if found else set()
    per_cycle = next((rate for flag, bf16_only, rate in CPU_FLOPS_PER_CYCLE
                      if flag in flags and (dtype == "bfloat16" or not bf16_only)), 64)
    mhz = [float(v) for v in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", cpuinfo, re.M)]
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as file:
            mhz.append(int(file.read()) / 1000)  # kHz
    except (OSError, ValueError):
        pass
    ghz = max(mhz) / 1000 if mhz else CPU_CLOCK_FALLBACK_GHZ
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if threads is None:  # a rank runs the threads its launcher exported (model.parallel.threads)
        wanted = os.environ.get(THREADS_VAR, "")
        threads = int(wanted) if wanted.isdigit() and int(wanted) > 0 else (cores or 1)
    threads = max(1, min(threads, cores or threads))
    return ghz * per_cycle * threads / 1e3
