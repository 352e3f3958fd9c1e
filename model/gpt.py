"""A decoder-only GPT in two families, readable top to bottom.

- ``llama``: RMSNorm, SwiGLU MLP (w1 gate, w3 up, w2 down), rotary, optional grouped-query
  attention (``n_kv_heads``), no biases.
- ``neox``: LayerNorm, GELU MLP (w1 up, w2 down), rotary, biases, optional parallel
  residual (attention and MLP read the same input and are summed).

What today's open models add, each a ModelConfig field whose default leaves the model as it
was: ``rope_scaling`` ('linear', or Llama 3.1's 'llama3' frequency-dependent scaling of the
inverse frequencies), ``tie_embeddings`` (the head *is* the embedding: one Parameter),
``qkv_bias`` (Qwen2: q/k/v biases, none on wo), ``qk_norm`` (Qwen3: RMSNorm over head_dim
of each q and k head, before rotary) and ``attention_head_dim`` (heads x head_dim need not
be d_model).

Parameter names follow the Meta/torchtitan LLaMA layout (``tok_embeddings``,
``layers.<i>.attention.{wq,wk,wv,wo}``, ``layers.<i>.feed_forward.{w1,w2,w3}``,
``layers.<i>.attention_norm``, ``layers.<i>.ffn_norm``, ``norm``, ``output``) so an HF
export is a rename (plus a q/k/v concatenation for GPT-NeoX's fused ``query_key_value``).

Rotary convention: HF "rotate_half" (the head dim is split into two halves, not
interleaved pairs): ``q' = q * cos + rotate_half(q) * sin`` with
``cos = cat(cos(pos * inv_freq), cos(pos * inv_freq))``. This is what HF
LlamaForCausalLM and GPTNeoXForCausalLM compute, so exported weights need no permutation.
Partial rotary (neox ``rotary_fraction`` < 1, GPT-NeoX's ``rotary_pct``, Pythia's 0.25)
rotates only the first ``cfg.rotary_dim`` dims of each head, with tables (and inv_freq) built
for that many dims, and passes the rest through, as HF GPT-NeoX does.

The model is built on the meta device, parallelised, materialised with ``to_empty`` and
then initialised by ``init_weights(seed)``: each parameter is drawn from a generator seeded
by (seed, parameter name) over its *full* shape, then the local shard is kept, so every
parallel layout starts from bit-identical weights.

Layers live in an ``nn.ModuleDict`` keyed "0".."n-1"; a pipeline stage deletes the layers it
does not own and sets ``tok_embeddings`` / ``norm`` / ``output`` to None where absent.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch._dynamo  # noqa: F401 - see below
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.config import ModelConfig

# torch._dynamo is imported here, with the model, not by its first initialisation: nn.init
# under a device context runs torch._refs, which imports it (about 1 CPU-second). Imported
# before a local launch forks its ranks, it is paid once per launch, not once per rank.


# --------------------------------------------------------------------------------------
# Rotary position embedding
# --------------------------------------------------------------------------------------
def rotary_tables(head_dim: int, max_seq_len: int, theta: float,
                  inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim] in the HF rotate_half layout (float32).

    ``head_dim`` is the number of dims rotated: the model passes ``cfg.rotary_dim``.
    ``inv_freq`` [head_dim / 2] replaces the plain ``theta ** (-2i / head_dim)`` (scaled rope).
    """
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    pos = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # [S, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, hd]
    return emb.cos(), emb.sin()


def rotary_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The inverse frequencies [rotary_dim / 2] (float32) of ``cfg``, scaled as
    ``cfg.rope_scaling`` says, with HF's ``modeling_rope_utils`` arithmetic op for op."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths (low frequencies) slowed by `factor`, short ones kept, a
    # smooth mix in between (wavelength between old_len / high and old_len / low).
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_seq_len
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's cos/sin tables [max_seq_len, rotary_dim]: ``rotary_tables`` with
    ``cfg``'s (possibly scaled) inverse frequencies. Plain rope gives rotary_tables' bits."""
    inv_freq = None if cfg.rope_scaling == "none" else rotary_inv_freq(cfg)
    return rotary_tables(cfg.rotary_dim, cfg.max_seq_len, cfg.rope_theta, inv_freq)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., hd] -> [..., hd]: (x1, x2) -> (-x2, x1) on the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd]; cos/sin [T, r] -> x [B, H, T, hd] (same dtype as x) with its first
    r dims rotated and the other hd - r passed through (r = hd: the whole head)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


# --------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------
def make_norm(cfg: ModelConfig) -> nn.Module:
    """RMSNorm for llama, LayerNorm (with bias) for neox."""
    if cfg.family == "llama":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention with rotary embeddings.

    Under tensor parallelism wq/wk/wv are column-sharded and wo row-sharded, so this module
    sees only its local heads; every reshape therefore uses -1 for the head count. With
    ``qk_norm`` each q and k head is RMS-normalised over its head_dim (one weight shared by
    all heads) before rotary, as Qwen3 does.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        bias = cfg.family == "neox"
        qkv_bias = bias or cfg.qkv_bias
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.kv_heads  # query heads per key/value head
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=bias)
        self.q_norm: nn.RMSNorm | None = None
        self.k_norm: nn.RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
            self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.recompute_core = False  # selective recompute: redo rotary + SDPA in backward

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
        """Rotary + causal attention: q [B, H, T, hd], k/v [B, KV, T, hd] -> [B, H, T, hd]."""
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Query head h reads key/value head h // n_rep (HF repeat_kv convention).
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_rep > 1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, D], cos/sin [max_seq_len, rotary_dim] -> [B, T, D]."""
        bsz, seqlen, _ = x.shape  # full T even under sequence parallelism (input gathered)
        cos, sin = cos[:seqlen], sin[:seqlen]  # [T, rotary_dim]
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)  # [B, T, H, hd]
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)  # [B, T, KV, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over hd, per head
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, hd], [B, KV, T, hd]
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)  # [B, KV, T, hd]
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self._core, q, k, v, cos, sin, use_reentrant=False)
        else:
            out = self._core(q, k, v, cos, sin)  # [B, H, T, hd]
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)  # [B, T, H*hd]
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU (llama: w2(silu(w1 x) * w3 x)) or GELU MLP (neox: w2(gelu(w1 x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.family = cfg.family
        bias = cfg.family == "neox"
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=bias)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=bias)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False) if cfg.family == "llama" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D] (inner activations [B, T, ffn])."""
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: sequential (x + attn, then + mlp) or neox parallel residual.

    ``recompute`` (full) and ``attention.recompute_core`` (selective) are set by
    ``model.parallel.parallelize.apply_activation_checkpointing``: the block's (or only the
    attention core's) activations are recomputed in backward with torch.utils.checkpoint.
    Keeping them attributes (not wrapper modules) keeps parameter names unchanged.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.parallel_residual = cfg.parallel_residual
        self.attention_norm = make_norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = make_norm(cfg)
        self.feed_forward = FeedForward(cfg)
        self.recompute = False

    def _block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.parallel_residual:
            return x + self.attention(self.attention_norm(x), cos, sin) + self.feed_forward(
                self.ffn_norm(x)
            )
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._block, x, cos, sin, use_reentrant=False)
        return self._block(x, cos, sin)


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------
class GPT(nn.Module):
    """Decoder-only GPT: embeddings -> n blocks -> final norm -> vocabulary projection.

    ``forward(tokens [B, T]) -> logits [B, T, V]`` on a full model. On a pipeline stage
    without embeddings the input is the hidden state [B, T, D]; on a stage without the
    head the output is the hidden state [B, T, D].

    With ``tie_embeddings`` ``output.weight`` is the very Parameter ``tok_embeddings.weight``
    (``named_parameters`` lists it once, as ``tok_embeddings.weight``; ``state_dict`` holds
    it under both names, so checkpoints keep the full model's keys). Split into pipeline
    stages, the last stage's ``output.weight`` is a copy kept equal by the trainer
    (model/parallel/pipeline.py).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = make_norm(cfg)
        self.output: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg)
        # Non-persistent: recomputed by init_weights, never part of checkpoints.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (or hidden [B, T, D] on a later stage) -> logits [B, T, V]
        (or [B, T, D])."""
        if self.tok_embeddings is not None:
            if tokens.shape[1] > self.cfg.max_seq_len:
                raise ValueError(
                    f"sequence length {tokens.shape[1]} exceeds model.max_seq_len="
                    f"{self.cfg.max_seq_len}"
                )
            h = self.tok_embeddings(tokens)  # [B, T, D]
        else:
            h = tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)  # [B, T, D]
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)  # [B, T, V]
        return h

    def tie_weights(self) -> None:
        """Make ``output.weight`` the Parameter ``tok_embeddings.weight`` again when
        ``cfg.tie_embeddings`` (a no-op while they are one; a pipeline stage holding only
        one of the two has nothing to tie)."""
        if not self.cfg.tie_embeddings or self.tok_embeddings is None or self.output is None:
            return
        if self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> GPT:
        """``Module.to_empty``, keeping tied embeddings one Parameter (materialising a meta
        Parameter makes a new one per module that holds it)."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def keep_rope_rows(self, rows: int) -> None:
        """Keep the rotary tables' first ``rows`` positions only (a trainer's sequence
        length). Every chunk holds float32 tables of max_seq_len rows, and FSDP2's mixed
        precision casts them whole into each block's forward, whose backward keeps the
        copy: for Llama 3.1 (131,072 positions) trained on 8,192, 134 MB a chunk and 67 MB
        a block in flight, for rows no step reads."""
        if rows < self.rope_cos.shape[0]:
            self.rope_cos = self.rope_cos[:rows].clone()  # still the registered buffers
            self.rope_sin = self.rope_sin[:rows].clone()

    # ----------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic, layout-independent initialisation (after ``to_empty``).

        Normal(0, init_std) for linears and embeddings; the residual projections (wo, w2)
        scaled by 1/sqrt(2*n_layers) (GPT-2); zeros for biases, ones for norm weights.
        Each tensor is drawn over its full shape from a CPU generator seeded by
        (seed, name), then the local shard of a DTensor parameter is kept. A tied head is
        not drawn: it is ``tok_embeddings.weight``, and on a last pipeline stage without the
        embedding its copy is drawn as ``tok_embeddings.weight`` (the same values).
        """
        cos, sin = rope_tables(self.cfg)
        rows = self.rope_cos.shape[0]  # max_seq_len, or what keep_rope_rows kept
        self.rope_cos.copy_(cos[:rows])
        self.rope_sin.copy_(sin[:rows])
        for name, param in self.named_parameters():
            drawn = TIED_NAME if self.cfg.tie_embeddings and name == HEAD_NAME else name
            full = _initial_value(drawn, tuple(param.shape), self.cfg, seed)
            _copy_full_into(param, full)


TIED_NAME, HEAD_NAME = "tok_embeddings.weight", "output.weight"
"""The tied matrix's name, and its name on a last pipeline stage that holds the copy."""


def _initial_value(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full initial tensor of parameter ``name`` (float32, CPU)."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name.rsplit(".", 2)[-2] or name.startswith("norm."):
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    std = cfg.init_std
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into ``param``, keeping only the local shard of a DTensor.

    The shard is cut out of ``full`` by its offset (DCP's own arithmetic, Shard and
    _StridedShard alike) rather than by ``distribute_tensor``, which splits the tensor into
    one piece per rank of each mesh dim: under fake tensors at a 1,536-way data-parallel
    mesh that split cost minutes per parameter.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(param, DTensor):
        local = param.to_local()
        # The offsets are integer arithmetic done with small index tensors: real ones even
        # when the parameters are fake (a rehearsal), since a fake index has no values.
        with unset_fake_temporarily():
            shape, offset = compute_local_shape_and_global_offset(
                full.shape, param.device_mesh, param.placements)
        if tuple(shape) != tuple(local.shape):
            raise RuntimeError(f"local shard {tuple(local.shape)} of a {tuple(full.shape)} "
                               f"parameter is not the {tuple(shape)} its placements give")
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        local.copy_(full[index].to(device=local.device, dtype=local.dtype))
    else:
        param.copy_(full.to(device=param.device, dtype=param.dtype))
