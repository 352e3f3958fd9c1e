"""Parsl site configurations: construction for local/slurm/frontier and a golden Frontier script.

The golden files pin what a Frontier run submits (batch script and rank launch). After an
intended change, regenerate them and review the diff:

    FRONTIER_LLM_UPDATE_GOLDEN=1 pytest -q tests/test_sites.py -k golden
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from parsl.executors import HighThroughputExecutor, MPIExecutor
from parsl.launchers import SimpleLauncher
from parsl.providers import LocalProvider, SlurmProvider

from stages.config import ConfigError, load_config
from workflows import sites

GOLDEN = Path(__file__).parent / "golden"
FRONTIER_OVERRIDES = [
    "site.name=frontier",
    "site.account=ABC123",
    "site.partition=batch",
    "site.walltime=02:00:00",
    "site.conda_env=/ccs/proj/abc123/envs/frontier-llm",
    "parallel.nproc=16",
    "parallel.nodes=2",
]
RUN_DIR = Path("/lustre/orion/abc123/scratch/runs/tiny")


def _normalise(text: str) -> str:
    """Replace machine-specific paths so the golden text is the same on every checkout."""
    return text.replace(str(sites.REPO_ROOT), "<repo>").replace(str(sites.BIN_DIR), "<bin>")


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("FRONTIER_LLM_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: regenerate with FRONTIER_LLM_UPDATE_GOLDEN=1"
    assert text == path.read_text(), (
        f"{name} changed; if intended, regenerate with FRONTIER_LLM_UPDATE_GOLDEN=1 and review"
    )


def test_frontier_batch_script_golden():
    cfg = load_config(None, FRONTIER_OVERRIDES)
    script = _normalise(sites.batch_script(cfg, RUN_DIR))
    _check_golden("frontier_batch.txt", script)
    # The parts that matter on Frontier, stated explicitly as well.
    assert "#SBATCH --nodes=2\n" in script
    assert "#SBATCH --account=ABC123\n" in script
    assert "#SBATCH --partition=batch\n" in script
    assert "#SBATCH --time=120\n" in script
    assert "#SBATCH --exclusive\n" in script
    assert "module load PrgEnv-gnu rocm/" in script
    assert "source activate /ccs/proj/abc123/envs/frontier-llm" in script
    assert "--enable_mpi_mode" in script and "--mpi-launcher=srun" in script


def test_frontier_srun_line_golden():
    cfg = load_config(None, FRONTIER_OVERRIDES)
    text = _normalise(sites.srun_line(cfg, RUN_DIR))
    _check_golden("frontier_srun.txt", text)
    launch = text.splitlines()[-1]
    assert launch.startswith("srun --ntasks 16 --ntasks-per-node 8 --nodelist <node0>,<node1>")
    assert "-c7 --gpus-per-task=1 --gpu-bind=closest" in launch
    assert "stages.train_worker --spec" in launch
    assert "export NCCL_SOCKET_IFNAME=hsn0" in text
    assert "/lustre/orion/world-shared/stf218/lib/aws-ofi-rccl/lib" in text
    assert "export MIOPEN_USER_DB_PATH=/tmp/" in text


def test_dry_run_text_combines_script_and_launch():
    cfg = load_config(None, FRONTIER_OVERRIDES)
    text = sites.dry_run_text(cfg, RUN_DIR)
    assert sites.batch_script(cfg, RUN_DIR) in text
    assert sites.srun_line(cfg, RUN_DIR) in text
    local = sites.dry_run_text(load_config(None), RUN_DIR)
    assert "torchrun --nproc-per-node 2" in local and "\n" not in local


def test_frontier_settings_come_from_config():
    cfg = load_config(None, FRONTIER_OVERRIDES + [
        "site.modules=[rocm/6.3.1]",
        "site.env=[NCCL_DEBUG=INFO, OMP_NUM_THREADS=3]",
        "site.srun_options=-c7 --gpus-per-task=1",
        "site.rccl_plugin_path=/opt/aws-ofi-rccl/lib",
        "site.qos=debug",
    ])
    script = sites.batch_script(cfg, RUN_DIR)
    assert "module load rocm/6.3.1\n" in script
    assert "#SBATCH --qos=debug\n" in script
    launch = sites.srun_line(cfg, RUN_DIR)
    assert "export NCCL_DEBUG=INFO" in launch
    assert "export OMP_NUM_THREADS=3" in launch and "OMP_NUM_THREADS=7" not in launch
    assert "/opt/aws-ofi-rccl/lib" in launch
    assert "--gpu-bind" not in launch


def test_frontier_rejects_missing_account_and_overfull_nodes():
    cfg = load_config(None, [o for o in FRONTIER_OVERRIDES if "account" not in o])
    with pytest.raises(sites.SiteError, match="site.account"):
        sites.make_parsl_config(cfg, RUN_DIR)
    cfg = load_config(None, FRONTIER_OVERRIDES + ["parallel.nodes=1"])
    with pytest.raises(sites.SiteError, match="16 ranks per node"):
        sites.dry_run_text(cfg, RUN_DIR)


def test_bad_site_values_are_config_errors():
    with pytest.raises(ConfigError, match="site.env"):
        load_config(None, ["site.env=[NO_EQUALS_SIGN]"])
    with pytest.raises(ConfigError, match="site.heartbeat_threshold"):
        load_config(None, ["site.heartbeat_threshold=0"])
    with pytest.raises(ConfigError, match="site.name"):
        load_config(None, ["site.name=summit"])


def test_local_config(tmp_path):
    cfg = load_config(None, ["site.max_workers=3", "site.retries=2"])
    config = sites.make_parsl_config(cfg, tmp_path)
    assert config.run_dir == str(tmp_path / "parsl")
    assert config.retries == 2
    by_label = {e.label: e for e in config.executors}
    assert set(by_label) == {"cpu", "train"}
    for executor in by_label.values():
        assert type(executor) is HighThroughputExecutor
        assert isinstance(executor.provider, LocalProvider)
        assert executor.address == "127.0.0.1"
        assert f"export PATH={sites.BIN_DIR}:" in executor.provider.worker_init
    assert by_label["cpu"].max_workers_per_node == 3
    assert by_label["train"].max_workers_per_node == 1
    assert sites.train_resource_spec(cfg, None) is None


def test_local_train_command():
    cfg = load_config(None, ["parallel.nproc=4"])
    command = sites.train_command(cfg, "/runs/train/spec.json", {"nproc": 4, "nodes": 1})
    launch = command.splitlines()[-1]
    assert launch == (
        f"{sites.BIN_DIR / 'torchrun'} --standalone --nnodes 1 --nproc-per-node 4 "
        "-m stages.train_worker --spec /runs/train/spec.json"
    )
    assert "export OMP_NUM_THREADS=1" in command
    with pytest.raises(sites.SiteError, match="parallel.nodes"):
        sites.train_command(cfg, "/x/spec.json", {"nproc": 4, "nodes": 2})


def test_slurm_config(tmp_path):
    cfg = load_config(None, [
        "site.name=slurm", "site.account=proj1", "site.partition=debug",
        "site.scheduler_options='#SBATCH --constraint=cpu'", "site.retries=1",
        "parallel.nproc=4", "parallel.nodes=2", "site.address=10.1.2.3",
    ])
    config = sites.make_parsl_config(cfg, tmp_path)
    by_label = {e.label: e for e in config.executors}
    assert type(by_label["cpu"]) is HighThroughputExecutor
    assert isinstance(by_label["cpu"].provider, LocalProvider)
    train = by_label["train"]
    assert isinstance(train, MPIExecutor) and train.mpi_launcher == "srun"
    assert train.max_workers_per_block == 1 and train.address == "10.1.2.3"
    provider = train.provider
    assert isinstance(provider, SlurmProvider) and isinstance(provider.launcher, SimpleLauncher)
    assert provider.nodes_per_block == 2 and provider.init_blocks == 0
    assert not provider.exclusive and provider.cores_per_node == 2
    for line in ("#SBATCH --account=proj1", "#SBATCH --partition=debug",
                 "#SBATCH --constraint=cpu"):
        assert line in provider.scheduler_options
    assert sites.train_resource_spec(cfg, {"tp": 2, "pp": 1, "dp": 2}) == {
        "num_nodes": 2, "ranks_per_node": 2, "num_ranks": 4,
        "launcher_options": "--cpus-per-task=1",
    }
    command = sites.train_command(cfg, "/r/spec.json", None)
    assert command.splitlines()[-1] == (
        f"$PARSL_MPI_PREFIX {sys.executable} -m stages.train_worker --spec /r/spec.json"
    )
    with pytest.raises(sites.SiteError, match="parallel.nodes=2"):
        sites.train_resource_spec(cfg, {"nproc": 3})


def test_local_executors_run_without_venv_on_path(tmp_path):
    """HTEX finds its interchange and worker pool even when the venv's bin/ is not on PATH."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, parsl\n"
        "from pathlib import Path\n"
        "from parsl import bash_app, python_app\n"
        "from stages.config import load_config\n"
        "from workflows import sites\n"
        "@python_app(executors=['cpu'])\n"
        "def square(x):\n    return x * x\n"
        "@bash_app(executors=['train'])\n"
        "def where(stdout=None):\n    return 'echo train-worker-ok'\n"
        "cfg = load_config(None)\n"
        "parsl.load(sites.make_parsl_config(cfg, Path(sys.argv[1])))\n"
        "try:\n"
        "    assert [f.result() for f in [square(i) for i in range(4)]] == [0, 1, 4, 9]\n"
        "    assert where(stdout=sys.argv[1] + '/where.out').result() == 0\n"
        "finally:\n"
        "    parsl.dfk().cleanup()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    env["PYTHONPATH"] = str(sites.REPO_ROOT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=180, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "where.out").read_text().strip() == "train-worker-ok"


def test_eval_ranks_use_the_same_launch_lines():
    """The evaluation ranks start like the training ranks, all on one node (eval.ranks)."""
    one = load_config(None)
    assert one.eval.ranks == 1
    # One rank: no launch at all (computed in the stage's own app); the dry run says so.
    assert "evaluation (eval.ranks=1) runs in one process" in sites.dry_run_text(one, RUN_DIR)
    frontier_one = sites.dry_run_text(load_config(None, FRONTIER_OVERRIDES), RUN_DIR)
    assert "eval_worker" not in frontier_one and "eval.ranks=1" in frontier_one
    cfg = load_config(None, ["eval.ranks=3"])
    command = sites.eval_command(cfg, "/runs/ev/spec.json", {"nproc": 3, "nodes": 1})
    assert command.splitlines()[-1] == (
        f"{sites.BIN_DIR / 'torchrun'} --standalone --nnodes 1 --nproc-per-node 3 "
        "-m stages.eval_worker --spec /runs/ev/spec.json"
    )
    assert "export OMP_NUM_THREADS=1" in command
    assert sites.ranks_resource_spec("evaluate", cfg) is None  # local: no MPIExecutor
    local = sites.dry_run_text(cfg, RUN_DIR)
    assert "--nproc-per-node 3 -m stages.eval_worker" in local and "\n" not in local

    slurm = load_config(None, ["site.name=slurm", "parallel.nproc=4", "parallel.nodes=2",
                               "eval.ranks=3"])
    assert sites.ranks_resource_spec("evaluate", slurm) == {
        "num_nodes": 1, "ranks_per_node": 3, "num_ranks": 3,
        "launcher_options": "--cpus-per-task=1",
    }
    # A non-exclusive job asks for enough CPUs per node for either set of ranks.
    assert sites.slurm_provider(slurm).cores_per_node == 3
    assert sites.eval_command(slurm, "/r/spec.json").splitlines()[-1] == (
        f"$PARSL_MPI_PREFIX {sys.executable} -m stages.eval_worker --spec /r/spec.json"
    )
    with pytest.raises(ValueError, match="stage 'plan' has no ranks"):
        sites.ranks_command("plan", slurm, "/r/spec.json")


def test_frontier_eval_srun_line_golden():
    cfg = load_config(None, FRONTIER_OVERRIDES + ["eval.ranks=8"])
    text = _normalise(sites.srun_line(cfg, RUN_DIR, stage="evaluate"))
    _check_golden("frontier_eval_srun.txt", text)
    launch = text.splitlines()[-1]
    assert launch.startswith("srun --ntasks 8 --ntasks-per-node 8 --nodelist <node0> --nodes 1 ")
    assert "-c7 --gpus-per-task=1 --gpu-bind=closest" in launch
    assert "stages.eval_worker --spec" in launch
    # Same environment as the training ranks.
    train = _normalise(sites.srun_line(cfg, RUN_DIR))
    assert text.splitlines()[:-1] == train.splitlines()[:-1]
    dry = sites.dry_run_text(cfg, RUN_DIR)
    assert sites.srun_line(cfg, RUN_DIR, stage="evaluate") in dry
    assert "8 ranks on one node" in dry
    with pytest.raises(sites.SiteError, match="eval.ranks=9.*one node.*8 GCDs"):
        sites.dry_run_text(load_config(None, FRONTIER_OVERRIDES + ["eval.ranks=9"]), RUN_DIR)
    with pytest.raises(ConfigError, match="eval.ranks must be >= 1"):
        load_config(None, ["eval.ranks=0"])
