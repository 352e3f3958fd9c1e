"""Bad training setups fail in stages.train.prepare, before any rank starts,
saying what to change."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.parallel.dims import LayoutError, ParallelDims
from model.parallel.layout import Plan
from model.training.validate import TrainSetupError, plan_from_parallel, validate_training
from stages.mechanism.launch import RankSpec
from stages.mechanism.walk import run_work
from stages.registry import declaration
from stages.train import work as train
from tests.train_helpers import tiny_config

TOKENIZE = declaration("tokenize")


def plan_file(tmp: Path, **fields) -> dict[str, dict]:
    """Write a plan.json and return train inputs pointing at it."""
    path = Plan(**fields).to_json(tmp / "plan.json")
    return {"plan": {"plan": str(path)}}


@pytest.mark.parametrize(
    ("overrides", "plan", "words"),
    [
        ((), {"tp": 8, "micro_batch": 8}, ["tp=8", "n_heads=4"]),
        (("model.n_heads=4", "model.n_kv_heads=1"), {"tp": 2, "micro_batch": 4, "grad_accum": 2},
         ["tp=2", "key/value heads (1)"]),
        ((), {"pp": 8, "micro_batch": 1, "grad_accum": 8, "schedule": "gpipe"},
         ["pp*virtual_stages", "n_layers=4"]),
        (("model.vocab_size=385", "tokenizer.vocab_size=384"),
         {"tp": 2, "micro_batch": 4, "grad_accum": 2}, ["tp=2", "vocab_size=385"]),
        (("model.ffn_hidden=99",), {"tp": 2, "micro_batch": 4, "grad_accum": 2},
         ["tp=2", "MLP size 99"]),
        ((), {"dp": 4, "micro_batch": 2}, ["pp*dp*tp", "world size 2"]),
        ((), {"dp": 2, "micro_batch": 3}, ["micro_batch*grad_accum*dp", "global_batch=8"]),
        ((), {"tp": 2, "micro_batch": 8, "sharding": "ddp"}, ["sharding 'ddp'", "zero2"]),
    ],
)
def test_bad_layouts_are_refused_before_launch(tmp_path, overrides, plan, words) -> None:
    cfg = tiny_config("parallel.nproc=2", *overrides)
    with pytest.raises(ValueError) as err:
        train.prepare(cfg, plan_file(tmp_path, **plan), tmp_path, None)
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    assert not (tmp_path / "spec.json").exists()


def test_sequence_longer_than_the_model(tmp_path) -> None:
    cfg = tiny_config()
    cfg.train.seq_len = 64  # bypasses the config check on purpose
    with pytest.raises(TrainSetupError, match="train.seq_len=64 exceeds model.max_seq_len=32"):
        validate_training(cfg.model, cfg.train, Plan(micro_batch=8), 1)


def test_checkpoint_of_another_model_shape(tmp_path) -> None:
    ckpt = tmp_path / "checkpoints" / "step-00000003"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    (ckpt / "extra.pt").write_bytes(b"")
    other = tiny_config("model.n_layers=2").model
    (ckpt / "model.json").write_text(json.dumps(other.__dict__))
    from model.training.checkpoint import write_manifest

    write_manifest(ckpt)  # a complete checkpoint, only of another shape
    cfg = tiny_config("parallel.nproc=1")
    with pytest.raises(TrainSetupError, match=r"model.n_layers: checkpoint 2 vs config 4"):
        train.prepare(cfg, plan_file(tmp_path, micro_batch=8), tmp_path, None)


def test_store_vocabulary_larger_than_the_model(tmp_path, seed_store) -> None:
    from tests.test_data_common import make_cfg, make_corpus, make_tracker

    make_corpus(tmp_path / "corpus", n_docs=20, seed=1)
    data_cfg = make_cfg(tmp_path, tmp_path / "corpus")  # a 320-token vocabulary
    (tmp_path / "tok").mkdir()
    tracker = make_tracker(tmp_path / "ml", seed_store)[0]
    tok = run_work(TOKENIZE, data_cfg, {}, tmp_path / "tok", tracker)
    cfg = tiny_config("parallel.nproc=1", "model.vocab_size=300", "tokenizer.vocab_size=300")
    inputs = {"tokenize": tok, **plan_file(tmp_path, micro_batch=8)}
    with pytest.raises(TrainSetupError, match=r"vocabulary \(320\) exceeds model.vocab_size=300"):
        train.prepare(cfg, inputs, tmp_path, None)


def test_good_setup_writes_the_spec(tmp_path) -> None:
    cfg = tiny_config("parallel.nproc=2")
    spec = RankSpec.read(train.prepare(cfg, plan_file(tmp_path, tp=2, micro_batch=4, grad_accum=2),
                                       tmp_path, None))
    assert (spec.nproc, spec.nodes, spec.worker) == (2, 1, "stages.train.worker")
    assert spec.plan["tp"] == 2 and spec.store is None
    assert spec.config["model"]["n_layers"] == 4
    assert spec.peak_tflops is None  # no predictions; the local cluster is measured at plan time
    plan = Plan(tp=2, micro_batch=4, grad_accum=2,
                predictions={"tflops_per_device": 0.02, "mfu": 0.1})
    predicted = plan.to_json(tmp_path / "p2.json")
    spec = RankSpec.read(train.prepare(cfg, {"plan": {"plan": str(predicted)}}, tmp_path, None))
    assert spec.peak_tflops is None  # a measured cluster's rates are no peak: the device's own
    gpus = tiny_config("parallel.nproc=2", "parallel.cluster=h100")
    spec = RankSpec.read(train.prepare(gpus, {"plan": {"plan": str(predicted)}}, tmp_path, None))
    assert spec.peak_tflops == pytest.approx(0.2)  # the peak the plan's predictions used


def test_parallel_dims_names_every_factor() -> None:
    with pytest.raises(LayoutError,
                       match=r"pp\*dp\*tp = 2\*3\*2 = 12 does not equal the world size 8"):
        ParallelDims(pp=2, dp=3, tp=2, world_size=8)
    dims = ParallelDims(pp=2, dp=2, tp=2, world_size=8)
    assert dims.coords(5) == (1, 0, 1)  # tp fastest, then dp, then pp


def test_plan_from_parallel_settings() -> None:
    cfg = tiny_config("parallel.nproc=4", "parallel.tp=2")
    plan = plan_from_parallel(cfg.parallel, cfg.train)
    assert (plan.tp, plan.pp, plan.dp) == (2, 1, 2)
    assert plan.micro_batch * plan.grad_accum * plan.dp == cfg.train.global_batch
    assert plan.sharding == "zero3"
