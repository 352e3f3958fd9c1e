"""Stage keys: what decides a stage's output, hashed.

A stage's output directory is ``<runs_dir>/stages/<name>/<key>`` (``stages.mechanism.outputs``).
The key is the first 16 hex digits of the SHA-256 of the JSON of its *ingredients*
(``key_ingredients``), in the vocabulary of Snakemake's rerun triggers:

- ``config``: for each config section the stage reads (its declaration's ``sections``) the
  hash of that section's values, less the fields that never change an output
  (``NEVER_IN_KEYS``: logging and checkpoint cadence) and less the *extent* fields a stage
  declares it can be extended by (``StageDeclaration.extends``: ``train.steps``), which go
  to ``extent`` and only into the key of that stage;
- ``input``: a digest of what each upstream stage *produced* (``StageDeclaration.digest``:
  the token store's manifest and chunk checksums, plan.json's layout, the final checkpoint's
  manifest), not the upstream's key. An upstream that reruns and makes the same output
  leaves its downstream stages reused (Bazel's early cutoff);
- ``code``: the code that computes the output (``code_hashes``): the stage's work module,
  its rank worker and every project module they import, followed through the syntax tree
  (``ast``; imports inside functions too, and module names written as string constants),
  each hashed from its syntax tree with comments and docstrings dropped. Never followed:
  the stage mechanism (``stages.mechanism``: keys, locks, attempts, tracking, the launcher,
  the config loader, ...), the modules that only report (``REPORTING_ONLY``), and
  everything outside ``stages``, ``model`` and ``data_prep`` (``workflows`` is the driver);
  plus ``configs/clusters/*.yaml`` when the code reads them (the planner);
- ``software``: the Python minor version (it decides the syntax trees' form) and the
  versions of the libraries that compute the stage's output
  (``StageDeclaration.software``: tokenizers and Zarr for tokenize, torch for the others).

A continued training (``stages.mechanism.continuation``) adds ``continues``: the key and
step it starts from. The ingredients are stored in ``status.json``, so ``rerun_reason``
can say why a stage would rerun by comparing with the stage's newest succeeded output.
docs/reruns.md has the table of which change reruns what.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from stages.mechanism import outputs
from stages.mechanism.config import PipelineConfig
from stages.mechanism.registry import STAGE_ORDER, STAGES, StageDeclaration, declaration

SOURCE_ROOT = Path(__file__).resolve().parents[2]
CODE_PACKAGES = ("stages", "model", "data_prep")
MECHANISM_PACKAGE = "stages.mechanism"
REPORTING_ONLY = frozenset({"data_prep.progress", "model.training.plots"})
"""Modules outside the mechanism that only print progress lines or draw pictures."""
CLUSTER_SOURCE = "model.planner.cluster"  # the code that reads configs/clusters/*.yaml
NEVER_IN_KEYS = {
    "train": ("log_every", "checkpoint_every", "checkpoint_minutes", "keep_last", "keep_every",
              "async_checkpoint", "resume_from", "collective_timeout_s", "slow_rank_every",
              "slow_rank_ratio"),
}
"""Config fields that change no stage's output: how often it logs, saves or watches its
ranks, how many saves it keeps, how long a collective may hang. ``train.resume_from`` enters
a key as the resolved ``continues`` ingredient."""
TRIGGERS = ("config", "input", "code", "software")
"""What can make a stage rerun (``--rerun-triggers``); each names ingredients below."""
TRIGGER_INGREDIENTS = {"config": ("sections", "extent"), "input": ("inputs", "continues"),
                       "code": ("code",), "software": ("software",)}
ANY_STAGE = "*"  # code_hashes() entry for a stage outside STAGE_ORDER: all sources


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


def docstring_of(node: ast.AST) -> ast.Expr | None:
    """The docstring statement of a module, class or function node, or None."""
    body = getattr(node, "body", None)
    if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
        return body[0]
    return None


def _drop_docstrings(tree: ast.AST) -> ast.AST:
    """Remove the docstring of the module and of every class and function in place."""
    for node in ast.walk(tree):
        if docstring_of(node) is not None:
            node.body = node.body[1:] or [ast.Pass()]
    return tree


def _is_type_checking(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _named_modules(tree: ast.AST, module: str, is_package: bool,
                   modules: dict[str, Path]) -> set[str]:
    """The project modules ``tree`` imports (at any depth, except under ``TYPE_CHECKING``)
    or names as a string constant (``python -m stages.train_worker``), with their parent
    packages."""
    names: set[str] = set()
    base = module if is_package else module.rpartition(".")[0]
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            package = node.module or ""
            if node.level:
                anchor = base.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                package = ".".join([*anchor, package] if package else anchor)
            names.add(package)
            names.update(f"{package}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, str) and node.value in modules:
                names.add(node.value)
        elif not _is_type_checking(node):
            todo.extend(ast.iter_child_nodes(node))
    found: set[str] = set()
    for name in names:
        parts = name.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return found & modules.keys()


_PARSED: dict[Path, tuple[tuple[int, int], str, set[str]]] = {}
"""Per source file: (mtime_ns, size) when parsed, its digest, the modules it names."""


def _parsed(name: str, path: Path, modules: dict[str, Path]) -> tuple[str, set[str]]:
    """(digest of the normalized syntax tree, project modules named) of one source file,
    parsed again only when its size or modification time changed."""
    stat = path.stat()
    stamp = (stat.st_mtime_ns, stat.st_size)
    cached = _PARSED.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1], cached[2]
    tree = _drop_docstrings(ast.parse(path.read_bytes(), filename=str(path)))
    digest = hashlib.sha256(ast.dump(tree).encode()).hexdigest()
    edges = _named_modules(tree, name, path.name == "__init__.py", modules)
    _PARSED[path] = (stamp, digest, edges)
    return digest, edges


def _outside_code(name: str) -> bool:
    """Modules never part of a stage's code: the mechanism and the reporting-only ones."""
    return (name == MECHANISM_PACKAGE or name.startswith(MECHANISM_PACKAGE + ".")
            or name in REPORTING_ONLY)


def code_hashes(root: str | Path = SOURCE_ROOT,
                stages: tuple[str, ...] = STAGE_ORDER) -> dict[str, str]:
    """Per stage, the hash of the code that computes its output (see the module docstring),
    plus ``ANY_STAGE``: the hash of every source file. The driver calls it once per
    invocation and hands the result on; a file is parsed again only once it changed."""
    root = Path(root)
    modules = _module_files(root)
    digests: dict[str, str] = {}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        digests[name], edges[name] = _parsed(name, path, modules)
    clusters = sorted((root / "configs" / "clusters").glob("*.yaml"))
    cluster_digests = {f"configs/clusters/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
                       for p in clusters}

    def digest(names: set[str]) -> str:
        files = {modules[n].relative_to(root).as_posix(): digests[n] for n in names}
        if CLUSTER_SOURCE in names:
            files.update(cluster_digests)
        return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]

    hashes = {ANY_STAGE: digest(set(modules))}
    for stage_name in stages:
        hashes[stage_name] = digest(stage_modules(declaration(stage_name), modules, edges))
    return hashes


def stage_modules(stage: StageDeclaration, modules: dict[str, Path],
                  edges: dict[str, set[str]]) -> set[str]:
    """The modules a stage's code digest covers: its work module and rank worker, closed
    over ``edges`` (module -> modules it names), the mechanism and reporting excepted."""
    seen: set[str] = set()
    todo = [stage.module, stage.worker]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules or _outside_code(name):
            continue
        seen.add(name)
        todo.extend(edges[name] - seen)
    return seen


def code_modules(stage_name: str, root: str | Path = SOURCE_ROOT) -> list[str]:
    """The module names stage ``stage_name``'s code digest covers, sorted (for docs and
    tests: which edits rerun it)."""
    root = Path(root)
    modules = _module_files(root)
    edges = {name: _parsed(name, path, modules)[1] for name, path in modules.items()}
    return sorted(stage_modules(declaration(stage_name), modules, edges))


def code_for(code: dict[str, str] | str, name: str) -> str:
    """Stage ``name``'s code hash from ``code_hashes()`` (or one string used for every stage)."""
    if isinstance(code, str):
        return code
    return code.get(name) or code[ANY_STAGE]


@lru_cache(maxsize=None)
def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def software_for(stage: StageDeclaration) -> dict[str, str]:
    """The software environment that enters a stage's key: Python's minor version and the
    installed versions of the libraries the stage declares (``StageDeclaration.software``)."""
    versions = {"python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    versions.update({name: _version(name) for name in stage.software})
    return versions


def section_values(cfg: PipelineConfig, section: str,
                   leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """One config section's values, less ``NEVER_IN_KEYS`` and ``leave_out``."""
    values = dataclasses.asdict(getattr(cfg, section))
    for name in (*NEVER_IN_KEYS.get(section, ()), *leave_out):
        values.pop(name, None)
    return values


def _hash(value: Any) -> str:
    blob = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def section_hash(cfg: PipelineConfig, section: str, leave_out: tuple[str, ...] = ()) -> str:
    """Hash of one config section's values that can change an output."""
    return _hash(section_values(cfg, section, leave_out))


def extent_fields(section: str) -> tuple[str, ...]:
    """The fields of ``section`` that are extent fields of some stage (left out of every
    section hash; they enter only the extended stage's ``extent``)."""
    return tuple(f.split(".", 1)[1] for s in STAGES for f in s.extends
                 if f.split(".", 1)[0] == section)


def key_ingredients(
    stage: StageDeclaration, cfg: PipelineConfig, input_digests: dict[str, str], code: str,
) -> dict[str, Any]:
    """Everything that decides a stage's output (see the module docstring)."""
    ingredients: dict[str, Any] = {
        "stage": stage.name,
        "sections": {s: section_hash(cfg, s, extent_fields(s))
                     for s in sorted(stage.sections)},
        "inputs": dict(sorted(input_digests.items())),
        "code": code,
        "software": software_for(stage),
    }
    if stage.extends:
        ingredients["extent"] = {f: _field(cfg, f) for f in stage.extends}
    return ingredients


def _field(cfg: PipelineConfig, dotted: str) -> Any:
    section, name = dotted.split(".", 1)
    return getattr(getattr(cfg, section), name)


def config_record(stage: StageDeclaration, cfg: PipelineConfig) -> dict[str, Any]:
    """The values of the sections a stage reads, as ``status.json`` keeps them beside the
    ingredients (never hashed: for saying which field differs)."""
    return {s: section_values(cfg, s) for s in sorted(stage.sections)}


def key_of(ingredients: dict[str, Any]) -> str:
    """The stage key: the first 16 hex digits of the SHA-256 of the ingredients."""
    return _hash(ingredients)


def same_except(old: dict[str, Any], new: dict[str, Any], triggers: tuple[str, ...]) -> bool:
    """Whether two ingredient records agree on every ingredient the given rerun triggers
    name (``TRIGGER_INGREDIENTS``)."""
    return all(old.get(part) == new.get(part)
               for trigger in triggers for part in TRIGGER_INGREDIENTS[trigger])


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two ingredient records, in words ("code", "config section
    model", "input tokenize", "software torch 2.12.0 -> 2.13.0", "train.steps 40 -> 60")."""
    changes = []
    if old.get("code") != new.get("code"):
        changes.append("code")
    for label, part in (("config section", "sections"), ("input", "inputs")):
        before, after = old.get(part, {}), new.get(part, {})
        changed = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
        changes.extend(f"{label} {n}" for n in changed)
    before, after = old.get("extent", {}), new.get("extent", {})
    changes.extend(f"{n} {before.get(n)} -> {after.get(n)}"
                   for n in sorted(set(before) | set(after)) if before.get(n) != after.get(n))
    before, after = old.get("software", {}), new.get("software", {})
    changes.extend(f"software {n} {before.get(n)} -> {after.get(n)}"
                   for n in sorted(set(before) | set(after)) if before.get(n) != after.get(n))
    if old.get("continues") != new.get("continues"):
        changes.append("continuation")
    return changes


def rerun_reason(runs_dir: str | Path, ingredients: dict[str, Any]) -> str:
    """Why a stage with these ingredients would run although an older output exists, e.g.
    "code, config section model changed since key 1a2b..."; "" when none exists."""
    name = ingredients["stage"]
    newest = outputs.newest_succeeded(runs_dir, name)
    if newest is None:
        return ""
    key, status = newest
    old = status.get("ingredients")
    if not old:
        return f"older output {key} records no key ingredients (made before they were kept)"
    changes = differences(old, ingredients)
    if not changes:
        return f"same ingredients as key {key} (forced, or hashed differently)"
    return f"{', '.join(changes)} changed since key {key}"
