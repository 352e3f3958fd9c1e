"""Export a GPT to Hugging Face format: LlamaForCausalLM, Qwen2ForCausalLM or
Qwen3ForCausalLM (llama; the class follows model.qkv_bias / model.qk_norm), or
GPTNeoXForCausalLM (neox).

``python -m model.export_hf CHECKPOINT OUT [--tokenizer tokenizer.json] [--eos-token T]
[--dtype bfloat16] [--shard-bytes N]`` exports one of our checkpoints (any training layout,
or one imported with ``python -m model.import_hf``), streamed one tensor at a time.

The export directory holds the weights (``model.safetensors``, or when they exceed the shard
size ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``),
``config.json``, ``generation_config.json`` and the tokenizer (``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``) so
``AutoModelForCausalLM.from_pretrained(dir)`` / ``AutoTokenizer.from_pretrained(dir)`` load it
with no code from this project.

Our parameter names follow the Meta/torchtitan layout and our rotary embedding uses HF's
rotate_half convention, so the LLaMA/Qwen export is a pure rename (q/k/v biases and q/k norms
included); tied embeddings are written once, as ``model.embed_tokens.weight`` with
``tie_word_embeddings: true`` and no ``lm_head.weight``. GPT-NeoX fuses q/k/v into one
``query_key_value`` projection whose output is laid out per head as ``[q_h, k_h, v_h]``
(HF views it as [B, T, H, 3*hd] and chunks the last dim), so we interleave per head.

The weights are written straight from our state dict or DCP checkpoint, one tensor at a time
(no HF model is instantiated; ``export_checkpoint`` never holds the whole model), and the
directory is published atomically: written to ``<out>.partial`` then renamed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from model.config import ModelConfig
from model.evaluation.shards import DEFAULT_SHARD_BYTES, TensorSpec, write_sharded

# family -> transformers class name written into config.json "architectures".
HF_CLASSES = {"llama": "LlamaForCausalLM", "neox": "GPTNeoXForCausalLM"}


class ExportError(ValueError):
    """A model that cannot be exported; the message says what to change."""


def hf_class_name(family: str) -> str:
    """The transformers class for ``family``; ExportError if transformers has none."""
    if family not in HF_CLASSES:
        raise ExportError(
            f"model.family={family!r} has no Hugging Face export; supported families: "
            f"{sorted(HF_CLASSES)}"
        )
    name = HF_CLASSES[family]
    _require_class(name, f"model.family={family!r}", "upgrade transformers (>=4.45)")
    return name


def hf_architecture(cfg: ModelConfig) -> str:
    """The transformers class that computes ``cfg``'s model (ExportError if none does).

    llama: ``LlamaForCausalLM``; with ``qkv_bias`` ``Qwen2ForCausalLM`` (biases on q/k/v
    only); with ``qk_norm`` ``Qwen3ForCausalLM``. neox: ``GPTNeoXForCausalLM``.
    """
    hf_class_name(cfg.family)
    if cfg.family != "llama" or not (cfg.qkv_bias or cfg.qk_norm):
        return HF_CLASSES[cfg.family]
    if cfg.qkv_bias and cfg.qk_norm:
        raise ExportError("model.qkv_bias=true with model.qk_norm=true has no Hugging Face "
                          "class: Qwen2 has q/k/v biases but no q/k norm, and Qwen3's "
                          "attention_bias also puts a bias on o_proj")
    name = "Qwen3ForCausalLM" if cfg.qk_norm else "Qwen2ForCausalLM"
    _require_class(name, f"model.{'qk_norm' if cfg.qk_norm else 'qkv_bias'}=true")
    return name


def _require_class(name: str, what: str, fix: str = "upgrade transformers") -> None:
    """ExportError unless the installed transformers has class ``name``. Looked up in the
    package's list of names, not by attribute: getting the class would import its modeling
    code (seconds), which an export that only writes files never needs."""
    import transformers

    if name not in getattr(transformers, "__all__", ()) and not hasattr(transformers, name):
        raise ExportError(f"the installed transformers {transformers.__version__} has no class "
                          f"{name} for {what}: {fix}")


def hf_rope_scaling(cfg: ModelConfig) -> dict[str, float | int | str] | None:
    """HF's ``rope_scaling`` mapping for ``cfg.rope_scaling`` (None for plain rotary)."""
    if cfg.rope_scaling == "none":
        return None
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_factor}
    return {"rope_type": "llama3", "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len}


def hf_config(cfg: ModelConfig, eos_id: int | None = None):
    """The transformers config (Llama/Qwen2/Qwen3/GPTNeoX) equivalent to ``cfg``.

    Rotary base, fraction and scaling use the legacy keyword names (``rope_theta`` /
    ``rotary_emb_base``, ``rotary_pct``, ``rope_scaling``), which transformers 4.45+ and 5.x
    both accept (5.x folds them into ``rope_parameters``).
    """
    import transformers

    arch = hf_architecture(cfg)
    scaling = hf_rope_scaling(cfg)
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.ffn_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": eos_id,  # documents are separated by eos; there is no separate bos
        "eos_token_id": eos_id,
        "initializer_range": cfg.init_std,
        **({"rope_scaling": scaling} if scaling else {}),
    }
    if cfg.family == "llama":
        llama = {**common, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                 "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta}
        if arch == "LlamaForCausalLM":
            config = transformers.LlamaConfig(**llama, attention_bias=False, mlp_bias=False)
        elif arch == "Qwen2ForCausalLM":  # q/k/v biases are built in
            config = transformers.Qwen2Config(**llama, use_sliding_window=False)
        else:  # Qwen3: q/k norms are built in
            config = transformers.Qwen3Config(**llama, attention_bias=False,
                                              use_sliding_window=False)
    else:
        config = transformers.GPTNeoXConfig(
            **common,
            hidden_act="gelu",  # exact (erf) GELU, as torch.nn.functional.gelu
            rotary_pct=cfg.rotary_fraction,
            rotary_emb_base=cfg.rope_theta,
            layer_norm_eps=cfg.norm_eps,
            use_parallel_residual=cfg.parallel_residual,
            attention_bias=True,
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )
    config.architectures = [arch]
    return config


def _llama_names(i: str) -> dict[str, str]:
    p = f"model.layers.{i}"
    return {
        "attention.wq": f"{p}.self_attn.q_proj",
        "attention.wk": f"{p}.self_attn.k_proj",
        "attention.wv": f"{p}.self_attn.v_proj",
        "attention.wo": f"{p}.self_attn.o_proj",
        "feed_forward.w1": f"{p}.mlp.gate_proj",
        "feed_forward.w3": f"{p}.mlp.up_proj",
        "feed_forward.w2": f"{p}.mlp.down_proj",
        "attention_norm": f"{p}.input_layernorm",
        "ffn_norm": f"{p}.post_attention_layernorm",
        "attention.q_norm": f"{p}.self_attn.q_norm",  # Qwen3 (model.qk_norm)
        "attention.k_norm": f"{p}.self_attn.k_norm",
    }


def _neox_names(i: str) -> dict[str, str]:
    p = f"gpt_neox.layers.{i}"
    return {
        "attention.wo": f"{p}.attention.dense",
        "feed_forward.w1": f"{p}.mlp.dense_h_to_4h",
        "feed_forward.w2": f"{p}.mlp.dense_4h_to_h",
        "attention_norm": f"{p}.input_layernorm",
        "ffn_norm": f"{p}.post_attention_layernorm",
    }


_TOP_LEVEL = {
    "llama": {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"},
    "neox": {
        "tok_embeddings": "gpt_neox.embed_in",
        "norm": "gpt_neox.final_layer_norm",
        "output": "embed_out",
    },
}


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[H*hd, ...] x3 -> [3*H*hd, ...] laid out per head as [q_h, k_h, v_h]."""
    rest = q.shape[1:]
    parts = [t.reshape(n_heads, -1, *rest) for t in (q, k, v)]  # [H, hd, ...]
    return torch.stack(parts, dim=1).reshape(-1, *rest)  # [H, 3, hd, ...] -> [3*H*hd, ...]


def hf_layout(cfg: ModelConfig, names: set[str] | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """The HF tensors of ``cfg`` in file order: ``(hf_name, our source names)``.

    One source is a rename; three (GPT-NeoX ``query_key_value``) are fused per head by
    ``combine``. ``names`` (default: a full GPT's) must be exactly our state dict's keys:
    ExportError on a missing or unexpected key, so a partial (pipeline-stage) or foreign
    state dict is never exported silently. With tied embeddings ``output.weight`` (the
    embedding under its second name) may be present or not and is not written.
    """
    hf_architecture(cfg)
    expected = _expected_keys(cfg)
    names = expected if names is None else set(names)
    tied = {"output.weight"} if cfg.tie_embeddings else set()
    missing = sorted(expected - names - tied)
    if missing:
        raise ExportError(f"state dict lacks {missing[:5]}: export needs a full GPT (all stages)")
    layout: list[tuple[str, tuple[str, ...]]] = []
    used: set[str] = set(tied)

    def add(theirs: str, *ours: str) -> None:
        if all(o in names for o in ours):
            layout.append((theirs, ours))
            used.update(ours)

    top = _TOP_LEVEL[cfg.family]
    for leaf in ("weight", "bias"):
        add(f"{top['tok_embeddings']}.{leaf}", f"tok_embeddings.{leaf}")
    for i in range(cfg.n_layers):
        prefix = f"layers.{i}."
        table = _llama_names(str(i)) if cfg.family == "llama" else _neox_names(str(i))
        for ours, theirs in table.items():
            if cfg.family == "neox" and ours == "attention.wo":
                qkv = f"gpt_neox.layers.{i}.attention.query_key_value"
                for leaf in ("weight", "bias"):
                    add(f"{qkv}.{leaf}", *(f"{prefix}attention.{w}.{leaf}" for w in QKV))
            for leaf in ("weight", "bias"):
                add(f"{theirs}.{leaf}", f"{prefix}{ours}.{leaf}")
    for ours in ("norm", "output"):
        for leaf in ("weight", "bias"):
            if f"{ours}.{leaf}" not in tied:
                add(f"{top[ours]}.{leaf}", f"{ours}.{leaf}")
    unexpected = sorted(names - used)
    if unexpected:
        raise ExportError(
            f"unexpected parameters for family {cfg.family!r}: {unexpected[:5]} "
            "(does model.* in the config match the checkpoint?)"
        )
    return layout


QKV = ("wq", "wk", "wv")


def combine(parts: list[torch.Tensor], cfg: ModelConfig,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """Our source tensors of one HF tensor -> that HF tensor (contiguous, on CPU, in
    ``dtype`` when given)."""
    if len(parts) == 1:
        out = parts[0].detach().to("cpu")
    else:
        out = _fuse_qkv(*(t.detach().to("cpu") for t in parts), cfg.n_heads)
    return (out if dtype is None else out.to(dtype)).contiguous()


def hf_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Shape of the HF tensor made from sources of ``shapes`` (a fusion stacks dim 0)."""
    return (sum(s[0] for s in shapes), *shapes[0][1:]) if len(shapes) > 1 else tuple(shapes[0])


def _expected_keys(cfg: ModelConfig) -> set[str]:
    """Our parameter names for ``cfg`` (from a GPT built on the meta device)."""
    from model.gpt import GPT

    with torch.device("meta"):
        return set(GPT(cfg).state_dict())


def save_tokenizer(tokenizer_file: str | Path, out_dir: Path, eos_token: str, max_len: int) -> None:
    """Write the HF tokenizer files (tokenizer.json, tokenizer_config.json, ...) into out_dir."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file),
        eos_token=eos_token,
        bos_token=eos_token,
        pad_token=eos_token,
        model_max_length=max_len,
    )
    tokenizer.save_pretrained(str(out_dir))


def _publish(
    cfg: ModelConfig,
    out_dir: str | Path,
    write_weights: Callable[[Path], object],
    tokenizer_file: str | Path | None,
    eos_token: str,
) -> Path:
    """Write config, generation config, tokenizer and (``write_weights(work)``) the weights
    into ``<out>.partial``, then rename it to ``out_dir`` (replacing an older export)."""
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    eos_id = None
    if tokenizer_file is not None:
        tokenizer_file = Path(tokenizer_file)
        if not tokenizer_file.is_file():
            raise ExportError(f"tokenizer file {str(tokenizer_file)!r} does not exist")
        eos_id = json_token_id(tokenizer_file, eos_token)
    config = hf_config(cfg, eos_id)
    work = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    write_weights(work)
    config.save_pretrained(str(work))
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(
        str(work)
    )
    if tokenizer_file is not None:
        save_tokenizer(tokenizer_file, work, eos_token, cfg.max_seq_len)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(work, out_dir)
    return out_dir


def export_state_dict(
    state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | Path,
    tokenizer_file: str | Path | None = None,
    eos_token: str = "<|endoftext|>",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write an HF model directory from our (full, in-memory) state dict; returns ``out_dir``.

    Published atomically: an existing ``out_dir`` is replaced only once the new one is complete.
    ``dtype`` (e.g. torch.bfloat16) converts the weights; None keeps the state dict's.
    """
    layout = dict(hf_layout(cfg, set(state)))
    specs = [TensorSpec(theirs, hf_shape([tuple(state[o].shape) for o in ours]),
                        dtype or state[ours[0]].dtype) for theirs, ours in layout.items()]

    def fetch(spec: TensorSpec) -> torch.Tensor:
        return combine([state[o] for o in layout[spec.name]], cfg, spec.dtype)

    return _publish(cfg, out_dir, lambda work: write_sharded(work, specs, fetch, shard_bytes),
                    tokenizer_file, eos_token)


def json_token_id(tokenizer_file: Path, token: str) -> int:
    """Id of ``token`` in a tokenizers JSON file; ExportError if it is not there."""
    from tokenizers import Tokenizer

    token_id = Tokenizer.from_file(str(tokenizer_file)).token_to_id(token)
    if token_id is None:
        raise ExportError(f"tokenizer {tokenizer_file} has no token {token!r} "
                          "(tokenizer.eos_token)")
    return token_id


def export_model(model: torch.nn.Module, out_dir: str | Path, **kwargs) -> Path:
    """Export a full (unsharded) ``model.gpt.GPT``; kwargs as ``export_state_dict``."""
    return export_state_dict(model.state_dict(), model.cfg, out_dir, **kwargs)


def export_checkpoint(
    ckpt_dir: str | Path,
    cfg: ModelConfig | None,
    out_dir: str | Path,
    tokenizer_file: str | Path | None = None,
    eos_token: str = "<|endoftext|>",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> Path:
    """Export a DCP checkpoint directory (any training layout), streamed.

    The HF tensors are planned from the checkpoint's DCP metadata; each is then read alone
    (a partial, process-group-free DCP load of its one to three source tensors), converted,
    written into its safetensors shard and dropped. The peak memory is about the largest
    tensor times a small factor, whatever the model's size (docs/evaluation.md). ``cfg``
    None: the checkpoint's own ``model.json``; otherwise it must match it. ``dtype``
    converts each tensor as it is written (None: the checkpoint's, float32 from training).
    """
    from model.evaluation.dcp_io import CheckpointTensors

    source = CheckpointTensors(ckpt_dir, cfg)
    cfg = source.cfg
    hf_architecture(cfg)  # fail before writing anything
    layout = dict(hf_layout(cfg, set(source.names())))
    specs = [TensorSpec(theirs, hf_shape([source.shape(o) for o in ours]),
                        dtype or source.dtype(ours[0])) for theirs, ours in layout.items()]

    def fetch(spec: TensorSpec) -> torch.Tensor:
        parts = source.load(layout[spec.name])
        return combine([parts[o] for o in layout[spec.name]], cfg, spec.dtype)

    return _publish(cfg, out_dir, lambda work: write_sharded(work, specs, fetch, shard_bytes),
                    tokenizer_file, eos_token)


def _intact_hint(named: str, error: Exception) -> str:
    """For a damaged ``step-N`` named on the command line: "; the newest intact checkpoint
    beside it is ...". The command exports what it is told, never another step silently
    (the evaluate stage falls back by itself: ``model.evaluation.choice``)."""
    from model.evaluation.choice import usable_checkpoint
    from model.training.checkpoint import CheckpointError

    if not isinstance(error, CheckpointError):
        return ""
    try:
        choice = usable_checkpoint(named)
    except CheckpointError:
        return ""
    if not choice.skipped:
        return ""
    return (f"; the newest intact checkpoint beside it is step {choice.step}: export "
            f"{choice.path}")


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m model.export_hf CHECKPOINT OUT [options]`` (see module doc).

    Exit status 2, with the reason on stderr, for a checkpoint that cannot be exported (for
    a damaged ``step-N``, naming the newest intact one beside it).
    """
    parser = argparse.ArgumentParser(prog="python -m model.export_hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="one of our checkpoints (step-N, or an import)")
    parser.add_argument("out", help="Hugging Face model directory to write (replaced if it "
                                    "exists, once the new one is complete)")
    parser.add_argument("--tokenizer", help="tokenizer.json to export beside the weights")
    parser.add_argument("--eos-token", default="<|endoftext|>",
                        help="end-of-document token of --tokenizer (Llama 3: <|end_of_text|>)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="weight dtype to write (default: the checkpoint's)")
    parser.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES,
                        help=f"largest safetensors file (default {DEFAULT_SHARD_BYTES})")
    args = parser.parse_args(argv)
    from model.training.checkpoint import CheckpointError

    try:
        out = export_checkpoint(args.checkpoint, None, args.out, tokenizer_file=args.tokenizer,
                                eos_token=args.eos_token, shard_bytes=args.shard_bytes,
                                dtype=getattr(torch, args.dtype) if args.dtype else None)
    except (ExportError, CheckpointError) as err:
        print(f"export_hf: {err}{_intact_hint(args.checkpoint, err)}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in out.glob("*.safetensors"))
    size = sum((out / f).stat().st_size for f in files)
    arch = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"exported {args.checkpoint} -> {out} ({arch}, {len(files)} safetensors file(s), "
          f"{size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
