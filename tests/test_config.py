"""Configuration: presets load, overrides apply, bad keys and values stop the run early."""
from pathlib import Path

import pytest
import yaml

from stages.config import CONFIG_DIR, ConfigError, load_config


def test_default_preset_loads_with_documented_values():
    cfg = load_config()
    assert cfg.name == "tiny"
    assert cfg.model.family == "llama"
    assert cfg.train.seq_len <= cfg.model.max_seq_len
    assert cfg.parallel.nproc == 2


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_every_shipped_preset_loads_and_its_resolved_form_loads_back(preset, tmp_path: Path):
    cfg = load_config(preset)
    assert cfg.name == preset  # experiments are named after the config
    # The resolved config the pipeline logs (config.yaml) is itself a valid config file.
    resolved = tmp_path / "config.yaml"
    resolved.write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_config(resolved) == cfg


def test_overrides_are_typed_and_applied():
    cfg = load_config(None, ["train.steps=50", "model.parallel_residual=false", "train.lr=1e-3",
                             "eval.prompts=['a', 'b']", "parallel.tp=null"])
    assert cfg.train.steps == 50
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.eval.prompts == ["a", "b"]
    assert cfg.parallel.tp is None


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.n_layer=3", "unknown key 'model.n_layer'"),
        ("modle.n_layers=3", "unknown key 'modle'"),
        ("train.steps=0", "train.steps must be > 0"),
        ("train.steps=ten", "train.steps must be an integer"),
        ("model.family=gpt2", "choose one of ['llama', 'neox']"),
        ("model.n_heads=5", "model.n_heads=5 must divide model.d_model="),
        ("train.seq_len=4096", "train.seq_len=4096 exceeds model.max_seq_len"),
        ("site.walltime=2h", "site.walltime must be HH:MM:SS"),
        ("parallel.schedule=zigzag", "choose one of"),
        ("parallel.recompute_layers=-1", "parallel.recompute_layers must be >= 0"),
        ("train.steps", "must look like section.key=value"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert fragment in str(err.value)


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(ConfigError, match="allowed keys in train: steps, global_batch"):
        load_config(None, ["train.stepz=3"])


def test_missing_config_file_is_named(tmp_path: Path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_file_with_unknown_section(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\noptimizer:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="unknown key 'optimizer'"):
        load_config(path)
