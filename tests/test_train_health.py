"""Step health on real gloo ranks: a NaN step is skipped on every rank, a loss spike or a run
of bad steps rolls back and skips the windows since the checkpoint (then the losses are those
of a run that never saw them), a slowed rank is named; and the rules on their own.

Faults come from the fault-injection switch (``model.training.health.FAULTS_VAR``).
"""
from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from model.training.checkpoint import load_extra, load_for_inference
from model.training.health import FAULTS_VAR, Faults, is_spike, written_in_bad_streak
from tests.train_helpers import launch_with, tiny_config

DP2 = {"dp": 2, "micro_batch": 4, "grad_accum": 1, "sharding": "ddp"}


def train(out: Path, faults: dict[str, Any] | None, *overrides: str,
          tracking: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """2 gloo ranks (dp 2) of the tiny model with ``faults`` injected: (summary, stdout)."""
    code, stdout, stderr = launch_with(out, tiny_config(*overrides), DP2, FAULTS_VAR, faults,
                                       tracking=tracking)
    assert code == 0, f"rc {code}:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return json.loads((out / "summary.json").read_text()), stdout


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_for_inference(ckpt, tiny_config().model).state_dict()


def test_a_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path) -> None:
    """Batch 2 (step 3) has NaN gradients on rank 1 only, after they were averaged: rank 0
    (the one that writes the weights) sees a finite loss and norm, yet no rank updates, and
    the weights of step 3 (the last: its save is written, marked as inside a run of bad steps,
    where a scheduled one would wait for a good step) are those of step 2."""
    summary, stdout = train(tmp_path, {"nan_batches": [2], "nan_rank": 1, "nan_loss": False},
                            "train.steps=3", "train.checkpoint_every=1", "train.keep_last=4")
    [skipped] = summary["health"]["skipped_steps"]
    assert (skipped["step"], skipped["batch"], skipped["first_sequence"],
            skipped["last_sequence"]) == (3, 2, 16, 23)
    assert math.isfinite(skipped["loss"]) and math.isfinite(skipped["grad_norm"])  # rank 0's
    assert summary["health"]["rollbacks"] == []
    assert "[train] step 3 skipped (not finite on some rank" in stdout
    assert all(math.isfinite(x) for x in summary["losses"])
    root = tmp_path / "checkpoints"
    first, before, at = (weights(root / f"step-{s:08d}") for s in (1, 2, 3))
    for name, value in before.items():
        assert torch.equal(value, at[name]), f"{name} changed in the skipped step"
    assert any(not torch.equal(value, before[name]) for name, value in first.items())
    assert written_in_bad_streak(load_extra(root / "step-00000003"))
    assert not written_in_bad_streak(load_extra(root / "step-00000002"))


SPIKE = ("train.steps=8", "train.checkpoint_every=2", "train.spike_window=3",
         "train.max_bad_steps=2")


@pytest.fixture(scope="module")
def never_saw(tmp_path_factory) -> dict[str, Any]:
    """The run that never saw batches 4 and 5 (drawn and thrown away)."""
    summary, _ = train(tmp_path_factory.mktemp("never-saw"), {"drop_batches": [4, 5]}, *SPIKE)
    assert summary["health"] == {"skipped_steps": [], "rollbacks": [], "batches_drawn": 10,
                                 "last_good_step": 8}
    return summary


def test_a_spike_rolls_back_and_skips_the_windows_since_the_checkpoint(never_saw,
                                                                      tmp_path) -> None:
    """Batch 5 (step 6) is a spike: back to step 4, batches 4-5 skipped; the losses are then
    bitwise those of the run that never saw them, and MLflow holds the rollback (and the
    slow-rank ratio, gathered at the first step and every 4, and the health counters from
    step 1)."""
    from stages.mechanism import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.start_run(uri, tracking.ensure_experiment(uri, "health", tmp_path), "t")
    summary, stdout = train(tmp_path / "out", {"spike_batches": [5], "spike_factor": 10},
                            *SPIKE, "train.slow_rank_every=4",
                            tracking={"uri": uri, "run_id": run_id})
    [rollback] = summary["health"]["rollbacks"]
    assert (rollback["step"], rollback["to_step"], rollback["batches"]) == (6, 4, [4, 5])
    assert rollback["reason"].startswith("loss spike")
    assert "[train] step 6: loss spike (" in stdout and "rolled back to step 4" in stdout
    assert summary["losses"] == never_saw["losses"] and len(summary["losses"]) == 8
    assert tracking.metric_history(uri, run_id, "rollback") == [(6, 1.0)]
    assert tracking.metric_history(uri, run_id, "rollback_to_step") == [(6, 4.0)]
    ratios = tracking.metric_history(uri, run_id, "slow_rank_ratio")
    assert [step for step, _ in ratios] == [1, 4, 8] and all(r >= 1 for _, r in ratios)
    # the health counters are charted from step 1, zeros included
    for name, after in (("skipped_steps_total", 0.0), ("rollbacks_total", 1.0)):
        history = tracking.metric_history(uri, run_id, name)
        assert history[0] == (1, 0.0) and history[-1] == (8, after), (name, history)


def test_bad_steps_in_a_row_roll_back(never_saw, tmp_path) -> None:
    """Batches 4 and 5 are NaN everywhere: step 5 is skipped, step 6 (the second bad step in a
    row, train.max_bad_steps=2) rolls back to step 4; then as if they never were."""
    summary, stdout = train(tmp_path, {"nan_batches": [4, 5]}, *SPIKE)
    assert [r["step"] for r in summary["health"]["skipped_steps"]] == [5]
    [rollback] = summary["health"]["rollbacks"]
    assert (rollback["step"], rollback["to_step"], rollback["batches"]) == (6, 4, [4, 5])
    assert "2 bad steps in a row: rolled back to step 4" in stdout
    assert summary["losses"] == never_saw["losses"]


def test_a_slowed_rank_is_named(tmp_path) -> None:
    """Rank 1 burns 300 ms of CPU before each step: it is named, with its host. Its busy time
    counts waiting for a core too, so on a loaded box the burn must stand well above a step
    of the tiny model (60 ms fell under train.slow_rank_ratio there)."""
    summary, stdout = train(tmp_path, {"slow_rank": 1, "slow_seconds": 0.3}, "train.steps=4",
                            "train.slow_rank_every=2")
    assert summary["steps_done"] == 4
    assert f"slow ranks at step 2: rank 1 on {socket.gethostname()} (" in stdout
    assert "rank 0 on" not in stdout


def test_the_spike_rule() -> None:
    good = [5.0, 5.1, 4.9, 5.05, 4.95]
    assert not is_spike(5.3, good, 6.0, 0.2)  # within 6 deviations and 20 %
    assert is_spike(7.0, good, 6.0, 0.2)
    assert not is_spike(5.9, good, 6.0, 0.2)  # 18 % above the median: under the floor
    assert is_spike(5.9, good, 6.0, 0.1)
    flat = [3.0] * 5  # no deviation at all: only the floor decides
    assert not is_spike(3.1, flat, 6.0, 0.2) and is_spike(3.7, flat, 6.0, 0.2)


def judged(losses: list[float], window: int, deviations: float, min_rise: float) -> list[int]:
    """The steps (1-based) the spike rule calls spikes on ``losses``, judged as the trainer
    does: against the last ``window`` good losses once there are that many."""
    good: list[float] = []
    fired = []
    for step, loss in enumerate(losses, 1):
        if len(good) >= window and is_spike(loss, good[-window:], deviations, min_rise):
            fired.append(step)
        else:
            good.append(loss)
    return fired


def test_the_defaults_never_fire_on_healthy_curves(never_saw) -> None:
    """The default rule on the tiny preset's real 300-step curve (a data shift of +54 % at
    step 257 included: a relative floor of 20 % would call it a spike) and on a micro run."""
    cfg = tiny_config().train
    tiny = json.loads((Path(__file__).parent / "golden" / "tiny_healthy_losses.json")
                      .read_text())["losses"]
    rule = (cfg.spike_window, cfg.spike_deviations, cfg.spike_min_rise)
    assert judged(tiny, *rule) == [] and judged(never_saw["losses"], 3, *rule[1:]) == []
    assert judged(tiny, cfg.spike_window, cfg.spike_deviations, 0.2)[:1] == [256]


def test_a_bad_fault_switch_is_one_clear_error(monkeypatch) -> None:
    monkeypatch.setenv(FAULTS_VAR, '{"nan_batches": [1], "bogus": 2}')
    with pytest.raises(ValueError, match=f"{FAULTS_VAR} must be a JSON object"):
        Faults.from_environ()
    monkeypatch.setenv(FAULTS_VAR, "")
    assert Faults.from_environ() is None


def test_the_benchmark_runs(tmp_path) -> None:
    """``benchmarks/bench_health.py --tiny``: two ranks, both arms; its last line is the JSON
    figures, and a --tiny run records nothing."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_health.py"
    proc = subprocess.run([sys.executable, str(script), "--tiny", "--steps", "2", "--rounds",
                           "2", "--results-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["steps_each"] == 4 and 0.3 < figures["health_ratio"] < 3
    assert list(tmp_path.iterdir()) == []
