"""The pipeline's stages, their order and what each one consumes."""
from __future__ import annotations

import importlib
from types import ModuleType

STAGE_ORDER: tuple[str, ...] = ("tokenize", "plan", "train", "evaluate")

# Upstream stages whose outputs (and keys) a stage consumes.
UPSTREAM: dict[str, tuple[str, ...]] = {
    "tokenize": (),
    "plan": ("tokenize",),  # checks that the store's vocabulary fits the model
    "train": ("tokenize", "plan"),
    "evaluate": ("tokenize", "train"),
}


def stage_module(name: str) -> ModuleType:
    """Import ``stages.<name>`` (lazily: training pulls in torch)."""
    if name not in STAGE_ORDER:
        raise ValueError(f"unknown stage {name!r}; choose one of {list(STAGE_ORDER)}")
    return importlib.import_module(f"stages.{name}")
