"""Typed configuration for the model, its parallel layout and the training loop.

Every field carries a docstring; every check lives in ``__post_init__`` and raises
``ValueError`` with a message that names the field and what is allowed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Family = Literal["llama", "neox"]
RopeScaling = Literal["none", "linear", "llama3"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
Sharding = Literal["zero3", "zero2", "ddp", "none"]
Recompute = Literal["none", "selective", "full"]
DType = Literal["float32", "bfloat16"]


def shards_with_fsdp(sharding: str, dp: int) -> bool:
    """Whether FSDP2 shards the states: zero2 or zero3 over more than one data-parallel rank
    (otherwise the trainer keeps float32 weights, under bf16 autocast in bfloat16)."""
    return sharding in ("zero2", "zero3") and dp > 1


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class ModelConfig:
    """Shape of a decoder-only GPT."""

    family: Family = "llama"
    """'llama' (RMSNorm, SwiGLU, rotary, optional GQA) or 'neox' (LayerNorm, GELU, rotary)."""
    n_layers: int = 2
    """Number of transformer blocks."""
    d_model: int = 64
    """Hidden size."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (llama only); None means n_heads."""
    ffn_hidden: int | None = None
    """MLP inner size; None means 4*d_model (neox) or the rounded 8/3*d_model (llama)."""
    vocab_size: int = 2048
    """Embedding rows; must be >= the tokenizer's vocab size."""
    max_seq_len: int = 128
    """Longest sequence the model accepts (rotary table length)."""
    parallel_residual: bool = False
    """neox only: attention and MLP read the same input and are summed (GPT-J/NeoX style)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rotary_fraction: float = 1.0
    """neox only: the fraction of each head's dimensions that rotary rotates (the first
    ``int(head_dim * rotary_fraction)``; the rest pass through), GPT-NeoX's ``rotary_pct``
    (Pythia: 0.25)."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm/RMSNorm."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    rope_scaling: RopeScaling = "none"
    """Rotary frequency scaling for a longer context: 'none'; 'linear' (every inverse
    frequency divided by rope_factor); 'llama3' (Llama 3.1's: wavelengths longer than
    rope_original_max_seq_len / rope_low_freq_factor divided by rope_factor, shorter than
    rope_original_max_seq_len / rope_high_freq_factor kept, smoothly mixed in between)."""
    rope_factor: float = 1.0
    """Factor of 'linear' and 'llama3' rope scaling (Llama 3.1: 8)."""
    rope_low_freq_factor: float = 1.0
    """'llama3' rope scaling: low_freq_factor (Llama 3.1: 1)."""
    rope_high_freq_factor: float = 4.0
    """'llama3' rope scaling: high_freq_factor (Llama 3.1: 4)."""
    rope_original_max_seq_len: int = 8192
    """'llama3' rope scaling: the context length before the extension, HF's
    original_max_position_embeddings (Llama 3.1: 8192)."""
    tie_embeddings: bool = False
    """The output projection is the input embedding (one vocab x d_model weight; Llama 3.2
    1B/3B, small Qwen models). Not supported with pipeline parallelism (parallel.pp > 1)."""
    qkv_bias: bool = False
    """llama only: biases on the q/k/v projections, none on the output projection (Qwen2)."""
    qk_norm: bool = False
    """llama only: RMSNorm over each head's head_dim of q and of k, before rotary (Qwen3)."""
    attention_head_dim: int | None = None
    """Per-head width of q/k/v; None means d_model // n_heads. Set where heads x head_dim is
    not d_model (Qwen3-0.6B: 16 heads of 128 over d_model 1024)."""

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            _require(value > 0, f"model.{name} must be > 0, got {value}")
        _require(
            self.attention_head_dim is not None or self.d_model % self.n_heads == 0,
            f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}",
        )
        _require(self.attention_head_dim is None or self.attention_head_dim > 0,
                 f"model.attention_head_dim must be > 0, got {self.attention_head_dim}")
        if self.n_kv_heads is not None:
            _require(
                self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads == 0,
                f"model.n_kv_heads={self.n_kv_heads} must be > 0 and divide "
                f"model.n_heads={self.n_heads}",
            )
            _require(
                self.family == "llama" or self.n_kv_heads == self.n_heads,
                "model.n_kv_heads (grouped-query attention) is only supported for family 'llama'",
            )
        _require(
            not (self.parallel_residual and self.family == "llama"),
            "model.parallel_residual is only supported for family 'neox'",
        )
        _require(self.head_dim % 2 == 0, "model head dim must be even for rotary")
        _require(0.0 < self.rotary_fraction <= 1.0,
                 f"model.rotary_fraction must be in (0, 1], got {self.rotary_fraction}")
        _require(self.rotary_fraction == 1.0 or self.family == "neox",
                 "model.rotary_fraction < 1 (partial rotary) is only supported for family 'neox'")
        _require(self.rotary_dim > 0 and self.rotary_dim % 2 == 0,
                 f"model.rotary_fraction={self.rotary_fraction} rotates int({self.head_dim} * "
                 f"{self.rotary_fraction}) = {self.rotary_dim} dims of each head: that must be a "
                 "positive even number")
        self._check_rope_scaling()
        for name in ("qkv_bias", "qk_norm"):
            _require(not getattr(self, name) or self.family == "llama",
                     f"model.{name} is only supported for family 'llama' (neox has all biases)")

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling == "none":
            _require(self.rope_factor == 1.0, f"model.rope_factor={self.rope_factor} needs "
                     "model.rope_scaling 'linear' or 'llama3' (it is 'none')")
            return
        _require(self.rope_factor > 0, f"model.rope_factor must be > 0, got {self.rope_factor}")
        if self.rope_scaling == "llama3":
            _require(0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
                     "model.rope_low_freq_factor must be > 0 and < model.rope_high_freq_factor, "
                     f"got {self.rope_low_freq_factor} and {self.rope_high_freq_factor}")
            _require(self.rope_original_max_seq_len > 0, "model.rope_original_max_seq_len must "
                     f"be > 0, got {self.rope_original_max_seq_len}")

    @property
    def head_dim(self) -> int:
        """Per-head width of q/k/v: attention_head_dim, or d_model // n_heads."""
        return self.attention_head_dim or self.d_model // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that rotary rotates (HF GPT-NeoX's ``rotary_ndims``)."""
        return int(self.head_dim * self.rotary_fraction)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.family == "neox":
            return 4 * self.d_model
        # LLaMA: 2/3 of 4*d, rounded up to a multiple of 64 (or 8 for tiny models).
        multiple = 64 if self.d_model >= 512 else 8
        hidden = int(8 * self.d_model / 3)
        return multiple * ((hidden + multiple - 1) // multiple)


def vocab_fit_problem(store_vocab: int | None, model_vocab: int) -> str | None:
    """Why a token store with ``store_vocab`` token ids cannot feed a model with
    ``model_vocab`` embedding rows, or None when it fits (or the store's size is unknown).

    The one statement of this rule: the plan, train and evaluate stages all ask it.
    """
    if store_vocab is None or store_vocab <= model_vocab:
        return None
    return (f"the token store's vocabulary ({store_vocab}) exceeds model.vocab_size="
            f"{model_vocab}: raise model.vocab_size to at least {store_vocab}, or use a store "
            f"whose tokenizer has at most {model_vocab} tokens")


@dataclass
class ParallelConfig:
    """How many ranks to run and, optionally, how to lay them out.

    Any of tp/pp/dp/micro_batch/schedule left as None is chosen by the plan stage.
    """

    nproc: int = 2
    """Total ranks (processes) for training: nodes * ranks per node."""
    nodes: int = 1
    """Nodes the training job spans."""
    cluster: str = "local"
    """Cluster description: a name in configs/clusters/ or a path to a YAML file."""
    tp: int | None = None
    """Tensor-parallel degree; None lets the planner choose."""
    pp: int | None = None
    """Pipeline-parallel degree; None lets the planner choose."""
    dp: int | None = None
    """Data-parallel degree; None lets the planner choose."""
    micro_batch: int | None = None
    """Sequences per micro-batch per data-parallel rank; None lets the planner choose."""
    schedule: Schedule | None = None
    """Pipeline schedule: gpipe, 1f1b or interleaved_1f1b; None lets the planner choose."""
    virtual_stages: int | None = None
    """Model chunks per pipeline rank (interleaved_1f1b only); None lets the planner choose."""
    sharding: Sharding | None = None
    """Data-parallel sharding: zero3 (FSDP2 reshard after forward), zero2, ddp or none."""
    recompute: Recompute | None = None
    """Activation checkpointing: none, selective or full; None lets the planner choose."""
    recompute_layers: int | None = None
    """With recompute full, recompute only the first N blocks of each pipeline chunk (0: every
    block); None lets the planner choose."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations along the sequence over the tp group."""
    refine_top_k: int = 0
    """If > 0, measure the planner's top-k plans for a few steps and keep the fastest."""
    rehearse: bool | None = None
    """Whether the plan stage rehearses its plan: the first and last pipeline stage's ranks
    run two training steps on fake tensors in a fake process group of the plan's world size
    (``model/rehearsal/rehearse.py``), and a plan whose rehearsed peak (with the cluster's
    margins) does not fit the device gives way to the next best that does (``rehearsal.json``
    beside the memory model's figures). None (the default): on for every cluster but the
    measured local one, whose plans run for real at once; a Frontier-size rank takes one to
    three minutes."""

    def __post_init__(self) -> None:
        _require(self.nproc > 0, f"parallel.nproc must be > 0, got {self.nproc}")
        _require(self.nodes > 0, f"parallel.nodes must be > 0, got {self.nodes}")
        _require(
            self.nproc % self.nodes == 0,
            f"parallel.nproc={self.nproc} must be a multiple of parallel.nodes={self.nodes}",
        )
        for name in ("tp", "pp", "dp", "micro_batch", "virtual_stages"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"parallel.{name} must be > 0, got {value}")
        _require(self.recompute_layers is None or self.recompute_layers >= 0,
                 f"parallel.recompute_layers must be >= 0 (0: every block), got "
                 f"{self.recompute_layers}")
        _require(self.refine_top_k >= 0, "parallel.refine_top_k must be >= 0")

    @property
    def ranks_per_node(self) -> int:
        return self.nproc // self.nodes


@dataclass
class TrainConfig:
    """The optimisation loop."""

    KEYLESS = ("steps", "log_every", "checkpoint_every", "checkpoint_minutes", "keep_last",
               "keep_every", "async_checkpoint", "resume_from", "collective_timeout_s",
               "slow_rank_every", "slow_rank_ratio", "eval_every", "eval_tokens")
    """Fields that enter no stage key: how often the run logs, saves or watches its ranks, how
    many saves it keeps, how long a collective may hang, how often and on how much it
    validates (validation changes no weight); ``resume_from`` enters the train key
    as the resolved continuation, and ``steps`` as the train stage's extent (it is the only
    stage whose output it changes: more steps continue a training)."""

    steps: int = 60
    """Optimizer steps."""
    global_batch: int = 8
    """Sequences per optimizer step over all data-parallel ranks (= micro_batch*grad_accum*dp)."""
    seq_len: int = 128
    """Tokens per training sequence; must be <= model.max_seq_len."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay as a fraction of lr."""
    warmup_steps: int = 5
    """Linear warm-up steps."""
    decay_steps: int | None = None
    """The step at which the cosine decay reaches min_lr_ratio (then stays there); None: at
    train.steps. Fix it (e.g. to the longest training you may extend to) and the schedule no
    longer depends on train.steps, so raising train.steps continues a training exactly as an
    uninterrupted run of the new length would have gone."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 1234
    """Seed for initialisation and data order."""
    dtype: DType = "float32"
    """Compute dtype: float32, or bfloat16 mixed precision where the device supports it."""
    checkpoint_every: int = 0
    """Save a checkpoint every K steps (0: only at the end)."""
    checkpoint_minutes: float | str | None = None
    """Also save a checkpoint once this many minutes of training have passed since the last
    save returned (or since training started in this attempt), whichever of this and
    checkpoint_every comes first; None: by step count only. Rank 0's clock decides for all
    ranks. ``auto``: the interval that loses least work to failures (Young/Daly, from the
    save time and the allocation's failure rate: model.planner.failures), resolved to
    minutes by the train stage before its ranks start."""
    keep_last: int = 2
    """Keep the newest K complete checkpoints; older ones are deleted after each new save
    (never the one this attempt resumed from, nor one kept by keep_every)."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this (e.g. 5000) for good;
    None: only keep_last decides."""
    async_checkpoint: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint.async_save): the
    state is copied to host memory, training continues while a separate gloo group writes
    it, and the next save (or the end of training) waits for it first."""
    log_every: int = 1
    """Log metrics every N steps."""
    compile: bool = False
    """Compile each transformer block with torch.compile (fuses norms/rotary/SwiGLU on GPU;
    costs tens of seconds of warm-up, so off by default)."""
    init_from: str | None = None
    """Start from these weights instead of a random initialisation (continued pretraining):
    a Hugging Face LLaMA/GPT-NeoX directory or one of our checkpoints (``step-N``). The model
    shape is taken from it (a conflicting model.* setting is an error); the optimizer, the
    schedule and the data start afresh. A checkpoint of this run, once written, wins."""
    resume_from: str | None = None
    """Continue another training of the same model and data instead of starting at step 0:
    ``auto`` (the newest training of this config whose key differs only by code or
    train.steps), a train stage key, or a checkpoint directory (``.../step-N``). Weights,
    optimizer, schedule position and data order all continue. None: only a rise of
    train.steps continues on its own (docs/reruns.md)."""
    step_checks: bool = True
    """Check every step's loss and gradient norm on every rank (one small all-reduce a step):
    a non-finite one skips the step's update, a loss spike or max_bad_steps bad steps in a row
    roll back to the newest checkpoint, skipping the data since it (docs/training.md)."""
    max_bad_steps: int = 3
    """Roll back after this many non-finite steps in a row (each one alone is skipped)."""
    spike_deviations: float | None = 6.0
    """A loss spike: more than this many robust deviations (1.4826 x the median absolute
    deviation) above the median of the last spike_window good losses; None: no spike rule."""
    spike_window: int = 50
    """Good steps the spike rule looks back on; it judges nothing until it has seen them."""
    spike_min_rise: float = 1.0
    """A spike must also exceed that median by this fraction of it (1.0: twice the median).
    A quiet curve's tiny deviation never makes a wobble a spike, nor a shift in the data a
    spike: the tiny preset's healthy curve rises up to 54 % where the loader moves to
    another group of blocks (step 256)."""
    max_rollbacks: int = 5
    """Stop with an error after this many rollbacks in one training."""
    slow_rank_every: int = 50
    """Gather every rank's busy seconds per step every N steps (one all-gather of a float)
    and log the slowest over the median rank; 0: never."""
    slow_rank_ratio: float = 1.5
    """Name on the console the ranks busier per step than this multiple of the median rank."""
    eval_every: int = 0
    """Score the validation split's fixed slice (eval_tokens) every N steps and after the last
    (``val_loss``, ``val_bpb``), under the training layout, without touching the training's
    data order or random state; 0: never. The presets choose about ten a run."""
    eval_tokens: int = 4096
    """Predicted tokens of that slice: the windows of seq_len tokens spread evenly over the
    split that the evaluate stage scores again for the final checkpoint (its
    ``train_slice_val_*``). A split with fewer tokens is scored whole; at least one window
    is scored (``slice_tokens``)."""
    collective_timeout_s: float = 600.0
    """A collective that waits longer than this for its peers fails the job, naming the ranks
    that did not arrive and what each was last doing (docs/training.md, "A hung collective").
    Longer than the slowest step and checkpoint save or load; changes no output."""

    @property
    def slice_tokens(self) -> int:
        """Tokens of the in-loop validation slice: ``eval_tokens``, at least one window of
        ``seq_len`` (a longer sequence does not need eval_tokens raised with it)."""
        return max(self.eval_tokens, self.seq_len)

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "seq_len", "log_every"):
            value = getattr(self, name)
            _require(value > 0, f"train.{name} must be > 0, got {value}")
        _require(self.lr > 0, f"train.lr must be > 0, got {self.lr}")
        _require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio must be in [0, 1]")
        _require(self.warmup_steps >= 0, "train.warmup_steps must be >= 0")
        _require(self.decay_steps is None or self.decay_steps > self.warmup_steps,
                 f"train.decay_steps must be null or > train.warmup_steps={self.warmup_steps}, "
                 f"got {self.decay_steps}")
        _require(self.grad_clip >= 0, "train.grad_clip must be >= 0")
        _require(self.checkpoint_every >= 0, "train.checkpoint_every must be >= 0")
        minutes = self.checkpoint_minutes
        _require(minutes is None or minutes == "auto" or (
                     not isinstance(minutes, str) and minutes > 0),
                 f"train.checkpoint_minutes must be > 0 minutes or null (by step count only), "
                 f"or auto (the interval that loses least work to failures), got {minutes!r}")
        _require(self.keep_last >= 1, f"train.keep_last must be >= 1 (the newest checkpoint is "
                 f"always kept), got {self.keep_last}")
        _require(self.keep_every is None or self.keep_every > 0,
                 f"train.keep_every must be > 0 steps or null, got {self.keep_every}")
        _require(self.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got "
                 f"{self.max_bad_steps}")
        _require(self.spike_deviations is None or self.spike_deviations > 0,
                 f"train.spike_deviations must be > 0 or null, got {self.spike_deviations}")
        _require(self.spike_window >= 3, f"train.spike_window must be >= 3 steps, got "
                 f"{self.spike_window}")
        _require(self.spike_min_rise >= 0, f"train.spike_min_rise must be >= 0, got "
                 f"{self.spike_min_rise}")
        _require(self.max_rollbacks >= 0, f"train.max_rollbacks must be >= 0, got "
                 f"{self.max_rollbacks}")
        _require(self.slow_rank_every >= 0, f"train.slow_rank_every must be >= 0 (0: never), "
                 f"got {self.slow_rank_every}")
        _require(self.slow_rank_ratio > 1, f"train.slow_rank_ratio must be > 1, got "
                 f"{self.slow_rank_ratio}")
        _require(self.eval_every >= 0, f"train.eval_every must be >= 0 steps (0: no validation "
                 f"in the loop), got {self.eval_every}")
        _require(self.eval_tokens > 0, f"train.eval_tokens must be > 0, got {self.eval_tokens}")
        _require(self.collective_timeout_s > 0, f"train.collective_timeout_s must be > 0 "
                 f"seconds, got {self.collective_timeout_s}")
