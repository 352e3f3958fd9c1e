"""The price of a whole run (model.planner.run_cost) and the plan CLI's --tokens."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from model.flops import GPTParams
from model.planner.cluster import load_cluster
from model.planner.run_cost import checkpoint_seconds, plan_run_cost, run_cost
from workflows import plan as plan_cli

ROOT = Path(__file__).resolve().parent.parent
PRESET_1T = str(ROOT / "configs" / "frontier-1t.yaml")
PRESET_175B = str(ROOT / "configs" / "frontier-175b.yaml")


def params_1t() -> GPTParams:
    model_cfg, _, _ = plan_cli.load_model_file(PRESET_1T)
    return GPTParams.from_config(model_cfg)


def test_arithmetic_1t_on_20t_tokens() -> None:
    """Steps, hours, node- and GCD-hours by hand; 6ND of the 1T preset is the study's 1.2e26."""
    cost = run_cost(step_time_s=100.0, tokens_per_s=1536 * 2048 / 100.0, global_batch=1536,
                    seq_len=2048, devices=3072, devices_per_node=8, params=params_1t(),
                    tokens=20e12, machine_nodes=9408)
    assert cost.tokens_per_step == 3_145_728
    assert cost.steps == 6_357_829 == math.ceil(20e12 / 3_145_728)
    assert cost.tokens_trained == 6_357_829 * 3_145_728 >= 20e12
    assert cost.wall_s == pytest.approx(635_782_900.0)
    assert cost.wall_hours == pytest.approx(635_782_900.0 / 3600)
    assert cost.wall_days == pytest.approx(635_782_900.0 / 86400)
    assert cost.nodes == 384
    assert cost.node_hours == pytest.approx(384 * 635_782_900.0 / 3600)
    assert cost.device_hours == pytest.approx(3072 * 635_782_900.0 / 3600)
    # P: the non-embedding count of model.flops (1.008e12; 1.009e12 with the embedding)
    assert cost.params_counted == "non-embedding"
    assert cost.params == 1_007_986_329_600
    assert cost.params_with_embedding == 1_009_297_049_600
    assert cost.train_flops == pytest.approx(6 * 20e12 * cost.params)
    assert cost.train_flops == pytest.approx(1.2e26, rel=0.02)  # the study's 120M exaflops
    assert cost.train_exaflops == pytest.approx(120e6, rel=0.02)
    assert cost.model_flops > cost.train_flops  # attention products on top
    assert cost.machine_devices == 75_264
    assert cost.machine_days == pytest.approx(cost.wall_days * 3072 / 75_264)


def test_steps_budget_and_bad_budgets() -> None:
    """Priced from a step count, N is steps x tokens per step; no or a bad budget is refused."""
    common = dict(step_time_s=2.0, tokens_per_s=4096.0, global_batch=4, seq_len=2048,
                  devices=12, devices_per_node=8, params=params_1t())
    cost = run_cost(steps=10, **common)
    assert cost.steps == 10 and cost.tokens == 81_920 == cost.tokens_trained
    assert cost.wall_s == 20.0 and cost.nodes == 2  # 12 devices need two whole nodes
    assert cost.node_hours == pytest.approx(2 * 20.0 / 3600)
    assert cost.device_hours == pytest.approx(12 * 20.0 / 3600)
    assert cost.machine_days is None
    assert run_cost(tokens=8193, **common).steps == 2
    for bad in ({}, {"tokens": 0.0}, {"steps": 0}):
        with pytest.raises(ValueError):
            run_cost(**bad, **common)
    frontier = load_cluster("frontier")
    priced = plan_run_cost({"step_time_s": 2.0, "tokens_per_s": 4096.0},
                           plan_cli.load_model_file(PRESET_1T)[0], 4, 2048, frontier, 16,
                           steps=3)
    assert priced.devices_per_node == 8 and priced.nodes == 2 and priced.machine_devices == 75_264


def test_cli_tokens_and_train_steps(capsys: pytest.CaptureFixture[str]) -> None:
    """--tokens N prices N tokens (--json: under run_cost); without it train.steps is priced."""
    base = ["--cluster", "frontier", "--devices", "3072", "--global-batch", "1536"]
    assert plan_cli.main(["--model", PRESET_1T, *base, "--tokens", "20e12", "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cost = data["run_cost"]
    assert cost["steps"] == 6_357_829 and cost["devices"] == 3072 and cost["nodes"] == 384
    assert cost["step_time_s"] == pytest.approx(data["step_time_s"])
    # one checkpoint every train.checkpoint_every=500 steps, priced from Orion's figures
    assert cost["checkpoints"] == 6_357_829 // 500 and cost["checkpoint_s"] > 0
    assert cost["wall_s"] == pytest.approx(6_357_829 * data["step_time_s"]
                                           + cost["checkpoints"] * cost["checkpoint_s"])
    assert cost["train_flops"] == pytest.approx(1.2e26, rel=0.02)
    assert cost["machine_days"] == pytest.approx(cost["wall_days"] * 3072 / 75_264)

    assert plan_cli.main(["--model", PRESET_175B, *base, "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert "run cost:" in text and "10,000 steps x 3,145,728 tokens/step" in text
    assert "20 checkpoints x " in text and "s per step, in the wall-clock" in text
    assert "node-hours" in text and "days on the whole machine" in text

    with pytest.raises(SystemExit):
        plan_cli.main(["--model", PRESET_1T, *base, "--tokens", "-5"])


def test_a_checkpoint_is_priced_from_the_file_systems_write_bandwidth() -> None:
    """Its bytes (float32 weights and two AdamW moments) over the nodes' write bandwidth,
    capped by the whole file system's; amortized over the steps between checkpoints."""
    frontier = load_cluster("frontier")
    params = 175_000_000_000
    nodes_bound = checkpoint_seconds(params, 4, frontier)  # 4 nodes x 5 GB/s
    assert nodes_bound == pytest.approx(12 * params / (4 * 5e9))
    whole = checkpoint_seconds(params, 9408, frontier)  # capped by Orion's 4.6 TB/s
    assert whole == pytest.approx(12 * params / 4.6e12)
    assert checkpoint_seconds(params, 4, load_cluster("h100")) is None  # no file-system figures
    common = dict(step_time_s=10.0, tokens_per_s=1.0, global_batch=2, seq_len=4, devices=8,
                  devices_per_node=8, params=GPTParams.from_config(
                      plan_cli.load_model_file(PRESET_175B)[0]))
    cost = run_cost(steps=1000, checkpoint_s=50.0, checkpoint_every=100, **common)
    assert cost.checkpoints == 10 and cost.checkpoint_s_per_step == pytest.approx(0.5)
    assert cost.wall_s == pytest.approx(1000 * 10.0 + 10 * 50.0)
    unpriced = run_cost(steps=1000, **common)
    assert unpriced.checkpoints == 0 and unpriced.wall_s == pytest.approx(10_000.0)
