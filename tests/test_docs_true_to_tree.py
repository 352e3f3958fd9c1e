"""The docs are true to the tree: docs/architecture.md names every module of the code
packages and nothing that is not there, every module or file the docs and the README name
exists, and every link between documents lands on a file and a heading."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("workflows", "stages", "model", "data_prep")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PARTS_ROW = re.compile(r"^\| `(?P<path>[\w/.]+)/` \| (?P<text>.*) \|$", re.M)


def _modules() -> set[str]:
    found = set()
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def _parts_table() -> dict[str, set[str]]:
    """docs/architecture.md's parts table: folder -> the ``*.py`` file names its row names
    (a stage folder's files are named in the ``stages/`` row)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    return {m["path"]: set(re.findall(r"`(\w+\.py)`", m["text"]))
            for m in PARTS_ROW.finditer(text)}


def test_the_parts_table_names_every_module_and_only_modules_that_exist() -> None:
    table = _parts_table()
    missing, absent = [], []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            if path.name == "__init__.py" or "__pycache__" in path.parts:
                continue
            folder = path.parent.relative_to(ROOT).as_posix()
            row = folder if folder in table else folder.split("/")[0]
            if path.name not in table.get(row, set()):
                missing.append(path.relative_to(ROOT).as_posix())
    for folder, names in table.items():
        roots = [ROOT / folder]
        if folder == "stages":  # the stage folders are described in the stages/ row
            roots += [p for p in (ROOT / "stages").iterdir() if p.is_dir()]
        for name in names:
            if not any((root / name).is_file() for root in roots):
                absent.append(f"{folder}/: {name}")
    assert not missing, "modules docs/architecture.md does not name:\n" + "\n".join(missing)
    assert not absent, "docs/architecture.md names files that are not there:\n" + "\n".join(
        absent)


def _defined(module_file: Path) -> set[str]:
    tree = ast.parse(module_file.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _module_file(name: str) -> Path:
    path = ROOT / Path(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def test_every_module_and_file_the_docs_name_exists() -> None:
    modules = _modules()
    wrong = []
    for doc in DOCS:
        text = doc.read_text()
        for token in set(re.findall(r"`([A-Za-z_][\w.]*)`", text)):
            if token.split(".")[0] not in LAYERS or "." not in token:
                continue
            parts = token.split(".")
            prefix = next((".".join(parts[:i]) for i in range(len(parts), 1, -1)
                           if ".".join(parts[:i]) in modules), None)
            if prefix is None:  # a config key (`model.n_layers`) or a file (`model.json`)
                continue
            rest = parts[len(prefix.split(".")):]
            if rest and rest[0] not in _defined(_module_file(prefix)):
                wrong.append(f"{doc.name}: `{token}`: {prefix} defines no {rest[0]}")
        for path in set(re.findall(r"`((?:workflows|stages|model|data_prep|configs|benchmarks|"
                                   r"tests|docs)/[\w/.-]+\.(?:py|yaml|json|md|sh))`", text)):
            if path.startswith("benchmarks/results/"):
                continue  # results files: tests/test_doc_figures.py checks those
            if "<" not in path and not (ROOT / path).exists():
                wrong.append(f"{doc.name}: `{path}` does not exist")
    assert not wrong, "\n".join(sorted(wrong))


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    anchors = set()
    for line in doc.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            title = re.sub(r"[^\w\- ]", "", title)
            anchors.add(title.replace(" ", "-"))
    return anchors


def test_every_link_between_documents_resolves() -> None:
    wrong = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                wrong.append(f"{doc.name}: ({target}): no such file")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                wrong.append(f"{doc.name}: ({target}): no such heading")
    assert not wrong, "\n".join(sorted(wrong))
