"""Two real pipelines started 0.5 s apart on one runs dir (micro preset, Parsl, ranks,
MLflow on SQLite): both succeed, every stage key is computed once, both parent runs are
in MLflow, and each driver has its own Parsl run dir.

The pipelines run from a snapshot of the sources, so stage keys (which hash the code)
cannot change between the two drivers while someone edits the checkout. Their drivers fork
from driver zygotes started on that snapshot, one per driver (``tests/warm_cli.py``), and
their launches fork too: the drivers, their locks and waits, ranks and MLflow runs are
real command lines'."""
from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.mechanism import tracking, tracking_store
from tests import warm_cli

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _snapshot(target: Path) -> Path:
    """Copy the code the pipeline runs (and its configs) to ``target``."""
    for name in ("stages", "model", "data_prep", "workflows", "configs"):
        shutil.copytree(REPO / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    return target


@pytest.fixture
def code(tmp_path: Path) -> Iterator[Path]:
    """A snapshot of the sources; its driver zygotes are ended after the test."""
    snapshot = _snapshot(tmp_path / "code")
    yield snapshot
    warm_cli.close_zygotes(snapshot)


def _start(code: Path, runs_dir: Path, *overrides: str) -> warm_cli.WarmProcess:
    # the snapshot first; the tests' own modules (the launch client) from this checkout
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(code), str(REPO)]),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    sets = ["--set", *overrides] if overrides else []
    return warm_cli.WarmProcess(
        "workflows.pipeline", ["--config", "micro", "--runs-dir", str(runs_dir), *sets],
        cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        forked_launches=True, code=code)


def _together(code: Path, runs_dir: Path, first: tuple[str, ...], second: tuple[str, ...]
              ) -> list[str]:
    warm_cli.start_zygotes(2, code)  # both importing now: the second driver starts on time
    procs = [_start(code, runs_dir, *first)]
    time.sleep(0.5)
    procs.append(_start(code, runs_dir, *second))
    outputs = [proc.communicate(timeout=900)[0] for proc in procs]
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-5000:]
    return outputs


def _stage_runs(runs_dir: Path) -> tuple[list, list]:
    runs = tracking.search_runs(tracking_store.default_tracking_uri(runs_dir), "micro")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return parents, children


def _computed(children: list) -> collections.Counter:
    """How many times each (stage, key) was computed (child runs not tagged reused)."""
    return collections.Counter((r.data.tags["stage"], r.data.tags["stage_key"])
                               for r in children if r.data.tags.get("reused") == "false")


def _keys(children: list, parent_id: str) -> dict[str, str]:
    """Stage -> key of the stage runs under one pipeline run."""
    return {r.data.tags["stage"]: r.data.tags["stage_key"]
            for r in children if r.data.tags["mlflow.parentRunId"] == parent_id}


def test_two_pipelines_share_one_runs_dir(code: Path, runs_dir: Path):
    # runs_dir: the session's measurement and migrated store; two drivers making a store
    # from nothing at once are tested in test_tracking_start.py.
    # The same config: the second waits for (or reuses) every stage the first computes.
    outputs = _together(code, runs_dir, (), ())
    parents, children = _stage_runs(runs_dir)
    assert len(parents) == 2 and all(p.info.status == "FINISHED" for p in parents)
    computed = _computed(children)
    assert sorted(s for s, _ in computed) == ["curate", "evaluate", "plan", "tokenize", "train"]
    assert set(computed.values()) == {1}, computed
    # One driver waited for a stage the other held (which one depends on how soon each gets
    # going: a micro pipeline tokenizes in about a second, then trains for many).
    assert any(f"waiting for {stage} " in out for out in outputs
               for stage in ("curate", "tokenize", "plan", "train", "evaluate")), outputs[1][-3000:]

    # Different configs: the shared keys once, the differing evaluate keys once each.
    _together(code, runs_dir, ("train.steps=4",), ("train.steps=4", "eval.max_tokens=1024"))
    parents, children = _stage_runs(runs_dir)
    assert len(parents) == 4 and all(p.info.status == "FINISHED" for p in parents)
    computed = _computed(children)
    assert set(computed.values()) == {1}, computed
    first, second = (_keys(children, p.info.run_id) for p in parents[1::-1])  # newest first
    assert {n: first[n] for n in ("curate", "tokenize", "plan", "train")} == {
        n: second[n] for n in ("curate", "tokenize", "plan", "train")}
    assert first["evaluate"] != second["evaluate"]
    assert set(first.items()) | set(second.items()) <= set(computed)  # each made by someone
    assert not list(runs_dir.glob("stages/*/*.lock"))
    assert len(list((runs_dir / "parsl").iterdir())) == 4  # one Parsl run dir per driver
