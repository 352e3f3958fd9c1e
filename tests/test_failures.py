"""Expected interruptions and the Young/Daly checkpoint interval (model.planner.failures), and
``train.checkpoint_minutes: auto`` resolved by the train stage before its ranks start."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from model.flops import GPTParams
from model.planner.failures import (
    DEFAULT_FAILURES_PER_NODE_HOUR,
    RESTART_STARTUP_S,
    allocation_mtbf_s,
    config_interruptions,
    lost_work,
    young_daly_interval_s,
)
from model.training.validate import TrainSetupError
from stages.config import ConfigError, load_config
from stages.train import work as train_stage
from stages.train.checks import checkpoint_cadence_problem


def test_the_default_rate_is_llama3s_interruptions_per_node_hour() -> None:
    # 419 interruptions / (54 days x 24 h x 16,384 GPUs / 8 per node) = 419 / 2,654,208
    assert DEFAULT_FAILURES_PER_NODE_HOUR == pytest.approx(1.5786e-4, rel=1e-4)
    # the whole 2,048-node job: one interruption every 3.09 h, as the Llama 3 report says
    assert allocation_mtbf_s(DEFAULT_FAILURES_PER_NODE_HOUR, 2048) / 3600 == pytest.approx(
        54 * 24 / 419)


def test_young_daly_on_known_inputs_and_it_minimizes_the_lost_work() -> None:
    assert allocation_mtbf_s(1e-4, 100) == pytest.approx(360_000)
    # sqrt(2 x 60 s x 16 h) = sqrt(6,912,000) = 2629.1 s
    assert young_daly_interval_s(60, 16 * 3600) == pytest.approx(2629.07, abs=0.01)
    # 10 h on 10 nodes at 1e-3 per node-hour: 0.1 failures, each 600/2 + 100 s; 60 saves of 10 s
    lost = lost_work(interval_s=600, run_s=36_000, save_s=10, restart_s=100,
                     rate_per_node_hour=1e-3, nodes=10)
    assert (lost.failures, lost.per_failure_s, lost.saves, lost.save_overhead_s) == pytest.approx(
        (0.1, 400, 60, 600))
    assert lost.lost_s == pytest.approx(640) and lost.node_hours == pytest.approx(640 * 10 / 3600)
    best = young_daly_interval_s(10, allocation_mtbf_s(1e-3, 10))  # sqrt(2 x 10 x 360,000)
    assert best == pytest.approx(math.sqrt(7.2e6))

    def cost(tau: float) -> float:
        return lost_work(interval_s=tau, run_s=36_000, save_s=10, restart_s=100,
                         rate_per_node_hour=1e-3, nodes=10).lost_s

    assert cost(best) < min(cost(best * 0.8), cost(best * 1.25), cost(600))


def test_the_save_time_comes_from_the_cluster_files_write_bandwidth() -> None:
    cfg = load_config("configs/frontier-175b.yaml")
    figures = config_interruptions(cfg)
    params = GPTParams.from_config(cfg.model).total()
    # 12 bytes a parameter over min(384 nodes x 5 GB/s, 4,600 GB/s) = 1,920 GB/s
    assert figures.save_s == pytest.approx(12 * params / 1920e9)
    assert figures.mtbf_s / 3600 == pytest.approx(1 / (DEFAULT_FAILURES_PER_NODE_HOUR * 384))
    assert figures.restart_s == pytest.approx(RESTART_STARTUP_S + figures.save_s)
    assert figures.best_interval_s == pytest.approx(
        math.sqrt(2 * figures.save_s * figures.mtbf_s))
    override = config_interruptions(load_config("configs/frontier-175b.yaml",
                                                ["site.failures_per_node_hour=1e-3"]))
    assert override.mtbf_s == pytest.approx(3600 / 0.384)
    assert override.rate_source == "site.failures_per_node_hour=0.001"
    with pytest.raises(ConfigError, match="site.failures_per_node_hour must be > 0"):
        load_config(None, ["site.failures_per_node_hour=0"])


def test_checkpoint_minutes_takes_auto_and_refuses_other_words() -> None:
    assert load_config(None, ["train.checkpoint_minutes=auto"]).train.checkpoint_minutes == "auto"
    with pytest.raises(ConfigError, match="must be > 0 minutes or null .*or auto.*'soon'"):
        load_config(None, ["train.checkpoint_minutes=soon"])
    # The cadence rule waits for the resolved minutes (pre-flight has no cluster figures).
    cfg = load_config(None, ["train.checkpoint_minutes=auto", "site.name=slurm",
                             "site.save_before_end_s=0", "train.checkpoint_every=0"])
    assert checkpoint_cadence_problem(cfg.train, cfg.site, 1e6) is None


def test_the_train_stage_resolves_auto_to_minutes_before_the_ranks_start(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = load_config("micro", ["parallel.cluster=frontier", "train.checkpoint_minutes=auto"])
    spec = json.loads(Path(train_stage.prepare(cfg, {}, tmp_path, None)).read_text())
    figures = config_interruptions(cfg)
    # micro on one Frontier node: sqrt(2 x save x 6,335 h), in minutes
    expected = math.sqrt(2 * figures.save_s * 3600 / DEFAULT_FAILURES_PER_NODE_HOUR) / 60
    assert spec["config"]["train"]["checkpoint_minutes"] == pytest.approx(expected)
    assert 1.0 < expected < 2.0
    said = capsys.readouterr().out
    assert f"[train] train.checkpoint_minutes=auto -> {expected:.3g} min (Young/Daly" in said
    assert "6,334.6 h" in said and "Llama 3 405B" in said
    # A cluster measured at plan time gives no write bandwidth: refused, with the fix.
    local = load_config("micro", ["train.checkpoint_minutes=auto"])
    with pytest.raises(TrainSetupError, match="set node_write_gbps in the cluster file, or give "
                       "train.checkpoint_minutes in minutes"):
        train_stage.prepare(local, {}, tmp_path, None)
