"""Held-out loss and greedy generation with the training layout: the model spread over
tp=2 x pp=2 gloo ranks (no process holds all of it) gives one process's loss and tokens."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from model.config import ModelConfig
from model.evaluation.dcp_io import write_model_checkpoint
from model.evaluation.generate import generate_tokens
from model.evaluation.loss import heldout_loss
from model.gpt import GPT
from model.training.checkpoint import load_for_inference
from stages.launch import rank_environment

REPO = Path(__file__).resolve().parent.parent
# init_std 0.2: decided (not near-uniform) next-token logits, so greedy picks are not ties.
SHAPES = {
    "llama-gqa": {"family": "llama", "n_kv_heads": 2},
    "neox-partial-rotary": {"family": "neox", "parallel_residual": True,
                            "rotary_fraction": 0.5},
}
PROMPTS = [[5, 17, 42], [300]]

WORKER = """
import json, sys
import numpy as np
import torch.distributed as dist
from model.config import ModelConfig
from model.evaluation.generate import generate_tokens
from model.evaluation.layout import LayoutModel
from model.evaluation.loss import heldout_loss
from tests.test_eval_layout import ArrayReader, PROMPTS

ckpt, cfg_json, out = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
model = LayoutModel(ckpt, ModelConfig(**json.loads(cfg_json)), tp=2, pp=2)
assert len(model.stage.layers) == 2  # this rank holds half the layers
result = heldout_loss(model, ArrayReader(), 16, 160, 3, progress_seconds=0)
result["greedy"] = [generate_tokens(model, p, 10) for p in PROMPTS]
if dist.get_rank() == 0:
    open(out, "w").write(json.dumps(result))
dist.destroy_process_group()
"""


class ArrayReader:
    """A split of 400 random tokens (the reader interface heldout_loss uses)."""

    def __init__(self) -> None:
        self.tokens = np.random.default_rng(0).integers(0, 384, 400)
        self.num_tokens = len(self.tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SHAPES))
def test_tp2_pp2_loss_and_greedy_tokens_equal_one_process(tmp_path, case):
    cfg = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=384, max_seq_len=32,
                      init_std=0.2, **SHAPES[case])
    model = GPT(cfg)
    model.init_weights(7)
    state = model.state_dict()
    ckpt = write_model_checkpoint(tmp_path / "ckpt", cfg,
                                  {k: (tuple(v.shape), v.dtype) for k, v in state.items()},
                                  lambda name: state[name])
    one = load_for_inference(ckpt, cfg)
    expected = heldout_loss(one, ArrayReader(), 16, 160, 3, progress_seconds=0)
    greedy = [generate_tokens(one, p, 10) for p in PROMPTS]
    (tmp_path / "worker.py").write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", "4", str(tmp_path / "worker.py"), str(ckpt),
           json.dumps(dataclasses.asdict(cfg)), str(tmp_path / "out.json")]
    proc = subprocess.run(cmd, cwd=REPO, env=rank_environment(), capture_output=True, text=True,
                          timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert (got["tokens"], got["windows"]) == (expected["tokens"], expected["windows"]) == (160, 10)
    assert got["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-6)
    assert got["greedy"] == greedy
    assert len(set(map(tuple, greedy))) > 1 and len(set(greedy[0])) > 1  # not one token
