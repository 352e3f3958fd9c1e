"""Tokenizer: deterministic training, hashing, transformers compatibility, dtype limits."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from data_prep.config import TokenizerConfig
from data_prep.errors import DataError
from data_prep.tokenizer import (
    load_tokenizer,
    save_tokenizer,
    token_dtype,
    tokenizer_hash,
    train_tokenizer,
)
from tests.test_data_common import make_corpus

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return make_corpus(tmp_path_factory.mktemp("corpus"), n_docs=30, seed=1)


def test_training_is_deterministic_and_sized(corpus: list[str]) -> None:
    cfg = TokenizerConfig(vocab_size=300)
    first, second = train_tokenizer(corpus, cfg), train_tokenizer(corpus, cfg)
    assert tokenizer_hash(first) == tokenizer_hash(second)
    assert first.get_vocab_size() == 300
    assert first.token_to_id(EOS) == 0
    assert first.encode(EOS).ids == [0]  # a special token, never split
    other = train_tokenizer(corpus, TokenizerConfig(vocab_size=280))
    assert tokenizer_hash(other) != tokenizer_hash(first)


def test_saved_tokenizer_loads_unchanged_in_transformers(corpus: list[str], tmp_path: Path) -> None:
    tok = train_tokenizer(corpus, TokenizerConfig(vocab_size=300))
    path = save_tokenizer(tok, tmp_path / "tokenizer.json")
    reloaded = load_tokenizer(path, EOS)
    assert tokenizer_hash(reloaded) == tokenizer_hash(tok)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
    for text in corpus[:5] + ["naïve 日本語 emoji🙂 \t x"]:
        ids = tok.encode(text).ids
        assert hf(text)["input_ids"] == ids
        assert hf.decode(ids) == text == tok.decode(ids)
    assert hf.convert_tokens_to_ids(EOS) == 0
    assert len(hf) == 300


def test_load_errors(tmp_path: Path, corpus: list[str]) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "none.json", EOS)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="bad.json.*not a tokenizers JSON"):
        load_tokenizer(tmp_path / "bad.json", EOS)
    path = save_tokenizer(train_tokenizer(corpus, TokenizerConfig(vocab_size=300)),
                          tmp_path / "t.json")
    with pytest.raises(DataError, match="has no token '<eos>'.*tokenizer.eos_token"):
        load_tokenizer(path, "<eos>")


def big_vocab_tokenizer(path: Path, size: int = 70_000) -> Path:
    """A byte-level BPE whose vocabulary needs more than 16 bits."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {EOS: 0, **{ch: i + 1 for i, ch in enumerate(alphabet)}}
    vocab.update({f"w{i}": len(vocab) + i for i in range(size - len(vocab))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens([EOS])
    return save_tokenizer(tok, path)


def test_token_dtype() -> None:
    assert token_dtype(2048) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    assert token_dtype(300, "uint32") == np.uint32
    with pytest.raises(DataError, match="70000 ids does not fit data.token_dtype=uint16"):
        token_dtype(70_000, "uint16")


def test_big_vocab_tokenizer_needs_uint32(tmp_path: Path) -> None:
    tok = load_tokenizer(big_vocab_tokenizer(tmp_path / "big.json"), EOS)
    assert tok.get_vocab_size() == 70_000
    assert token_dtype(tok.get_vocab_size()) == np.uint32


def test_shared_tokenizer_is_loaded_once_per_file_version(tmp_path: Path) -> None:
    from data_prep.tokenizer import shared_tokenizer

    path = big_vocab_tokenizer(tmp_path / "tok.json", size=300)
    first = shared_tokenizer(path, EOS)
    assert shared_tokenizer(path, EOS) is first  # one object per process
    big_vocab_tokenizer(path, size=400)  # rewritten in place: loaded afresh
    second = shared_tokenizer(path, EOS)
    assert second is not first and second.get_vocab_size() == 400
    with pytest.raises(DataError, match="does not exist"):
        shared_tokenizer(tmp_path / "missing.json", EOS)
