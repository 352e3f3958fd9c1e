"""Model shapes for the planner's command line: a bare YAML mapping of shapes, with
``ModelConfig`` names or the common aliases of other frameworks, or a pipeline preset
(which the command line loads with the pipeline's own config loader)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from model.config import ModelConfig
from model.parallel.layout import PlanError

ALIASES = {
    "n_layers": ("num_layers", "num_hidden_layers", "n_layer", "layers"),
    "d_model": ("hidden_size", "n_embd", "hidden", "dim"),
    "n_heads": ("num_attention_heads", "n_head", "heads"),
    "n_kv_heads": ("num_key_value_heads", "kv_heads"),
    "vocab_size": ("padded_vocab_size", "vocab"),
    "max_seq_len": ("seq_length", "max_position_embeddings", "n_positions", "seq_len"),
    "ffn_hidden": ("intermediate_size", "ffn_hidden_size"),
}
PRESET_SECTIONS = {"train", "parallel", "data"}
"""A file with a ``model`` mapping and any of these is a pipeline preset."""


def model_from_mapping(raw: dict[str, Any], where: str) -> ModelConfig:
    """A ModelConfig from ModelConfig names or common aliases; unknown keys are an error."""
    out: dict[str, Any] = {}
    used = set()
    for name, aliases in ALIASES.items():
        for key in (name, *aliases):
            if key in raw:
                out[name] = raw[key]
                used.add(key)
                break
    for key in ("family", "parallel_residual", "rope_theta", "norm_eps", "init_std"):
        if key in raw:
            out[key] = raw[key]
            used.add(key)
    missing = [n for n in ("n_layers", "d_model", "n_heads", "vocab_size") if n not in out]
    if missing:
        raise PlanError(f"{where}: model shape lacks {missing} (accepted names: "
                        + "; ".join(f"{n} or {'/'.join(a)}" for n, a in ALIASES.items()) + ")")
    extra = sorted(set(raw) - used)
    if extra:
        raise PlanError(f"{where}: unknown model keys {extra}")
    try:
        return ModelConfig(**out)
    except (TypeError, ValueError) as exc:
        raise PlanError(f"{where}: {exc}") from exc


def read_model_file(path: str | Path) -> tuple[ModelConfig | None, dict[str, Any]]:
    """(the model, the file's mapping) of a bare shape file or a preset's lone ``model``
    section; (None, the mapping) for a pipeline preset, which the caller loads whole."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PlanError(f"cannot read model config {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: expected a mapping")
    if "model" in raw and isinstance(raw["model"], dict):
        if PRESET_SECTIONS & set(raw):
            return None, raw
        return model_from_mapping(raw["model"], str(path)), raw
    return model_from_mapping(raw, str(path)), raw
