"""Stage keys: what decides a stage's output, hashed.

A stage's output directory is ``<runs_dir>/stages/<name>/<key>`` (``stages.mechanism.outputs``).
The key is the first 16 hex digits of the SHA-256 of the JSON of its *ingredients*
(``key_ingredients``), in the vocabulary of Snakemake's rerun triggers:

- ``config``: for each config section the stage reads (its declaration's ``sections``) the
  hash of that section's values, less the fields its config class lists as ``KEYLESS``
  (they change no output: logging, progress and checkpoint cadence), plus the single
  ``fields`` of other sections it declares and its ``derived`` value (a digest); its *extent* fields
  (``StageDeclaration.extends``: ``train.steps``) go to ``extent``;
- ``input``: a digest of what each upstream stage *produced* (``StageDeclaration.digest``:
  the token store's manifest and chunk checksums, plan.json's layout, the final checkpoint's
  manifest), not the upstream's key. An upstream that reruns and makes the same output
  leaves its downstream stages reused (Bazel's early cutoff);
- ``code``: the code that computes the output (``code_hashes``): the stage's roots (work
  module, rank worker, ``code_roots``) and every project module they import, followed
  through the syntax tree (``ast``; imports inside functions too, and module names written
  as string constants), each hashed from its syntax tree with comments and docstrings
  dropped. Never followed: the engine (``stages.mechanism``), the packages that hold the
  stage's declaration, the modules the stage declares ``not_code`` and everything outside
  ``stages``, ``model`` and ``data_prep`` (``workflows`` is the driver); plus the data files
  a covered module reads as code (``data_files``: the cluster descriptions), hashed by their
  parsed content, so a comment there changes nothing;
- ``software``: the Python minor version (it decides the syntax trees' form) and the
  versions of the libraries that compute the stage's output
  (``StageDeclaration.software``: tokenizers and Zarr for tokenize, torch for the others).

A continued stage (its declaration's ``continuation`` hook: more training) adds
``continues``: the source key, the step it starts from and the source's content digest.
The ingredients are stored in ``status.json``, so ``rerun_reason`` can say why a stage
would rerun by comparing with the stage's newest succeeded output.
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

import yaml

from stages.mechanism import outputs
from stages.mechanism.declaration import StageDeclaration, StageList, json_digest

SOURCE_ROOT = Path(__file__).resolve().parents[2]
CODE_PACKAGES = ("stages", "model", "data_prep")
MECHANISM_PACKAGE = "stages.mechanism"
TRIGGERS = ("config", "input", "code", "software")
"""What can make a stage rerun (``--rerun-triggers``); each names ingredients below."""
TRIGGER_INGREDIENTS = {"config": ("sections", "fields", "derived", "extent"),
                       "input": ("inputs", "continues"), "code": ("code",),
                       "software": ("software",)}
ANY_STAGE = "*"  # code_hashes() entry for a stage outside the pipeline: all sources


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


def _named_modules(tree: ast.AST, module: str, is_package: bool) -> frozenset[str]:
    """The module names ``tree`` imports (at any depth, except under ``TYPE_CHECKING``) and
    its string constants, any of which may name a project module (``python -m
    stages.train.worker``): the caller keeps those that are project modules."""
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
            if isinstance(node.value, str):
                names.add(node.value)
        elif not _is_type_checking(node):
            todo.extend(ast.iter_child_nodes(node))
    return frozenset(names)


_PARSED: dict[tuple[str, str, bool], tuple[str, frozenset[str]]] = {}
"""(sha-256 of a source file's bytes, its module, whether a package) -> the digest of its
syntax tree and the names it holds: a file is parsed once per content, wherever it lies
(the rerun tests hash many copies of one tree)."""


def _parsed(name: str, path: Path, modules: dict[str, Path]) -> tuple[str, set[str]]:
    """(digest of the normalized syntax tree, project modules named) of one source file."""
    source = path.read_bytes()
    key = (hashlib.sha256(source).hexdigest(), name, path.name == "__init__.py")
    if key not in _PARSED:
        tree = _drop_docstrings(ast.parse(source, filename=str(path)))
        _PARSED[key] = (hashlib.sha256(ast.dump(tree).encode()).hexdigest(),
                        _named_modules(tree, name, key[2]))
    digest, names = _PARSED[key]
    return digest, names & modules.keys()


def _data_file_digest(path: Path) -> str:
    """A data file's digest by its parsed content (YAML/JSON), so comments and layout change
    nothing; raw bytes for a file that does not parse."""
    try:
        value = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError):
        return hashlib.sha256(path.read_bytes()).hexdigest()
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _parsed_sources(root: Path) -> tuple[dict[str, Path], dict[str, str], dict[str, set[str]]]:
    """(module -> file, module -> digest, module -> modules it names) of the code packages."""
    modules = _module_files(root)
    digests: dict[str, str] = {}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        digests[name], edges[name] = _parsed(name, path, modules)
    return modules, digests, edges


def code_hashes(pipeline: StageList, root: str | Path = SOURCE_ROOT) -> dict[str, str]:
    """Per stage of ``pipeline``, the hash of the code that computes its output (see the
    module docstring), plus ``ANY_STAGE``: the hash of every source file. The driver calls it
    once per invocation and hands the result on; a file is parsed again only once it
    changed."""
    root = Path(root)
    modules, digests, edges = _parsed_sources(root)

    def digest(stage: StageDeclaration | None, names: set[str]) -> str:
        files = {modules[n].relative_to(root).as_posix(): digests[n] for n in names}
        for module, pattern in (stage.data_files if stage else ()):
            if module in names:
                files.update({p.relative_to(root).as_posix(): _data_file_digest(p)
                              for p in sorted(root.glob(pattern))})
        return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]

    hashes = {ANY_STAGE: digest(None, set(modules))}
    for stage in pipeline:
        hashes[stage.name] = digest(stage, stage_modules(stage, modules, edges))
    return hashes


def _declaring_packages(stage: StageDeclaration) -> set[str]:
    """The packages above the stage's roots (``stages``, ``stages.train``): they hold its
    declaration, which says how it runs, not what it makes."""
    packages: set[str] = set()
    for root in stage.roots():
        parts = root.split(".")[:-1]
        packages.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return packages


def stage_modules(stage: StageDeclaration, modules: dict[str, Path],
                  edges: dict[str, set[str]]) -> set[str]:
    """The modules a stage's code digest covers: its roots, closed over ``edges`` (module ->
    modules it names), less the engine, its declaring packages and its ``not_code``."""
    outside = _declaring_packages(stage) | set(stage.not_code)
    seen: set[str] = set()
    todo = list(stage.roots())
    while todo:
        name = todo.pop()
        if name in seen or name not in modules or name in outside:
            continue
        if name == MECHANISM_PACKAGE or name.startswith(MECHANISM_PACKAGE + "."):
            continue
        seen.add(name)
        todo.extend(edges[name] - seen)
        parts = name.split(".")  # importing a module runs its packages' __init__ first
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
    return seen


def code_modules(stage: StageDeclaration, root: str | Path = SOURCE_ROOT) -> list[str]:
    """The module names a stage's code digest covers, sorted (for docs and tests: which
    edits rerun it)."""
    modules, _, edges = _parsed_sources(Path(root))
    return sorted(stage_modules(stage, modules, edges))


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


def section_values(cfg: Any, section: str, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """One config section's values, less its class's ``KEYLESS`` fields and ``leave_out``."""
    values_of = getattr(cfg, section)
    values = dataclasses.asdict(values_of)
    for name in (*getattr(type(values_of), "KEYLESS", ()), *leave_out):
        values.pop(name, None)
    return values


def sectionjson_digest(cfg: Any, section: str, leave_out: tuple[str, ...] = ()) -> str:
    """Hash of one config section's values that can change an output."""
    return json_digest(section_values(cfg, section, leave_out))


def key_ingredients(stage: StageDeclaration, cfg: Any, input_digests: dict[str, str],
                    code: str) -> dict[str, Any]:
    """Everything that decides a stage's output (see the module docstring)."""
    ingredients: dict[str, Any] = {
        "stage": stage.name,
        "sections": {s: sectionjson_digest(cfg, s) for s in sorted(stage.sections)},
        "inputs": dict(sorted(input_digests.items())),
        "code": code,
        "software": software_for(stage),
    }
    if stage.fields:
        ingredients["fields"] = {f: _field(cfg, f) for f in sorted(stage.fields)}
    if stage.derived is not None:
        ingredients["derived"] = json_digest(stage.derived(cfg))
    if stage.extends:
        ingredients["extent"] = {f: _field(cfg, f) for f in stage.extends}
    return ingredients


def _field(cfg: Any, dotted: str) -> Any:
    section, name = dotted.split(".", 1)
    return getattr(getattr(cfg, section), name)


def config_record(stage: StageDeclaration, cfg: Any) -> dict[str, Any]:
    """The values of the sections a stage reads, as ``status.json`` keeps them beside the
    ingredients (never hashed: for saying which field differs)."""
    return {s: section_values(cfg, s) for s in sorted(stage.sections)}


def key_of(ingredients: dict[str, Any]) -> str:
    """The stage key: the first 16 hex digits of the SHA-256 of the ingredients."""
    return json_digest(ingredients)


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
    if old.get("derived") != new.get("derived"):
        changes.append("derived config values")
    for label, part in (("config section", "sections"), ("input", "inputs")):
        before, after = old.get(part, {}), new.get(part, {})
        changed = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
        changes.extend(f"{label} {n}" for n in changed)
    for part in ("fields", "extent"):
        before, after = old.get(part, {}), new.get(part, {})
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
