"""Stage keys: what decides a stage's output, hashed.

A stage's output directory is ``<runs_dir>/stages/<name>/<key>`` (``stages.mechanism.outputs``). The
key is the first 16 hex digits of the SHA-256 of the JSON of its *ingredients*
(``key_ingredients``):

- ``stage``: the stage name;
- ``sections``: for each config section the stage reads (its declaration's ``sections``),
  the SHA-256 (16 hex digits) of that section's values;
- ``inputs``: the keys of the upstream stages it consumes;
- ``code``: the hash of the code that produces the output (``code_hashes``): the bytes of
  every ``.py`` file under ``stages/``, ``model/`` and ``data_prep/`` that the stage's work
  module, its rank worker and the stage mechanism (``stages.mechanism.attempt``) reach through
  imports
  (``import``/``from ... import``, and dotted module names written as strings), closed
  transitively and with every parent package's ``__init__.py`` (the registry and the
  pre-flight checks excepted: they declare and refuse, they never shape an output); plus
  ``configs/clusters/*.yaml`` when that code includes ``model/planner/cluster.py``. README,
  docs, tests and the other stages' modules are not part of it, so changing them reruns
  nothing.

The ingredients are stored in ``status.json``, so ``rerun_reason`` can say why a stage
would rerun ("code changed since key X") by comparing with the stage's newest succeeded
output.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from stages.mechanism import outputs
from stages.mechanism.config import PipelineConfig
from stages.mechanism.registry import STAGE_ORDER, declaration

SOURCE_ROOT = Path(__file__).resolve().parents[2]
CODE_PACKAGES = ("stages", "model", "data_prep")
# The code that reads configs/clusters/*.yaml (a path: a dotted module name written here
# would make every stage's code include it).
CLUSTER_SOURCE = Path("model/planner/cluster.py")
# Not followed into a stage's code: what the registry declares enters a key as the sections
# and inputs themselves (following it would put every stage's code into every key), and the
# pre-flight checks only refuse inputs, they never shape an output.
NOT_CODE = frozenset({"stages.mechanism.registry", "stages.mechanism.checks"})
# The stage mechanism (attempt, outputs, keys, locks, tracking) is part of every stage's code.
MECHANISM = ("stages", "stages.mechanism.attempt")
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
        declared = declaration(stage_name)
        todo = [declared.module, declared.worker, *MECHANISM]
        while todo:
            name = todo.pop()
            if name in seen or name not in modules or name in NOT_CODE:
                continue
            seen.add(name)
            todo.extend(edges[name] - seen)
        hashes[stage_name] = digest(seen)
    return hashes


def code_for(code: dict[str, str] | str, name: str) -> str:
    """Stage ``name``'s code hash from ``code_hashes()`` (or one string used for every stage)."""
    if isinstance(code, str):
        return code
    return code.get(name) or code[ANY_STAGE]


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


def rerun_reason(runs_dir: str | Path, ingredients: dict[str, Any]) -> str:
    """Why a stage with these ingredients would run although an older output exists, e.g.
    "code changed, config section model changed since key 1a2b..."; "" when none exists."""
    name = ingredients["stage"]
    newest = outputs.newest_succeeded(runs_dir, name)
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
