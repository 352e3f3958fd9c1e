"""The GPT model on one process: shapes, parameter counts, init, rotary/HF equivalence, helpers."""
from __future__ import annotations

import itertools
import math
import types
from dataclasses import replace

import pytest
import torch

from model.config import ModelConfig, TrainConfig
from model.flops import flops_per_token, param_count
from model.gpt import GPT, apply_rotary, rotary_tables
from model.parallel.dist_env import expand_first_host, from_environ, local_rank_variables
from model.parallel.pipeline import build_chunk, chunk_ids
from model.planner.shapes import Shapes
from model.training.batches import SyntheticBatches, synthetic_batch_factory
from model.training.optim import clip_grad_norm_, lr_factor

CONFIGS = {
    "llama_gqa": ModelConfig(family="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                             vocab_size=300, max_seq_len=32),
    "neox_parallel": ModelConfig(family="neox", n_layers=2, d_model=64, n_heads=4,
                                 vocab_size=300, max_seq_len=32, parallel_residual=True),
    "neox_sequential": ModelConfig(family="neox", n_layers=2, d_model=64, n_heads=4,
                                   vocab_size=300, max_seq_len=32),
    "llama_mha": ModelConfig(family="llama", n_layers=3, d_model=32, n_heads=2, ffn_hidden=72,
                             vocab_size=260, max_seq_len=32),
    "neox_partial_rotary": ModelConfig(family="neox", n_layers=2, d_model=64, n_heads=4,
                                       vocab_size=300, max_seq_len=32, parallel_residual=True,
                                       rotary_fraction=0.25),  # Pythia's: 4 of 16 dims
    # Qwen3's heads: wider than d_model / n_heads, with q/k norms
    "llama_head_dim_qk_norm": ModelConfig(family="llama", n_layers=2, d_model=64, n_heads=4,
                                          n_kv_heads=2, attention_head_dim=32, qk_norm=True,
                                          vocab_size=300, max_seq_len=32),
    "llama_qkv_bias": ModelConfig(family="llama", n_layers=2, d_model=64, n_heads=4,
                                  n_kv_heads=2, qkv_bias=True, vocab_size=300,
                                  max_seq_len=32),  # Qwen2's
}


def built(cfg: ModelConfig, seed: int = 0) -> GPT:
    """Meta-device build, materialise, deterministic init (the trainer's path)."""
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_shapes_and_parameter_count(name: str) -> None:
    cfg = CONFIGS[name]
    model = built(cfg)
    logits = model(torch.randint(0, cfg.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, cfg.vocab_size)
    assert list(model.layers.keys()) == [str(i) for i in range(cfg.n_layers)]
    assert "rope_cos" not in model.state_dict()  # rotary tables are not checkpointed


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_parameter_formula_counts_the_real_model(name: str) -> None:
    """model.flops is the only parameter count: it equals the built GPT's, and the planner's
    shapes use it (blocks' matrices split by tp, norms replicated)."""
    cfg = CONFIGS[name]
    with torch.device("meta"):
        model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert param_count(cfg) == total
    assert param_count(cfg, include_embedding=False) == total - cfg.vocab_size * cfg.d_model
    shapes = Shapes.from_configs(cfg, TrainConfig(seq_len=32))
    assert shapes.total_params == total
    block = model.layers["0"]
    matrices = sum(p.numel() for n, p in block.named_parameters()
                   if p.dim() == 2 and "norm" not in n)
    norms = sum(p.numel() for n, p in block.named_parameters() if "norm" in n)
    assert (shapes.layer_matrix_params, shapes.layer_norm_params) == (matrices, norms)
    assert shapes.model_flops_per_token() == flops_per_token(cfg, 32)


def test_init_is_deterministic_and_seeded() -> None:
    cfg = CONFIGS["llama_gqa"]
    a, b, c = built(cfg, 7), built(cfg, 7), built(cfg, 8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    std = a.layers["0"].attention.wq.weight.std().item()
    assert abs(std - cfg.init_std) < 0.003
    wo_std = a.layers["0"].attention.wo.weight.std().item()
    assert abs(wo_std - cfg.init_std / math.sqrt(2 * cfg.n_layers)) < 0.003
    assert torch.equal(a.layers["1"].ffn_norm.weight, torch.ones(64))


def test_a_chunk_keeps_only_the_rope_rows_its_sequences_read() -> None:
    """Tables cut to the training length: same logits, tables of those rows only, and a
    re-initialisation fills the rows kept."""
    cfg = CONFIGS["llama_gqa"]
    full, cut = built(cfg, 7), built(cfg, 7)
    cut.keep_rope_rows(8)
    assert tuple(cut.rope_cos.shape) == (8, cfg.head_dim) == tuple(cut.rope_sin.shape)
    assert dict(cut.named_buffers())["rope_cos"] is cut.rope_cos
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    torch.testing.assert_close(cut(tokens), full(tokens))
    cut.init_weights(7)
    torch.testing.assert_close(cut.rope_sin, full.rope_sin[:8])


def test_causality() -> None:
    model = built(CONFIGS["llama_gqa"])
    tokens = torch.randint(0, 300, (1, 12))
    changed = tokens.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 300
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:], atol=1e-4)


def test_rotary_preserves_norms_and_encodes_relative_position() -> None:
    cos, sin = rotary_tables(16, 32, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    def rot(x, p):
        return apply_rotary(x, cos[p : p + 1], sin[p : p + 1])
    assert torch.allclose(rot(q, 5).norm(), q.norm(), atol=1e-5)
    # <R_m q, R_n k> depends on m - n only.
    assert torch.allclose((rot(q, 3) * rot(k, 1)).sum(), (rot(q, 12) * rot(k, 10)).sum(), atol=1e-5)


def test_partial_rotary_rotates_the_leading_dims_and_passes_the_rest() -> None:
    cos, sin = rotary_tables(4, 32, 10000.0)  # 4 of 16 dims rotated
    x = torch.randn(1, 2, 32, 16)
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert torch.equal(out[..., :4], apply_rotary(x[..., :4].contiguous(), cos, sin))
    assert not torch.allclose(out[:, :, 1:, :4], x[:, :, 1:, :4])
    # The tables belong to the rotated width: inv_freq = theta^(-2i/4), not theta^(-2i/16).
    assert cos[1, 1].item() == pytest.approx(math.cos(10000.0 ** -0.5))
    model = built(CONFIGS["neox_partial_rotary"])
    assert tuple(model.rope_cos.shape) == (32, 4)


@pytest.mark.parametrize("fields, fragment", [
    ({"rotary_fraction": 0.0}, r"model.rotary_fraction must be in \(0, 1\], got 0.0"),
    ({"rotary_fraction": 1.5}, r"model.rotary_fraction must be in \(0, 1\], got 1.5"),
    ({"rotary_fraction": 0.1}, r"rotates int\(16 \* 0.1\) = 1 dims .* positive even number"),
    ({"rotary_fraction": 0.5, "family": "llama"}, "only supported for family 'neox'"),
])
def test_rotary_fraction_is_checked(fields, fragment) -> None:
    shape = {"family": "neox", "d_model": 64, "n_heads": 4, **fields}
    with pytest.raises(ValueError, match=fragment):
        ModelConfig(**shape)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_hugging_face_after_export(name: str, tmp_path) -> None:
    """Same logits as LlamaForCausalLM / GPTNeoXForCausalLM loaded from our export."""
    import transformers

    from model.evaluation.export_hf import export_model

    cfg = CONFIGS[name]
    model = built(cfg, 3)
    export_model(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                           attn_implementation="eager")
    hf.eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 20))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_pipeline_chunks_keep_full_model_names() -> None:
    cfg = ModelConfig(n_layers=5, d_model=32, n_heads=4, vocab_size=300, max_seq_len=32)
    assert chunk_ids(1, 2, 2) == [1, 3]
    chunks = [build_chunk(cfg, c, 4) for c in range(4)]
    assert [list(c.layers.keys()) for c in chunks] == [["0", "1"], ["2"], ["3"], ["4"]]
    assert chunks[0].tok_embeddings is not None and chunks[0].output is None
    assert chunks[3].tok_embeddings is None and chunks[3].norm is not None
    names = set().union(*(dict(c.named_parameters()).keys() for c in chunks))
    with torch.device("meta"):
        assert names == set(dict(GPT(cfg).named_parameters()).keys())


def test_flops_formula() -> None:
    cfg = CONFIGS["llama_gqa"]
    n = param_count(cfg) - cfg.vocab_size * cfg.d_model  # without the input embedding
    assert flops_per_token(cfg, 32) == 6 * n + 6 * 2 * 64 * 32  # causal attention: half of 12
    # the attention products are as wide as the heads, n_heads x head_dim, not d_model
    wide = replace(cfg, attention_head_dim=32)  # 4 heads of 32 on a width of 64
    n_wide = param_count(wide) - wide.vocab_size * wide.d_model
    assert flops_per_token(wide, 32) == 6 * n_wide + 6 * 2 * (4 * 32) * 32


def test_lr_schedule_warmup_then_cosine() -> None:
    cfg = TrainConfig(steps=20, warmup_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(s, cfg) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(factors[3:]))
    assert lr_factor(20, cfg) == pytest.approx(0.1)


def test_clip_grad_norm_single_process() -> None:
    p1, p2 = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    p1.grad, p2.grad = torch.full((3,), 2.0), torch.full((4,), 2.0)
    norm = clip_grad_norm_([p1, p2], max_norm=1.0)
    assert norm.item() == pytest.approx(math.sqrt(7 * 4.0))
    clipped = torch.cat([p1.grad, p2.grad]).norm().item()
    assert clipped == pytest.approx(1.0, rel=1e-4)


def test_synthetic_batches_are_layout_independent() -> None:
    whole = SyntheticBatches(300, 16, 8, 0, 1, seed=5)
    halves = [SyntheticBatches(300, 16, 8, r, 2, seed=5) for r in range(2)]
    for _ in range(3):
        full = whole.next_batch()
        assert full.shape == (8, 17)
        assert torch.equal(torch.cat([h.next_batch() for h in halves]), full)
    resumed = SyntheticBatches(300, 16, 8, 0, 1, seed=5)
    resumed.load_state_dict(whole.state_dict())
    assert torch.equal(resumed.next_batch(), whole.next_batch())


def test_synthetic_batch_factory_serves_the_train_config_batches() -> None:
    """The ranks' factory (train, measure and rehearsal workers) reads seq_len, global_batch
    and seed from the train config."""
    train = types.SimpleNamespace(seq_len=16, global_batch=8, seed=5)
    factory = synthetic_batch_factory(300, train)
    halves = [factory(r, 2) for r in range(2)]
    assert halves[1].dp_rank == 1 and halves[1].rows == 4
    assert torch.equal(torch.cat([h.next_batch() for h in halves]),
                       SyntheticBatches(300, 16, 8, 0, 1, seed=5).next_batch())
    with pytest.raises(ValueError, match="not divisible by dp=3"):
        factory(0, 3)


def test_rank_identity_from_the_local_launcher_torchrun_and_slurm() -> None:
    local = from_environ(local_rank_variables(1, 4, "/tmp/ranks-x/store"))
    assert (local.rank, local.local_rank, local.world_size, local.store_file) == (
        1, 1, 4, "/tmp/ranks-x/store")
    env = from_environ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                        "MASTER_ADDR": "h0", "MASTER_PORT": "1234"})
    assert (env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port) == (
        3, 1, 8, "h0", 1234)
    assert env.store_file is None  # torchrun's ranks meet at MASTER_ADDR:MASTER_PORT
    slurm = from_environ({"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16",
                          "SLURM_JOB_NODELIST": "frontier[00012-00013]", "SLURM_JOB_ID": "123456"})
    assert (slurm.rank, slurm.local_rank, slurm.world_size) == (9, 1, 16)
    assert slurm.master_addr == "frontier00012"
    assert slurm.master_port == 20000 + 123456 * 16 % 20000
    # A step on some nodes of the job meets on the step's first node, at the step's port.
    step = from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "123456",
                         "SLURM_JOB_NODELIST": "nid[001-002]", "SLURM_STEP_NODELIST": "nid002",
                         "SLURM_STEP_ID": "3"})
    assert step.master_addr == "nid002"
    assert step.master_port == 20000 + (123456 * 16 + 3) % 20000 != slurm.master_port
    assert expand_first_host("login1,nid[3-4]") == "login1"
    assert expand_first_host("nid[007,010-012]") == "nid007"
    single = from_environ({})
    assert (single.rank, single.world_size) == (0, 1)


def _grads_and_saved_bytes(mode: str) -> tuple[dict[str, torch.Tensor], int]:
    from model.parallel.parallelize import apply_activation_checkpointing

    model = built(ModelConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=300, max_seq_len=64), 1)
    apply_activation_checkpointing(model, mode)
    tokens = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(0))
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)


def test_recompute_modes_keep_gradients_and_save_memory() -> None:
    base, none_bytes = _grads_and_saved_bytes("none")
    sel, sel_bytes = _grads_and_saved_bytes("selective")
    full, full_bytes = _grads_and_saved_bytes("full")
    for name in base:
        assert torch.allclose(sel[name], base[name], atol=1e-6), name
        assert torch.allclose(full[name], base[name], atol=1e-6), name
    assert full_bytes < sel_bytes < none_bytes


SHARD_CHECK = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from model.gpt import _copy_full_into

full = torch.arange(7 * 10, dtype=torch.float32).reshape(7, 10)
for rank in range(8):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    for placements in ([Shard(0), Shard(0)], [Shard(0), Shard(1)], [Replicate(), Shard(1)],
                       [_StridedShard(0, split_factor=2), Shard(0)], [Shard(1), Replicate()]):
        reference = distribute_tensor(full, mesh, placements, src_data_rank=None)
        param = distribute_tensor(torch.zeros_like(full), mesh, placements, src_data_rank=None)
        _copy_full_into(param, full)
        assert torch.equal(param.to_local(), reference.to_local()), (rank, placements)
    dist.destroy_process_group()
print("every shard equal")
"""


def test_initial_shards_are_those_distribute_tensor_cuts() -> None:
    """Init cuts each rank's shard by its offset; on uneven (7 x 10 over 4 x 2) FSDP/TP/strided
    placements of every rank of a fake 8-rank group it equals ``distribute_tensor``'s. A
    process of its own: the fake group is initialised once per rank."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", SHARD_CHECK], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every shard equal" in proc.stdout
