"""The one stage mechanism every stage shares: keys, status, locks, atomic publish, reuse, MLflow.

A stage's output directory is ``<runs_dir>/stages/<name>/<key>``. The key is the first 16
hex digits of the SHA-256 of the JSON of its *ingredients* (``key_ingredients``):

- ``stage``: the stage name;
- ``sections``: for each config section the stage reads (its module's ``SECTIONS``), the
  SHA-256 (16 hex digits) of that section's values;
- ``inputs``: the keys of the upstream stages it consumes;
- ``code``: the hash of the code that produces the output (``code_hashes``): the bytes of
  every ``.py`` file under ``stages/``, ``model/`` and ``data_prep/`` that ``stages/<name>.py``
  reaches through imports (``import``/``from ... import``, and dotted module names written
  as strings, such as a stage's rank worker module), closed transitively and
  with every parent package's ``__init__.py``; plus ``configs/clusters/*.yaml`` when that
  code includes ``model/planner/cluster.py``. README, docs, tests and the other stages'
  modules are not part of it, so changing them reruns nothing.

The ingredients are stored in ``status.json``, so ``rerun_reason`` can say why a stage
would rerun ("code changed since key X") by comparing with the stage's newest succeeded
output. Work happens in ``<key>.partial``; only a stage that finished is renamed to
``<key>`` with ``status.json`` saying ``succeeded``. So a failed or interrupted stage never
leaves output that a later run could take as done, and a succeeded stage with the same key
is reused instead of recomputed.

One attempt per key at a time: ``begin`` takes the lock ``<key>.lock`` beside the output
(``stages.locks``) in the name of the pipeline driver (``PipelineContext.driver``), waiting
while another live driver holds it, and looks for a succeeded output again once it has it
(so a pipeline that waited reuses what the other one made); ``finish`` and ``fail``
release it, in whichever process they run. The driver keeps its locks fresh with
``stages.locks.Heartbeat``.

The flow is split in ``begin`` / ``finish`` / ``fail`` so that work between them can run
anywhere (Parsl fan-out apps, training ranks launched by torchrun or srun);
``run_stage`` chains them for a stage that is one plain function.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from data_prep.atomic import write_json_atomic
from stages import locks, tracking
from stages.config import PipelineConfig
from stages.registry import STAGE_ORDER

STATUS_FILE = "status.json"

SINGLE, FAN_OUT, RANKS = "single", "fan-out", "ranks"
LOGIN, COMPUTE, ALLOCATION = "login", "compute", "allocation"
PLACEMENTS = (LOGIN, COMPUTE, ALLOCATION)


@dataclass(frozen=True)
class StageShape:
    """How the workflow runs a stage; each stage module's ``shape(cfg)`` returns one.

    - ``single``: one app calls ``run(cfg, inputs, out_dir, tracker) -> outputs``.
    - ``fan-out``: ``prepare(cfg, inputs, out_dir, tracker)``, then ``parts`` apps each call
      ``part(cfg, out_dir, index) -> dict``, then ``finalize(cfg, out_dir, parts, tracker)``.
    - ``ranks``: ``prepare`` writes a ``stages.launch.RankSpec`` and returns its path, the
      launcher starts ``nproc`` ranks of ``python -m <worker> --spec PATH`` on ``nodes``
      nodes, then ``finalize(cfg, out_dir, [], tracker)``.

    ``placement`` says where the stage's Python apps (the single app; prepare, parts and
    finalize) run on a Slurm site; locally they all run on this machine. ``login``: the
    submitting node, for light work; ``compute``: a block of compute nodes of their own
    (``site.tokenize_nodes``), for work that spreads over nodes; ``allocation``: the block
    that runs the ranks stages, for work that needs a compute node after training. A ranks
    stage's ranks always run in that block, wherever its prepare and finalize run.
    """

    kind: str
    parts: int = 0
    nproc: int = 1
    nodes: int = 1
    worker: str = ""
    note: str = ""  # what --dry-run prints after the stage, e.g. "x2 shards"
    placement: str = LOGIN

    def __post_init__(self) -> None:
        if self.kind not in (SINGLE, FAN_OUT, RANKS):
            raise ValueError(f"unknown stage shape {self.kind!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown stage placement {self.placement!r}; one of {PLACEMENTS}")
        if self.kind == RANKS and not self.worker:
            raise ValueError("a ranks stage names its worker module")

    @property
    def ranks_per_node(self) -> int:
        """The most ranks the stage puts on one node (its processes spread over its nodes)."""
        return -(-self.nproc // self.nodes)

OUTPUTS_FILE = "outputs.json"


SOURCE_ROOT = Path(__file__).resolve().parents[1]
CODE_PACKAGES = ("stages", "model", "data_prep")
# The code that reads configs/clusters/*.yaml (a path: a dotted module name written here
# would make every stage's code include it).
CLUSTER_SOURCE = Path("model/planner/cluster.py")
ANY_STAGE = "*"  # code_hashes() entry for a stage outside STAGE_ORDER: all sources
_PKG = "|".join(CODE_PACKAGES)
# Dotted project module names anywhere (imports, worker modules named in strings), and the
# names imported by ``from <package> import a, b`` (which may be modules themselves).
_DOTTED = re.compile(rf"(?<![\w.])(?:{_PKG})(?:\.\w+)+".encode())
_FROM = re.compile(rf"^[ \t]*from[ \t]+((?:{_PKG})[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)"
                   .encode(), re.MULTILINE)


def _module_files(root: Path) -> dict[str, Path]:
    """Module name -> source file for every .py file of the code packages under ``root``."""
    modules: dict[str, Path] = {}
    for package in CODE_PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _imports(source: bytes, modules: dict[str, Path]) -> set[str]:
    """The project modules a source file names (longest prefix of each dotted name that is
    a module, plus its parent packages)."""
    names = {m.decode() for m in _DOTTED.findall(source)}
    for package, imported in _FROM.findall(source):
        base = package.decode()
        names.add(base)
        listed = re.sub(r"#[^\n]*", "", imported.decode()).strip().strip("()\\")
        for item in listed.split(","):
            word = item.split(" as ")[0].strip()
            if word.isidentifier():
                names.add(f"{base}.{word}")
    found: set[str] = set()
    for name in names:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in modules:
                found.update(".".join(parts[:i]) for i in range(1, end + 1))
                break
    return found & modules.keys()


def code_hashes(root: str | Path = SOURCE_ROOT,
                stages: tuple[str, ...] = STAGE_ORDER) -> dict[str, str]:
    """Per stage, the hash of the code that produces its output (see the module docstring),
    plus ``ANY_STAGE``: the hash of every source file. Reads each file once (~20 ms)."""
    root = Path(root)
    modules = _module_files(root)
    sources = {name: path.read_bytes() for name, path in modules.items()}
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in sources.items()}
    edges = {name: _imports(data, modules) for name, data in sources.items()}
    clusters = sorted((root / "configs" / "clusters").glob("*.yaml"))
    cluster_digests = {f"configs/clusters/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
                       for p in clusters}

    def digest(names: set[str]) -> str:
        files = {modules[n].relative_to(root).as_posix(): digests[n] for n in names}
        if CLUSTER_SOURCE.as_posix() in files:
            files.update(cluster_digests)
        return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]

    hashes = {ANY_STAGE: digest(set(modules))}
    for stage_name in stages:
        seen: set[str] = set()
        todo = [f"stages.{stage_name}", "stages"]
        while todo:
            name = todo.pop()
            if name in seen or name not in modules:
                continue
            seen.add(name)
            todo.extend(edges[name] - seen)
        hashes[stage_name] = digest(seen)
    return hashes


@dataclass
class PipelineContext:
    """What every stage needs to know about the pipeline invocation (picklable).

    ``code`` is the per-stage code hash (``code_hashes``, computed once by the driver), or
    one string used for every stage. ``driver`` owns the stage locks this pipeline takes,
    whichever process takes them; ``lock_stale_s`` is how old a lock's heartbeat may get
    before another pipeline takes it as abandoned.
    """

    runs_dir: str
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    code: dict[str, str] | str = field(default_factory=code_hashes)
    driver: locks.Owner = field(default_factory=locks.Owner)
    lock_stale_s: float = locks.STALE_AFTER_S

    def code_for(self, name: str) -> str:
        """The code hash that goes into stage ``name``'s key."""
        if isinstance(self.code, str):
            return self.code
        return self.code.get(name) or self.code[ANY_STAGE]


@dataclass
class StageResult:
    """A finished (or reused) stage: where its outputs are and which runs describe it."""

    name: str
    key: str
    out_dir: str
    outputs: dict[str, Any]
    run_id: str
    producer_run_id: str
    reused: bool


@dataclass
class StageAttempt:
    """A stage in progress: writing into ``work_dir``, logging to MLflow run ``run_id``."""

    name: str
    key: str
    work_dir: str
    final_dir: str
    run_id: str
    inputs: dict[str, dict[str, Any]]
    ingredients: dict[str, Any] = field(default_factory=dict)

    def tracker(self, ctx: PipelineContext) -> tracking.Tracker:
        return tracking.Tracker(ctx.tracking_uri, self.run_id)


def section_hash(cfg: PipelineConfig, section: str) -> str:
    """Hash of one config section's values."""
    blob = json.dumps(dataclasses.asdict(getattr(cfg, section)), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def key_ingredients(
    name: str, cfg: PipelineConfig, sections: tuple[str, ...], input_keys: dict[str, str], code: str
) -> dict[str, Any]:
    """Everything that decides a stage's output (see the module docstring)."""
    return {
        "stage": name,
        "sections": {section: section_hash(cfg, section) for section in sorted(sections)},
        "inputs": dict(sorted(input_keys.items())),
        "code": code,
    }


def key_of(ingredients: dict[str, Any]) -> str:
    """The stage key: the first 16 hex digits of the SHA-256 of the ingredients."""
    blob = json.dumps(ingredients, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def stage_key(
    name: str, cfg: PipelineConfig, sections: tuple[str, ...], input_keys: dict[str, str], code: str
) -> str:
    """Hash of everything that decides a stage's output (``code``: its code hash)."""
    return key_of(key_ingredients(name, cfg, sections, input_keys, code))


def stage_dir(runs_dir: str | Path, name: str, key: str) -> Path:
    return Path(runs_dir) / "stages" / name / key


def read_status(directory: str | Path) -> dict[str, Any] | None:
    """status.json of a stage directory, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((Path(directory) / STATUS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def find_succeeded(runs_dir: str | Path, name: str, key: str) -> StageResult | None:
    """The published result of (name, key) if a run already produced it."""
    directory = stage_dir(runs_dir, name, key)
    status = read_status(directory)
    if not status or status.get("state") != "succeeded":
        return None
    outputs = json.loads((directory / OUTPUTS_FILE).read_text())
    return StageResult(
        name=name,
        key=key,
        out_dir=str(directory),
        outputs=outputs,
        run_id=status["run_id"],
        producer_run_id=status["run_id"],
        reused=True,
    )


def newest_succeeded(runs_dir: str | Path, name: str) -> tuple[str, dict[str, Any]] | None:
    """(key, status) of the most recently published succeeded output of stage ``name``."""
    best: tuple[float, str, dict[str, Any]] | None = None
    for status_path in (Path(runs_dir) / "stages" / name).glob(f"*/{STATUS_FILE}"):
        key = status_path.parent.name
        if "." in key:  # <key>.partial, <key>.old-<pid>
            continue
        status = read_status(status_path.parent)
        if not status or status.get("state") != "succeeded":
            continue
        when = status_path.stat().st_mtime
        if best is None or when > best[0]:
            best = (when, key, status)
    return None if best is None else (best[1], best[2])


def rerun_reason(runs_dir: str | Path, ingredients: dict[str, Any]) -> str:
    """Why a stage with these ingredients would run although an older output exists, e.g.
    "code changed, config section model changed since key 1a2b..."; "" when none exists."""
    name = ingredients["stage"]
    newest = newest_succeeded(runs_dir, name)
    if newest is None:
        return ""
    key, status = newest
    old = status.get("ingredients")
    if not old:
        return f"older output {key} records no key ingredients (made before they were kept)"
    changes = []
    if old.get("code") != ingredients["code"]:
        changes.append("code changed")
    old_sections, new_sections = old.get("sections", {}), ingredients["sections"]
    changed = sorted(s for s in set(old_sections) | set(new_sections)
                     if old_sections.get(s) != new_sections.get(s))
    if changed:
        changes.append(f"config section{'s' if len(changed) > 1 else ''} "
                       f"{', '.join(changed)} changed")
    old_inputs, new_inputs = old.get("inputs", {}), ingredients["inputs"]
    inputs = sorted(i for i in set(old_inputs) | set(new_inputs)
                    if old_inputs.get(i) != new_inputs.get(i))
    if inputs:
        changes.append(f"input{'s' if len(inputs) > 1 else ''} {', '.join(inputs)} changed")
    if not changes:
        return f"same ingredients as key {key} (forced, or hashed differently)"
    return f"{', '.join(changes)} since key {key}"


def _overwrite_status(path: Path, status: dict[str, Any], error: BaseException) -> None:
    """Last resort when the disk is full: rewrite status.json in place, short, inside the
    space the "running" status already holds (no new file, no new blocks)."""
    short = {**status, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    short.pop("ingredients", None)
    try:
        with open(path, "r+b") as handle:
            handle.write(json.dumps(short).encode())
            handle.truncate()
    except OSError as write_error:
        print(f"[stage] could not record the failure in {path}: {write_error}", file=sys.stderr,
              flush=True)


def _status(state: str, run_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "state": state,
        "run_id": run_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }


def _child_run(ctx: PipelineContext, name: str, key: str, tags: dict[str, str]) -> str:
    return tracking.start_run(
        ctx.tracking_uri,
        ctx.experiment_id,
        run_name=f"{name}-{key[:8]}",
        parent_run_id=ctx.parent_run_id,
        tags={"stage": name, "stage_key": key, **tags},
    )


def _log_stage_params(
    tracker: tracking.Tracker,
    cfg: PipelineConfig,
    sections: tuple[str, ...],
    inputs: dict[str, StageResult],
) -> None:
    tracker.log_params({section: dataclasses.asdict(getattr(cfg, section)) for section in sections})
    tracker.set_tags({f"input.{name}.run_id": res.producer_run_id for name, res in inputs.items()})
    tracker.set_tags({f"input.{name}.key": res.key for name, res in inputs.items()})
    tracker.log_dict(cfg.to_dict(), "config.yaml")


def reuse(
    ctx: PipelineContext, found: StageResult, cfg: PipelineConfig, sections, inputs
) -> StageResult:
    """Record a reused stage: a child run tagged ``reused`` that points at its producer."""
    run_id = _child_run(
        ctx,
        found.name,
        found.key,
        {"reused": "true", "producer_run_id": found.producer_run_id, "out_dir": found.out_dir},
    )
    tracker = tracking.Tracker(ctx.tracking_uri, run_id)
    _log_stage_params(tracker, cfg, sections, inputs)
    # Copy the producer's latest metric values so the reused run reads the same in the UI.
    producer = tracking.get_run(ctx.tracking_uri, found.producer_run_id)
    tracker.log_metrics(dict(producer.data.metrics))
    tracker.flush()
    tracking.end_run(ctx.tracking_uri, run_id)
    return dataclasses.replace(found, run_id=run_id)


def lock_path(runs_dir: str | Path, name: str, key: str) -> Path:
    """The lock that one attempt at (name, key) holds: ``<stage dir>/<key>.lock``."""
    return stage_dir(runs_dir, name, key).with_name(f"{key}.lock")


def _take_lock(ctx: PipelineContext, name: str, key: str) -> None:
    """Take (name, key)'s lock for the driver, saying whom it waits for while it waits."""

    def waiting(holder: dict[str, Any]) -> None:
        print(f"waiting for {name} {key} held by {holder.get('host')}:{holder.get('pid')}",
              flush=True)

    locks.acquire(lock_path(ctx.runs_dir, name, key), ctx.driver, ctx.lock_stale_s,
                  on_wait=waiting)


def begin(
    ctx: PipelineContext,
    name: str,
    sections: tuple[str, ...],
    cfg: PipelineConfig,
    inputs: dict[str, StageResult],
    force: bool = False,
    resumable: bool = False,
) -> StageAttempt | StageResult:
    """Reuse a succeeded stage with the same key, or open an attempt to compute it.

    ``resumable`` stages (training) keep an earlier attempt's ``.partial`` directory so
    they can continue from its checkpoints; the others start from an empty directory.
    """
    ingredients = key_ingredients(
        name, cfg, sections, {n: r.key for n, r in inputs.items()}, ctx.code_for(name)
    )
    key = key_of(ingredients)
    if not force:
        found = find_succeeded(ctx.runs_dir, name, key)
        if found is not None:
            return reuse(ctx, found, cfg, sections, inputs)
    final_dir = stage_dir(ctx.runs_dir, name, key)
    _take_lock(ctx, name, key)
    try:
        if not force:  # another pipeline may have made it while this one waited
            found = find_succeeded(ctx.runs_dir, name, key)
            if found is not None:
                locks.release(lock_path(ctx.runs_dir, name, key), ctx.driver)
                return reuse(ctx, found, cfg, sections, inputs)
        work_dir = final_dir.with_name(f"{key}.partial")
        if work_dir.exists() and not resumable:
            shutil.rmtree(work_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
        run_id = _child_run(ctx, name, key, {"reused": "false", "out_dir": str(final_dir)})
        write_json_atomic(
            work_dir / STATUS_FILE, _status("running", run_id, key=key, ingredients=ingredients)
        )
        attempt = StageAttempt(
            name=name,
            key=key,
            work_dir=str(work_dir),
            final_dir=str(final_dir),
            run_id=run_id,
            inputs={n: r.outputs for n, r in inputs.items()},
            ingredients=ingredients,
        )
        _log_stage_params(attempt.tracker(ctx), cfg, sections, inputs)
    except BaseException:
        locks.release(lock_path(ctx.runs_dir, name, key), ctx.driver)
        raise
    return attempt


def _relocate(value: Any, old: str, new: str) -> Any:
    """Rewrite paths inside the work directory to where they live once published."""
    if isinstance(value, str) and (value == old or value.startswith(old + os.sep)):
        return new + value[len(old) :]
    if isinstance(value, dict):
        return {k: _relocate(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_relocate(v, old, new) for v in value]
    return value


def finish(ctx: PipelineContext, attempt: StageAttempt, outputs: dict[str, Any]) -> StageResult:
    """Publish a stage's outputs atomically and close its MLflow run as FINISHED."""
    work, final = Path(attempt.work_dir), Path(attempt.final_dir)
    outputs = _relocate(outputs, str(work), str(final))
    write_json_atomic(work / OUTPUTS_FILE, outputs)
    write_json_atomic(work / STATUS_FILE, _status(
        "succeeded", attempt.run_id, key=attempt.key, ingredients=attempt.ingredients
    ))
    attempt.tracker(ctx).log_artifact(work / OUTPUTS_FILE)
    # A forced recompute replaces the old output only once the new one is complete.
    old = final.with_name(f"{attempt.key}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(work, final)
    shutil.rmtree(old, ignore_errors=True)
    locks.release(lock_path(ctx.runs_dir, attempt.name, attempt.key), ctx.driver)
    tracking.end_run(ctx.tracking_uri, attempt.run_id, "FINISHED")
    return StageResult(
        name=attempt.name,
        key=attempt.key,
        out_dir=str(final),
        outputs=outputs,
        run_id=attempt.run_id,
        producer_run_id=attempt.run_id,
        reused=False,
    )


def fail(ctx: PipelineContext, attempt: StageAttempt, error: BaseException) -> None:
    """Record the error in status.json and close the MLflow run as FAILED."""
    work = Path(attempt.work_dir)
    if work.exists():
        detail = "".join(traceback.format_exception(error))
        status = _status("failed", attempt.run_id, key=attempt.key, error=detail,
                         ingredients=attempt.ingredients)
        try:
            write_json_atomic(work / STATUS_FILE, status)
        except OSError:
            _overwrite_status(work / STATUS_FILE, status, error)
    try:
        locks.release(lock_path(ctx.runs_dir, attempt.name, attempt.key), ctx.driver)
    except OSError as lock_error:
        print(f"[stage] could not release the lock of {attempt.name} {attempt.key}: {lock_error}",
              file=sys.stderr, flush=True)
    try:
        tracking.Tracker(ctx.tracking_uri, attempt.run_id).set_tags({"error": str(error)[:4000]})
        tracking.end_run(ctx.tracking_uri, attempt.run_id, "FAILED")
    except Exception as tracking_error:  # noqa: BLE001 - tracking must not hide the original error
        print(f"[stage] could not mark MLflow run {attempt.run_id} FAILED: {tracking_error}",
              file=sys.stderr, flush=True)


def run_stage(
    ctx: PipelineContext,
    module: ModuleType,
    cfg: PipelineConfig,
    inputs: dict[str, StageResult],
    force: bool = False,
) -> StageResult:
    """Run a stage module's ``run(cfg, inputs, out_dir, tracker)`` under the mechanism."""
    name = module.__name__.rsplit(".", 1)[-1]
    resumable = getattr(module, "RESUMABLE", False)
    attempt = begin(ctx, name, module.SECTIONS, cfg, inputs, force, resumable)
    if isinstance(attempt, StageResult):
        return attempt
    tracker = attempt.tracker(ctx)
    try:
        outputs = module.run(cfg, attempt.inputs, Path(attempt.work_dir), tracker)
        tracker.flush()
    except BaseException as error:
        fail(ctx, attempt, error)
        raise
    return finish(ctx, attempt, outputs)
