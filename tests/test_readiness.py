"""The readiness report of ``--dry-run`` on Slurm sites (workflows.readiness): each check's
verdict and fix, on the Frontier presets and on settings that break one rule each."""
from __future__ import annotations

from pathlib import Path

import pytest

from stages.config import load_config
from workflows.dry_run import batch_script
from workflows.frontier import SiteError, check_site, walltime_bin
from workflows.pipeline import main
from workflows.readiness import plan_findings, readiness, readiness_text

ROOT = Path(__file__).resolve().parents[1]
# The same preset's plan is asked for by most tests: searched once (conftest.py).
pytestmark = pytest.mark.usefixtures("plan_search_once")
LUSTRE = "/lustre/orion/abc123/scratch/user/runs"


PACKED_ENV = "/lustre/orion/abc123/proj-shared/envs/frontier-llm.tar.gz"
PROXY = "site.worker_init=export https_proxy=http://proxy.ccs.ornl.gov:3128/"


def report(preset: str, *overrides: str) -> dict:
    """Check name -> Finding for a Frontier preset with a Lustre runs dir, a packed
    environment for the nodes' NVMe and the hub reached through OLCF's proxy."""
    cfg = load_config(str(ROOT / "configs" / f"{preset}.yaml"),
                      ["site.account=abc123", f"tracking.runs_dir={LUSTRE}",
                       f"site.node_local_env={PACKED_ENV}", PROXY, *overrides])
    return {row.check: row for row in readiness(cfg)}


def test_job_size_bins_follow_frontier_scheduling_policy() -> None:
    edges = {1: 5, 91: 5, 92: 4, 183: 4, 184: 3, 1881: 3, 1882: 2, 5644: 2, 5645: 1, 9408: 1}
    assert {nodes: walltime_bin(nodes)[0] for nodes in edges} == edges
    assert [walltime_bin(n)[2] for n in (91, 92, 184, 9408)] == [2.0, 6.0, 12.0, 12.0]


@pytest.mark.parametrize("preset", ["frontier-22b", "frontier-175b", "frontier-1t"])
def test_the_frontier_presets_have_no_errors(preset: str) -> None:
    rows = report(preset)
    assert [name for name, row in rows.items() if row.verdict == "error"] == []
    assert rows["evaluation"].value.endswith("no process holds the whole model")
    assert "bin 3" in rows["training job"].value or "bin 4" in rows["training job"].value
    # the evaluation, in the training layout, asks for the training's nodes in a job of its own
    cfg = load_config(f"configs/{preset}.yaml")
    assert rows["evaluation job"].value.startswith(f"{cfg.parallel.nodes} node(s) x 02:00:00")
    assert "s/step" in rows["plan"].value
    # The hub corpus streams within the preset's document budget; its size is not checked.
    assert rows["corpus"].verdict == "warning"
    assert "streamed within data.max_documents=" in rows["corpus"].value


def test_each_broken_rule_is_an_error_with_its_fix() -> None:
    rows = report("frontier-175b", "site.walltime=14:00:00")
    assert rows["training job"].verdict == "error"
    assert "site.walltime <= 12:00:00" in rows["training job"].fix

    rows = report("frontier-175b", "site.compute_walltime=06:00:00")
    assert rows["tokenize job"].verdict == "error"
    assert "site.compute_walltime <= 02:00:00" in rows["tokenize job"].fix

    # The whole 175B model in float32 in one process: 701 GB, more than a node's 512 GB.
    rows = report("frontier-175b", "eval.layout=replicas", "eval.ranks=1")
    assert rows["evaluation"].verdict == "error" and "> 512 GB" in rows["evaluation"].value
    assert "eval.layout=training eval.ranks=3072" in rows["evaluation"].fix
    # A run refuses it before any work, with the same words (the dry run shows them as a row).
    cfg = load_config(str(ROOT / "configs" / "frontier-175b.yaml"),
                      ["site.account=abc123", f"tracking.runs_dir={LUSTRE}",
                       "eval.layout=replicas", "eval.ranks=1"])
    with pytest.raises(SiteError, match="eval.layout=training eval.ranks=3072") as refused:
        check_site(cfg)
    assert str(refused.value) == rows["evaluation"].fix
    # Measured refinement runs its candidates as the plan's ranks in an allocation of the
    # training's size, never on the login node: a job of its own in the report.
    rows = report("frontier-175b", "parallel.refine_top_k=2")
    measure, train = rows["measurement job"].value, rows["training job"].value
    assert measure.split(" x ")[0] == train.split(" x ")[0] == "384 node(s)"
    assert "x 02:00:00 (bin" in measure and rows["measurement job"].verdict == "ok"
    check_site(load_config(str(ROOT / "configs" / "frontier-175b.yaml"),
                           ["site.account=abc123", f"tracking.runs_dir={LUSTRE}",
                            "parallel.refine_top_k=2"]))  # no refusal

    # No checkpoint by steps or by the clock before the job ends, and no save at its end.
    rows = report("frontier-175b", "train.checkpoint_every=5000", "train.checkpoint_minutes=null",
                  "site.save_before_end_s=0")
    assert rows["first checkpoint"].verdict == "error"
    assert "train.checkpoint_minutes" in rows["first checkpoint"].fix

    cfg = load_config(str(ROOT / "configs" / "frontier-175b.yaml"),
                      ["site.account=abc123", "tracking.runs_dir=/ccs/home/user/runs"])
    rows = {row.check: row for row in readiness(cfg)}
    assert rows["runs dir"].verdict == "error" and "/lustre/orion" in rows["runs dir"].fix


def test_a_short_walltime_for_the_bin_is_a_warning_with_the_jobs_saved() -> None:
    rows = report("frontier-175b", "site.walltime=02:00:00")
    whole = rows["whole run"]
    assert whole.verdict == "warning" and "site.walltime=12:00:00" in whole.fix
    assert int(whole.value.split("at least ")[1].split()[0]) > int(whole.fix.split()[-2])


def test_the_compute_block_gets_its_own_walltime(tmp_path: Path) -> None:
    cfg = load_config(str(ROOT / "configs" / "frontier-175b.yaml"),
                      ["site.account=abc123", f"tracking.runs_dir={LUSTRE}"])
    assert "#SBATCH --time=720" in batch_script(cfg, tmp_path, "train")
    assert "#SBATCH --time=120" in batch_script(cfg, tmp_path, "compute")
    # A clock time given on the command line stays a string (YAML 1.1 reads 12:00:00 as 43200).
    assert load_config(None, ["site.walltime=12:00:00"]).site.walltime == "12:00:00"
    with pytest.raises(ValueError, match="site.compute_walltime must be HH:MM:SS"):
        load_config(None, ["site.compute_walltime=2h"])


def test_dry_run_prints_the_report_and_exits_2_on_its_errors(
        capsys: pytest.CaptureFixture) -> None:
    args = ["--config", str(ROOT / "configs" / "frontier-175b.yaml"), "--dry-run",
            "--runs-dir", LUSTRE, "--set", "site.account=abc123",
            f"site.node_local_env={PACKED_ENV}", PROXY]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "# --- readiness ---" in out and "0 error(s)" in out
    assert main([*args, "eval.layout=replicas", "eval.ranks=1"]) == 2
    text = capsys.readouterr().out
    assert "1 error(s)" in text and "set eval.layout=training eval.ranks=3072" in text
    # The table is the report's own text.
    cfg = load_config(str(ROOT / "configs" / "frontier-175b.yaml"),
                      ["site.account=abc123", f"tracking.runs_dir={LUSTRE}",
                       f"site.node_local_env={PACKED_ENV}", PROXY])
    assert readiness_text(readiness(cfg)) in out


def test_a_hub_corpus_without_a_budget_is_refused_on_slurm_sites() -> None:
    """Tokenize would stream the whole split inside one compute job: an error with the fix
    in the report, and a refusal before any work; locally it streams the whole split."""
    from data_prep.errors import DataError
    from stages.tokenize.checks import check_tokenize, hub_budget_problem

    rows = report("frontier-175b", "data.max_documents=null")
    assert rows["corpus"].verdict == "error" and "set data.max_documents=N" in rows["corpus"].fix
    cfg = load_config("configs/frontier-175b.yaml", ["data.max_documents=null"])
    with pytest.raises(DataError, match="needs a budget.*data.max_documents=N"):
        check_tokenize(cfg)
    local = load_config("micro", ["data.source=hf:org/corpus"])
    assert hub_budget_problem(local) is None
    assert hub_budget_problem(load_config("configs/frontier-175b.yaml")) is None


def test_the_report_prices_interruptions_and_the_checkpoint_interval(
        capsys: pytest.CaptureFixture) -> None:
    """Llama 3's rate on the 175B preset's 384 nodes: one interruption every 16.5 h; its
    2.1 TB checkpoint takes 1.1 s, so Young/Daly checkpoints every 6.01 min, where the
    an hourly checkpoint (the presets' before they took auto) loses about three times the
    node-hours."""
    from model.planner.failures import DEFAULT_FAILURES_PER_NODE_HOUR, RESTART_STARTUP_S

    args = ["--config", str(ROOT / "configs" / "frontier-175b.yaml"), "--dry-run",
            "--runs-dir", LUSTRE, "--set", "site.account=abc123",
            f"site.node_local_env={PACKED_ENV}", PROXY, "train.checkpoint_minutes=60"]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = {line.split()[1] + " " + line.split()[2]: line for line in out.splitlines()
             if line.startswith("#   ") and len(line.split()) > 3}
    cfg = load_config(str(ROOT / "configs" / "frontier-175b.yaml"), ["site.account=abc123"])
    step = plan_findings(cfg)[1]  # the planner's step time, unrounded
    assert f"{step:.4g} s/step" in out
    hours = 10000 * step / 3600
    failures = DEFAULT_FAILURES_PER_NODE_HOUR * 384 * hours
    assert (f"ok       {failures:.3g} expected in {hours:.3g} h of training: 0.000158 per "
            "node-hour x 384 node(s), one every 16.5 h (Llama 3 405B: 419 interruptions in 54 "
            "days on 2,048 nodes of 8 GPUs)") in lines["interruptions ok"]
    row = lines["checkpoint interval"]
    assert "warning  Young/Daly 6.01 min (save 1.1 s): " in row
    save = 1.0951  # 12 B x 175e9 parameters / 1,920 GB/s

    def lost(interval_s: float) -> float:  # failures x (interval/2 + restart) + saves x save
        seconds = (failures * (interval_s / 2 + RESTART_STARTUP_S + save)
                   + 10000 * step / interval_s * save)
        return seconds * 384 / 3600

    assert f"{lost(360.66):,.0f} node-hours lost; configured 1 h: {lost(3600):,.0f} node-hours" \
        in row
    assert f"-> train.checkpoint_minutes=auto (6.01 min) loses {lost(3600) - lost(360.66):,.0f} " \
        "fewer node-hours" in out

    # auto takes Young/Daly's interval: the first checkpoint comes then, and nothing is wasted.
    rows = report("frontier-175b", "train.checkpoint_minutes=auto",
                  "site.failures_per_node_hour=1e-3")
    interval = rows["checkpoint interval"]
    best = (2 * save * 3600 / (1e-3 * 384)) ** 0.5 / 60  # MTBF 2.6 h
    assert interval.verdict == "ok" and interval.value.startswith(f"Young/Daly {best:.3g} min")
    assert f"configured {best:.3g} min" in interval.value
    assert rows["first checkpoint"].value.startswith(f"after {best:.3g} min of training")
    assert "one every 2.6 h (site.failures_per_node_hour=0.001)" in rows["interruptions"].value


def test_walltimes_slurm_would_round_are_refused_with_the_whole_minutes(tmp_path: Path) -> None:
    """Parsl hands sbatch whole minutes: 00:01:30 would run as 1 minute while the save before
    the end is timed from 90 s, so it is refused before anything is rendered."""
    from stages.config import ConfigError

    for setting, refusal in [
            ("site.walltime=00:01:30", "site.walltime=00:01:30: Slurm takes whole minutes (at "
             "least one); use 00:02:00 or 00:01:00"),
            ("site.compute_walltime=11:59:59", "site.compute_walltime=11:59:59: Slurm takes "
             "whole minutes (at least one); use 12:00:00 or 11:59:00"),
            ("site.walltime=00:00:30", "site.walltime=00:00:30: Slurm takes whole minutes (at "
             "least one); use 00:01:00"),
            ("site.walltime=00:00:00", "site.walltime=00:00:00: Slurm takes whole minutes (at "
             "least one); use 00:01:00")]:
        with pytest.raises(ConfigError) as refused:
            load_config(str(ROOT / "configs" / "frontier-175b.yaml"), [setting])
        assert str(refused.value) == refusal
    # whole minutes: what is rendered is what the signal is timed from
    cfg = load_config(str(ROOT / "configs" / "frontier-175b.yaml"),
                      ["site.account=abc123", "site.walltime=00:02:00"])
    script = batch_script(cfg, tmp_path, "train")
    assert "#SBATCH --time=2" in script and "#SBATCH --signal=USR1@30" in script  # 120 s / 4


def test_a_torch_the_rehearsal_refuses_is_an_error_unless_the_rehearsal_is_turned_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan stage rehearses Frontier plans; a torch other than the one the rehearsal was
    checked on would leave the plan on the memory model alone: an error with its fix, and
    a warning once the user turns the rehearsal off by name."""
    from model.rehearsal import torch_pin

    checked = ".".join(map(str, torch_pin.CHECKED_TORCH))
    rows = report("frontier-175b")
    assert rows["rehearsal"].verdict == "ok"
    assert rows["rehearsal"].value.startswith(f"torch {checked}")

    monkeypatch.setattr(torch_pin, "installed_torch", lambda: "2.8.0+rocm6.4")
    rows = report("frontier-175b")
    row = rows["rehearsal"]
    assert row.verdict == "error" and "torch 2.8.0+rocm6.4 here" in row.value
    assert f"torch {checked} only" in row.value
    assert "--set parallel.rehearse=false" in row.fix and "docs/frontier.md" in row.fix
    assert [name for name, r in rows.items() if r.verdict == "error"] == ["rehearsal"]

    rows = report("frontier-175b", "parallel.rehearse=false")
    assert rows["rehearsal"].verdict == "warning"
    assert [name for name, r in rows.items() if r.verdict == "error"] == []

    monkeypatch.setattr(torch_pin, "installed_torch", lambda: None)
    assert "torch not installed here" in report("frontier-175b")["rehearsal"].value
    # The measured local cluster is not rehearsed by default: no row.
    cfg = load_config(str(ROOT / "configs" / "micro.yaml"), ["site.name=slurm"])
    assert "rehearsal" not in {row.check for row in readiness(cfg)}


def test_a_plan_the_stage_could_not_rehearse_is_an_error(tmp_path: Path) -> None:
    from model.parallel.layout import Plan

    plan = Plan.from_dict({"tp": 2, "pp": 1, "dp": 4, "micro_batch": 1, "grad_accum": 1,
                           "sharding": "zero3",
                           "predictions": {"step_time_s": 2.0, "memory_gb_per_device": 40.0}})
    plan_path = plan.to_json(tmp_path / "plan.json")
    error = tmp_path / "rehearsal.json"
    error.write_text('{"error": "the rehearsal\'s private hooks were checked on torch 2.13"}')
    cfg = load_config(str(ROOT / "configs" / "frontier-175b.yaml"), ["site.account=abc123"])
    rows = {row.check: row for row in plan_findings(
        cfg, {"plan": str(plan_path), "rehearsal": str(error)})[0]}
    memory = rows["device memory"]
    assert memory.verdict == "error" and memory.value == "40 GB modeled, not rehearsed"
    assert "checked on torch 2.13" in memory.fix and "parallel.rehearse=false" in memory.fix


def test_the_rehearsal_interpreter_named_is_the_one_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from model.rehearsal.torch_pin import REHEARSAL_PYTHON

    def interpreter(version: str) -> str:
        path = tmp_path / f"python-{version}"
        path.write_text(f"#!/bin/sh\necho {version}\n")
        path.chmod(0o755)
        return str(path)

    monkeypatch.setenv(REHEARSAL_PYTHON, interpreter("2.13.0+cpu"))
    row = report("frontier-175b")["rehearsal"]
    assert row.verdict == "ok" and row.value.startswith("torch 2.13.0+cpu in ")
    monkeypatch.setenv(REHEARSAL_PYTHON, interpreter("2.10.0"))
    row = report("frontier-175b")["rehearsal"]
    assert row.verdict == "error" and "torch 2.10.0 in " in row.value
    monkeypatch.setenv(REHEARSAL_PYTHON, str(tmp_path / "absent"))
    assert report("frontier-175b")["rehearsal"].verdict == "error"


def test_a_reused_rehearsed_plan_needs_no_rehearsal_here(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from model.rehearsal import torch_pin
    from workflows.readiness import rehearsal_finding

    monkeypatch.setattr(torch_pin, "installed_torch", lambda: "2.8.0+rocm6.4")
    cfg = load_config(str(ROOT / "configs" / "frontier-175b.yaml"), ["site.account=abc123"])
    assert rehearsal_finding(cfg).verdict == "error"
    row = rehearsal_finding(cfg, rehearsed=True)
    assert row.verdict == "ok" and "rehearsed" in row.value
