"""Held-out loss and greedy generation with the training layout: the model spread over
tp=2 x pp=2 gloo ranks (no process holds all of it), or tp=2 x dp=2 (two replicas splitting
the windows), gives one process's loss and tokens."""
import dataclasses
import json

import numpy as np
import pytest

from model.config import ModelConfig
from model.evaluation.dcp_io import write_model_checkpoint
from model.evaluation.generate import generate_tokens
from model.gpt import GPT
from model.training.checkpoint import load_for_inference
from model.training.heldout import heldout_loss
from tests.train_helpers import run_script_ranks

# init_std 0.2: decided (not near-uniform) next-token logits, so greedy picks are not ties.
SHAPES = {
    "llama-gqa": {"family": "llama", "n_kv_heads": 2},
    "neox-partial-rotary": {"family": "neox", "parallel_residual": True,
                            "rotary_fraction": 0.5},
}
PROMPTS = [[5, 17, 42], [300]]
# (shape, tp, pp) on 4 ranks: dp = 4 / (tp * pp)
CASES = [("llama-gqa", 2, 2), ("neox-partial-rotary", 2, 2), ("llama-gqa", 2, 1)]

WORKER = """
import json, sys
import numpy as np
import torch.distributed as dist
from model.config import ModelConfig
from model.evaluation.generate import generate_tokens
from model.evaluation.layout import LayoutModel
from model.training.heldout import heldout_loss
from tests.test_eval_layout import ArrayReader, PROMPTS

ckpt, cfg_json, out, tp, pp = sys.argv[1:6]
dist.init_process_group("gloo")
model = LayoutModel(ckpt, ModelConfig(**json.loads(cfg_json)), tp=int(tp), pp=int(pp))
assert len(model.stage.layers) == 4 // int(pp)  # this rank holds its stage's layers
result = heldout_loss(model, ArrayReader(), 16, 160, 3, progress_seconds=0)
windows = [None] * dist.get_world_size()
dist.all_gather_object(windows, result["local_windows"])
result["windows_per_rank"] = windows
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
@pytest.mark.parametrize(("case", "tp", "pp"), CASES)
def test_layout_loss_and_greedy_tokens_equal_one_process(tmp_path, case, tp, pp):
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
    code, _, stderr = run_script_ranks(
        tmp_path / "worker.py", [str(ckpt), json.dumps(dataclasses.asdict(cfg)),
                                 str(tmp_path / "out.json"), str(tp), str(pp)], 4, timeout=240)
    assert code == 0, stderr[-4000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert (got["tokens"], got["windows"]) == (expected["tokens"], expected["windows"]) == (160, 10)
    assert got["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-6)
    # One replica: every rank went through all 10 windows; two: each replica (and each rank
    # of it) through half of them.
    assert got["windows_per_rank"] == {1: [10] * 4, 2: [5] * 4}[4 // (tp * pp)]
    assert got["greedy"] == greedy
    assert len(set(map(tuple, greedy))) > 1 and len(set(greedy[0])) > 1  # not one token
