"""The pipeline's stages and their order; each stage module declares the rest.

A stage module ``stages/<name>.py`` declares ``SECTIONS`` (the config sections its key
hashes), ``UPSTREAM`` (the stages whose outputs it consumes), ``RESUMABLE`` (whether a
failed attempt's work directory is kept to continue from) and ``shape(cfg)`` (see
``stages.stage.StageShape``). The workflow reads these and knows no stage by name.

A stage module may also define ``check(cfg) -> None``: a cheap pre-flight of its inputs
(paths exist, files parse, settings fit together) that reads no more than the start of a
file and writes nothing. It raises a ``ValueError`` subclass (``ConfigError``,
``DataError``, ...) whose message names the setting and the fix. ``stages.preflight`` runs
it for every stage a run will compute, before any work; the stage's own checks stay.
"""
from __future__ import annotations

import importlib
from types import ModuleType

STAGE_ORDER: tuple[str, ...] = ("tokenize", "plan", "train", "evaluate")


def stage_module(name: str) -> ModuleType:
    """Import ``stages.<name>`` (lazily: training pulls in torch)."""
    if name not in STAGE_ORDER:
        raise ValueError(f"unknown stage {name!r}; choose one of {list(STAGE_ORDER)}")
    return importlib.import_module(f"stages.{name}")


def upstream(name: str) -> tuple[str, ...]:
    """The stages whose outputs (and keys) stage ``name`` consumes."""
    return tuple(stage_module(name).UPSTREAM)
