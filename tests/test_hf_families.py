"""Today's open model families through Hugging Face and back, on random small models built
by transformers: Llama 3.1 (llama3 rope scaling), Llama 3.2 (tied embeddings and llama3
scaling), Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm, head_dim 16 over d_model 32 / 4 heads,
tied), Mistral (no sliding window).

Each is imported (weights equal bit for bit, logits within 1e-5 in float32), exported back
(transformers' own class, logits within 1e-5), continued-pretrained one step (the first loss is
transformers' loss on that batch); the slow tests run them under tp2 x pp2 on 4 gloo ranks.
Tied embeddings split into pipeline stages as two copies kept equal (the first stage's
embedding, the last stage's head): a pp2 run equals one process and leaves the copies bitwise
equal.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.config import ModelConfig
from model.evaluation.dcp_io import checkpoint_model_config
from model.evaluation.export_hf import (
    ExportError,
    export_checkpoint,
    export_model,
    hf_config,
    hf_layout,
)
from model.evaluation.import_hf import ImportHFError, import_hf, model_config_from_hf
from model.gpt import GPT
from model.training.checkpoint import load_for_inference
from tests.test_import_hf import max_diff, tokens
from tests.train_helpers import run_script_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parent.parent

# The shape of tests/train_helpers.TINY (4 layers, d_model 32, 4 heads, 2 kv heads, vocabulary
# 384, 32 positions), so the trainer's tiny config accepts every one as train.init_from.
BASE = {"vocab_size": 384, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 88, "max_position_embeddings": 32,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
# Llama 3.1's scaling with the original context shrunk to 16 positions so that, at 32, it
# changes every frequency of an 8-dim head (wavelengths 6.3 (mixed), 167, 4443 and 1.2e5
# (slowed by 8) against the 4..16 band).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {
    "llama31": ("LlamaConfig", {**BASE, "rope_theta": 5e5, "rope_scaling": LLAMA3_ROPE}),
    "llama32": ("LlamaConfig", {**BASE, "rope_theta": 5e5, "tie_word_embeddings": True,
                                "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0}}),
    "qwen2": ("Qwen2Config", {**BASE, "rope_theta": 1e6}),
    "qwen3": ("Qwen3Config", {**BASE, "head_dim": 16, "rope_theta": 1e6,
                              "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {**BASE, "head_dim": 8, "sliding_window": None}),
}
# What each family turns into (beyond the shared shape), and the class the export writes.
EXPECTED = {
    "llama31": ({"rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_max_seq_len": 16,
                 "rope_theta": 5e5}, "LlamaForCausalLM"),
    "llama32": ({"rope_scaling": "llama3", "rope_factor": 32.0, "tie_embeddings": True},
                "LlamaForCausalLM"),
    "qwen2": ({"qkv_bias": True, "rope_theta": 1e6}, "Qwen2ForCausalLM"),
    "qwen3": ({"qk_norm": True, "attention_head_dim": 16, "tie_embeddings": True},
              "Qwen3ForCausalLM"),
    "mistral": ({"family": "llama"}, "LlamaForCausalLM"),
}
TOL = 1e-5  # float32 logits


def hf_model(family: str, seed: int = 0):
    """A random HF model of ``family`` whose norm weights and biases are perturbed (not
    just 1/0) and whose attention is sharp (q/k projections x8, or q/k norm weights x3 where
    a q/k norm would undo the x8), so rotary and its scaling show in the logits."""
    cls, fields = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cls)(**fields)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.mul_(3.0)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8.0)
    return model.eval()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """family -> (HF model, its saved directory, our imported checkpoint), built on demand."""
    root, cache = tmp_path_factory.mktemp("families"), {}

    def get(family: str):
        if family not in cache:
            hf = hf_model(family)
            hf.save_pretrained(str(root / family / "hf"))
            cache[family] = (hf, root / family / "hf",
                             import_hf(root / family / "hf", root / family / "ours"))
        return cache[family]

    return get


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_gives_equal_weights_and_logits(imported, family):
    hf, _, ckpt = imported(family)
    cfg = checkpoint_model_config(ckpt)
    fields, _ = EXPECTED[family]
    assert {k: getattr(cfg, k) for k in fields} == fields
    assert (cfg.n_layers, cfg.d_model, cfg.kv_heads) == (4, 32, 2)
    ours = load_for_inference(ckpt, cfg)
    theirs, mine = hf.state_dict(), ours.state_dict()
    for hf_name, (name,) in hf_layout(cfg):  # every HF tensor, bit for bit
        assert torch.equal(mine[name], theirs[hf_name]), hf_name
    if cfg.tie_embeddings:  # one Parameter, the HF embedding
        assert ours.output.weight is ours.tok_embeddings.weight
        assert torch.equal(ours.output.weight, theirs["lm_head.weight"])
    diff = max_diff(ours, hf)
    print(f"{family}: max |logit difference| {diff:.2e}")
    assert diff < TOL


@pytest.mark.parametrize("family", ["llama31", "llama32", "qwen2", "qwen3"])
def test_each_new_field_changes_the_logits(imported, family):
    """Without the family's own feature our logits miss transformers' by far more than the
    tolerance: the tests above would catch a feature that were computed wrong or not at all."""
    hf, _, ckpt = imported(family)
    cfg = checkpoint_model_config(ckpt)
    ours = load_for_inference(ckpt, cfg)
    if family in ("llama31", "llama32"):
        plain = GPT(dataclasses.replace(cfg, rope_scaling="none", rope_factor=1.0))
        plain.load_state_dict(ours.state_dict())
    elif family == "qwen2":
        plain = GPT(dataclasses.replace(cfg, qkv_bias=False))
        plain.load_state_dict(ours.state_dict(), strict=False)  # the biases dropped
    else:
        plain = GPT(dataclasses.replace(cfg, qk_norm=False))
        plain.load_state_dict(ours.state_dict(), strict=False)  # the q/k norms dropped
    assert max_diff(plain, hf) > 1e-2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_round_trip_writes_the_family_class(imported, family, tmp_path):
    """ours -> HF (in memory and streamed + sharded from the checkpoint) -> transformers'
    class for the family computes the original HF model's logits; importing the export
    gives the same model config back."""
    hf, _, ckpt = imported(family)
    cfg = checkpoint_model_config(ckpt)
    out = export_model(load_for_inference(ckpt, cfg), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [EXPECTED[family][1]]
    assert config["tie_word_embeddings"] == cfg.tie_embeddings
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(reloaded).__name__ == EXPECTED[family][1]
    with torch.no_grad():
        a = reloaded.eval()(tokens()).logits
        assert (a - hf(tokens()).logits).abs().max().item() < TOL
    names = set(_safetensors_names(out))
    assert ("lm_head.weight" in names) == (not cfg.tie_embeddings)
    assert model_config_from_hf(config) == cfg
    streamed = export_checkpoint(ckpt, None, tmp_path / "streamed", shard_bytes=20_000)
    assert (streamed / "model.safetensors.index.json").is_file()
    again = transformers.AutoModelForCausalLM.from_pretrained(str(streamed), dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(again.eval()(tokens()).logits, a)


def _safetensors_names(out: Path) -> list[str]:
    from safetensors import safe_open

    names = []
    for path in out.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            names.extend(handle.keys())
    return names


def _safetensors_tensor(out: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    for path in out.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    raise KeyError(name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_continued_pretraining_starts_from_the_imported_weights(imported, family, tmp_path):
    """One rank, one step from the import: the first loss is transformers' loss on that batch."""
    from model.training.batches import SyntheticBatches
    from tests.train_helpers import run_worker

    hf, _, ckpt = imported(family)
    summary = run_worker(tmp_path / "train", {"micro_batch": 4, "grad_accum": 2,
                                              "sharding": "none"}, 1,
                         f"train.init_from={ckpt}", "train.steps=1")
    loss = summary["losses"][0]
    expected = hf_loss(hf, SyntheticBatches(384, 32, 8, 0, 1, 1234).next_batch())
    print(f"{family}: first loss {loss:.7f}, transformers {expected:.7f}")
    assert abs(loss - expected) < TOL
    assert summary["steps_done"] == 1


def hf_loss(hf, batch: torch.Tensor) -> float:
    """transformers' mean next-token loss on ``batch`` [B, T+1]."""
    with torch.no_grad():
        logits = hf(batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def test_tied_embeddings_stay_one_parameter_through_materialisation():
    """The trainer's path (meta device -> to_empty -> init_weights) keeps the tie: one
    Parameter, listed once, the head computing with the embedding matrix."""
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=384, max_seq_len=32,
                      tie_embeddings=True)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    assert model.output.weight is model.tok_embeddings.weight
    assert [n for n, _ in model.named_parameters()].count("tok_embeddings.weight") == 1
    assert "output.weight" not in dict(model.named_parameters())
    assert {"tok_embeddings.weight", "output.weight"} <= set(model.state_dict())
    untied = GPT(dataclasses.replace(cfg, tie_embeddings=False))
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in untied.parameters()) - 384 * 32


def test_tied_checkpoint_resumes_as_the_uninterrupted_run(imported, tmp_path):
    """Llama 3.2 (tied): stopped after step 1 and resumed (model and optimizer state through
    DCP, the shared matrix under both names) gives the uninterrupted run's second loss."""
    from tests.train_helpers import run_worker

    _, _, ckpt = imported("llama32")
    plan = {"micro_batch": 8, "grad_accum": 1, "sharding": "none"}
    init = (f"train.init_from={ckpt}", "train.steps=2")
    whole = run_worker(tmp_path / "whole", plan, 1, *init)
    run_worker(tmp_path / "split", plan, 1, *init, steps=1)
    resumed = run_worker(tmp_path / "split", plan, 1, *init)
    assert resumed["steps_done"] == 2
    assert resumed["losses"] == whole["losses"]


def test_tied_gpt_neox_round_trip(tmp_path):
    """GPT-NeoX with tie_word_embeddings (embed_in is the head): import, logits, export."""
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        vocab_size=384, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=32, rotary_pct=0.25,
        use_parallel_residual=True, tie_word_embeddings=True)
    hf = transformers.GPTNeoXForCausalLM(config).eval()
    hf.save_pretrained(str(tmp_path / "hf"))
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ours")
    cfg = checkpoint_model_config(ckpt)
    assert (cfg.family, cfg.tie_embeddings) == ("neox", True)
    ours = load_for_inference(ckpt, cfg)
    assert max_diff(ours, hf) < TOL
    out = export_model(ours, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert max_diff(ours, reloaded.eval()) < TOL


def test_llama31_8b_config_translates_to_the_preset_model():
    """Llama 3.1 8B's published config.json (llama3 rope scaling) gives
    configs/llama31-8b-continue.yaml's model section, so the preset's restated shape does not
    conflict with train.init_from; the preset takes its tokenizer from the HF directory."""
    from stages.config import load_config

    published = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 128256}
    cfg = model_config_from_hf(published)
    preset = load_config(str(REPO / "configs" / "llama31-8b-continue.yaml"), [])
    assert cfg == preset.model
    assert (cfg.head_dim, cfg.kv_heads, cfg.rope_scaling, cfg.rope_factor) == (128, 8, "llama3", 8)
    # At the real scale our scaled frequencies are transformers' bit for bit.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from model.gpt import rotary_inv_freq

    hf_config_8b = transformers.LlamaConfig(**{k: v for k, v in published.items()
                                               if k not in ("architectures", "torch_dtype")})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config_8b, "cpu")
    assert torch.equal(rotary_inv_freq(cfg), theirs)
    init_from = Path(preset.train.init_from)
    assert Path(preset.tokenizer.path) == init_from / "tokenizer.json"
    assert preset.tokenizer.eos_token == "<|end_of_text|>"
    assert preset.train.seq_len <= cfg.max_seq_len


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("cls, change, fragment", [
    ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
     r"use_sliding_window=true slides layers 2..3 \(max_window_layers=2\)"),
    ("Qwen3Config", {"layer_types": ["full_attention", "sliding_attention"] * 2,
                     "use_sliding_window": True, "sliding_window": 8},
     "layer_types has 2 of 4 layers 'sliding_attention'"),
    ("MistralConfig", {"sliding_window": 16}, r"sliding_window=16 < max_position_embeddings=32"),
    ("Qwen3Config", {"attention_bias": True}, r"attention_bias=true is not supported \(biases "
                                              "on q/k/v and o_proj"),
    ("LlamaConfig", {"attention_bias": True}, "attention_bias=true is not supported"),
    ("LlamaConfig", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 16}},
     "rope_scaling type 'yarn' is not supported"),
    ("Qwen2Config", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling type 'dynamic' is not supported"),
])
def test_what_stays_unsupported_is_refused_by_name(cls, change, fragment):
    config = getattr(transformers, cls)(**{**BASE, **change}).to_dict()
    if "layer_types" not in change:  # as published configs (written before 5.x) read
        config.pop("layer_types", None)
    with pytest.raises(ImportHFError, match=fragment):
        model_config_from_hf(config)


def test_linear_rope_scaling_imports_and_matches(tmp_path):
    """Linear scaling (every frequency / factor) is cheap and supported too."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**BASE, rope_scaling={"rope_type": "linear", "factor": 4.0})
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8.0)
    hf.save_pretrained(str(tmp_path / "hf"))
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ours")
    cfg = checkpoint_model_config(ckpt)
    assert (cfg.rope_scaling, cfg.rope_factor) == ("linear", 4.0)
    assert max_diff(load_for_inference(ckpt, cfg), hf) < TOL
    assert hf_config(cfg).to_dict()["rope_parameters"]["factor"] == 4.0


def test_tied_embeddings_split_into_two_equal_copies():
    """One chunk keeps the tie (one Parameter); two chunks give the first the embedding and
    the last its own ``output.weight``, initialised with the embedding's values."""
    from model.parallel.pipeline import build_chunk

    cfg = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=384, max_seq_len=32,
                      tie_embeddings=True)
    whole = build_chunk(cfg, 0, 1)
    assert whole.output.weight is whole.tok_embeddings.weight
    first, last = build_chunk(cfg, 0, 2), build_chunk(cfg, 1, 2)
    for chunk in (first, last):
        chunk.to_empty(device="cpu")
        chunk.init_weights(7)
    assert first.output is None and last.tok_embeddings is None
    assert set(dict(last.named_parameters())) >= {"output.weight"}
    assert torch.equal(last.output.weight, first.tok_embeddings.weight)


def tied_copies(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """A tied checkpoint's two copies of the matrix, each weight and AdamW moment by key."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from model.evaluation.dcp_io import CheckpointTensors

    names = ("tok_embeddings.weight", "output.weight")
    out = CheckpointTensors(ckpt).load(names)
    optim = {f"state.{n}.{k}": torch.empty(384, 32) for n in names
             for k in ("exp_avg", "exp_avg_sq")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"optim": optim}, checkpoint_id=str(ckpt), no_dist=True)
    return {**out, **optim}


def assert_equal_copies(ckpt: str | Path) -> None:
    """The embedding and the head copy of a pipelined tied run: bitwise equal weights and
    AdamW moments."""
    copies = tied_copies(ckpt)
    pairs = [("tok_embeddings.weight", "output.weight")] + [
        (f"state.tok_embeddings.weight.{m}", f"state.output.weight.{m}")
        for m in ("exp_avg", "exp_avg_sq")]
    for a, b in pairs:
        assert torch.equal(copies[a], copies[b]), b


def test_tied_llama_pipeline_equals_one_process(imported, tmp_path):
    """Llama 3.2 (tied) on 2 pipeline ranks from the import: the first stage's embedding and
    the last stage's head copy have their gradients summed over the embedding group, so the
    losses equal one process's with clipping at work (the matrix counted once in the norm)
    and the two copies (weights, AdamW moments) are bitwise equal in the checkpoint. A
    one-process checkpoint resumes under interleaved pp2 (the copy's optimizer state read
    from the embedding's) as the uninterrupted run."""
    from tests.train_helpers import run_worker

    _, _, ckpt = imported("llama32")
    init = (f"train.init_from={ckpt}", "train.steps=3", "train.grad_clip=0.05")
    single = {"micro_batch": 4, "grad_accum": 2, "sharding": "none"}
    one = run_worker(tmp_path / "one", single, 1, *init)
    two = run_worker(tmp_path / "pp2", {"pp": 2, "micro_batch": 4, "grad_accum": 2,
                                        "schedule": "gpipe", "sharding": "none"}, 2, *init)
    print(f"llama32 pp2 {two['losses']}, one process {one['losses']}")
    for a, b in zip(two["losses"], one["losses"], strict=True):
        assert abs(a - b) < TOL
    assert_equal_copies(two["checkpoint"])
    trained = tied_copies(two["checkpoint"])["output.weight"]
    assert not torch.equal(trained, load_for_inference(ckpt, checkpoint_model_config(ckpt))
                           .output.weight)
    out = export_checkpoint(two["checkpoint"], None, tmp_path / "hf")  # one matrix, no lm_head
    names = set(_safetensors_names(out))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    exported = _safetensors_tensor(out, "model.embed_tokens.weight")
    assert torch.equal(exported, trained)
    run_worker(tmp_path / "split", single, 1, *init, steps=1)
    resumed = run_worker(tmp_path / "split", {"pp": 2, "micro_batch": 2, "grad_accum": 4,
                                              "schedule": "interleaved_1f1b",
                                              "virtual_stages": 2, "sharding": "none"}, 2, *init)
    assert resumed["steps_done"] == 3
    for a, b in zip(resumed["losses"], one["losses"], strict=True):
        assert abs(a - b) < TOL


def test_qkv_bias_with_qk_norm_has_no_export_class(tmp_path):
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=384, max_seq_len=32,
                      qkv_bias=True, qk_norm=True)
    with pytest.raises(ExportError, match="model.qkv_bias=true with model.qk_norm=true has no"):
        export_model(GPT(cfg), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_new_fields_default_to_the_old_model():
    """A model.json written before these fields existed reads as the model it was."""
    old = {"family": "llama", "n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64,
           "max_seq_len": 16}
    cfg = ModelConfig(**old)
    assert (cfg.rope_scaling, cfg.tie_embeddings, cfg.qkv_bias, cfg.qk_norm,
            cfg.attention_head_dim, cfg.head_dim) == ("none", False, False, False, None, 8)
    names = set(GPT(cfg).state_dict())
    assert not any("bias" in n or "q_norm" in n for n in names)
    with pytest.raises(ValueError, match="model.rope_factor=2.0 needs model.rope_scaling"):
        ModelConfig(**old, rope_factor=2.0)
    with pytest.raises(ValueError, match="model.qk_norm is only supported for family 'llama'"):
        ModelConfig(**{**old, "family": "neox"}, qk_norm=True)


def test_export_command_line(imported, tmp_path):
    """``python -m model.export_hf CHECKPOINT OUT``: a Qwen3 (tied) import, in bfloat16."""
    hf, _, ckpt = imported("qwen3")
    proc = subprocess.run([sys.executable, "-m", "model.export_hf", str(ckpt),
                           str(tmp_path / "hf"), "--dtype", "bfloat16", "--shard-bytes", "20000"],
                          cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(Qwen3ForCausalLM, " in proc.stdout and "safetensors file(s)" in proc.stdout
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                                 dtype=torch.float32)
    assert type(reloaded).__name__ == "Qwen3ForCausalLM"
    for name, tensor in reloaded.state_dict().items():  # the bf16 rounding of HF's weights
        assert torch.equal(tensor, hf.state_dict()[name].to(torch.bfloat16).float()), name
    bad = subprocess.run([sys.executable, "-m", "model.export_hf", str(tmp_path / "nope"),
                          str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=False)
    assert bad.returncode == 2 and "export_hf: checkpoint" in bad.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ several ranks
LAYOUT_WORKER = """
import json, sys
import torch, torch.distributed as dist
from model.evaluation.dcp_io import checkpoint_model_config
from model.evaluation.layout import LayoutModel
from tests.test_import_hf import tokens

cases, out = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
result = {}
for family, (ckpt, tp, pp) in cases.items():
    model = LayoutModel(ckpt, checkpoint_model_config(ckpt), tp=tp, pp=pp)
    result[family] = {"losses": model.token_losses(tokens(2)).tolist(),
                      "last_logits": model.last_logits(tokens()).tolist()}
if dist.get_rank() == 0:
    open(out, "w").write(json.dumps(result))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_training_layout_tp2_pp2_computes_transformers_logits(imported, tmp_path):
    """Every family's import spread over 4 gloo ranks as LayoutModel (tp2 x pp2; the tied
    ones with the head copy on the last stage): per-token losses and last-position logits
    equal transformers' within 1e-5 (one launch of 4 ranks, as torchrun's, for all of them)."""
    cases = {f: (str(imported(f)[2]), 2, 2) for f in sorted(FAMILIES)}
    (tmp_path / "worker.py").write_text(LAYOUT_WORKER)
    code, _, stderr = run_script_ranks(tmp_path / "worker.py",
                                       [json.dumps(cases), str(tmp_path / "out.json")], 4,
                                       timeout=300)
    assert code == 0, stderr[-4000:]
    got = json.loads((tmp_path / "out.json").read_text())
    for family in sorted(FAMILIES):
        hf = imported(family)[0]
        batch = tokens(2)
        with torch.no_grad():
            logits = hf(batch[:, :-1]).logits
            losses = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="none").view(3, 31)
            last = hf(tokens()).logits[:, -1]
        loss_diff = (torch.tensor(got[family]["losses"]) - losses).abs().max().item()
        logit_diff = (torch.tensor(got[family]["last_logits"]) - last).abs().max().item()
        print(f"{family} {cases[family][1:]}: |loss| {loss_diff:.2e}, |logit| {logit_diff:.2e}")
        assert loss_diff < TOL and logit_diff < TOL, family


@pytest.mark.slow
@pytest.mark.parametrize("family, plan", [
    # Qwen3 (tied, q/k norms): the vocabulary-parallel embedding is the head, sharded again by
    # FSDP2 over dp; the q/k norm weights see half the heads per tp rank; sequence parallel
    # (the tied head reads a sequence-sharded input) and selective recompute.
    ("qwen3", {"tp": 2, "pp": 1, "dp": 2, "micro_batch": 2, "grad_accum": 2,
               "sharding": "zero3", "sequence_parallel": True, "recompute": "selective"}),
    # Qwen2 (q/k/v biases, column-sharded with their weights) through a 1F1B pipeline.
    ("qwen2", {"tp": 2, "pp": 2, "dp": 1, "micro_batch": 2, "grad_accum": 4,
               "schedule": "1f1b", "sharding": "none"}),
    # Llama 3.2 (tied) through a 1F1B pipeline: the vocabulary-parallel embedding on the
    # first stage, its copy as the head on the last, gradients summed between them.
    ("llama32", {"tp": 2, "pp": 2, "dp": 1, "micro_batch": 2, "grad_accum": 4,
                 "schedule": "1f1b", "sharding": "none"}),
])
def test_continued_pretraining_on_4_ranks_equals_one_process(imported, family, plan, tmp_path):
    """Two steps on 4 gloo ranks from the import: both losses equal one process's within
    1e-5 and the first is transformers'; the trained checkpoint exports (streamed) to
    transformers with our logits."""
    from model.training.batches import SyntheticBatches
    from tests.train_helpers import run_worker

    hf, _, ckpt = imported(family)
    init = (f"train.init_from={ckpt}", "train.steps=2")
    one = run_worker(tmp_path / "one", {"micro_batch": 4, "grad_accum": 2, "sharding": "none"},
                     1, *init)
    four = run_worker(tmp_path / "four", plan, 4, *init, timeout=400)
    print(f"{family}: losses on 4 ranks {four['losses']}, on one {one['losses']}")
    assert four["steps_done"] == 2
    for a, b in zip(four["losses"], one["losses"], strict=True):
        assert abs(a - b) < TOL
    assert abs(four["losses"][0] - hf_loss(hf, SyntheticBatches(384, 32, 8, 0, 1, 1234)
                                           .next_batch())) < TOL
    cfg = checkpoint_model_config(ckpt)
    trained = load_for_inference(four["checkpoint"], cfg)
    # Every tensor (q/k norms, biases, the tied matrix) took one process's two AdamW steps:
    # within 5% of how far they moved (AdamW's first steps are about +-lr wherever a gradient
    # is nonzero, so float32 noise in near-zero gradients shows; a missing gradient term
    # would be as large as the step).
    start = load_for_inference(ckpt, cfg).state_dict()
    reference = load_for_inference(one["checkpoint"], cfg).state_dict()
    for name, tensor in trained.state_dict().items():
        moved = (reference[name] - start[name]).abs().max().item()
        assert (tensor - reference[name]).abs().max().item() <= 0.05 * moved, name
    if cfg.tie_embeddings:
        assert trained.output.weight is trained.tok_embeddings.weight
        if plan["pp"] > 1:
            assert_equal_copies(four["checkpoint"])
    out = export_checkpoint(four["checkpoint"], None, tmp_path / "hf", shard_bytes=50_000)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert max_diff(trained, reloaded.eval()) < TOL
    assert max_diff(trained, hf) > 1e-3  # the weights moved
