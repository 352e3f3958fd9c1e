"""The rehearsal (``model.rehearsal.rehearse``) against the same steps on real gloo ranks.

Two real CPU ranks (``stages.mechanism.launch``, gloo, a 4-layer d=64 GQA LLaMA) run each layout
family
below through the real trainer, measured by ``measure_steps`` on real tensors; the same
plans are rehearsed rank by rank on fake tensors in a fake process group. Per rank: the
peak memory must agree within 10 %, FLOPs and bytes per collective kind and mesh dimension
exactly, and the parameter and optimizer-state categories exactly. Families compared:
FSDP2 zero3 (fp32), FSDP2 zero2 with bf16 mixed precision and full recompute, tp2 with
sequence parallelism and selective recompute, pp2 1F1B with full recompute, pp2
interleaved 1F1B in bf16 (autocast). In the pipeline families the real ranks infer their
shapes dynamically (the real warm-up vote and shape exchange) while the rehearsal is given
them; ``measure_steps`` checks the real outputs against the given shapes.

The memory tracker's categories are checked against the tensors themselves on the real
zero3 run (parameter shards, AdamW's moments and step counters, FSDP2's all-gather and
reduce-scatter volumes) and FLOPs against the matmul and attention formula.

Not compared on real ranks, and why:

- sharding ddp without pipelining is rehearsed with a stand-in for DDP, whose C++
  constructor reads parameter storage (``model.rehearsal.rehearsed_ddp``): its gradients
  are checked against DDP's on real ranks, its traffic and buckets in the rehearsal.
- ddp under pipelining, FSDP2 under pipelining and tp x FSDP2 need pp2 x dp2 or tp2 x dp2 =
  4 ranks, more than the 2 real ranks these tests start; they are rehearsed only, ddp with
  its gradient all-reduce checked against the stage's parameter bytes.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.distributed.pipelining import schedules as pipelining_schedules
from torch.distributed.pipelining._utils import InferenceMode

from model.config import ModelConfig, TrainConfig
from model.parallel.layout import Plan, PlanError
from model.parallel.pipeline import build_schedule, chunk_ids
from model.rehearsal.rank_server import rehearse_isolated
from model.rehearsal.rehearse import (
    RehearsalError,
    busiest_ranks,
    check_stage_outputs,
    check_torch_internals,
    fake_process_group,
    make_trainer,
    rehearse,
    stage_io,
    static_schedule,
)
from model.training.trainer import cross_entropy

REPO = Path(__file__).resolve().parent.parent
MODEL = {"n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512,
         "max_seq_len": 32}
SEQ = 32
FAMILIES: dict[str, dict[str, Any]] = {
    "zero3": {"plan": {"dp": 2, "micro_batch": 2, "grad_accum": 2, "sharding": "zero3"},
              "train": {"global_batch": 8}},
    "zero2_bf16_full": {"plan": {"dp": 2, "micro_batch": 2, "grad_accum": 2,
                                 "sharding": "zero2", "recompute": "full"},
                        "train": {"global_batch": 8, "dtype": "bfloat16"}},
    "tp_sp_selective": {"plan": {"tp": 2, "micro_batch": 2, "grad_accum": 2, "sharding": "none",
                                 "recompute": "selective", "sequence_parallel": True},
                        "train": {"global_batch": 4}},
    "pp_1f1b_full": {"plan": {"pp": 2, "micro_batch": 1, "grad_accum": 4, "sharding": "none",
                              "schedule": "1f1b", "recompute": "full"},
                     "train": {"global_batch": 4}},
    "pp_interleaved_bf16": {"plan": {"pp": 2, "micro_batch": 1, "grad_accum": 4,
                                     "sharding": "none", "schedule": "interleaved_1f1b",
                                     "virtual_stages": 2},
                            "train": {"global_batch": 4, "dtype": "bfloat16"}},
}

CHILD = r"""
import json, sys
from pathlib import Path
import torch, torch.distributed as dist
from model.config import ModelConfig, TrainConfig
from model.parallel.layout import Plan
from model.rehearsal.rehearse import make_trainer, measure_steps, rehearsal_train_config
from torch.distributed.tensor import DTensor
torch.set_num_threads(1)
spec = json.loads(Path(sys.argv[1]).read_text())
dist.init_process_group("gloo")
model_cfg = ModelConfig(**spec["model"])
out = {}
for name, case in spec["families"].items():
    train_cfg = rehearsal_train_config(TrainConfig(seq_len=spec["seq"], **case["train"]))
    trainer = make_trainer(model_cfg, train_cfg, Plan(**case["plan"]), torch.device("cpu"))
    result = measure_steps(trainer, steps=1, warmup=1).to_dict()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in trainer.params]
    result["param_bytes"] = sum(p.numel() * p.element_size() for p in local)
    result["param_tensors"] = len(local)
    out[name] = result
    dist.barrier()
Path(sys.argv[2], f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
dist.destroy_process_group()
"""


def plan_of(name: str) -> Plan:
    return Plan(**FAMILIES[name]["plan"])


def train_of(name: str) -> TrainConfig:
    return TrainConfig(seq_len=SEQ, **FAMILIES[name]["train"])


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Every family measured on 2 real gloo ranks (one launch): rank -> family -> result."""
    work = tmp_path_factory.mktemp("rehearse-real")
    (work / "child.py").write_text(CHILD)
    (work / "spec.json").write_text(json.dumps({"model": MODEL, "seq": SEQ,
                                                "families": FAMILIES}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(work / "child.py"), str(work / "spec.json"), str(work)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {r: json.loads((work / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rehearsal_matches_real_ranks(family: str, measured: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        real = measured[rank][family]
        fake = rehearse(ModelConfig(**MODEL), train_of(family), plan_of(family), rank).to_dict()
        assert fake["fake"] and not real["fake"]
        ratio = fake["peak_memory_bytes"] / real["peak_memory_bytes"]
        print(f"{family} rank {rank}: rehearsed {fake['peak_memory_bytes']} B, measured "
              f"{real['peak_memory_bytes']} B (ratio {ratio:.4f})")
        assert 0.9 <= ratio <= 1.1, (fake["peak_memory_by_category"],
                                     real["peak_memory_by_category"])
        assert fake["flops_per_step"] == real["flops_per_step"]
        assert fake["flops_by_op"] == real["flops_by_op"]
        assert fake["collective_bytes_per_step"] == real["collective_bytes_per_step"]
        assert fake["collective_bytes_by_dim"] == real["collective_bytes_by_dim"]
        assert fake["collective_calls"] == real["collective_calls"]
        for category in ("sharded_param", "parameter", "optstate", "buffer"):
            assert fake["peak_memory_by_category"].get(category) == \
                real["peak_memory_by_category"].get(category), category
        assert fake["flops_per_step"][0] > 0


@pytest.mark.slow
def test_tracker_categories_match_the_tensors(measured: dict[int, dict[str, Any]]) -> None:
    """On the real zero3 run: the tracker's categories are the rank's tensors, its FSDP2
    volumes the parameters' bytes, and the FLOPs the matmul + attention formula."""
    real = measured[0]["zero3"]
    plan, cfg = plan_of("zero3"), ModelConfig(**MODEL)
    cats = real["peak_memory_by_category"]
    full = 4 * sum(p.numel() for p in _meta_gpt(cfg).parameters())  # fp32 bytes
    assert real["param_bytes"] == full // plan.dp
    assert cats["sharded_param"] == real["param_bytes"]
    # AdamW: two fp32 moments per parameter shard and a float32 step counter per tensor
    assert cats["optstate"] == 2 * real["param_bytes"] + 4 * real["param_tensors"]
    # zero3 gathers every parameter for each micro-batch's forward and backward and
    # reduce-scatters every gradient once per micro-batch
    dp_bytes = real["collective_bytes_by_dim"]["dp"]
    assert dp_bytes["all_gather"] == 2 * plan.grad_accum * full
    assert dp_bytes["reduce_scatter"] == plan.grad_accum * full
    tokens = plan.micro_batch * plan.grad_accum * SEQ
    matrices = sum(p.numel() for n, p in _meta_gpt(cfg).named_parameters()
                   if p.ndim == 2 and "tok_embeddings" not in n)
    assert real["flops_by_op"]["aten.mm"] == 6 * matrices * tokens
    attention = 4 * plan.micro_batch * SEQ * SEQ * cfg.d_model * cfg.n_layers * plan.grad_accum
    assert real["flops_by_op"]["aten._scaled_dot_product_flash_attention_for_cpu"] == attention
    assert real["flops_by_op"][
        "aten._scaled_dot_product_flash_attention_for_cpu_backward"] == 5 * attention // 2


def _meta_gpt(cfg: ModelConfig) -> torch.nn.Module:
    from model.gpt import GPT

    with torch.device("meta"):
        return GPT(cfg)


def test_pipelining_bypass_still_applies_on_this_torch() -> None:
    """The private hook: this torch is the pinned one, the schedule still calls the method
    the bypass replaces, a fake pipeline step fails without the bypass and runs with it."""
    check_torch_internals()
    source = inspect.getsource(pipelining_schedules._PipelineSchedule._initialize_pp_stages)
    assert "self._warmup_p2p(" in source
    model_cfg, plan = ModelConfig(**MODEL), plan_of("pp_1f1b_full")
    train_cfg = TrainConfig(seq_len=SEQ, global_batch=4, grad_clip=0.0)  # no host read-back
    for bypass in (False, True):
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_process_group(0, plan.world_size):
            trainer = make_trainer(model_cfg, train_cfg, plan, torch.device("cpu"), fake)
            with fake:
                if bypass:
                    trainer.schedule = static_schedule(trainer)
                else:  # the same shapes given, the vote left to run
                    ids = chunk_ids(trainer.pp_rank, plan.pp, plan.virtual_stages)
                    trainer.schedule = build_schedule(
                        trainer.runners, ids, plan.pp, trainer.device, trainer.pp_group,
                        plan.schedule, plan.grad_accum, cross_entropy, stage_io(trainer))
                batch = trainer.batches.next_batch()
                if bypass:
                    trainer.train_step(batch)
                    assert trainer.schedule._stage._inference_mode is InferenceMode.STATIC
                else:  # the vote reads a received tensor with .item()
                    with pytest.raises(DataDependentOutputException) as failed:
                        trainer.train_step(batch)
                    assert any(entry.name == "_warmup_p2p" for entry in failed.traceback)


def test_ddp_under_pipelining_all_reduces_the_stage_gradients() -> None:
    """pp2 x dp2 ddp (4 ranks, rehearsed only): one flat all-reduce of the stage's fp32
    gradients over dp per step, and no other dp traffic on the first stage."""
    plan = Plan(pp=2, dp=2, micro_batch=1, grad_accum=2, sharding="ddp", schedule="1f1b")
    result = rehearse(ModelConfig(**MODEL), TrainConfig(seq_len=SEQ, global_batch=4), plan, 0)
    params = result.peak_memory_by_category["parameter"]
    assert result.collective_bytes_by_dim["dp"] == {"all_reduce": params}
    assert result.collective_bytes_by_dim["pp"]["send"] == \
        result.collective_bytes_by_dim["pp"]["recv"] == plan.grad_accum * SEQ * MODEL["d_model"] * 4
    # the stage's gradient receive buffers, one per micro-batch, made in the warm-up step and
    # held by no autograd graph, are in its memory
    assert result.peak_memory_by_category["other"] == plan.grad_accum * SEQ * MODEL["d_model"] * 4


def test_fsdp2_pipeline_counts_its_gradient_receive_buffers() -> None:
    """pp2 x dp2 zero2 (rehearsed only): the first stage's gradient receive buffers, one per
    micro-batch, are in its memory, though FSDP2's tracker takes no external tensors."""
    plan = Plan(pp=2, dp=2, micro_batch=1, grad_accum=2, sharding="zero2", schedule="1f1b")
    result = rehearse(ModelConfig(**MODEL), TrainConfig(seq_len=SEQ, global_batch=4), plan, 0)
    assert result.peak_memory_by_category["inputs"] == plan.grad_accum * SEQ * MODEL["d_model"] * 4


def test_partial_recompute_keeps_activations_between_none_and_full() -> None:
    """Recomputing the first 2 of 4 blocks (fake tensors, one rank) keeps more activations
    than recomputing all of them and fewer than recomputing none."""
    base = {"micro_batch": 2, "grad_accum": 2, "sharding": "none"}
    train = TrainConfig(seq_len=SEQ, global_batch=4)
    activation = {}
    for rec, layers in (("none", 0), ("full", 2), ("full", 0)):
        plan = Plan(**base, recompute=rec, recompute_layers=layers)
        result = rehearse(ModelConfig(**MODEL), train, plan, 0)
        activation[plan.describe().split()[-1]] = result.peak_memory_by_category["activation"]
    assert activation["full"] < activation["full2"] < activation["none"], activation


def test_ddp_without_pipelining_rehearses_ddps_bucket_copy_and_all_reduce() -> None:
    """dp2 ddp (rehearsed with the stand-in): one all-reduce of every float32 gradient over
    dp per step (the first micro-batch under no_sync), and the bucket copy of them kept."""
    plan = Plan(dp=2, micro_batch=2, grad_accum=2, sharding="ddp")
    result = rehearse(ModelConfig(**MODEL), TrainConfig(seq_len=SEQ, global_batch=8), plan, 0)
    params = result.peak_memory_by_category["parameter"]
    # the gradients, and the step's float32 loss averaged for the log
    assert result.collective_bytes_by_dim["dp"] == {"all_reduce": params + 4}
    assert result.collective_calls["all_reduce"] == 2
    assert result.peak_memory_by_category["buffer"] >= params  # the buckets
    assert result.peak_memory_by_category["gradient"] == params


REHEARSED_DDP_CHILD = r"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from model.rehearsal.rehearsed_ddp import RehearsedDDP
torch.set_num_threads(1)
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
real, stand_in = DistributedDataParallel(net()), RehearsedDDP(net(), mesh)
torch.manual_seed(1 + dist.get_rank())
batches = [torch.randn(3, 8) for _ in range(2)]
for wrapped in (real, stand_in):
    with wrapped.no_sync():
        wrapped(batches[0]).square().sum().backward()
    wrapped(batches[1]).square().sum().backward()
for a, b in zip(real.module.parameters(), stand_in.module.parameters()):
    torch.testing.assert_close(a.grad, b.grad)
buckets = sum(b.numel() for b in stand_in.buffers())
assert buckets == sum(p.numel() for p in stand_in.module.parameters()), buckets
print("same gradients", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_rehearsed_ddp_averages_gradients_as_ddp_does(tmp_path: Path) -> None:
    """On 2 real gloo ranks with different data, two micro-batches (the first under
    no_sync) leave the stand-in's gradients equal to DistributedDataParallel's."""
    (tmp_path / "child.py").write_text(REHEARSED_DDP_CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(tmp_path / "child.py")], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("same gradients") == 2


def test_busiest_ranks_are_the_first_and_last_stage() -> None:
    assert busiest_ranks(Plan(tp=4, pp=6, dp=128)) == [0, 5 * 128 * 4]
    assert busiest_ranks(Plan(tp=2, dp=4)) == [0]


def test_stage_outputs_that_differ_from_the_given_shapes_are_refused() -> None:
    given = [(torch.empty(1, 4, device="meta"), torch.empty(1, 4, 8, device="meta"))]
    check_stage_outputs(given, [{((1, 4, 8), torch.float32)}])
    with pytest.raises(RehearsalError, match="chunk 0"):
        check_stage_outputs(given, [{((1, 4, 8), torch.bfloat16)}])


def test_plan_cli_prints_the_rehearsal_beside_the_model(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """``python -m workflows.plan ... --rehearse --json``: per rehearsed rank (first and last
    stage) the model's peak and the rehearsed one under their own keys, equal to a direct
    rehearsal of the chosen plan on the cluster's device type (Frontier: fake cuda)."""
    from workflows import plan as plan_cli

    shape = tmp_path / "model.yaml"
    shape.write_text(json.dumps({"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                                 "vocab_size": 512, "seq_length": 32}))
    args = ["--model", str(shape), "--cluster", "frontier", "--devices", "4",
            "--global-batch", "8", "--fix", "pp=2", "--fix", "tp=1", "--json"]
    assert plan_cli.main(args) == 0
    assert "rehearsal" not in json.loads(capsys.readouterr().out)  # only when asked
    assert plan_cli.main([*args, "--rehearse"]) == 0
    out = json.loads(capsys.readouterr().out)
    ranks = out["rehearsal"]
    assert [r["rank"] for r in ranks] == [0, out["dp"] * out["tp"]] and \
        [r["stage"] for r in ranks] == ["first", "last"]
    assert [r["peak_memory_gb"] for r in ranks] == [out["memory_breakdown"]["first"],
                                                    out["memory_breakdown"]["last"]]
    plan = Plan(**{k: out[k] for k in ("tp", "pp", "dp", "micro_batch", "grad_accum",
                                       "schedule", "virtual_stages", "sharding", "recompute",
                                       "sequence_parallel")})
    model_cfg = ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=512, max_seq_len=32)
    train_cfg = TrainConfig(global_batch=8, seq_len=32, dtype="bfloat16")
    assert out["rehearsal_rejected"] == []  # it fits: nothing gave way
    for record in ranks:
        assert record["device_type"] == "cuda"
        direct = rehearse_isolated(model_cfg, train_cfg, plan, record["rank"],
                                   device_type="cuda")
        assert record["rehearsed_peak_memory_gb"] == direct.peak_memory_gb > 0
        assert record["rehearsed_flops_per_step"] == direct.flops_per_step[-1] > 0
        assert record["rehearsed_collective_bytes_per_step"] == \
            direct.collective_bytes_per_step[-1]
        assert record["modeled_tensor_memory_gb"] < record["peak_memory_gb"]  # margins


def test_plan_stage_rehearses_by_default_off_the_local_cluster(tmp_path: Path,
                                                              runs_dir: Path) -> None:
    from model.config import ParallelConfig
    from stages.config import load_config
    from stages.mechanism import tracking, tracking_store
    from stages.plan import work as plan_stage

    assert ParallelConfig().rehearse is None
    runs = runs_dir  # the session's measurement and migrated store
    uri = tracking_store.default_tracking_uri(runs)
    experiment = tracking.ensure_experiment(uri, "rehearse-test", runs)
    # (parallel.rehearse, cluster, rehearsed?): None rehearses on frontier, not on local
    for setting, cluster, expected in (("false", "frontier", False), ("null", "local", False),
                                       ("null", "frontier", True)):
        cfg = load_config("tiny", [f"tracking.runs_dir={runs}", "parallel.nproc=2",
                                   f"parallel.cluster={cluster}", f"parallel.rehearse={setting}"])
        run_id = tracking.start_run(uri, experiment, f"plan-{setting}-{cluster}")
        tracker = tracking.Tracker(uri, run_id)
        out_dir = tmp_path / f"plan-{setting}-{cluster}"
        out_dir.mkdir()
        out = plan_stage.run(cfg, {}, out_dir, tracker)
        tracker.flush()
        assert ("rehearsal" in out) is expected
        assert (out_dir / "rehearsal.json").exists() is expected
    records = json.loads((out_dir / "rehearsal.json").read_text())
    plan = Plan.from_json(out["plan"])
    assert [r["rank"] for r in records] == busiest_ranks(plan)
    assert all(r["rehearsed_fits_device"] for r in records)
    metrics = tracking.MlflowClient(uri).get_run(run_id).data.metrics
    for r in records:
        assert metrics[f"rehearsed_peak_memory_gb_rank{r['rank']}"] == pytest.approx(
            r["rehearsed_peak_memory_gb"])


@pytest.mark.slow  # two rehearsals, each in a process of its own
def test_plan_stage_never_keeps_a_plan_its_rehearsal_says_does_not_fit(
        tmp_path: Path, runs_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """Two plans of one model, the first holding far more activations (no recompute, a
    large micro-batch); on a device sized between their rehearsed peaks the stage keeps the
    second and records why the first gave way; below both it refuses with the figures.

    Each plan's rank is rehearsed once, for real; the stage's later asks for the same rank
    of the same plan get that result again (a rehearsal is deterministic: the cluster's
    memory, which the three asks change, is not among its inputs)."""
    import dataclasses

    from model.planner.cluster import load_cluster
    from model.rehearsal import rank_server
    from model.rehearsal.plans import rehearsal_records
    from stages.config import load_config
    from stages.mechanism import tracking, tracking_store
    from stages.plan import work as plan_stage

    rehearsed: dict[tuple, object] = {}
    real = rank_server.rehearse_isolated

    def once(model_cfg, train_cfg, plan, rank, **kwargs):
        key = (plan.key(), rank)
        if key not in rehearsed:
            rehearsed[key] = real(model_cfg, train_cfg, plan, rank, **kwargs)
        return rehearsed[key]

    monkeypatch.setattr(rank_server, "rehearse_isolated", once)

    runs = runs_dir  # the session's measurement and migrated store
    cfg = load_config("tiny", [f"tracking.runs_dir={runs}", "parallel.nproc=2",
                               "train.global_batch=16", "train.seq_len=256",
                               "model.max_seq_len=256"])
    lavish = Plan(dp=2, micro_batch=8, grad_accum=1, sharding="zero3", recompute="none")
    frugal = Plan(dp=2, micro_batch=1, grad_accum=8, sharding="zero3", recompute="full")
    bare = dataclasses.replace(load_cluster("frontier"), fragmentation=0.0, reserved_gb=0.0)
    peaks = [rehearsal_records(cfg.model, cfg.train, p, bare, 2)[0][
        "rehearsed_peak_memory_gb"] for p in (lavish, frugal)]
    assert peaks[0] > 1.5 * peaks[1]
    uri = tracking_store.default_tracking_uri(runs)
    experiment = tracking.ensure_experiment(uri, "rehearse-fit", runs)
    tracker = tracking.Tracker(uri, tracking.start_run(uri, experiment, "fit"))
    between = dataclasses.replace(bare, memory_gb=(peaks[0] + peaks[1]) / 2)
    kept = plan_stage.rehearse_in_stage(cfg, lavish, [lavish, frugal], between, None, tmp_path,
                                        tracker)
    assert kept.key() == frugal.key()
    said = capsys.readouterr().out
    assert f"kept {frugal.describe()} (by its rehearsal), not the model's choice " \
        f"{lavish.describe()}: 1 plan(s) gave way" in said
    rejected = json.loads((tmp_path / "rehearsal_rejected.json").read_text())
    assert [r["plan"] for r in rejected] == [lavish.describe()]
    assert rejected[0]["rehearsed_peak_memory_gb_with_margins"] == pytest.approx(peaks[0])
    assert json.loads((tmp_path / "rehearsal.json").read_text())[0]["rehearsed_fits_device"]
    below = dataclasses.replace(bare, memory_gb=peaks[1] / 2)
    with pytest.raises(PlanError, match="no plan fits .* by its rehearsal"):
        plan_stage.rehearse_in_stage(cfg, lavish, [lavish, frugal], below, None, tmp_path,
                                     tracker)
    tracker.flush()
    assert len(rehearsed) == 2
