"""Pre-flight: the cheap input checks of every stage a run will compute, before any work.

A stage module may define ``check(cfg) -> None`` (see ``stages.registry``). ``preflight``
calls it for each stage this invocation will run or force, by the driver's rule: with
``--only``/``--from`` the selected stages are recomputed; otherwise (``--force`` aside) a
stage whose key already succeeded is reused and not checked. Nothing is written and no
worker is started, so a bad input costs a second, not a Parsl start-up and a corpus load.
"""
from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

from stages import stage
from stages.config import PipelineConfig
from stages.registry import STAGE_ORDER, stage_module, upstream


def stages_to_compute(cfg: PipelineConfig, only: str | None = None, start: str | None = None,
                      force: bool = False) -> Iterator[tuple[str, ModuleType]]:
    """The stages the driver will run or force (not reuse), in order, with their modules.

    Lazily: a stage's module is imported (and, for a plain run, its key computed from its
    upstream keys) only when the previous ones are yielded, so a check that fails early
    spares importing the later stages (training pulls in torch)."""
    if only or start or force:
        names = [only] if only else STAGE_ORDER[STAGE_ORDER.index(start):] if start else STAGE_ORDER
        for name in names:
            yield name, stage_module(name)
        return
    ctx = stage.PipelineContext("", "", "", "", stage.code_hashes())
    keys: dict[str, str] = {}
    for name in STAGE_ORDER:
        module = stage_module(name)
        inputs = {u: keys[u] for u in upstream(name)}
        keys[name] = stage.stage_key(name, cfg, module.SECTIONS, inputs, ctx.code_for(name))
        if stage.find_succeeded(cfg.runs_dir, name, keys[name]) is None:
            yield name, module


def preflight(cfg: PipelineConfig, only: str | None = None, start: str | None = None,
              force: bool = False) -> list[str]:
    """Run ``check(cfg)`` of every stage that will be computed; return their names.

    A failing check raises its ``ValueError`` (``ConfigError``, ``DataError``, ...), whose
    message names the setting and the fix.
    """
    names = []
    for name, module in stages_to_compute(cfg, only, start, force):
        check = getattr(module, "check", None)
        if check is not None:
            check(cfg)
        names.append(name)
    return names
