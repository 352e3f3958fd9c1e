"""Bad inputs are refused before any work, in one line that says what to fix, with no
traceback: the pipeline's command line in this process (``pipeline_main``), each case on a
fresh runs dir that must stay unmade (no store, no Parsl directory, no stage)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from stages.config import ConfigError, load_config
from stages.train.checks import check_layout

WORKFLOW_YAML = """name: CI
on:
  push:
    branches: [main]
jobs:
  test:
    runs-on: ubuntu-latest
    steps:
      - run: pytest
"""


def _refused(console, *fragments: str) -> str:
    """The console's one error line (exit 2, no traceback) holding every fragment."""
    assert console.returncode == 2, console
    assert "Traceback" not in console.stderr + console.stdout
    lines = [line for line in console.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, console.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_a_directory_as_config_is_named(pipeline_main, tmp_path):
    runs = tmp_path / "runs"
    line = _refused(pipeline_main("--config", "configs", "--runs-dir", str(runs)),
                    "config error: --config 'configs' is a directory, not a config file",
                    "configs/tiny.yaml")
    assert "IsADirectoryError" not in line and not runs.exists()


@pytest.mark.parametrize(("text", "fragments"), [
    (WORKFLOW_YAML, ("is not a pipeline config: unknown key 'on/yes/true', 'jobs'",
                     "none of the sections data, curate, tokenizer")),
    ("- name: a\n- name: b\n", ("is not a pipeline config: its top level is a list",)),
    ("name: x\non: 3\ntrain: {steps: 2}\n", ("unknown key 'on/yes/true'; allowed keys: name",)),
    ("\xff\xfe not text", ()),
])
def test_a_yaml_that_is_not_a_pipeline_config_is_refused(pipeline_main, tmp_path, text,
                                                        fragments):
    path, runs = tmp_path / "ci.yml", tmp_path / "runs"
    if text.startswith("\xff"):
        path.write_bytes(b"\xff\xfe not text")
        fragments = ("is not UTF-8 text",)
    else:
        path.write_text(text)
    _refused(pipeline_main("--config", str(path), "--runs-dir", str(runs)), "config error: ",
             *fragments)
    assert not runs.exists()


@pytest.mark.parametrize(("sets", "fragments"), [
    (("parallel.nproc=3", "parallel.tp=3"), ("parallel.tp=3 is not possible",
                                              "tp=3 must divide model.n_heads=4")),
    (("parallel.tp=3",), ("parallel.tp=3 is not possible (it does not divide the 2 devices)",
                          "tp can be [1, 2]")),
    (("parallel.tp=2", "parallel.dp=2"), ("parallel.dp=2 is not possible here: dp can be [1]",)),
    (("train.global_batch=3", "parallel.dp=2"), ("dp must divide train.global_batch=3",)),
    (("parallel.tp=2", "parallel.pp=1", "parallel.dp=2", "parallel.micro_batch=4",
      "parallel.schedule=1f1b", "parallel.sharding=zero3", "parallel.recompute=none"),
     ("is invalid: pp*dp*tp = 1*2*2 = 4 must equal the world size 2",)),
])
def test_an_impossible_fixed_layout_is_refused_before_any_work(pipeline_main, tmp_path, sets,
                                                               fragments):
    runs = tmp_path / "runs"
    _refused(pipeline_main("--runs-dir", str(runs), "--set", *sets),
             "config error: parallel.* on parallel.nproc=", *fragments)
    assert not runs.exists()


def test_the_layout_rule_is_the_plan_stages_own():
    """What pre-flight refuses the plan stage refuses, with the same words; every shipped
    preset passes."""
    from model.parallel.layout import PlanError
    from stages.plan.work import choose, fixed_fields

    cfg = load_config(None, ["train.global_batch=3", "parallel.dp=2"])
    with pytest.raises(ConfigError) as early:
        check_layout(cfg)
    with pytest.raises(PlanError) as late:
        choose(cfg.model, cfg.train, None, cfg.parallel.nproc, fixed_fields(cfg.parallel))
    assert str(late.value) in str(early.value)
    for preset in Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"):
        check_layout(load_config(preset))


def test_a_file_as_runs_dir_is_named_a_file(pipeline_main, tmp_path):
    runs = tmp_path / "runs"
    runs.write_text("not a directory\n")
    _refused(pipeline_main("--config", "micro", "--runs-dir", str(runs)),
             f"--runs-dir {runs} is a file, not a directory")
    _refused(pipeline_main("--config", "micro", "--runs-dir", str(runs / "sub")),
             f"--runs-dir {runs / 'sub'} is inside {runs}, a file, not a directory")
    assert runs.read_text() == "not a directory\n"


def test_slurm_without_a_reachable_controller_is_one_line(pipeline_main, tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    # No Slurm client at all.
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    _refused(pipeline_main("--config", "micro", "--site", "slurm", "--runs-dir", str(runs)),
             "no Slurm controller reachable: 'scontrol' is not on PATH",
             "`scontrol ping` failed", "or use --site local")
    # A client that cannot find its controller, as Slurm says it (a stand-in scontrol).
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "scontrol").write_text(
        "#!/bin/sh\necho 'scontrol: error: resolve_ctls_from_dns_srv: res_nsearch error: "
        "Unknown host' >&2\necho 'scontrol: fatal: Could not establish a configuration "
        "source' >&2\nexit 1\n")
    (tools / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin")
    _refused(pipeline_main("--config", "micro", "--site", "slurm", "--runs-dir", str(runs)),
             "no Slurm controller reachable: `scontrol ping` failed (scontrol: error: "
             "resolve_ctls_from_dns_srv", "run the pipeline on a login node of the cluster")
    assert not runs.exists()


def test_a_model_shape_key_that_does_not_exist_is_named(pipeline_main, tmp_path):
    _refused(pipeline_main("--runs-dir", str(tmp_path / "runs"), "--set", "model.seq_len=100000"),
             "unknown key 'model.seq_len'", "max_seq_len")
