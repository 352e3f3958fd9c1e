"""The Parsl internals ``workflows.parsl_seam`` uses exist on the installed Parsl, and
nothing else in the project reaches past Parsl's public API."""
from __future__ import annotations

import ast
from importlib import metadata
from pathlib import Path

import parsl
from parsl.config import Config
from parsl.executors import HighThroughputExecutor, MPIExecutor, ThreadPoolExecutor

from workflows import parsl_seam

ROOT = Path(__file__).resolve().parent.parent


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3])


def test_the_installed_parsl_is_the_checked_one_or_older() -> None:
    assert _release(metadata.version("parsl")) <= _release(parsl_seam.PARSL_CHECKED)


def test_every_internal_the_seam_uses_is_there(tmp_path: Path) -> None:
    for cls in (HighThroughputExecutor, MPIExecutor):
        for name in ("set_bad_state_and_fail_all", "status_facade", "scale_in_facade",
                     "connected_blocks"):
            assert hasattr(cls, name), f"{cls.__name__}.{name}"
    assert "interchange_proc" in HighThroughputExecutor.__init__.__code__.co_names
    assert "blocks_to_job_id" in HighThroughputExecutor.__init__.__code__.co_names or hasattr(
        HighThroughputExecutor(), "blocks_to_job_id")
    assert "${scheduler_options}" in parsl_seam.slurm_script_template()
    prefix = parsl_seam.srun_prefix({"num_nodes": "2", "ranks_per_node": "4",
                                     "num_ranks": "8"}, "node1,node2")
    assert prefix.startswith("srun") and "8" in prefix
    dfk = parsl.load(Config(executors=[ThreadPoolExecutor(label="seam")],
                            run_dir=str(tmp_path / "parsl")))
    try:
        parsl_seam.stop_status_poller(dfk)
        assert dfk.job_status_poller._kill_event.is_set()
        assert parsl_seam.interchange_process(dfk.executors["seam"]) is None
        assert parsl_seam.job_ids(dfk.executors["seam"]) == []
    finally:
        dfk.cleanup()
        parsl.clear()


def test_no_other_module_reaches_into_parsl() -> None:
    """Outside the seam: no private Parsl module and no ``_attribute`` of a Parsl object."""
    public = ("parsl", "parsl.config", "parsl.executors", "parsl.providers", "parsl.launchers",
              "parsl.errors", "parsl.app.errors", "parsl.app.python", "parsl.dataflow.errors",
              "parsl.executors.high_throughput.errors", "parsl.jobs.states", "parsl.utils")
    wrong = []
    for path in sorted((ROOT / "workflows").glob("*.py")):
        if path.name == "parsl_seam.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("parsl"):
                if node.module not in public:
                    wrong.append(f"{path.name}: from {node.module}")
            if isinstance(node, ast.Attribute) and node.attr in ("job_status_poller",
                                                                 "interchange_proc",
                                                                 "blocks_to_job_id",
                                                                 "status_facade",
                                                                 "scale_in_facade"):
                wrong.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not wrong, "\n".join(wrong)
