"""The readiness report of ``--dry-run`` on Slurm sites (workflows.readiness): each check's
verdict and fix, on the Frontier presets and on settings that break one rule each."""
from __future__ import annotations

from pathlib import Path

import pytest

from stages.mechanism.config import load_config
from workflows.dry_run import batch_script
from workflows.frontier import SiteError, check_site, walltime_bin
from workflows.pipeline import main
from workflows.readiness import readiness, readiness_text

ROOT = Path(__file__).resolve().parents[1]
LUSTRE = "/lustre/orion/abc123/scratch/user/runs"


def report(preset: str, *overrides: str) -> dict:
    """Check name -> Finding for a Frontier preset with a Lustre runs dir."""
    cfg = load_config(str(ROOT / "configs" / f"{preset}.yaml"),
                      ["site.account=abc123", f"tracking.runs_dir={LUSTRE}", *overrides])
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
            "--runs-dir", LUSTRE, "--set", "site.account=abc123"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "# --- readiness ---" in out and "0 error(s)" in out
    assert main([*args, "eval.layout=replicas", "eval.ranks=1"]) == 2
    text = capsys.readouterr().out
    assert "1 error(s)" in text and "set eval.layout=training eval.ranks=3072" in text
    # The table is the report's own text.
    cfg = load_config(str(ROOT / "configs" / "frontier-175b.yaml"),
                      ["site.account=abc123", f"tracking.runs_dir={LUSTRE}"])
    assert readiness_text(readiness(cfg)) in out


def test_a_hub_corpus_without_a_budget_is_refused_on_slurm_sites() -> None:
    """Tokenize would stream the whole split inside one compute job: an error with the fix
    in the report, and a refusal before any work; locally it streams the whole split."""
    from data_prep.errors import DataError
    from stages.mechanism.checks import check_tokenize, hub_budget_problem

    rows = report("frontier-175b", "data.max_documents=null")
    assert rows["corpus"].verdict == "error" and "set data.max_documents=N" in rows["corpus"].fix
    cfg = load_config("configs/frontier-175b.yaml", ["data.max_documents=null"])
    with pytest.raises(DataError, match="needs a budget.*data.max_documents=N"):
        check_tokenize(cfg)
    local = load_config("micro", ["data.source=hf:org/corpus"])
    assert hub_budget_problem(local) is None
    assert hub_budget_problem(load_config("configs/frontier-175b.yaml")) is None
