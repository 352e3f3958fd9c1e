"""What a stage declares, and the ordered list of stages the engine takes.

A stage is one folder, ``stages/<name>/``: its declaration (``STAGE``, a ``StageDeclaration``
in ``stages/<name>/__init__.py``), its work module and, for a ranks stage, its rank worker.
``stages.registry`` names the stages in order. The engine (``stages.mechanism``: keys,
outputs, attempts, locks, tracking, the stage walk, the launcher) reads declarations and
knows no stage, model or data rule, as Bazel's engine knows no rule: everything particular
to a stage is a field here.

A declaration is light: building it imports only the configuration and the shape
arithmetic; the work module is imported only where the work runs (``work``).
"""
from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from stages.mechanism.shape import StageShape


def json_digest(value: Any) -> str:
    """A digest of a JSON-able value (16 hex digits); of a stage's outputs, the default output
    digest (``StageDeclaration.digest``)."""
    blob = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Continuation:
    """Where a new attempt of a stage continues from: an earlier output (``key``; "" for a
    bare source path), its position ``step`` in ``source`` and why. ``digest`` identifies
    the source's content and enters the key (``ingredient``), so a continued output never
    passes for a fresh one. ``source_run_id``/``source_store``: the MLflow run it continues,
    whose history is copied up to ``step``."""

    key: str
    step: int
    checkpoint: str
    why: str
    digest: str = ""
    source_run_id: str = ""
    source_store: str = ""
    warning: str = ""
    history: bool = True
    """Whether the new MLflow run takes the source run's metric history up to ``step`` (a
    continued training's curve); False where the new attempt logs every figure afresh."""

    def ingredient(self) -> dict[str, Any]:
        """What enters the key: the source and its content's digest."""
        return {"from": self.key or self.checkpoint, "step": self.step,
                "checkpoint": self.digest}


@dataclass(frozen=True)
class ContinuationHook:
    """How a stage with extent fields continues an earlier output of its own.

    ``find(runs_dir, stage, cfg, ingredients)`` returns the ``Continuation`` a new attempt
    starts from, or None to start afresh; ``seed(continuation, work_dir)`` places the source
    in the new attempt's work directory and says whether it did (False: the attempt already
    holds work of its own to resume)."""

    find: Callable[[Any, StageDeclaration, Any, dict[str, Any]], Continuation | None]
    seed: Callable[[Continuation, Any], bool]


@dataclass(frozen=True)
class StageDeclaration:
    """One stage of the pipeline.

    - ``sections``: the config sections its key hashes (and its MLflow run records), each
      less the fields its config class lists in ``KEYLESS`` (they change no output);
    - ``fields``: single ``section.field`` values of other sections its key hashes too;
    - ``derived``: a value computed from the config that decides the output and that no
      section states directly (curation's evaluation texts, read from the task files the
      config names), hashed into the key; cheap and light, since the driver calls it;
    - ``upstream``: the stages whose outputs (and digests) it consumes;
    - ``shape``: how it runs for a config (``stages.mechanism.shape.StageShape``);
    - ``module``: the work module; ``worker``: the rank worker module of a ranks stage;
    - ``code_roots``: more modules whose code computes its output (the key's code hash
      follows ``module``, ``worker`` and these through their imports);
    - ``not_code``: project modules its code imports that never change its output (files,
      progress lines, pictures, errors): left out of the code hash;
    - ``data_files``: (module, glob) pairs: files the module reads as code does (cluster
      descriptions), hashed by their parsed content when the module is in the code;
    - ``software``: the libraries (distribution names) whose versions enter its key;
    - ``resumable``: a failed attempt's work directory is kept to continue from;
    - ``check``: a cheap pre-flight of its inputs, run before any work, given the config and
      the published outputs of its upstream stages this invocation reuses (name -> outputs);
    - ``verify``: a cheap check of a published output before it is reused: a problem it
      names makes the stage run again (a resumable one continuing from that output);
    - ``digest``: what its downstream stages' keys hash of its output (early cutoff);
    - ``extends`` and ``continuation``: its *extent* fields (``section.field``) and the hook
      that continues an earlier output differing only there (training's more steps);
    - ``ranks_log``, ``activity``: where a local run of its ranks logs and what it is called.
    """

    name: str
    sections: tuple[str, ...]
    upstream: tuple[str, ...]
    shape: Callable[[Any], StageShape]
    module: str
    worker: str = ""
    fields: tuple[str, ...] = ()
    derived: Callable[[Any], Any] | None = None
    code_roots: tuple[str, ...] = ()
    not_code: tuple[str, ...] = ()
    data_files: tuple[tuple[str, str], ...] = ()
    software: tuple[str, ...] = ()
    resumable: bool = False
    check: Callable[[Any, dict[str, Any]], None] | None = None
    verify: Callable[[dict[str, Any]], str | None] | None = None
    digest: Callable[[dict[str, Any]], str] | None = None
    extends: tuple[str, ...] = ()
    continuation: ContinuationHook | None = None
    ranks_log: str = "ranks.log"
    activity: str = ""

    def __post_init__(self) -> None:
        if self.extends and self.continuation is None:
            raise ValueError(f"stage {self.name}: extent fields {self.extends} need a "
                             "continuation hook")

    def work(self) -> ModuleType:
        """Import the work module (lazily: training pulls in torch)."""
        return importlib.import_module(self.module)

    def roots(self) -> tuple[str, ...]:
        """The modules the code hash starts from: work module, rank worker, ``code_roots``."""
        return tuple(m for m in (self.module, self.worker, *self.code_roots) if m)

    def output_digest(self, outputs: dict[str, Any]) -> str:
        """The digest of a published output that downstream keys hash (``digest``)."""
        return (self.digest or json_digest)(outputs)

    def output_problem(self, outputs: dict[str, Any]) -> str | None:
        """What is wrong with a published output of this stage (``verify``), or None."""
        return self.verify(outputs) if self.verify is not None else None


class StageList:
    """The pipeline's stages in order: what the engine takes (``stages.registry.PIPELINE``).

    Checks that names are unique and that every stage's upstream comes before it."""

    def __init__(self, stages: Iterable[StageDeclaration]) -> None:
        self.stages: tuple[StageDeclaration, ...] = tuple(stages)
        seen: set[str] = set()
        for stage in self.stages:
            if stage.name in seen:
                raise ValueError(f"stage {stage.name!r} is declared twice")
            missing = [u for u in stage.upstream if u not in seen]
            if missing:
                raise ValueError(f"stage {stage.name!r}: upstream {missing} must come before it")
            seen.add(stage.name)
        self._by_name = {s.name: s for s in self.stages}

    def __iter__(self) -> Iterator[StageDeclaration]:
        return iter(self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def order(self) -> tuple[str, ...]:
        """The stage names in pipeline order."""
        return tuple(s.name for s in self.stages)

    def get(self, name: str) -> StageDeclaration:
        """The declaration of stage ``name``."""
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(f"unknown stage {name!r}; choose one of {list(self.order)}") from None

    def find(self, name: str) -> StageDeclaration | None:
        """The declaration of stage ``name``, or None (a test's or a notebook's own stage)."""
        return self._by_name.get(name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (StageList, (self.stages,))
