"""Data-parallel held-out loss: 2 gloo ranks give the single-process result; per-source sums."""
import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from data_prep.store import MANIFEST, SplitReader, open_store
from model.training.checkpoint import load_for_inference
from model.training.heldout import heldout_loss, plan_windows
from stages.config import config_from_dict
from stages.evaluate.work import split_sources
from tests.train_helpers import run_function_ranks

pytest_plugins = ["tests.evalkit"]  # the shared micro_pipeline fixture
# The first test also builds the session's pipeline (several minutes on 2 busy cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
BOUNDARY = 1000  # a source boundary inside a window


def _evaluate(cfg, ckpt, store, rank=None, world=None):
    model = load_for_inference(ckpt, cfg.model)
    reader = SplitReader(store, "validation")
    spans = [(0, BOUNDARY, "a"), (BOUNDARY, reader.num_tokens, "b")]
    return heldout_loss(model, reader, cfg.train.seq_len, cfg.eval.max_tokens, batch_size=3,
                        rank=rank, world=world, sources=spans)


def _rank_main(rank, world, port, cfg_dict, ckpt, store, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = _evaluate(config_from_dict(cfg_dict), ckpt, store)  # rank/world from dist
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_match_one_process(micro_pipeline, tmp_path):
    cfg, _, results = micro_pipeline
    ckpt, store = results["train"].outputs["checkpoint"], results["tokenize"].outputs["store"]
    single = _evaluate(cfg, ckpt, store, rank=0, world=1)
    code, _, stderr = run_function_ranks(
        _rank_main, [2, _free_port(), cfg.to_dict(), ckpt, store, str(tmp_path)], 2)
    assert code == 0, stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    windows = cfg.eval.max_tokens // cfg.train.seq_len
    # Each rank evaluated half of the windows, and both hold the all-reduced totals.
    assert [r["local_windows"] for r in ranks] == [windows // 2, windows // 2]
    assert single["local_windows"] == windows
    for r in ranks:
        assert r["tokens"] == single["tokens"] == windows * cfg.train.seq_len
        assert r["val_loss"] == pytest.approx(single["val_loss"], rel=1e-6)
        for name in ("a", "b"):
            assert r["per_source"][name]["tokens"] == single["per_source"][name]["tokens"]
            assert r["per_source"][name]["val_loss"] == pytest.approx(
                single["per_source"][name]["val_loss"], rel=1e-6)
    # Predicted positions below BOUNDARY belong to "a", the rest to "b" (the evaluated
    # windows are spread over the split); the total is their token-weighted mean.
    plan = plan_windows(SplitReader(store, "validation").num_tokens, cfg.train.seq_len,
                        cfg.eval.max_tokens)
    positions = np.concatenate([plan.window_index(k) * plan.seq_len + np.arange(1, plan.seq_len + 1)
                                for k in range(plan.windows)])
    in_a = int((positions < BOUNDARY).sum())
    per = single["per_source"]
    assert 0 < in_a < single["tokens"]
    assert per["a"]["tokens"] == in_a
    assert per["b"]["tokens"] == single["tokens"] - in_a
    mean = (per["a"]["val_loss"] * per["a"]["tokens"] + per["b"]["val_loss"] * per["b"]["tokens"])
    assert mean / single["tokens"] == pytest.approx(single["val_loss"], rel=1e-9)
    assert per["a"]["val_loss"] != pytest.approx(per["b"]["val_loss"], rel=1e-6)


def test_part_source_labels_become_spans(micro_pipeline, tmp_path):
    _, _, results = micro_pipeline
    target = tmp_path / "store.zarr"
    shutil.copytree(results["tokenize"].outputs["store"], target)
    unlabelled = split_sources(open_store(target), "validation")
    assert {name for _, _, name in unlabelled} == {"all"}
    manifest = json.loads((target / MANIFEST).read_text())
    parts = manifest["splits"]["validation"]["parts"]
    assert len(parts) == 2
    for part, label in zip(parts, ("code", "docs")):
        part["source"] = label
    # A labelled part must name a source the manifest lists, with counts that add up
    # (the train split is counted as "code" here).
    train = manifest["splits"]["train"]
    manifest["sources"] = []
    for part, label, with_train in zip(parts, ("code", "docs"), (1, 0)):
        tokens = {"validation": part["tokens"], "train": with_train * train["tokens"]}
        docs = {"validation": part["documents"], "train": with_train * train["documents"]}
        manifest["sources"].append({"label": label, "source": label, "tokens": sum(tokens.values()),
                                    "documents": sum(docs.values()), "split_tokens": tokens,
                                    "split_documents": docs})
    (target / MANIFEST).write_text(json.dumps(manifest))
    spans = split_sources(open_store(target), "validation")
    sizes = [p["tokens"] for p in parts]
    assert spans == [(0, sizes[0], "code"), (sizes[0], sizes[0] + sizes[1], "docs")]
