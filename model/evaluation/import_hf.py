"""Import a Hugging Face LLaMA (2, 3, 3.1, 3.2), Mistral, Qwen2/2.5, Qwen3 or GPT-NeoX
checkpoint as one of our DCP checkpoints.

``python -m model.import_hf SRC OUT``: SRC is an HF model directory (``config.json`` plus
safetensors or ``.bin`` weights, single or sharded) or ``hf:<id>`` where the Hugging Face
hub is reachable; OUT becomes a model-only checkpoint of ours (DCP + ``model.json`` +
``manifest.json``) that loads into any training layout (``train.init_from``) or one process.

Streaming: tensors are read one at a time (safetensors lazily, ``.bin`` memory-mapped with
``weights_only=True``) while DCP writes them; GPT-NeoX's fused ``query_key_value`` is split
per head back into wq/wk/wv (the inverse of the export's fusion). The HF config is
translated field by field (GPT-NeoX's ``rotary_pct`` / ``partial_rotary_factor`` becomes
``model.rotary_fraction``; Llama 3.1's ``rope_scaling`` ``model.rope_scaling`` and its
factors; ``tie_word_embeddings`` ``model.tie_embeddings``; Qwen2's q/k/v biases
``model.qkv_bias``; Qwen3's q/k norms ``model.qk_norm`` and its ``head_dim``
``model.attention_head_dim``). What our model cannot compute (sliding-window attention,
partial rotary in a LLaMA, rope scaling other than linear/llama3, other activations, biases
on o_proj or the MLP) is refused with a message naming the field.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from model.config import ModelConfig
from model.evaluation.export_hf import QKV, hf_layout
from model.evaluation.shards import TensorReader, weight_files

# HF buffers that some checkpoints carry and that we recompute (causal masks, rotary tables).
_IGNORED_SUFFIXES = (".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")
# HF model_type -> our family. Mistral, Qwen2 and Qwen3 are LLaMA blocks with extras
# (q/k/v biases: model.qkv_bias; q/k norms: model.qk_norm); see docs/evaluation.md.
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
               "gpt_neox": "neox"}
ROPE_TYPES = ("default", "linear", "llama3")


class ImportHFError(ValueError):
    """An HF checkpoint we cannot import; the message says what is unsupported or missing."""


def _refuse(ok: bool, message: str) -> None:
    if not ok:
        raise ImportHFError(message)


def _rope(config: dict[str, Any], legacy_theta: str, where: str) -> dict[str, Any]:
    """Our rope fields (rope_theta, rotary_fraction, rope_scaling and its parameters) from
    the legacy keys (``rope_theta`` / ``rotary_emb_base``, ``rope_scaling``) or 5.x's
    ``rope_parameters``; a scaling other than linear or llama3 is refused."""
    params = config.get("rope_parameters") or {}
    scaling = {**(config.get("rope_scaling") or {}), **params}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    _refuse(kind in ROPE_TYPES, f"{where}: rope_scaling type {kind!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})")
    theta = params.get("rope_theta", config.get(legacy_theta, config.get("rope_theta", 10000.0)))
    fraction = params.get("partial_rotary_factor",
                          config.get("partial_rotary_factor", config.get("rotary_pct", 1.0)))
    fields: dict[str, Any] = {"rope_theta": float(theta), "rotary_fraction": float(fraction)}
    if kind == "default":
        return fields
    fields.update(rope_scaling=kind, rope_factor=float(scaling["factor"]))
    if kind == "llama3":
        fields.update(
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
            rope_original_max_seq_len=int(scaling.get("original_max_position_embeddings")
                                          or config["max_position_embeddings"]))
    return fields


def _sliding_window_problem(config: dict[str, Any], model_type: str) -> str | None:
    """Why the config asks for sliding-window attention (which we do not compute), or None."""
    layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types")
    if layer_types:
        sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
        if sliding:
            return (f"layer_types has {len(sliding)} of {layers} layers "
                    f"{layer_types[sliding[0]]!r} (sliding-window attention)")
        return None
    window = config.get("sliding_window")
    if model_type == "mistral":  # every layer slides when the window is set
        limit = config["max_position_embeddings"]
        if window is not None and window < limit:
            return (f"sliding_window={window} < max_position_embeddings={limit} "
                    "(sliding-window attention; Mistral v0.2+ sets it null)")
        return None
    if model_type in ("qwen2", "qwen3") and config.get("use_sliding_window") and window:
        first = config.get("max_window_layers", 28)
        if first < layers:
            return (f"use_sliding_window=true slides layers {first}..{layers - 1} "
                    f"(max_window_layers={first}): sliding-window attention")
    return None


def model_config_from_hf(config: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Our ModelConfig equivalent to an HF ``config.json``; ImportHFError if unsupported."""
    model_type = config.get("model_type")
    _refuse(model_type in MODEL_TYPES, f"{where}: model_type {model_type!r} is not supported; "
            f"supported: {sorted(MODEL_TYPES)}")
    family = MODEL_TYPES[model_type]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    rope = _rope(config, "rope_theta" if family == "llama" else "rotary_emb_base", where)
    _refuse(rope["rotary_fraction"] == 1.0 or family == "neox", f"{where}: partial rotary "
            f"(rotary fraction {rope['rotary_fraction']}) is not supported for LLaMA models "
            "(only GPT-NeoX's rotary_pct)")
    sliding = _sliding_window_problem(config, model_type)
    _refuse(sliding is None, f"{where}: {sliding} is not supported")
    common = {"family": family, "n_layers": config["num_hidden_layers"], "d_model": hidden,
              "n_heads": heads, "ffn_hidden": config["intermediate_size"],
              "vocab_size": config["vocab_size"],
              "max_seq_len": config["max_position_embeddings"],
              "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
              "init_std": float(config.get("initializer_range", 0.02)), **rope}
    if family == "llama":
        act = config.get("hidden_act", "silu")
        _refuse(act == "silu", f"{where}: hidden_act {act!r} is not supported (llama: silu)")
        # Qwen2's q/k/v biases are built in; attention_bias (llama, mistral, qwen3) would
        # bias o_proj too, which our blocks do not have.
        for flag in ("attention_bias", "mlp_bias"):
            _refuse(not config.get(flag, False), f"{where}: {flag}=true is not supported "
                    + ("(biases on q/k/v and o_proj)" if flag == "attention_bias" else ""))
        head_dim = config.get("head_dim") or hidden // heads
        kv = config.get("num_key_value_heads") or heads
        return _model_config(where, **common, n_kv_heads=None if kv == heads else kv,
                             attention_head_dim=None if head_dim * heads == hidden else head_dim,
                             qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
                             norm_eps=float(config.get("rms_norm_eps", 1e-6)))
    act = config.get("hidden_act", "gelu")
    _refuse(act == "gelu", f"{where}: hidden_act {act!r} is not supported (neox: exact gelu)")
    _refuse(config.get("attention_bias", True), f"{where}: attention_bias=false is not supported")
    return _model_config(where, **common,
                         parallel_residual=bool(config.get("use_parallel_residual", True)),
                         norm_eps=float(config.get("layer_norm_eps", 1e-5)))


def _model_config(where: str, **fields: Any) -> ModelConfig:
    """ModelConfig(**fields); its check failing (e.g. an odd rotary width) is an ImportHFError."""
    try:
        return ModelConfig(**fields)
    except ValueError as err:
        raise ImportHFError(f"{where}: not supported: {err}") from None


def resolve_source(src: str) -> Path:
    """An HF model directory for ``src`` (a path, or ``hf:<id>`` downloaded from the hub)."""
    if src.startswith("hf:"):
        repo_id = src[3:]
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
            raise ImportHFError(f"{src}: the Hugging Face hub is off (HF_HUB_OFFLINE is set): "
                                "download the model where the hub is reachable and pass its "
                                "directory instead")
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(repo_id, allow_patterns=[
                "*.json", "*.safetensors", "*.bin", "tokenizer*"]))
        except Exception as err:  # noqa: BLE001 - offline, unknown id, auth: all one message
            raise ImportHFError(f"{src}: could not download from the Hugging Face hub "
                                f"({type(err).__name__}: {err}); pass a local directory") from None
    path = Path(src)
    _refuse(path.is_dir(), f"{src!r} is not a directory (an HF model directory or hf:<id>)")
    _refuse((path / "config.json").is_file(), f"{path} has no config.json: not an HF model")
    return path


def read_hf_config(model_dir: str | Path) -> ModelConfig:
    """The ModelConfig of an HF model directory (its config.json translated)."""
    path = Path(model_dir) / "config.json"
    return model_config_from_hf(json.loads(path.read_text()), str(path))


def is_hf_dir(path: str | Path) -> bool:
    """True for an HF model directory (config.json and no model.json of ours)."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "model.json").is_file()


def _split_qkv(qkv: torch.Tensor, n_heads: int) -> list[torch.Tensor]:
    """[3*H*hd, ...] laid out per head as [q_h, k_h, v_h] -> q, k, v [H*hd, ...] each."""
    rest = qkv.shape[1:]
    per_head = qkv.reshape(n_heads, 3, -1, *rest)
    return [per_head[:, j].reshape(-1, *rest) for j in range(3)]


def import_hf(src: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Convert the HF checkpoint ``src`` into our checkpoint at ``out_dir``; return it.

    Weights are stored as ``dtype`` (float32 by default, what the trainer keeps).
    """
    from model.evaluation.dcp_io import write_model_checkpoint
    from model.gpt import GPT

    model_dir = resolve_source(str(src))
    cfg = read_hf_config(model_dir)
    try:
        files = weight_files(model_dir)
    except FileNotFoundError as err:
        raise ImportHFError(str(err)) from None
    reader = TensorReader(files)
    layout = hf_layout(cfg)
    renamed = {}  # our HF name -> the name stored in the files
    if cfg.family == "neox" and "lm_head.weight" in files and "embed_out.weight" not in files:
        renamed["embed_out.weight"] = "lm_head.weight"  # transformers 5.x's module name
    ignored = set()
    if cfg.tie_embeddings:  # a tied head stored anyway is the embedding (transformers ties it)
        ignored = {"lm_head.weight", "embed_out.weight"}
        renamed = {}
    present = {n for n in files if not n.endswith(_IGNORED_SUFFIXES) and n not in ignored}
    present = (present - set(renamed.values())) | set(renamed)
    wanted = {theirs for theirs, _ in layout}
    missing, extra = sorted(wanted - present), sorted(present - wanted)
    _refuse(not missing, f"{model_dir}: weights lack {missing[:5]} for the config's model")
    _refuse(not extra, f"{model_dir}: weights {extra[:5]} have no place in our "
            f"{cfg.family} model (biased or extra modules are not supported)")
    # our name -> (HF name, its part of a fused q/k/v tensor or None)
    source = {ours: (theirs, i if len(group) == len(QKV) else None)
              for theirs, group in layout for i, ours in enumerate(group)}
    if cfg.tie_embeddings:  # written under both of our names (see model.gpt.GPT)
        source["output.weight"] = source["tok_embeddings.weight"]
    with torch.device("meta"):
        specs = {k: (tuple(v.shape), dtype) for k, v in GPT(cfg).state_dict().items()}

    def produce(name: str) -> torch.Tensor:
        theirs, part = source[name]
        tensor = reader.get(renamed.get(theirs, theirs))
        if part is not None:
            tensor = _split_qkv(tensor, cfg.n_heads)[part]
        if tuple(tensor.shape) != specs[name][0]:
            raise ImportHFError(f"{theirs}: shape {tuple(tensor.shape)} does not fit {name} "
                                f"{specs[name][0]} of the config's model")
        return tensor.to(dtype)

    imported_from = str(src) if str(src).startswith("hf:") else str(Path(src).resolve())
    return write_model_checkpoint(out_dir, cfg, specs, produce,
                                  extra={"imported_from": imported_from})


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m model.import_hf SRC OUT [--dtype bfloat16]``."""
    parser = argparse.ArgumentParser(prog="python -m model.import_hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="HF model directory, or hf:<id> where the hub is reachable")
    parser.add_argument("out", help="checkpoint directory to write")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)
    try:
        out = import_hf(args.src, args.out, getattr(torch, args.dtype))
    except ImportHFError as err:
        print(f"import_hf: {err}", file=sys.stderr)
        return 2
    cfg = json.loads((out / "model.json").read_text())
    print(f"imported {args.src} -> {out} ({cfg['family']}, {cfg['n_layers']} layers, "
          f"d_model {cfg['d_model']}, vocab {cfg['vocab_size']})")
    return 0



def init_model_config(src: str | Path) -> ModelConfig:
    """The model shape of a ``train.init_from`` source: an HF directory's translated
    config.json, or the model.json of one of our checkpoints."""
    from model.evaluation.dcp_io import checkpoint_model_config

    path = Path(src)
    if is_hf_dir(path):
        return read_hf_config(path)
    if (path / "model.json").is_file():
        return checkpoint_model_config(path)
    raise ImportHFError(f"{src} is neither a Hugging Face model directory (config.json) nor "
                        "a checkpoint of ours (model.json)")


def resolve_init_from(src: str | Path, work_dir: str | Path, model_cfg: ModelConfig) -> Path:
    """The checkpoint of ours that ``train.init_from=src`` starts from.

    One of our checkpoints is used in place; an HF directory is imported once into
    ``work_dir`` (reused while it is complete and imported from the same ``src``). Raises
    ImportHFError (or CheckpointError) naming the problem: a missing path, an unsupported
    model, a shape other than ``model_cfg``.
    """
    from model.training.checkpoint import check_model_shape, checkpoint_problem, load_extra

    path = Path(src)
    if not path.exists():
        raise ImportHFError(f"train.init_from {str(src)!r} does not exist: point it at a Hugging "
                            "Face model directory or a checkpoint of ours (step-N)")
    if is_hf_dir(path):
        work = Path(work_dir)
        reusable = (checkpoint_problem(work) is None
                    and load_extra(work).get("imported_from") == str(path.resolve()))
        if not reusable:
            import_hf(path.resolve(), work)
        path = work
    check_model_shape(path, model_cfg)
    return path


if __name__ == "__main__":
    sys.exit(main())
