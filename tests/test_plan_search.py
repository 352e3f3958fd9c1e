"""Plan search, plan.json, the command line and bad inputs."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from model.config import ModelConfig, TrainConfig
from model.parallel.layout import Plan, PlanError
from model.planner.choose import choose
from model.planner.cluster import ClusterError, load_cluster
from model.planner.search import search
from model.planner.shapes import Shapes

ROOT = Path(__file__).resolve().parent.parent
ONE_T = ModelConfig(family="neox", n_layers=128, d_model=25600, n_heads=160, vocab_size=51200,
                    max_seq_len=2048)


def _shapes(model: ModelConfig, gb: int, seq: int = 2048) -> tuple[Shapes, TrainConfig]:
    train = TrainConfig(global_batch=gb, seq_len=seq, dtype="bfloat16")
    return Shapes.from_configs(model, train), train


def test_every_ranked_plan_passes_check_and_fits() -> None:
    model = ModelConfig(family="neox", n_layers=48, d_model=6144, n_heads=48, vocab_size=51200,
                        max_seq_len=2048)
    s, train = _shapes(model, 512)
    cl = load_cluster("frontier")
    res = search(s, cl, 256, 512, top_k=50)
    assert len(res.plans) == 50 and res.n_fit <= res.n_candidates
    tps = [p.predictions["tokens_per_s"] for p in res.plans]
    assert tps == sorted(tps, reverse=True)
    for p in res.plans:
        p.check(model, train, 256)
        assert p.predictions["memory_gb_per_device"] <= 64
        assert 0 < p.predictions["mfu"] < 1
    # the 22B model does not fit one GCD without sharding: the table explains rejections
    assert "rejected families" in res.table()


def test_fixed_fields_are_honoured() -> None:
    model = ModelConfig(family="neox", n_layers=24, d_model=2048, n_heads=16, vocab_size=51200,
                        max_seq_len=2048)
    cl = load_cluster("dgx-a100")
    train = TrainConfig(global_batch=64, seq_len=2048, dtype="bfloat16")
    fixed = {"tp": 2, "schedule": "gpipe", "recompute": "selective", "sequence_parallel": False}
    plan, res = choose(model, train, cl, 32, fixed)
    assert res is not None and res.plans
    for p in res.plans:
        assert (p.tp, p.recompute, p.sequence_parallel) == (2, "selective", False)
        assert p.pp == 1 or p.schedule == "gpipe"
    # a fully fixed plan is validated rather than searched, with the same messages
    hand = {"tp": 2, "pp": 2, "dp": 8, "micro_batch": 2, "schedule": "1f1b",
            "sharding": "zero2", "recompute": "none"}
    plan, res = choose(model, train, cl, 32, hand)
    assert res is None and (plan.tp, plan.pp, plan.dp, plan.grad_accum) == (2, 2, 8, 4)
    assert plan.predictions["step_time_s"] > 0
    with pytest.raises(PlanError, match=r"pp\*dp\*tp = 2\*8\*4 = 64 must equal the world size 32"):
        choose(model, train, cl, 32, {**hand, "tp": 4})


def test_partial_recompute_is_searched_and_a_fixed_count_honoured() -> None:
    from model.planner.search import enumerate_plans, recompute_layer_options
    from model.planner.shapes import REC_FULL

    model = ModelConfig(family="neox", n_layers=24, d_model=2048, n_heads=16, vocab_size=51200,
                        max_seq_len=2048)
    cl = load_cluster("dgx-a100")
    train = TrainConfig(global_batch=64, seq_len=2048, dtype="bfloat16")
    s = Shapes.from_configs(model, train)
    # a quarter, half and three quarters of each chunk's blocks, besides all of them
    assert recompute_layer_options(12) == [3, 6, 9]
    assert recompute_layer_options(2) == [1] and recompute_layer_options(1) == []
    c, _ = enumerate_plans(s, 32, 64, {"tp": 2, "pp": 2, "schedule": "1f1b"})
    assert sorted(set(c["rl"][c["rec"] == REC_FULL])) == [0, 3, 6, 9]
    assert set(c["rl"][c["rec"] != REC_FULL]) == {0}
    # fixed: every ranked plan recomputes the first 3 blocks of each chunk, fully
    plan, res = choose(model, train, cl, 32, {"recompute_layers": 3})
    assert res is not None and res.plans
    assert all((p.recompute, p.recompute_layers) == ("full", 3) for p in res.plans)
    assert "full3" in plan.describe()
    # pp=8 leaves 3 layers per chunk: too few for 3 recomputed blocks
    assert all(p.pp * p.virtual_stages <= 6 for p in res.plans)
    hand = {"tp": 2, "pp": 2, "dp": 8, "micro_batch": 2, "schedule": "1f1b",
            "sharding": "zero2", "recompute": "full", "recompute_layers": 4}
    plan, res = choose(model, train, cl, 32, hand)
    assert res is None and plan.recompute_layers == 4
    # refused, with the field and the fix named
    with pytest.raises(PlanError, match=r"recompute_layers=12 must be smaller than the 12 "
                                        r"layers of the smallest pipeline chunk.*use "
                                        r"recompute_layers=0"):
        choose(model, train, cl, 32, {**hand, "recompute_layers": 12})
    with pytest.raises(PlanError, match=r"recompute_layers=2 needs recompute=full \(got "
                                        r"recompute=selective\)"):
        choose(model, train, cl, 32, {"recompute": "selective", "recompute_layers": 2})
    with pytest.raises(PlanError, match=r"plan.recompute_layers must be an integer >= 0"):
        Plan.from_dict({**Plan().to_dict(), "recompute_layers": -1})


def test_zero1_is_refused_with_the_mode_that_does_its_work() -> None:
    with pytest.raises(PlanError, match=r"plan.sharding='zero1' is not a mode of its own here: "
                                        r"use zero2, which shards the optimizer states"):
        Plan.from_dict({**Plan().to_dict(), "sharding": "zero1"})


def test_1t_on_3072_frontier_gcds_returns_a_valid_plan() -> None:
    s, train = _shapes(ONE_T, 1536)
    res = search(s, load_cluster("frontier"), 3072, 1536)
    best = res.best
    best.check(ONE_T, train, 3072)
    assert best.tp * best.pp * best.dp == 3072
    assert best.predictions["memory_gb_per_device"] <= 64
    # 1T parameters fit 64 GB only sharded: over tp x pp, or over dp by ZeRO-3
    assert (best.pp > 1 and best.tp > 1) or best.sharding == "zero3"


def test_model_that_fits_nowhere_says_what_would_work() -> None:
    s, _ = _shapes(ONE_T, 64)
    with pytest.raises(PlanError) as err:
        search(s, load_cluster("frontier"), 16, 64)
    msg = str(err.value)
    assert "no plan fits in 64 GB" in msg and "more devices" in msg and "devices" in msg


def test_global_batch_no_plan_can_form() -> None:
    model = ModelConfig(n_layers=1, d_model=64, n_heads=2, vocab_size=256, max_seq_len=64)
    s, _ = _shapes(model, 3, 64)
    with pytest.raises(PlanError, match=r"dp must divide train.global_batch=3.*dp can be \[4, 8\]"):
        search(s, load_cluster("h100"), 8, 3)


def test_cluster_with_a_missing_field(tmp_path: Path) -> None:
    raw = yaml.safe_load((ROOT / "configs/clusters/frontier.yaml").read_text())
    del raw["memory_gb"]
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ClusterError) as err:
        load_cluster(path)
    msg = str(err.value)
    assert str(path) in msg and "memory_gb" in msg and "Required fields" in msg
    raw = yaml.safe_load((ROOT / "configs/clusters/frontier.yaml").read_text())
    del raw["links"]["pair"]["bandwidth_gbps"]
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ClusterError, match=r"links.pair: missing field\(s\) \['bandwidth_gbps'\]"):
        load_cluster(path)


def test_plan_json_round_trip(tmp_path: Path) -> None:
    plan = Plan(tp=2, pp=4, dp=3, micro_batch=2, grad_accum=8, schedule="interleaved_1f1b",
                virtual_stages=2, sharding="zero2", recompute="full", recompute_layers=2,
                sequence_parallel=True, predictions={"step_time_s": 1.5, "mfu": 0.4})
    path = plan.to_json(tmp_path / "sub" / "plan.json")
    back = Plan.from_json(path)
    assert back == plan and back.to_dict() == json.loads(path.read_text())
    with pytest.raises(PlanError, match="unknown plan keys"):
        Plan.from_dict({**plan.to_dict(), "bogus": 1})
    with pytest.raises(PlanError, match="plan.schedule"):
        Plan.from_dict({**plan.to_dict(), "schedule": "zigzag"})


def test_check_names_every_factor() -> None:
    model = ModelConfig(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=256)
    train = TrainConfig(global_batch=8, seq_len=64)
    with pytest.raises(ValueError) as err:
        Plan(tp=4, pp=8, dp=1, micro_batch=1, grad_accum=4, schedule="interleaved_1f1b",
             virtual_stages=1).check(model, train, 16)
    msg = str(err.value)
    for part in ("pp*dp*tp = 8*1*4 = 32 must equal the world size 16",
                 "tp=4 must divide the key/value heads (2)",
                 "pp*virtual_stages = 8*1 = 8 must be at most model.n_layers=4",
                 "micro_batch*grad_accum*dp = 1*4*1 = 4 must equal train.global_batch=8",
                 "interleaved_1f1b needs virtual_stages > 1"):
        assert part in msg


def test_cli_json(tmp_path: Path) -> None:
    shape = tmp_path / "m.yaml"
    shape.write_text(yaml.safe_dump({"num_layers": 48, "hidden_size": 6144,
                                     "num_attention_heads": 48, "vocab_size": 51200,
                                     "seq_length": 2048}))
    out = subprocess.run([sys.executable, "-m", "workflows.plan", "--model", str(shape),
                          "--cluster", "frontier", "--devices", "1024", "--global-batch", "1024",
                          "--json"],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("tp", "pp", "dp", "micro_batch", "grad_accum", "schedule", "sharding",
                "recompute", "step_time_s", "tflops_per_device", "mfu", "memory_gb_per_device"):
        assert key in data
    assert data["tp"] * data["pp"] * data["dp"] == 1024
    assert data["micro_batch"] * data["grad_accum"] * data["dp"] == 1024
    bad = subprocess.run([sys.executable, "-m", "workflows.plan", "--model", str(shape),
                          "--cluster", "frontier", "--devices", "4", "--global-batch", "8",
                          "--json"],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=120)
    assert bad.returncode == 2 and "more devices" in bad.stderr


def test_planner_refuses_what_training_refuses() -> None:
    """tp must divide the vocabulary and the MLP width too: the search never offers such a
    tp, a fixed one is refused with the rule, and every plan it ranks passes training's checks."""
    from model.planner.choose import fixed_fields
    from model.training.validate import training_problems
    from tests.train_helpers import tiny_config

    cfg = tiny_config("model.n_heads=6", "model.n_kv_heads=null", "model.d_model=48",
                      "parallel.tp=3", "parallel.nproc=3")
    assert (cfg.model.n_heads % 3, cfg.model.vocab_size % 3, cfg.model.ffn_dim) == (0, 0, 128)
    cl = load_cluster("h100")
    with pytest.raises(PlanError) as err:
        choose(cfg.model, cfg.train, cl, 3, fixed_fields(cfg.parallel))
    msg = str(err.value)
    assert "tp=3 must divide the MLP size 128 (model.ffn_hidden)" in msg
    assert "on 3 devices tp can be [1]" in msg
    cfg.model.vocab_size = 385  # and the vocabulary (the config check is bypassed on purpose)
    with pytest.raises(PlanError, match=r"tp=3 must divide model.vocab_size=385"):
        choose(cfg.model, cfg.train, cl, 3, fixed_fields(cfg.parallel))
    cfg.model.vocab_size = 384
    cfg.parallel.tp = None
    for world in (2, 3, 6, 12):
        _, res = choose(cfg.model, cfg.train, cl, world, fixed_fields(cfg.parallel), top_k=50)
        assert res.plans and all(p.tp in (1, 2) for p in res.plans)
        for p in res.plans:
            assert training_problems(cfg.model, cfg.train, p, world) == [], p.describe()


def test_tp_that_does_not_divide_the_devices_lists_what_would() -> None:
    model = ModelConfig(n_layers=2, d_model=48, n_heads=6, vocab_size=2048, max_seq_len=128)
    train = TrainConfig(global_batch=8, seq_len=128)
    with pytest.raises(PlanError) as err:
        choose(model, train, load_cluster("h100"), 4, {"tp": 3})
    msg = str(err.value)
    assert "()" not in msg
    assert "parallel.tp=3 is not possible (it does not divide the 4 devices)" in msg
    assert "on 4 devices tp can be [1, 2]" in msg
    with pytest.raises(PlanError, match=r"parallel.pp=3 is not possible here: pp can be \[1, 2\]"):
        choose(model, train, load_cluster("h100"), 8, {"pp": 3})
    # a hand-written plan of the wrong size says the same
    with pytest.raises(PlanError, match=r"tp=3 does not divide 4; on 4 devices tp can be \[1, 2\]"):
        Plan(tp=3, micro_batch=8).check(model, train, 4)


def test_when_more_devices_cannot_help_the_error_says_so() -> None:
    # one layer and one head: neither pp nor tp can split the 1-layer activations
    model = ModelConfig(family="neox", n_layers=1, d_model=131072, n_heads=1, vocab_size=51200,
                        max_seq_len=2048)
    s, _ = _shapes(model, 1536)
    with pytest.raises(PlanError) as err:
        search(s, load_cluster("frontier"), 1536, 1536)
    msg = str(err.value)
    assert "more devices do not help" in msg.lower() and "Use more devices" not in msg
    assert "tp can be at most 1" in msg and "pp at most model.n_layers=1" in msg


def test_tied_embeddings_are_planned_with_pipeline_stages():
    # The last stage holds a copy of the tied embedding (gradients summed with the first
    # stage's): a tied model splits into pipeline stages like an untied one, and its last
    # stage carries the head's parameters and the embedding group's all-reduce.
    from model.planner.rank_counts import rank_collective_bytes, rank_params

    model_cfg = ModelConfig(n_layers=8, d_model=512, n_heads=8, vocab_size=8192,
                            max_seq_len=512, tie_embeddings=True)
    train_cfg = TrainConfig(global_batch=64, seq_len=512)
    shapes = Shapes.from_configs(model_cfg, train_cfg)
    plan = Plan(tp=1, pp=2, dp=8, micro_batch=4, grad_accum=2)
    plan.check(model_cfg, train_cfg, 16)
    result = search(shapes, load_cluster("frontier"), 16, 64, fixed={"pp": 2})
    assert result.best is not None and all(p.pp == 2 for p in result.plans)
    untied = dataclasses.replace(shapes, tied=False)
    head = -(-8192 // 8) * 8 * 512  # the head copy, FSDP-padded
    assert rank_params(shapes, plan, 1) == rank_params(untied, plan, 1)
    assert rank_params(shapes, Plan(dp=16, micro_batch=4), 0)[0] == rank_params(
        untied, Plan(dp=16, micro_batch=4), 0)[0] - -(-8192 // 16) * 16 * 512
    for pp_rank in (0, 1):
        tied_bytes = rank_collective_bytes(shapes, plan, pp_rank)["pp"]
        plain = rank_collective_bytes(untied, plan, pp_rank)["pp"]
        assert tied_bytes["all_reduce"] == 4 * head / 8  # float32, this dp rank's rows
        assert {k: v for k, v in tied_bytes.items() if k != "all_reduce"} == plain
    middle = Plan(tp=1, pp=4, dp=4, micro_batch=4, grad_accum=4)
    assert "all_reduce" not in rank_collective_bytes(shapes, middle, 1)["pp"]
