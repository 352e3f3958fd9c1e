"""Bits per byte: each token's bytes come from the tokenizer (no document text kept), the
held-out loss divides its bits by them, per source too, and the in-loop metrics are named
per source only where there are several."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data_prep.config import TokenizerConfig
from data_prep.tokenizer import token_byte_lengths, train_tokenizer
from model.config import ModelConfig
from model.gpt import GPT
from model.training.heldout import heldout_loss
from model.training.validation import SplitTokens, validation_metrics

TEXTS = ["déjà vu: naïve café — 東京 and plain ascii words " * 20,
         "def f(x):\n    return x * 2  # ünïcödé\n" * 20]


def test_token_bytes_add_up_to_the_texts_bytes() -> None:
    tokenizer = train_tokenizer(TEXTS, TokenizerConfig(vocab_size=300))
    lengths = token_byte_lengths(tokenizer, size=320)
    assert lengths.shape == (320,) and (lengths[300:] == 0).all()  # padded ids: no text
    eos = tokenizer.token_to_id(TokenizerConfig().eos_token)
    assert lengths[eos] == 0
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert int(lengths[ids].sum()) == len(text.encode("utf-8"))


def test_bits_per_byte_overall_and_per_source() -> None:
    """A tiny model over a two-source split: val_bpb is the summed loss in bits over the
    predicted tokens' bytes, overall and per source."""
    cfg = ModelConfig(family="llama", n_layers=1, d_model=16, n_heads=2, vocab_size=64,
                      max_seq_len=8)
    model = GPT(cfg)
    model.init_weights(0)
    tokens = np.random.default_rng(0).integers(0, 64, 8 * 6 + 1)
    token_bytes = np.arange(64) % 4  # some tokens stand for no bytes
    sources = [(0, 24, "a"), (24, len(tokens), "b")]
    result = heldout_loss(model, SplitTokens(tokens), 8, 48, 2, sources=sources,
                          token_bytes=token_bytes)
    x = torch.from_numpy(tokens.astype(np.int64))
    with torch.no_grad():  # window by window: tokens [8w, 8w + 9)
        losses = torch.cat([F.cross_entropy(model(x[None, w * 8:w * 8 + 8])[0],
                                            x[w * 8 + 1:w * 8 + 9], reduction="none")
                            for w in range(6)]).double()
    predicted = tokens[1:]
    total_bytes = token_bytes[predicted].sum()
    assert result["bytes"] == total_bytes
    assert result["val_bpb"] == pytest.approx(float(losses.sum()) / math.log(2) / total_bytes,
                                              rel=1e-6)
    in_a = np.arange(1, len(tokens)) < 24
    a = result["per_source"]["a"]
    assert a["val_bpb"] == pytest.approx(
        float(losses[torch.from_numpy(in_a)].sum()) / math.log(2)
        / token_bytes[predicted[in_a]].sum(), rel=1e-6)
    metrics = validation_metrics(result)
    assert set(metrics) == {"val_loss", "val_bpb", "val_loss.a", "val_bpb.a", "val_loss.b",
                            "val_bpb.b"}
    one = {**result, "per_source": {"all": result["per_source"]["a"]}}
    assert set(validation_metrics(one)) == {"val_loss", "val_bpb"}
