"""The layering the architecture promises, read from the sources themselves.

workflows -> stages -> model -> data_prep: a package imports only packages to its right;
only workflows/ imports parsl; only stages/mechanism/tracking.py imports mlflow; imports form
no cycle, at module level or inside functions; the planner plans without torch; and the
engine (stages/mechanism/) imports no stage and no model or data rule, not even through a
module name written as a string.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("workflows", "stages", "model", "data_prep")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (imports for type
    checkers only, which never run)."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """Absolute module names imported by a file (every import that runs, or module-level
    ones)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else _runtime_nodes(tree)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}


def test_each_package_imports_only_packages_to_its_right() -> None:
    wrong = []
    for name, path in _sources().items():
        layer = name.split(".")[0]
        allowed = set(LAYERS[LAYERS.index(layer):])
        for imported in _imports(path, top_level_only=False):
            top = imported.split(".")[0]
            if top in LAYERS and top not in allowed:
                wrong.append(f"{name} imports {imported}")
            if top == "parsl" and layer != "workflows":
                wrong.append(f"{name} imports parsl (only workflows/ may)")
            if top == "mlflow" and name != "stages.mechanism.tracking":
                wrong.append(f"{name} imports mlflow (only stages/mechanism/tracking.py may)")
    assert not wrong, "\n".join(sorted(wrong))


ENGINE = "stages.mechanism"
ENGINE_MAY_USE = {
    "data_prep.atomic",  # write a file whole or not at all: a file helper, not a data rule
    "model.parallel.dist_env",  # the torch.distributed environment variables a rank reads
    "model.parallel.threads",  # one thread per CPU rank: the environment a rank starts with
    "model.parallel.parent_death",  # a child dies with its parent: ranks, rank servers
    "model.parallel.fork_server",  # fork_child: the one way a rank process is forked
}
"""The only project modules outside the engine that it may name: plumbing its launcher and
outputs share with the ranks, none of which decides what a stage computes."""


def _named_project_modules(path: Path, sources: dict[str, Path]) -> set[str]:
    """Project modules a file imports (at any depth) or names in a string constant (a module
    to import lazily, or a ``python -m`` target)."""
    tree = ast.parse(path.read_text(), str(path))
    names = set(_imports(path, top_level_only=False))
    names.update(node.value for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)
                 and node.value in sources)
    return {n for n in names if n in sources or n.split(".")[0] in LAYERS}


def test_the_engine_imports_no_stage_and_no_rule() -> None:
    sources = _sources()
    wrong = []
    for name, path in sources.items():
        if name != ENGINE and not name.startswith(ENGINE + "."):
            continue
        for named in _named_project_modules(path, sources):
            if named == ENGINE or named.startswith(ENGINE + ".") or named in ENGINE_MAY_USE:
                continue
            if named in LAYERS:  # a layer's name as a directory or hashed package, no module
                continue
            if named in sources or any(m.startswith(named + ".") for m in sources):
                wrong.append(f"{name} names {named}")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_engine_contract_sees_a_lazy_import_through_a_string(tmp_path: Path) -> None:
    """The check above would catch ``importlib.import_module("stages.train.work")``."""
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("import importlib\nwork = importlib.import_module('stages.train.work')\n")
    assert _named_project_modules(sneaky, _sources()) == {"stages.train.work"}


def test_a_stage_is_one_folder_and_one_line() -> None:
    """Every stage's declaration lives in ``stages/<name>/__init__.py`` with its work module
    (and rank worker) in the same folder; the registry names each once, in order."""
    from stages.registry import PIPELINE

    for stage in PIPELINE:
        folder = ROOT / "stages" / stage.name
        assert (folder / "__init__.py").is_file(), stage.name
        assert stage.module.startswith(f"stages.{stage.name}."), (stage.name, stage.module)
        # A rank worker may be another stage's (the plan measures with the training's ranks).
        assert not stage.worker or stage.worker.split(".")[1] in PIPELINE, stage.worker
    registry = (ROOT / "stages" / "registry.py").read_text()
    assert [line.strip().removesuffix(".STAGE,") for line in registry.splitlines()
            if line.strip().endswith(".STAGE,")] == list(PIPELINE.order)


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module-level", "any-depth"])
def test_imports_form_no_cycle(top_level_only: bool) -> None:
    """No circle of imports, not even through an import inside a function (which only
    defers the circle to the first call)."""
    sources = _sources()
    graph = {
        name: {m for m in _imports(path, top_level_only) if m in sources and m != name
               and not name.startswith(m + ".")}
        for name, path in sources.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path, node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [])
            assert cycle is None, " -> ".join(cycle)


def test_the_planner_plans_without_torch() -> None:
    planner = sorted(_module_name(p) for p in (ROOT / "model" / "planner").glob("*.py"))
    code = (
        "import sys\n"
        f"for name in {planner + ['model.config', 'model.flops']!r}:\n"
        "    __import__(name)\n"
        "from model.planner.cluster import load_cluster\n"
        "from model.planner.search import search\n"
        "from model.planner.shapes import Shapes\n"
        "from model.config import ModelConfig, TrainConfig\n"
        "shapes = Shapes.from_configs(ModelConfig(), TrainConfig())\n"
        "assert search(shapes, load_cluster('frontier'), 64, 64).best is not None\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout



def test_checking_a_fresh_training_imports_no_torch(tmp_path: Path) -> None:
    """The driver checks a training's setup before its ranks start; only a checkpoint to
    resume from (``test_train_validation.py``) needs torch to read."""
    code = (
        "import sys\n"
        "from model.training.validate import plan_from_parallel, validate_training\n"
        "from stages.config import load_config\n"
        "cfg = load_config('micro')\n"
        "plan = plan_from_parallel(cfg.parallel, cfg.train)\n"
        f"for root in ({str(tmp_path / 'none')!r}, {str(tmp_path)!r}):\n"
        "    validate_training(cfg.model, cfg.train, plan, 2, 512, root)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False"]

HEAVY = ("torch", "datasets", "mlflow")
"""What the driver's cheapest commands must not import (seconds each on this box)."""


def _heavy_imports_of(argv: list[str], tmp_path: Path) -> tuple[int, str, list[str]]:
    """Run ``workflows.pipeline.main(argv)`` in a fresh interpreter; its exit code, its
    stderr and the heavy packages it imported."""
    code = (
        "import sys\n"
        "from workflows.pipeline import main\n"
        f"code = main({argv!r})\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
        "sys.exit(code)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False)
    return out.returncode, out.stderr, eval(out.stdout.strip().splitlines()[-1])  # noqa: S307


def test_dry_run_imports_neither_torch_nor_datasets_nor_mlflow(tmp_path: Path) -> None:
    for site in ("local", "slurm", "frontier"):
        # Frontier's readiness report refuses a runs dir off Lustre (nothing is created there).
        runs = "/lustre/orion/abc123/scratch/user/runs" if site == "frontier" else str(tmp_path)
        argv = ["--config", "configs/micro.yaml", "--runs-dir", runs, "--dry-run",
                "--site", site, "--set", "site.account=abc123"]
        code, err, heavy = _heavy_imports_of(argv, tmp_path)
        assert code == 0, err[-3000:]
        assert heavy == [], f"--dry-run --site {site} imported {heavy}"


def test_preflight_errors_import_neither_torch_nor_datasets_nor_mlflow(tmp_path: Path) -> None:
    refused = {
        "a missing corpus": ["data.source=" + str(tmp_path / "missing.txt")],
        "an evaluation layout that does not fit": ["eval.layout=training", "eval.ranks=3"],
        "frontier without an account": ["site.name=frontier"],
    }
    for what, overrides in refused.items():
        argv = ["--config", "configs/micro.yaml", "--runs-dir", str(tmp_path / "runs"),
                "--set", *overrides]
        code, err, heavy = _heavy_imports_of(argv, tmp_path)
        assert code == 2, f"{what}: exit {code}\n{err[-3000:]}"
        assert heavy == [], f"{what}: the refusal imported {heavy}\n{err[-1000:]}"
        assert not (tmp_path / "runs" / "mlflow.db").exists(), f"{what}: a store was created"


MODEL_LAYERS = {
    "parallel": set(),  # the layout and the parallelism functions: no other concern
    "planner": {"parallel"},  # plans over the layout; imports no torch
    "training": {"parallel"},  # the trainer: never the planner that chose its layout
    "evaluation": {"parallel", "training"},
    "rehearsal": {"parallel", "planner", "training"},  # runs the trainer on the planner's plans
}
"""Which subpackages of ``model/`` each may import (besides ``model``'s own top modules):
no import points upward, so the planner and the trainer each stand without the other and
the rehearsal, which needs both, sits above them."""


def test_no_subpackage_of_model_imports_upward() -> None:
    wrong = []
    for name, path in _sources().items():
        parts = name.split(".")
        if parts[0] != "model" or len(parts) < 3 or parts[1] not in MODEL_LAYERS:
            continue
        for imported in _imports(path, top_level_only=False):
            target = imported.split(".")
            if (target[0] == "model" and len(target) > 1 and target[1] in MODEL_LAYERS
                    and target[1] != parts[1] and target[1] not in MODEL_LAYERS[parts[1]]):
                wrong.append(f"{name} imports {imported}")
    assert not wrong, "\n".join(sorted(wrong))
    packages = {p.name for p in (ROOT / "model").iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(MODEL_LAYERS), "a new subpackage of model/ needs its place here"
