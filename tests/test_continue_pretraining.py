"""Continued pretraining: train.init_from (an HF directory or one of our checkpoints) gives
the model shape and the first step's weights."""
import json
import os

import pytest
import torch

from model.training.batches import SyntheticBatches
from stages.config import ConfigError, load_config
from tests.test_import_hf import LLAMA, hf_model
from tests.train_helpers import TINY, run_worker

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
# TINY without its model.* settings: the shape must come from train.init_from.
NO_MODEL = [o for o in TINY if not o.startswith("model.")]


def load(tmp_path, *overrides):
    """A config from a preset without a model section, plus ``overrides``."""
    preset = tmp_path / "continue.yaml"
    preset.write_text("name: continue\n")
    return load_config(preset, NO_MODEL + list(overrides))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    hf_model("llama", seed=4).save_pretrained(str(path))
    return path


def test_model_shape_comes_from_init_from(hf_dir, tmp_path):
    cfg = load(tmp_path, f"train.init_from={hf_dir}")
    assert (cfg.model.family, cfg.model.n_layers, cfg.model.d_model) == ("llama", 4, 32)
    assert (cfg.model.n_kv_heads, cfg.model.ffn_hidden, cfg.model.vocab_size) == (2, 88, 384)
    same = load(tmp_path, f"train.init_from={hf_dir}", "model.n_heads=4")
    assert same.model == cfg.model  # a setting equal to the checkpoint's is accepted


def test_conflicting_model_setting_names_both_values(hf_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"model.d_model=64 but train.init_from has "
                                          r"d_model=32.*model shape comes from train.init_from"):
        load(tmp_path, f"train.init_from={hf_dir}", "model.d_model=64")


def test_train_stage_imports_once_and_refuses_missing_source(hf_dir, tmp_path):
    from model.training.validate import TrainSetupError
    from stages.train.work import initial_checkpoint

    cfg = load(tmp_path, f"train.init_from={hf_dir}")
    first = initial_checkpoint(cfg, tmp_path)
    assert first == tmp_path / "init" and (first / "manifest.json").is_file()
    stamp = (first / "manifest.json").stat().st_mtime_ns
    assert initial_checkpoint(cfg, tmp_path) == first  # reused, not imported again
    assert (first / "manifest.json").stat().st_mtime_ns == stamp
    cfg.train.init_from = str(tmp_path / "nope")
    with pytest.raises(TrainSetupError, match=r"train.init_from.*nope' does not exist"):
        initial_checkpoint(cfg, tmp_path)


def test_trainer_starts_from_imported_weights(hf_dir, tmp_path):
    """One rank, one step: the first loss is HF's loss on that batch (not a random model's)."""
    from model.evaluation.import_hf import import_hf

    ckpt = import_hf(hf_dir, tmp_path / "init")
    summary = run_worker(tmp_path / "train", {"micro_batch": 4, "grad_accum": 2,
                                              "sharding": "none"}, 1,
                         f"train.init_from={ckpt}", "train.steps=1")
    batch = SyntheticBatches(LLAMA["vocab_size"], 32, 8, 0, 1, 1234).next_batch()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = hf.eval()(batch[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    assert abs(summary["losses"][0] - expected.item()) < 1e-4
    log = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert log["steps_done"] == 1


def test_new_family_fields_come_from_init_from(tmp_path):
    """A Llama 3.2-style HF directory (tied, llama3 rope scaling) as train.init_from: those
    fields come from it, a conflicting setting is refused naming both values, and the train
    stage imports it into a checkpoint of that shape."""
    from stages.train.work import initial_checkpoint
    from tests.test_hf_families import hf_model as family_model

    hf_dir = tmp_path / "llama32"
    family_model("llama32").save_pretrained(str(hf_dir))
    cfg = load(tmp_path, f"train.init_from={hf_dir}")
    assert (cfg.model.tie_embeddings, cfg.model.rope_scaling, cfg.model.rope_factor,
            cfg.model.rope_original_max_seq_len) == (True, "llama3", 32.0, 16)
    with pytest.raises(ConfigError, match=r"model.tie_embeddings=False but train.init_from has "
                                          r"tie_embeddings=True"):
        load(tmp_path, f"train.init_from={hf_dir}", "model.tie_embeddings=false")
    ckpt = initial_checkpoint(cfg, tmp_path / "train")
    assert json.loads((ckpt / "model.json").read_text())["tie_embeddings"] is True
