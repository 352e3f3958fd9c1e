"""lm-evaluation-harness over our GPT, offline, on a local task built from the held-out split.

Needs the ``eval`` extra (lm-eval); no download: HF_DATASETS_OFFLINE / HF_HUB_OFFLINE are set.
"""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from tokenizers import Tokenizer

from data_prep.store import SplitReader
from model.evaluation.generate import generate_tokens
from model.evaluation.lm_eval_adapter import GPTHarnessLM, run_tasks
from model.training.checkpoint import load_for_inference
from stages.evaluate.work import heldout_documents
from stages.mechanism import tracking

pytest_plugins = ["tests.evalkit"]  # the shared micro_pipeline fixture
# The first test also builds the session's pipeline (several minutes on 2 busy cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _setup(micro_pipeline):
    cfg, ctx, results = micro_pipeline
    tok = results["tokenize"].outputs
    model = load_for_inference(results["train"].outputs["checkpoint"], cfg.model)
    tokenizer = Tokenizer.from_file(tok["tokenizer"])
    return cfg, ctx, results, tok, model, tokenizer


def _doc_loglikelihood(model, ids: list[int], eos_id: int, T: int) -> float:
    """log p(doc) as [eos] + doc in chunks of T predicted tokens; the last chunk gets a full
    T-token context (lm-eval's rolling windows with context_len=1)."""
    seq = torch.tensor([eos_id] + ids)
    n, total = len(ids), 0.0
    with torch.no_grad():
        for start in range(1, n + 1, T):  # predicted positions [start, stop)
            stop = min(start + T, n + 1)
            lo = max(0, stop - 1 - T) if stop - start < T else start - 1
            inp = seq[lo : stop - 1]
            logp = F.log_softmax(model(inp[None])[0], dim=-1)
            k = stop - start
            total += logp[-k:].gather(1, seq[start:stop, None]).sum().item()
    return total


def test_heldout_task_through_the_stage_matches_direct_computation(micro_pipeline):
    cfg, ctx, results, tok, model, tokenizer = _setup(micro_pipeline)
    ev = results["evaluate"]
    report = json.loads(Path(ev.outputs["report"]).read_text())
    got = report["lm_eval"]["heldout_perplexity"]
    docs = heldout_documents(SplitReader(tok["store"], "validation"), tokenizer, tok["eos_id"],
                             cfg.eval.task_limit)
    assert len(docs) == cfg.eval.task_limit == got["sample_len"]
    # windows roll
    assert max(len(tokenizer.encode(d).ids) for d in docs) > 2 * cfg.model.max_seq_len
    loglik = sum(_doc_loglikelihood(model, tokenizer.encode(d).ids, tok["eos_id"],
                                    cfg.model.max_seq_len) for d in docs)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    assert got["bits_per_byte"] == pytest.approx(-loglik / n_bytes / math.log(2), rel=1e-5)
    assert got["byte_perplexity"] == pytest.approx(math.exp(-loglik / n_bytes), rel=1e-5)
    metrics = tracking.get_run(ctx.tracking_uri, ev.run_id).data.metrics
    assert metrics["heldout_perplexity.bits_per_byte"] == pytest.approx(got["bits_per_byte"])


def test_loglikelihood_and_generate_until(micro_pipeline):
    _cfg, _, _, tok, model, tokenizer = _setup(micro_pipeline)
    lm = GPTHarnessLM(model, tokenizer, tok["eos_id"], batch_size=2)
    context = "import os\nimport sys\n\n\ndef main"
    ctx_ids = tokenizer.encode(context).ids
    greedy = generate_tokens(model, ctx_ids, 6)
    continuation = tokenizer.decode(greedy)
    assert tokenizer.encode(context + continuation).ids == ctx_ids + greedy  # clean split
    requests = [Instance("loglikelihood", {}, (context, continuation), 0),
                Instance("loglikelihood", {}, (context, " zzz"), 1)]
    (ll, is_greedy), (_, other_greedy) = lm.loglikelihood(requests)
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ctx_ids + greedy[:-1]]))[0], dim=-1)
    expected = logp[len(ctx_ids) - 1 :].gather(1, torch.tensor(greedy)[:, None]).sum().item()
    assert ll == pytest.approx(expected, abs=1e-4)
    assert is_greedy and not other_greedy
    (text,) = lm.generate_until([Instance("generate_until", {}, (context, {"until": ["\n"],
                                                                           "max_gen_toks": 6}), 0)])
    assert text == continuation.split("\n")[0]


def test_unknown_task_is_a_clear_error(micro_pipeline):
    _, _, _, tok, model, tokenizer = _setup(micro_pipeline)
    lm = GPTHarnessLM(model, tokenizer, tok["eos_id"])
    with pytest.raises(ValueError, match=r"unknown lm-eval task\(s\) \['no_such_task_xyz'\]"):
        run_tasks(lm, ["no_such_task_xyz"])
