"""This machine's figures for the planner: measured once per machine, cached per user and
trusted only when they match (``model.planner.microbench_cache``), so one config plans alike
in every runs dir.

The measurement replayed here is the session's real one (``microbench_cache``, tests/conftest.py):
its per-rank raw timings go through the real summary, cache and plan stage; a changed replay
stands for a measurement taken under another load."""
from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from model.parallel.layout import LAYOUT_FIELDS
from model.planner import microbench
from model.planner.microbench_cache import (
    FORMAT_VERSION,
    cache_file,
    default_cache_dir,
    fingerprint,
    fingerprint_digest,
    read_cached,
)
from stages.config import load_config
from stages.mechanism import tracking, tracking_store
from stages.plan import work as plan_stage

NPROC = 2  # the micro preset's ranks


def _replay(monkeypatch: pytest.MonkeyPatch, raw: dict[str, Any], calls: list[int],
            delay_s: float = 0.0) -> None:
    """Have the microbenchmark return ``raw`` (recording each call) instead of measuring."""
    def measure(nproc: int) -> dict[str, Any]:
        calls.append(nproc)
        time.sleep(delay_s)
        return copy.deepcopy(raw)

    monkeypatch.setattr(microbench, "run_microbench", measure)


def _under_load(raw: dict[str, Any]) -> dict[str, Any]:
    """The same machine measured while busy: every timing of every rank 1.7x slower."""
    slow = copy.deepcopy(raw)
    for rank in slow["ranks"]:
        for mm in rank["matmul"]:
            mm["seconds"] *= 1.7
        rank["host"] = {k: v * 1.7 for k, v in rank["host"].items()}
        rank["collectives"] = {k: [t * 1.7 for t in v] for k, v in rank["collectives"].items()}
        rank["copy_gbps"] /= 1.7
    return slow


def _plan_in(runs: Path, seed_store) -> dict[str, Any]:
    """The micro preset's plan stage run in the new runs dir ``runs``; its plan.json."""
    seed_store(runs)
    uri = tracking_store.default_tracking_uri(runs)
    tracker = tracking.Tracker(uri, tracking.start_run(
        uri, tracking.ensure_experiment(uri, "figures", runs), "plan"))
    out_dir = runs / "plan"
    out_dir.mkdir()
    out = plan_stage.run(load_config("micro", [f"tracking.runs_dir={runs}"]), {}, out_dir,
                         tracker)
    tracker.flush()
    return json.loads(Path(out["plan"]).read_text())


def test_one_config_plans_alike_in_two_runs_dirs(
        tmp_path: Path, microbench_cache: Path, seed_store,
        monkeypatch: pytest.MonkeyPatch) -> None:
    user_cache = tmp_path / "user-cache"
    monkeypatch.setenv("FRONTIER_LLM_CACHE", str(user_cache))
    recorded = json.loads(microbench_cache.read_text())["raw"]
    calls: list[int] = []
    _replay(monkeypatch, recorded, calls)
    first = _plan_in(tmp_path / "a", seed_store)
    cached = cache_file(NPROC, user_cache)
    assert calls == [NPROC] and first["figures"] == {
        "cluster": "local", "figures": "measured", "source": str(cached)}
    data, why = read_cached(cached, NPROC)
    assert why == "" and data["format"] == FORMAT_VERSION and data["fingerprint"] == fingerprint()
    kept = cached.read_bytes()

    # Measured again now, the machine would give other figures (it is busier)...
    _replay(monkeypatch, _under_load(recorded), calls)
    busy = microbench.summarise(_under_load(recorded), NPROC)
    assert busy["peak_tflops"] < 0.9 * data["fields"]["peak_tflops"]
    # ...but a second runs dir reads the cache: nothing is measured and the plan is the same.
    second = _plan_in(tmp_path / "b", seed_store)
    assert calls == [NPROC] and cached.read_bytes() == kept
    assert second["figures"] == {"cluster": "local", "figures": "cached", "source": str(cached)}
    layout = [json.dumps({k: plan[k] for k in LAYOUT_FIELDS}, sort_keys=True)
              for plan in (first, second)]
    assert layout[0] == layout[1]
    assert first["predictions"] == second["predictions"]  # the same figures priced it
    assert not (tmp_path / "a" / "cache").exists()  # the stage never writes a runs dir's copy


@pytest.mark.parametrize("spoil", ["garbage", "list", "older format", "other torch",
                                   "other rank count", "no fields"])
def test_a_cache_file_that_does_not_match_is_measured_again(
        spoil: str, tmp_path: Path, microbench_cache: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    good = json.loads(microbench_cache.read_text())
    calls: list[int] = []
    _replay(monkeypatch, good["raw"], calls)
    path = cache_file(NPROC, tmp_path)
    path.write_text(json.dumps(good))
    assert microbench.measured_cluster_fields(NPROC, cache_dir=tmp_path)["figures"] == "cached"
    assert calls == []
    spoiled = {
        "garbage": "{not json",
        "list": "[]",
        "older format": json.dumps({**good, "format": FORMAT_VERSION - 1}),
        "other torch": json.dumps({**good, "fingerprint": {**good["fingerprint"],
                                                            "torch": "0.0.1"}}),
        "other rank count": json.dumps({**good, "nproc": NPROC + 1}),
        "no fields": json.dumps({k: v for k, v in good.items() if k != "fields"}),
    }[spoil]
    path.write_text(spoiled)
    assert read_cached(path, NPROC)[0] is None
    fields = microbench.measured_cluster_fields(NPROC, cache_dir=tmp_path)
    assert calls == [NPROC] and fields["figures"] == "measured"
    assert f"[microbench] not trusting {path}" in capsys.readouterr().out
    rewritten, why = read_cached(path, NPROC)  # replaced by a trusted file
    assert why == "" and rewritten["fields"]["peak_tflops"] == fields["peak_tflops"]


def test_two_planners_on_a_cold_cache_measure_once(
        tmp_path: Path, microbench_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    _replay(monkeypatch, json.loads(microbench_cache.read_text())["raw"], calls, delay_s=0.5)
    found: list[dict[str, Any]] = []

    def plan() -> None:
        found.append(microbench.measured_cluster_fields(NPROC, cache_dir=tmp_path))

    threads = [threading.Thread(target=plan) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [NPROC]
    assert sorted(f["figures"] for f in found) == ["cached", "measured"]
    assert found[0]["peak_tflops"] == found[1]["peak_tflops"]


def test_the_cache_dir_and_file_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FRONTIER_LLM_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("FRONTIER_LLM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "frontier-llm"
    name = cache_file(4).name
    assert name.startswith("microbench-") and f"-n4-{fingerprint_digest(fingerprint())}" in name
    assert cache_file(4).parent == tmp_path / "xdg" / "frontier-llm"
    print_ = fingerprint()
    assert set(print_) == {"format", "cpu", "cores", "torch"} and print_["cores"] >= 1
    assert fingerprint_digest({**print_, "torch": "0.0.1"}) != fingerprint_digest(print_)
