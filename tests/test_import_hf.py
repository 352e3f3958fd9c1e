"""Hugging Face import: random LLaMA / Pythia-style GPT-NeoX models built by transformers
become our checkpoints that compute HF's logits, in one process and under tp2 x pp2."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.evaluation.dcp_io import checkpoint_model_config
from model.evaluation.import_hf import ImportHFError, import_hf, model_config_from_hf
from model.gpt import GPT
from model.training.checkpoint import load_for_inference

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parent.parent

# Shapes equal to tests/train_helpers.TINY's model (so the multi-rank runs can use it); the
# GPT-NeoX one is Pythia-style: parallel residual, rotary over a quarter of each head (4 of 16).
LLAMA = {"vocab_size": 384, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 88, "max_position_embeddings": 32,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
PYTHIA = {"vocab_size": 384, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
          "intermediate_size": 128, "max_position_embeddings": 32, "rotary_pct": 0.25,
          "rotary_emb_base": 10000, "use_parallel_residual": True, "hidden_act": "gelu",
          "layer_norm_eps": 1e-5, "tie_word_embeddings": False}
NEOX_OVERRIDES = ("model.family=neox", "model.n_heads=2", "model.n_kv_heads=null",
                  "model.ffn_hidden=128", "model.parallel_residual=true")


def hf_model(family: str, seed: int = 0):
    """A random HF model whose norm weights and biases are perturbed too (not just 1/0) and
    whose attention is sharp (q/k/v weights x8), so the rotary embedding shows in the logits."""
    torch.manual_seed(seed)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    else:
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**PYTHIA))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith(("q_proj.weight", "k_proj.weight", "query_key_value.weight")):
                param.mul_(8.0)
    return model.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 384, (3, 32), generator=torch.Generator().manual_seed(seed))


def max_diff(ours, hf) -> float:
    with torch.no_grad():
        return (ours(tokens()) - hf(tokens()).logits).abs().max().item()


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_import_safetensors_logits_match(tmp_path, family):
    hf = hf_model(family)
    hf.save_pretrained(str(tmp_path / "hf"))
    out = import_hf(tmp_path / "hf", tmp_path / "ours")
    cfg = checkpoint_model_config(out)
    assert (cfg.family, cfg.n_layers, cfg.d_model) == (family, 4, 32)
    assert cfg.kv_heads == 2
    assert cfg.parallel_residual == (family == "neox")
    assert cfg.rotary_fraction == (0.25 if family == "neox" else 1.0)
    assert (out / "manifest.json").is_file() and not (tmp_path / "ours.partial").exists()
    ours = load_for_inference(out, cfg)
    assert max_diff(ours, hf) < 1e-4
    if family == "neox":  # the partial rotary matters: rotating whole heads misses HF's logits
        whole = GPT(dataclasses.replace(cfg, rotary_fraction=1.0))
        whole.load_state_dict(ours.state_dict())
        assert max_diff(whole, hf) > 1e-2


def test_import_sharded_bin_with_legacy_buffers_via_command_line(tmp_path):
    """A sharded pytorch_model.bin (read with weights_only) carrying HF's old attention
    buffers, imported by ``python -m model.import_hf``."""
    hf = hf_model("neox", seed=2)
    src = tmp_path / "hf"
    src.mkdir()
    hf.config.save_pretrained(str(src))
    state = dict(hf.state_dict())
    state["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    names = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for file, keys in halves.items():
        torch.save({k: state[k].clone() for k in keys}, src / file)
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, keys in halves.items() for k in keys}}))
    proc = subprocess.run([sys.executable, "-m", "model.import_hf", str(src), str(tmp_path / "o")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "neox, 4 layers, d_model 32" in proc.stdout
    assert max_diff(load_for_inference(tmp_path / "o", checkpoint_model_config(tmp_path / "o")),
                    hf) < 1e-4


@pytest.mark.parametrize("change, fragment", [
    ({"rotary_pct": 0.1}, r"rotates int\(16 \* 0.1\) = 1 dims .* positive even number"),
    ({"attention_bias": False}, "attention_bias=false is not supported"),
    ({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new' is not supported"),
])
def test_unsupported_configs_are_refused_by_name(change, fragment):
    config = transformers.GPTNeoXConfig(**{**PYTHIA, **change}).to_dict()
    with pytest.raises(ImportHFError, match=fragment):
        model_config_from_hf(config)


def test_unknown_family_unknown_rope_scaling_and_offline_hub_are_refused(tmp_path):
    with pytest.raises(ImportHFError, match="model_type 'gpt2' is not supported"):
        model_config_from_hf(transformers.GPT2Config().to_dict())
    partial = {**transformers.LlamaConfig(**LLAMA).to_dict(), "partial_rotary_factor": 0.5}
    with pytest.raises(ImportHFError, match=r"rotary fraction 0.5\) is not supported for LLaMA"):
        model_config_from_hf(partial)
    # linear and llama3 scaling import (tests/test_hf_families.py); the others do not.
    scaled = transformers.LlamaConfig(**LLAMA, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ImportHFError, match="rope_scaling type 'dynamic' is not supported"):
        model_config_from_hf(scaled.to_dict())
    with pytest.raises(ImportHFError, match="hub is off.*pass its directory"):
        import_hf("hf:EleutherAI/pythia-160m", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_config_translation_keeps_gqa_theta_and_eps():
    cfg = model_config_from_hf(transformers.LlamaConfig(
        **{**LLAMA, "rope_theta": 5e5, "rms_norm_eps": 1e-6}).to_dict())
    assert (cfg.n_kv_heads, cfg.rope_theta, cfg.norm_eps, cfg.ffn_dim) == (2, 5e5, 1e-6, 88)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "neox"])
def test_import_train_tp2_pp2_export_round_trip(tmp_path, family):
    """HF -> ours; the first step's loss under tp2 x pp2 (4 gloo ranks) equals HF's on that
    batch; train 4 steps; the streamed export loads in transformers with our logits."""
    from model.evaluation.export_hf import export_checkpoint
    from model.training.batches import SyntheticBatches
    from tests.train_helpers import run_worker

    hf = hf_model(family, seed=3)
    hf.save_pretrained(str(tmp_path / "hf"))
    ckpt = import_hf(tmp_path / "hf", tmp_path / "init")
    overrides = NEOX_OVERRIDES if family == "neox" else ()
    plan = {"tp": 2, "pp": 2, "dp": 1, "micro_batch": 2, "grad_accum": 4, "schedule": "1f1b",
            "sharding": "none"}
    summary = run_worker(tmp_path / "train", plan, 4, *overrides, f"train.init_from={ckpt}")
    batch = SyntheticBatches(384, 32, 8, 0, 1, 1234).next_batch()
    with torch.no_grad():
        logits = hf(batch[:, :-1]).logits
    hf_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    assert abs(summary["losses"][0] - hf_loss.item()) < 1e-4
    assert summary["steps_done"] == 4
    trained = load_for_inference(summary["checkpoint"], checkpoint_model_config(ckpt))
    out = export_checkpoint(summary["checkpoint"], None, tmp_path / "export", shard_bytes=50_000)
    assert (out / "model.safetensors.index.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert max_diff(trained, reloaded.eval()) < 1e-4
    assert max_diff(trained, hf) > 1e-3  # the weights moved


def test_older_model_json_without_rotary_fraction_reads_as_full_rotary(tmp_path):
    """A model.json written before model.rotary_fraction existed means full rotary."""
    from model.training.checkpoint import CheckpointError, check_model_shape

    hf_model("neox").save_pretrained(str(tmp_path / "hf"))
    out = import_hf(tmp_path / "hf", tmp_path / "ours")
    pythia = checkpoint_model_config(out)
    saved = json.loads((out / "model.json").read_text())
    del saved["rotary_fraction"]
    (out / "model.json").write_text(json.dumps(saved))
    full = checkpoint_model_config(out)
    assert full.rotary_fraction == 1.0
    check_model_shape(out, full)
    with pytest.raises(CheckpointError, match="model.rotary_fraction: checkpoint 1.0 vs config "
                                              "0.25"):
        check_model_shape(out, pythia)


def test_pythia_160m_config_translates_to_the_preset_model():
    """Pythia-160M's published config.json (rotary_pct 0.25) gives configs/pythia-continue.yaml's
    model section, so the preset's restated shape does not conflict with train.init_from."""
    from stages.config import load_config

    pythia_160m = transformers.GPTNeoXConfig(
        vocab_size=50304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        intermediate_size=3072, max_position_embeddings=2048, rotary_pct=0.25,
        rotary_emb_base=10000, use_parallel_residual=True, hidden_act="gelu",
        layer_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.02)
    cfg = model_config_from_hf(pythia_160m.to_dict())
    assert (cfg.rotary_fraction, cfg.rotary_dim, cfg.head_dim) == (0.25, 16, 64)
    assert cfg == load_config(str(REPO / "configs" / "pythia-continue.yaml"), []).model
