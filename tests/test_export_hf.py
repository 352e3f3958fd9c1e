"""Hugging Face export: transformers loads it and computes our logits (both families)."""
import glob
import json
import os
from pathlib import Path

import pytest
import torch

from model.config import ModelConfig
from model.evaluation.export_hf import ExportError, export_checkpoint, export_model
from model.evaluation.generate import generate_tokens
from model.gpt import GPT

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

CASES = {
    "llama-gqa": {"family": "llama", "n_kv_heads": 2},
    "neox-sequential": {"family": "neox"},
    "neox-parallel-residual": {"family": "neox", "parallel_residual": True},
    "neox-partial-rotary": {"family": "neox", "parallel_residual": True, "rotary_fraction": 0.5},
}


def tiny_model(seed: int = 0, **shape) -> GPT:
    """A random tiny GPT whose norm weights and biases are perturbed too (not just 1/0) and
    whose attention is sharp (wq, wk x8), so the rotary embedding shows in the logits."""
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=300, max_seq_len=32,
                      **shape)
    model = GPT(cfg)
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
            if name.endswith(("attention.wq.weight", "attention.wk.weight")):
                param.mul_(8.0)
    return model.eval()


def load_hf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_logits_match_transformers(tmp_path, case):
    ours = tiny_model(**CASES[case])
    out = export_model(ours, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    expected_class = {"llama": "LlamaForCausalLM", "neox": "GPTNeoXForCausalLM"}
    assert config["architectures"] == [expected_class[ours.cfg.family]]
    assert (out / "model.safetensors").is_file() and not (tmp_path / "hf.partial").exists()
    hf = load_hf(out)
    assert type(hf).__name__ == expected_class[ours.cfg.family]
    tokens = torch.randint(0, 300, (3, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < 1e-4, f"{case}: max |logit difference| {diff}"


def test_export_greedy_generation_and_tokenizer_match(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = [Path(p).read_text() for p in sorted(glob.glob(json.__path__[0] + "/*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = tiny_model(3, family="llama")
    out = export_model(ours, tmp_path / "hf", tokenizer_file=tmp_path / "tokenizer.json")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def main(argv):\n    return json.dumps(argv)"
    assert hf_tok(text)["input_ids"] == tok.encode(text).ids
    assert hf_tok.eos_token == "<|endoftext|>"
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tok.token_to_id(
        "<|endoftext|>")
    prompt = tok.encode("def main(").ids
    new = generate_tokens(ours, prompt, 12)
    with torch.no_grad():
        hf_ids = load_hf(out).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
    assert hf_ids[0, len(prompt):].tolist() == new


def test_export_refuses_family_without_transformers_class(tmp_path):
    model = tiny_model(family="llama")
    model.cfg = ModelConfig(family="rwkv", n_layers=2, d_model=32, n_heads=4, vocab_size=300,
                            max_seq_len=32)
    with pytest.raises(ExportError,
                       match=r"model.family='rwkv'.*supported families: \['llama', 'neox'\]"):
        export_model(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


def test_export_refuses_partial_state_dict(tmp_path):
    model = tiny_model(family="neox")
    model.output = None  # a pipeline stage without the head
    with pytest.raises(ExportError, match=r"lacks \['output.weight'\].*full GPT"):
        export_model(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_export_of_tp2_pp2_checkpoint_matches(tmp_path):
    """Train 2 steps under tp=2 x pp=2 (4 gloo ranks), export the DCP checkpoint, compare."""
    from model.parallel.layout import Plan
    from model.training.checkpoint import load_for_inference
    from stages.config import load_config
    from stages.mechanism.launch import RankSpec, run_local

    cfg = load_config("micro", [f"tracking.runs_dir={tmp_path}", "train.global_batch=2",
                                "train.steps=2", "train.checkpoint_every=0"])
    plan = Plan(tp=2, pp=2, dp=1, micro_batch=1, grad_accum=2, schedule="1f1b", sharding="none")
    plan.check(cfg.model, cfg.train, 4)
    spec = RankSpec(worker="stages.train.worker", nproc=4, nodes=1,
                    out_dir=str(tmp_path / "train"), config=cfg.to_dict(), plan=plan.to_dict(),
                    steps=2)
    run_local(spec.write(tmp_path / "spec.json"), tmp_path / "train.log", what="training")
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert summary["steps_done"] == 2
    ckpt = summary["checkpoint"]
    ours = load_for_inference(ckpt, cfg.model)
    fresh = GPT(cfg.model)
    fresh.init_weights(cfg.train.seed)
    moved = (ours.output.weight - fresh.output.weight).abs().max().item()
    assert moved > 1e-5, "the checkpoint holds trained (not initial) weights"
    out = export_checkpoint(ckpt, cfg.model, tmp_path / "hf")
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.max_seq_len),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - load_hf(out)(tokens).logits).abs().max().item()
    assert diff < 1e-4


def write_checkpoint_of(model: GPT, path: Path) -> Path:
    """A model-only DCP checkpoint of ``model`` (as the trainer would write its weights)."""
    from model.evaluation.dcp_io import write_model_checkpoint

    state = model.state_dict()
    specs = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    return write_model_checkpoint(path, model.cfg, specs, lambda name: state[name])


@pytest.mark.parametrize("case", ["llama-gqa", "neox-partial-rotary"])
def test_streamed_sharded_export_equals_in_memory_export(tmp_path, case):
    ours = tiny_model(5, **CASES[case])
    ckpt = write_checkpoint_of(ours, tmp_path / "ckpt")
    whole = export_model(ours, tmp_path / "whole")
    sharded = export_checkpoint(ckpt, None, tmp_path / "sharded", shard_bytes=20_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    count = len(files)
    assert count >= 4 and files == [f"model-{i:05d}-of-{count:05d}.safetensors"
                                    for i in range(1, count + 1)]
    assert sorted(set(index["weight_map"].values())) == files
    for name in files:  # no shard over the limit unless it holds a single larger tensor
        from safetensors import safe_open

        with safe_open(str(sharded / name), "pt") as handle:
            sizes = [handle.get_tensor(k).nbytes for k in handle.keys()]  # noqa: SIM118 - safe_open is no dict
        assert sum(sizes) <= 20_000 or len(sizes) == 1
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = load_hf(whole)(tokens).logits, load_hf(sharded)(tokens).logits
        assert torch.equal(a, b)
        assert (ours(tokens) - b).abs().max().item() < 1e-4


MEASURE = """
import json, sys
import psutil
from model.evaluation.export_hf import export_checkpoint
ckpt, warm, out, shard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
export_checkpoint(warm, None, out + "-warm", shard_bytes=shard)  # imports, first-use caches
baseline = psutil.Process().memory_info().rss
export_checkpoint(ckpt, None, out, shard_bytes=shard)
from benchmarks.peak_rss import own_peak_rss_bytes  # not ru_maxrss: the worker's peak
print(json.dumps({"growth": own_peak_rss_bytes() - baseline}))
"""


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory) -> dict:
    """A 179 MiB checkpoint (12 layers, d_model 512, vocabulary 8192; largest tensor 16 MiB)
    and a tiny one to warm up with; their paths and the model's and largest tensor's bytes."""
    from model.evaluation.dcp_io import write_model_checkpoint

    root = tmp_path_factory.mktemp("big")
    big = ModelConfig(family="llama", n_layers=12, d_model=512, n_heads=8, vocab_size=8192,
                      max_seq_len=64)
    with torch.device("meta"):
        specs = {k: (tuple(v.shape), v.dtype) for k, v in GPT(big).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    write_model_checkpoint(root / "big", big, specs,
                           lambda name: 0.02 * torch.randn(specs[name][0], generator=gen))
    write_checkpoint_of(tiny_model(0, family="llama"), root / "warm")
    sizes = [torch.Size(shape).numel() * 4 for shape, _ in specs.values()]
    return {"big": root / "big", "warm": root / "warm", "model_bytes": sum(sizes),
            "largest": max(sizes)}


def test_export_peak_memory_is_bounded_by_shard_not_model(big_checkpoint, tmp_path):
    """Export a 179 MiB checkpoint in 16 MiB shards in a fresh process: the peak RSS growth
    stays under shard + largest tensor + 64 MiB (a gathering export needs > the model)."""
    import subprocess
    import sys

    pytest.importorskip("psutil")
    model_bytes, largest, shard = (big_checkpoint["model_bytes"], big_checkpoint["largest"],
                                   16 * 2**20)
    assert model_bytes > 10 * shard
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(big_checkpoint["big"]), str(big_checkpoint["warm"]),
         str(tmp_path / "hf"), str(shard)],
        capture_output=True, text=True, timeout=300, check=False,
        cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    growth = json.loads(proc.stdout.strip().splitlines()[-1])["growth"]
    bound = shard + largest + 64 * 2**20
    assert growth < bound, f"peak RSS grew {growth / 2**20:.0f} MiB > {bound / 2**20:.0f} MiB"
    assert growth < model_bytes / 2
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) >= 10


# ``python -m model.export_hf ...`` run as is (runpy), then this process's own peak RSS.
CLI_PEAK = """
import runpy, sys
sys.argv = ["model.export_hf", *sys.argv[1:]]
try:
    runpy.run_module("model.export_hf", run_name="__main__")
except SystemExit as done:
    assert not done.code, done.code
from benchmarks.peak_rss import own_peak_rss_bytes
print(own_peak_rss_bytes())
"""


def test_export_command_peak_memory_is_bounded_by_shard_not_model(big_checkpoint, tmp_path):
    """``python -m model.export_hf`` on the 179 MiB checkpoint in 16 MiB shards peaks less
    than shard + largest tensor + 64 MiB above the same command on a tiny checkpoint (each a
    fresh process: imports, tokenizer-free config writing and all)."""
    import subprocess
    import sys

    shard = 16 * 2**20

    def peak(ckpt: Path, out: Path) -> int:
        proc = subprocess.run(
            [sys.executable, "-c", CLI_PEAK, str(ckpt), str(out), "--shard-bytes", str(shard)],
            capture_output=True, text=True, timeout=300, check=False,
            cwd=Path(__file__).resolve().parent.parent)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "exported " in proc.stdout
        return int(proc.stdout.strip().splitlines()[-1])

    small = peak(big_checkpoint["warm"], tmp_path / "warm")
    growth = peak(big_checkpoint["big"], tmp_path / "hf") - small
    bound = shard + big_checkpoint["largest"] + 64 * 2**20
    print(f"export command: peak RSS {growth / 2**20:.0f} MiB above the tiny export's")
    assert growth < bound, f"peak RSS grew {growth / 2**20:.0f} MiB > {bound / 2**20:.0f} MiB"
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) >= 10
