"""The site side of the workflow (workflows.executors, .ranks, .frontier, .dry_run):
Parsl configurations for local/slurm/frontier, rank launches, site checks, dry runs and
golden Frontier scripts.

The golden files pin what a Frontier run submits (batch script and rank launch). After an
intended change, regenerate them and review the diff:

    FRONTIER_LLM_UPDATE_GOLDEN=1 pytest -q tests/test_sites.py -k golden
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from parsl.executors import HighThroughputExecutor, MPIExecutor, ThreadPoolExecutor
from parsl.executors.errors import InvalidResourceSpecification
from parsl.jobs.states import JobState, JobStatus
from parsl.launchers import SimpleLauncher, SrunLauncher
from parsl.providers import LocalProvider, SlurmProvider

from stages.config import ConfigError, load_config
from stages.mechanism.launch import REPO_ROOT, USER_ERROR_EXIT, RankSpec, run_local
from stages.mechanism.shape import RANKS, StageShape
from stages.registry import declaration
from workflows.dry_run import batch_script, dry_run_text, srun_line
from workflows.executors import (
    BIN_DIR,
    allocation_label,
    allocation_provider,
    app_resource_spec,
    compute_provider,
    executor_label,
    interchange_command,
    make_parsl_config,
    running_blocks,
    worker_init,
)
from workflows.frontier import SiteError, check_site
from workflows.ranks import ranks_command, ranks_resource_spec

TOKENIZE, PLAN, TRAIN, EVALUATE = (declaration(name)
                                   for name in ("tokenize", "plan", "train", "evaluate"))
GOLDEN = Path(__file__).parent / "golden"
FRONTIER_OVERRIDES = [
    "site.name=frontier",
    "site.account=ABC123",
    "site.partition=batch",
    "site.walltime=02:00:00",
    "site.conda_env=/ccs/proj/abc123/envs/frontier-llm",
    "parallel.nproc=16",
    "parallel.nodes=2",
    "tracking.runs_dir=/lustre/orion/abc123/scratch/runs/tiny",
]
RUN_DIR = Path("/lustre/orion/abc123/scratch/runs/tiny")


def _normalise(text: str) -> str:
    """Replace machine-specific paths so the golden text is the same on every checkout."""
    return text.replace(str(REPO_ROOT), "<repo>").replace(str(BIN_DIR), "<bin>")


def _srun(cfg, stage=TRAIN) -> str:
    """The srun line of a stage's ranks under ``cfg``."""
    return srun_line(cfg, RUN_DIR, stage.name, stage.shape(cfg))


def _launch(command: str) -> str:
    """The line of a ranks command that starts the ranks."""
    return next(line for line in command.splitlines() if "-m stages." in line)


def _spec(nproc: int, nodes: int = 1, worker: str = TRAIN.worker) -> RankSpec:
    return RankSpec(worker=worker, nproc=nproc, nodes=nodes, out_dir="/runs/st", config={})


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
    script = _normalise(batch_script(cfg, RUN_DIR))
    _check_golden("frontier_batch.txt", script)
    # The parts that matter on Frontier, stated explicitly as well.
    assert "#SBATCH --nodes=2\n" in script
    assert "#SBATCH --account=ABC123\n" in script
    assert "#SBATCH --partition=batch\n" in script
    assert "#SBATCH --time=120\n" in script
    assert "#SBATCH --exclusive\n" in script
    assert "module load PrgEnv-gnu rocm/6.4.1 " in script
    assert "\nmodule load rccl-net-plugin\n" in script  # OLCF's RCCL plugin, after rocm
    assert script.index("rocm/6.4.1") < script.index("rccl-net-plugin")
    assert "source activate /ccs/proj/abc123/envs/frontier-llm" in script
    assert "sbcast" not in script and "--constraint" not in script  # no node_local_env
    assert "--enable_mpi_mode" in script and "--mpi-launcher=srun" in script


def test_frontier_srun_line_golden():
    cfg = load_config(None, FRONTIER_OVERRIDES)
    text = _normalise(_srun(cfg))
    _check_golden("frontier_srun.txt", text)
    launch = _launch(text)
    assert launch.startswith("srun --ntasks 16 --ntasks-per-node 8 --nodelist <node0>,<node1>")
    assert "-c7 --gpus-per-task=1 --gpu-bind=closest" in launch
    assert "stages.train.worker --spec" in launch
    assert "export NCCL_SOCKET_IFNAME=hsn0" in text
    # The plugin comes from OLCF's module (batch script), and only it may carry RCCL.
    assert "export NCCL_NET='AWS Libfabric'\n" in text
    assert "LD_LIBRARY_PATH" not in text and "stf218" not in text
    assert "FI_MR_CACHE_MONITOR" not in text  # the site default (kdreg2)
    assert 'export MIOPEN_USER_DB_PATH="/tmp/' in text
    # MASTER_ADDR: the first node's address by hostname -i, before the ranks start.
    assert text.index("export MASTER_ADDR=") < text.index("srun --ntasks")
    assert "hostname -i" in text


def test_dry_run_shows_the_blocks_and_each_ranks_stage():
    cfg = load_config(None, FRONTIER_OVERRIDES + ["eval.ranks=4", "site.tokenize_nodes=3"])
    text = dry_run_text(cfg, RUN_DIR)
    assert "#SBATCH --nodes=2" in text and "#SBATCH --account=ABC123" in text
    assert "#SBATCH --job-name=parsl.train.block-0\n" in text
    assert "#SBATCH --job-name=parsl.compute.block-0\n" in text
    assert "#SBATCH --nodes=3" in text  # the compute block
    assert "# --- train app: 2 node(s) x 8 ranks" in text
    assert "# --- evaluate app: 1 node(s) x 4 ranks" in text
    # The two ranks launches, and the compute block's one worker pool per node.
    assert text.count("srun --ntasks ") == 3
    workers = cfg.site.max_workers
    assert f"srun --ntasks 3 -l --ntasks-per-node=1 --cpus-per-task={workers} bash" in text
    where = dict(line.split(None, 2)[1:] for line in text.splitlines()
                 if line.startswith("#   "))
    shards = cfg.data.num_shards
    assert where["tokenize"].startswith(f"prepare, {shards} parts, finalize: compute block")
    assert f"3 node(s) x {workers} workers" in where["tokenize"]
    assert where["plan"] == "one app: login node ('cpu' executor)"
    assert where["train"].startswith("prepare, finalize: login node")
    assert where["evaluate"].startswith("prepare, finalize: its allocation ('evaluate' "
                                        "executor")
    assert "#SBATCH --job-name=parsl.evaluate.block-0\n" in text  # its own block, one node
    evaluate_script = text[text.index("# --- batch script for the evaluate allocation"):]
    assert "#SBATCH --nodes=1\n" in evaluate_script.split("# --- batch script for")[1]
    local = dry_run_text(load_config(None), RUN_DIR)
    assert "train runs 2 ranks on this machine" in local and "\n" not in local
    assert "evaluate" not in local  # one evaluation rank runs inside its Python app


def test_frontier_settings_come_from_config():
    cfg = load_config(None, FRONTIER_OVERRIDES + [
        "site.modules=[rocm/6.3.1]",
        "site.env=[NCCL_DEBUG=INFO, OMP_NUM_THREADS=3]",
        "site.srun_options=-c7 --gpus-per-task=1",
        "site.rccl_plugin_path=/opt/aws-ofi-rccl/lib",
        "site.qos=debug",
    ])
    script = batch_script(cfg, RUN_DIR)
    assert "module load rocm/6.3.1\n" in script
    assert "#SBATCH --qos=debug\n" in script
    launch = _srun(cfg)
    assert "export NCCL_DEBUG=INFO" in launch
    assert "export OMP_NUM_THREADS=3" in launch and "OMP_NUM_THREADS=7" not in launch
    assert "export LD_LIBRARY_PATH=/opt/aws-ofi-rccl/lib${LD_LIBRARY_PATH:+:" in launch
    assert "rccl-net-plugin" not in script  # a plugin path replaces OLCF's module
    # ... and the allocation flag that the module's alt_read rendezvous needs
    assert "disable_rdzv_get" not in script
    assert "#SBATCH --network=disable_rdzv_get\n" in batch_script(
        load_config(None, FRONTIER_OVERRIDES), RUN_DIR)
    assert "--gpu-bind" not in launch


def test_frontier_rejects_missing_account_and_overfull_nodes():
    cfg = load_config(None, [o for o in FRONTIER_OVERRIDES if "account" not in o])
    with pytest.raises(SiteError, match="site.account"):
        make_parsl_config(cfg, RUN_DIR)
    cfg = load_config(None, FRONTIER_OVERRIDES + ["parallel.nodes=1"])
    with pytest.raises(SiteError, match="16 ranks per node"):
        dry_run_text(cfg, RUN_DIR)


def test_bad_site_values_are_config_errors():
    with pytest.raises(ConfigError, match="site.env"):
        load_config(None, ["site.env=[NO_EQUALS_SIGN]"])
    with pytest.raises(ConfigError, match="site.heartbeat_threshold"):
        load_config(None, ["site.heartbeat_threshold=0"])
    with pytest.raises(ConfigError, match="site.name"):
        load_config(None, ["site.name=summit"])


def test_local_config(tmp_path):
    cfg = load_config(None, ["site.max_workers=3", "site.retries=2"])
    config = make_parsl_config(cfg, tmp_path)
    assert config.run_dir == str(tmp_path / "parsl")
    assert config.retries == 2
    by_label = {e.label: e for e in config.executors}
    assert set(by_label) == {"cpu", "train"}
    for executor in by_label.values():
        assert type(executor) is HighThroughputExecutor
        assert isinstance(executor.provider, LocalProvider)
        assert executor.address == "127.0.0.1"
        assert f"export PATH={BIN_DIR}:" in executor.provider.worker_init
    assert by_label["cpu"].max_workers_per_node == 3
    assert by_label["train"].max_workers_per_node == 1
    assert ranks_resource_spec(cfg, TRAIN.shape(cfg)) is None


def test_login_workers_as_threads_start_no_worker_processes(tmp_path):
    """site.login_workers=threads: the executors of this machine are the driver's thread
    pools (cpu: site.max_workers threads; train: one, one launch at a time); under Slurm only
    the login node's, the compute and allocation blocks keep their worker processes."""
    cfg = load_config(None, ["site.max_workers=3", "site.login_workers=threads"])
    by_label = {e.label: e for e in make_parsl_config(cfg, tmp_path).executors}
    assert {label: (type(e), e.max_threads) for label, e in by_label.items()} == {
        "cpu": (ThreadPoolExecutor, 3), "train": (ThreadPoolExecutor, 1)}
    slurm = load_config(None, ["site.name=slurm", "site.login_workers=threads"])
    kinds = {e.label: type(e) for e in make_parsl_config(slurm, tmp_path).executors}
    assert kinds == {"cpu": ThreadPoolExecutor, "compute": HighThroughputExecutor,
                     "train": MPIExecutor, "evaluate": MPIExecutor}
    with pytest.raises(ConfigError, match="site.login_workers"):
        load_config(None, ["site.login_workers=fibers"])


def test_apps_in_threads_each_write_to_their_own_log(tmp_path):
    """Two apps running at once as threads of one process: each one's prints and warnings land
    in its own log, and the process's own output stays where it was."""
    import contextlib
    import io
    import threading

    from workflows.apps import _logged

    both_inside = threading.Barrier(2)

    def app(name: str) -> None:
        with _logged(str(tmp_path / f"{name}.log")):
            both_inside.wait()
            for i in range(50):
                print(f"{name} {i}")
            print(f"{name} done", file=sys.stderr)
            both_inside.wait()

    console, errors = io.StringIO(), io.StringIO()
    # Both streams replaced for the test, so the routing goes with them when it ends.
    with contextlib.redirect_stdout(console), contextlib.redirect_stderr(errors):
        threads = [threading.Thread(target=app, args=(name,)) for name in ("a", "b")]
        for thread in threads:
            thread.start()
        print("driver line")
        for thread in threads:
            thread.join()
    for name in ("a", "b"):
        lines = (tmp_path / f"{name}.log").read_text().splitlines()
        assert lines == [f"{name} {i}" for i in range(50)] + [f"{name} done"]
    assert "driver line" in console.getvalue() and " 0\n" not in console.getvalue()
    assert errors.getvalue() == ""


def test_local_ranks_command():
    cfg = load_config(None, ["parallel.nproc=4"])
    command = ranks_command(cfg, _spec(4), "/runs/train/spec.json")
    assert command.splitlines()[-1] == (
        f"exec {sys.executable} -m stages.mechanism.launch --spec /runs/train/spec.json"
    )
    assert "export OMP_NUM_THREADS=1" in command
    with pytest.raises(SiteError, match="parallel.nodes=1"):
        ranks_command(cfg, _spec(4, nodes=2), "/x/spec.json")


def test_slurm_config(tmp_path):
    cfg = load_config(None, [
        "site.name=slurm", "site.account=proj1", "site.partition=debug",
        "site.scheduler_options='#SBATCH --constraint=cpu'", "site.retries=1",
        "parallel.nproc=4", "parallel.nodes=2", "site.address=10.1.2.3",
    ])
    config = make_parsl_config(cfg, tmp_path)
    by_label = {e.label: e for e in config.executors}
    assert set(by_label) == {"cpu", "compute", "train", "evaluate"}
    assert type(by_label["cpu"]) is HighThroughputExecutor
    assert isinstance(by_label["cpu"].provider, LocalProvider)
    assert by_label["cpu"].address == "127.0.0.1"
    ranks = by_label["train"]
    assert isinstance(ranks, MPIExecutor) and ranks.mpi_launcher == "srun"
    assert ranks.max_workers_per_block == 1 and ranks.address == "10.1.2.3"
    provider = ranks.provider
    assert isinstance(provider, SlurmProvider) and isinstance(provider.launcher, SimpleLauncher)
    assert provider.nodes_per_block == 2 and provider.init_blocks == 0
    assert not provider.exclusive and provider.cores_per_node == 2
    for line in ("#SBATCH --account=proj1", "#SBATCH --partition=debug",
                 "#SBATCH --constraint=cpu"):
        assert line in provider.scheduler_options
    assert ranks_resource_spec(cfg, TRAIN.shape(cfg)) == {
        "num_nodes": 2, "ranks_per_node": 2, "num_ranks": 4,
        "launcher_options": "--cpus-per-task=1",
    }
    command = ranks_command(cfg, _spec(4, nodes=2), "/r/spec.json")
    assert _launch(command) == (
        f"$PARSL_MPI_PREFIX {sys.executable} -m stages.train.worker --spec /r/spec.json"
    )
    with pytest.raises(SiteError, match="3 ranks do not divide over 2 nodes"):
        ranks_resource_spec(cfg, StageShape(RANKS, nproc=3, nodes=2, worker=TRAIN.worker))


def test_a_series_of_launches_is_one_srun_step_each_and_never_stops_early(tmp_path):
    """Measured refinement's series spec: one srun step per launch, in order, each killed
    after its timeout; a failed step is reported and the next runs; the command exits 0."""
    cfg = load_config(None, ["site.name=slurm", "parallel.nproc=4", "parallel.nodes=2"])
    paths = []
    for i in range(2):
        launch = RankSpec(worker=TRAIN.worker, nproc=4, nodes=2, out_dir=str(tmp_path / f"p{i}"),
                          config={}, timeout_s=900)
        paths.append(str(launch.write(tmp_path / f"p{i}" / "spec.json")))
    series = RankSpec(worker=TRAIN.worker, nproc=4, nodes=2, out_dir=str(tmp_path), config={},
                      series=paths)
    lines = ranks_command(cfg, series, tmp_path / "spec.json").splitlines()
    steps = [line for line in lines if "$PARSL_MPI_PREFIX" in line]
    assert steps == [
        f"timeout 900 $PARSL_MPI_PREFIX {sys.executable} -m stages.train.worker --spec {path}"
        f' || echo "[launch] launch {i + 1} of 2 failed: exit $?" >&2'
        for i, path in enumerate(paths)]
    assert lines[-1] == "exit 0"
    wrong = RankSpec(worker=TRAIN.worker, nproc=2, nodes=1, out_dir=str(tmp_path), config={})
    series.series = [str(wrong.write(tmp_path / "w" / "spec.json"))]
    with pytest.raises(SiteError, match="every launch of a series spans the same ranks"):
        ranks_command(cfg, series, tmp_path / "spec.json")


def test_a_local_series_runs_every_launch_whatever_fails(tmp_path):
    """On this machine the launches run one after another through the local launcher; one
    whose ranks fail is reported in a line and the next still runs."""
    paths = []
    for i, worker in enumerate(("no_such_module_here", "this")):
        launch = RankSpec(worker=worker, nproc=1, nodes=1, out_dir=str(tmp_path / f"p{i}"),
                          config={}, timeout_s=120)
        paths.append(str(launch.write(tmp_path / f"p{i}" / "spec.json")))
    series = RankSpec(worker=TRAIN.worker, nproc=1, nodes=1, out_dir=str(tmp_path), config={},
                      series=paths)
    log = tmp_path / "series.log"
    run_local(series.write(tmp_path / "spec.json"), log, what="measurement", echo=False)
    text = log.read_text()
    assert f"[launch] {paths[0]}: measurement ranks failed" in text
    assert "Beautiful is better than ugly." in text  # `python -m this` ran after it


def test_a_launcher_whose_own_log_fills_the_disk_still_reports_its_ranks(tmp_path):
    """The launcher's stdout is the stage's log on the runs dir; when that disk fills, the
    launcher goes on reading its ranks and exits with their verdict, not a traceback of its
    own (which Parsl would retry) or Python's failed flush at exit."""
    spec = RankSpec(worker="this", nproc=1, nodes=1, out_dir=str(tmp_path), config={},
                    timeout_s=120)
    path = spec.write(tmp_path / "spec.json")
    with open("/dev/full", "w") as full:  # every write: ENOSPC
        done = subprocess.run([sys.executable, "-m", "stages.mechanism.launch", "--spec",
        str(path)],
                              cwd=REPO_ROOT, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


def test_each_allocation_is_sized_for_its_stage(tmp_path):
    """Training and evaluation each get a block of their own size: an evaluation on one node
    never holds the training's nodes, and evaluating alone asks for its node only. Only the
    training's block has Slurm's signal ahead of the end; the evaluation's runs for
    site.compute_walltime."""
    cfg = load_config(None, ["site.name=slurm", "parallel.nproc=8", "parallel.nodes=4",
                             "eval.ranks=3", "site.walltime=04:00:00",
                             "site.compute_walltime=00:20:00"])

    def blocks(running):
        config = make_parsl_config(cfg, tmp_path, running=running)
        return {e.label: (e.provider.nodes_per_block, e.provider.cores_per_node)
                for e in config.executors if e.label in ("train", "evaluate")}

    # training: 4 nodes x 2 ranks; evaluation: 3 ranks on one node
    assert blocks(None) == {"train": (4, 2), "evaluate": (1, 3)}
    assert blocks(["plan", "train"]) == {"train": (4, 2)}
    assert blocks(["evaluate"]) == {"evaluate": (1, 3)}
    train, evaluate = allocation_provider(cfg, "train"), allocation_provider(cfg, "evaluate")
    assert (train.walltime, evaluate.walltime) == ("04:00:00", "00:20:00")
    assert "#SBATCH --signal=USR1@" in train.scheduler_options
    assert "--signal" not in evaluate.scheduler_options
    single = load_config(None, ["site.name=slurm", "parallel.nproc=8", "parallel.nodes=4"])
    provider = allocation_provider(single, "evaluate")  # one process, in its own allocation
    assert (provider.nodes_per_block, provider.cores_per_node) == (1, 1)
    assert provider.walltime == single.site.walltime  # no compute_walltime: the site's


def test_only_the_executors_the_running_stages_use_are_made(tmp_path):
    """--only tokenize starts no training executor (no interchange, no local worker pool);
    on Slurm sites the compute block's executor exists only for the stages placed there."""
    def labels(site: str, running: list[str] | None) -> list[str]:
        cfg = load_config("micro", [f"site.name={site}"])
        return [e.label for e in make_parsl_config(cfg, tmp_path, running=running).executors]

    assert labels("local", None) == labels("local", ["train"]) == ["cpu", "train"]
    assert labels("local", ["tokenize"]) == labels("local", ["tokenize", "plan"]) == ["cpu"]
    assert labels("local", ["evaluate"]) == ["cpu", "train"]
    assert labels("slurm", None) == ["cpu", "compute", "train", "evaluate"]
    assert labels("slurm", ["tokenize"]) == ["cpu", "compute"]
    assert labels("slurm", ["plan"]) == ["cpu"]
    assert labels("slurm", ["evaluate"]) == ["cpu", "evaluate"]


def test_slurm_ranks_command_turns_a_rank_refusal_into_the_user_error_exit(tmp_path):
    """The command's exit code, run by a real shell: a rank's rank-error.json means no retry."""
    cfg = load_config(None, ["site.name=slurm"])
    spec = RankSpec(worker="stages.train.worker", nproc=1, nodes=1, out_dir=str(tmp_path),
                    config={})
    command = ranks_command(cfg, spec, tmp_path / "spec.json")
    scripts = {"refuse": f"echo {{}} > {tmp_path}/rank-error.json; exit 1", "fail": "exit 7",
               "succeed": "exit 0"}
    codes = []
    for name, body in scripts.items():  # each stands in for srun and its ranks
        prefix = tmp_path / f"{name}.sh"
        prefix.write_text(f"#!/bin/sh\n{body}\n")
        prefix.chmod(0o755)
        env = {**os.environ, "PARSL_MPI_PREFIX": str(prefix)}
        codes.append(subprocess.run(["bash", "-c", command], env=env, check=False).returncode)
    assert codes == [USER_ERROR_EXIT, 7, 0]


def test_local_executors_run_without_venv_on_path(tmp_path):
    """HTEX finds its interchange and worker pool even when the venv's bin/ is not on PATH."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, parsl\n"
        "from pathlib import Path\n"
        "from parsl import bash_app, python_app\n"
        "from stages.config import load_config\n"
        "from workflows import executors\n"
        "@python_app(executors=['cpu'])\n"
        "def square(x):\n    return x * x\n"
        "@bash_app(executors=['train'])\n"
        "def where(stdout=None):\n    return 'echo train-worker-ok'\n"
        "cfg = load_config(None)\n"
        "parsl.load(executors.make_parsl_config(cfg, Path(sys.argv[1])))\n"
        "try:\n"
        "    assert [f.result() for f in [square(i) for i in range(4)]] == [0, 1, 4, 9]\n"
        "    assert where(stdout=sys.argv[1] + '/where.out').result() == 0\n"
        "finally:\n"
        "    parsl.dfk().cleanup()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=180, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "where.out").read_text().strip() == "train-worker-ok"


def test_eval_ranks_use_the_same_launch_lines():
    """The evaluation ranks start like the training ranks, all on one node (eval.ranks)."""
    one = load_config(None)
    assert one.eval.ranks == 1 and EVALUATE.shape(one).kind != RANKS
    frontier_one = dry_run_text(load_config(None, FRONTIER_OVERRIDES), RUN_DIR)
    assert "stages.evaluate.worker" not in frontier_one
    cfg = load_config(None, ["eval.ranks=3"])
    shape = EVALUATE.shape(cfg)
    assert (shape.kind, shape.nproc, shape.nodes, shape.worker) == (RANKS, 3, 1, EVALUATE.worker)
    assert ranks_resource_spec(cfg, shape) is None  # local: no MPIExecutor
    assert "evaluate runs 3 ranks on this machine" in dry_run_text(cfg, RUN_DIR)

    slurm = load_config(None, ["site.name=slurm", "parallel.nproc=4", "parallel.nodes=2",
                               "eval.ranks=3"])
    assert ranks_resource_spec(slurm, EVALUATE.shape(slurm)) == {
        "num_nodes": 1, "ranks_per_node": 3, "num_ranks": 3,
        "launcher_options": "--cpus-per-task=1",
    }
    # A non-exclusive job asks for a CPU per rank on a node, each for its own ranks.
    assert allocation_provider(slurm, "evaluate").cores_per_node == 3
    assert allocation_provider(slurm, "train").cores_per_node == 2
    command = ranks_command(slurm, _spec(3, worker=EVALUATE.worker), "/r/spec.json")
    assert _launch(command) == (
        f"$PARSL_MPI_PREFIX {sys.executable} -m stages.evaluate.worker --spec /r/spec.json"
    )


def test_frontier_forces_the_plugin_only_across_nodes():
    # OLCF: the libfabric plugin does not initialise in a one-node job, so NCCL_NET names
    # the plugin only when the ranks span nodes; site.env still overrides it.
    cfg = load_config(None, FRONTIER_OVERRIDES)
    one = ranks_command(cfg, _spec(8, nodes=1), "/r/spec.json")
    two = ranks_command(cfg, _spec(16, nodes=2), "/r/spec.json")
    assert "export NCCL_NET=Socket\n" in one and "Libfabric" not in one
    assert "export NCCL_NET='AWS Libfabric'\n" in two
    own = load_config(None, FRONTIER_OVERRIDES + ["site.env=[NCCL_NET=OFI]"])
    assert "export NCCL_NET=OFI\n" in ranks_command(own, _spec(8, nodes=1), "/r/spec.json")
    slurm = load_config(None, ["site.name=slurm"])
    assert "NCCL_NET" not in ranks_command(slurm, _spec(2, nodes=2), "/r/spec.json")


def test_frontier_eval_srun_line_golden():
    cfg = load_config(None, FRONTIER_OVERRIDES + ["eval.ranks=8"])
    text = _normalise(_srun(cfg, EVALUATE))
    _check_golden("frontier_eval_srun.txt", text)
    launch = _launch(text)
    assert launch.startswith("srun --ntasks 8 --ntasks-per-node 8 --nodelist <node0> --nodes 1 ")
    assert "-c7 --gpus-per-task=1 --gpu-bind=closest" in launch
    assert "stages.evaluate.worker --spec" in launch
    # Same environment as the training ranks, but for NCCL_NET: this evaluation runs on one
    # node, where the plugin does not initialise, so RCCL is pointed at its sockets.
    train_text = _normalise(_srun(cfg))
    assert "export NCCL_NET=Socket\n" in text
    assert "export NCCL_NET='AWS Libfabric'\n" in train_text
    assert [ln for ln in text.splitlines()
            if ln.startswith("export") and not ln.startswith("export NCCL_NET=")] == [
        ln for ln in train_text.splitlines()
        if ln.startswith("export") and not ln.startswith("export NCCL_NET=")]
    with pytest.raises(SiteError, match="evaluate runs 9 ranks on 1 node.*8 GCDs"):
        dry_run_text(load_config(None, FRONTIER_OVERRIDES + ["eval.ranks=9"]), RUN_DIR)
    with pytest.raises(ConfigError, match="eval.ranks must be >= 1"):
        load_config(None, ["eval.ranks=0"])


def test_compute_block_is_a_slurm_job_of_tokenize_nodes_with_a_pool_per_node(tmp_path):
    cfg = load_config(None, ["site.name=slurm", "site.address=10.1.2.3", "site.max_workers=3",
                             "site.tokenize_nodes=4", "site.heartbeat_threshold=40"])
    by_label = {e.label: e for e in make_parsl_config(cfg, tmp_path).executors}
    compute = by_label["compute"]
    assert type(compute) is HighThroughputExecutor
    assert compute.address == "10.1.2.3" and compute.encrypted
    assert compute.interchange_launch_cmd == interchange_command()
    assert compute.max_workers_per_node == 3 and compute.heartbeat_threshold == 40
    provider = compute.provider
    assert isinstance(provider, SlurmProvider) and isinstance(provider.launcher, SrunLauncher)
    assert provider.nodes_per_block == 4
    assert (provider.init_blocks, provider.min_blocks, provider.max_blocks) == (0, 0, 1)
    # Non-exclusive: one CPU per worker, and srun hands them all to the node's pool.
    assert not provider.exclusive and provider.cores_per_node == 3
    assert provider.worker_init.strip() == worker_init(cfg)
    script = batch_script(cfg, tmp_path, "compute")
    assert "#SBATCH --nodes=4\n" in script and "#SBATCH --cpus-per-task=3" in script
    assert "srun --ntasks 4 -l --ntasks-per-node=1 --cpus-per-task=3 bash" in script
    assert "--max_workers_per_node=3 " in script and "--enable_mpi_mode" not in script
    frontier = load_config(None, FRONTIER_OVERRIDES)
    provider = compute_provider(frontier)
    assert provider.exclusive and provider.cores_per_node is None
    assert provider.account == "ABC123" and provider.walltime == "02:00:00"


def test_each_stage_runs_where_its_placement_says():
    """Locally every Python app is on "cpu"; under Slurm tokenize fans out on the compute
    block, evaluation runs in its own allocation, plan (when it only searches) and train's
    own apps on the login node. The ranks of both run locally on the one "train" worker,
    under Slurm each in its stage's allocation."""
    stages = {"tokenize": TOKENIZE, "plan": PLAN, "train": TRAIN, "evaluate": EVALUATE}
    expected = {"local": dict.fromkeys(stages, "cpu"),
                "slurm": {"tokenize": "compute", "plan": "cpu", "train": "cpu",
                          "evaluate": "evaluate"}}
    expected["frontier"] = expected["slurm"]
    for site, labels in expected.items():
        for ranks in (1, 2):
            cfg = load_config(None, [f"site.name={site}", f"eval.ranks={ranks}"])
            got = {name: executor_label(cfg, name, stage.shape(cfg).placement)
                   for name, stage in stages.items()}
            assert got == labels, (site, ranks)
            ranks_on = {name: allocation_label(cfg, name) for name in ("train", "evaluate")}
            assert ranks_on == ({"train": "train", "evaluate": "train"} if site == "local"
                                else {"train": "train", "evaluate": "evaluate"}), site
    # A plan stage that rehearses its pick (on by default for every cluster but a measured
    # one) does it on a compute node under Slurm (locally: "cpu"); one that measures its
    # candidates searches on the login node and measures them as ranks in an allocation of
    # its own, the training's size (locally: the one "train" executor).
    for overrides, where in ((["parallel.cluster=frontier"], "compute"),
                             (["parallel.cluster=frontier", "parallel.rehearse=false"], "cpu"),
                             (["parallel.rehearse=true"], "compute"),
                             (["parallel.refine_top_k=2"], "cpu"),
                             (["parallel.refine_top_k=2", "parallel.rehearse=true"], "compute")):
        for site in ("local", "slurm"):
            cfg = load_config(None, [f"site.name={site}", "parallel.nproc=4",
                                     "parallel.nodes=2" if site == "slurm" else "parallel.nodes=1",
                                     *overrides])
            shape = PLAN.shape(cfg)
            label = executor_label(cfg, "plan", shape.placement)
            assert label == (where if site == "slurm" else "cpu"), (overrides, site)
            refines = "parallel.refine_top_k=2" in overrides
            assert shape.kind == ("ranks" if refines else "single"), overrides
            if refines:
                assert (shape.nproc, shape.nodes) == (4, 2 if site == "slurm" else 1)
                assert allocation_label(cfg, "plan") == ("plan" if site == "slurm" else "train")
    with pytest.raises(SiteError, match="unknown stage placement 'gpu'"):
        executor_label(load_config(None), "evaluate", "gpu")
    with pytest.raises(ValueError, match="unknown stage placement"):
        StageShape("single", placement="anywhere")


def test_python_apps_in_the_allocation_carry_the_resource_spec_the_mpi_executor_needs(tmp_path):
    cfg = load_config(None, ["site.name=slurm", "site.address=10.1.2.3"])
    by_label = {e.label: e for e in make_parsl_config(cfg, tmp_path).executors}
    for label in ("train", "evaluate"):
        mpi = by_label[label]
        with pytest.raises(InvalidResourceSpecification):
            mpi.validate_resource_spec({})  # a Python app without one would be refused
        spec = app_resource_spec(cfg, label)
        mpi.validate_resource_spec(dict(spec))
        assert spec["num_nodes"] == 1  # one node of the block: the app runs on its first node
    for label in ("cpu", "compute"):
        assert app_resource_spec(cfg, label) == {}
        by_label[label].validate_resource_spec({})
    assert app_resource_spec(load_config(None), "train") == {}


def test_tokenize_nodes_and_workers_are_checked():
    with pytest.raises(ConfigError, match="site.tokenize_nodes must be > 0, got 0"):
        load_config(None, ["site.tokenize_nodes=0"])
    with pytest.raises(ConfigError, match="site.tokenize_nodes"):
        load_config(None, ["site.tokenize_nodes=two"])
    with pytest.raises(SiteError, match="site.max_workers=64.*56"):
        check_site(load_config(None, FRONTIER_OVERRIDES + ["site.max_workers=64"]))
    assert load_config(None, ["site.tokenize_nodes=8"]).site.tokenize_nodes == 8


def test_frontier_compute_batch_script_golden():
    cfg = load_config(None, FRONTIER_OVERRIDES + ["site.tokenize_nodes=4", "site.max_workers=48"])
    script = _normalise(batch_script(cfg, RUN_DIR, "compute"))
    _check_golden("frontier_compute_batch.txt", script)
    assert "#SBATCH --job-name=parsl.compute.block-0\n" in script
    assert "#SBATCH --nodes=4\n" in script and "#SBATCH --exclusive\n" in script
    assert "#SBATCH --account=ABC123\n" in script and "#SBATCH --time=120\n" in script
    assert "source activate /ccs/proj/abc123/envs/frontier-llm" in script
    assert "srun --ntasks 4 -l --ntasks-per-node=1 --cpus-per-task=48 bash" in script
    assert "process_worker_pool.py --max_workers_per_node=48 -a <addresses>" in script


def test_frontier_two_node_dry_run_golden():
    """The whole Slurm part of a 2-node Frontier dry run: where each stage runs, the three
    blocks' scripts (training, evaluation, compute), the training and evaluation ranks'
    srun lines."""
    cfg = load_config(None, FRONTIER_OVERRIDES + ["site.tokenize_nodes=4", "eval.ranks=8"])
    assert cfg.parallel.nodes == 2
    text = _normalise(dry_run_text(cfg, RUN_DIR))
    _check_golden("frontier_dry_run.txt", text)
    assert text.count("#!/bin/bash") == 3 and "#SBATCH --nodes=2\n" in text
    assert "--nodelist <node0>,<node1> --nodes 2" in text


NODE_LOCAL_ENV = "/lustre/orion/abc123/proj-shared/envs/frontier-llm.tar.gz"
NODE_LOCAL_OVERRIDES = [o for o in FRONTIER_OVERRIDES if not o.startswith("site.conda_env")] + [
    f"site.node_local_env={NODE_LOCAL_ENV}"]


def test_frontier_node_local_env_batch_script_golden():
    """site.node_local_env: the job asks for NVMe, sbcasts the packed environment to every
    node, unpacks it there and runs the worker pools and the ranks from it."""
    cfg = load_config(None, NODE_LOCAL_OVERRIDES)
    script = _normalise(batch_script(cfg, RUN_DIR))
    _check_golden("frontier_batch_node_local.txt", script)
    assert "#SBATCH --constraint=nvme\n" in script
    assert f'sbcast --preserve --force {NODE_LOCAL_ENV} "/mnt/bb/$USER/' in script
    assert 'srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 bash -c ' in script
    assert 'export PATH="/mnt/bb/$USER/frontier-llm-env/bin:$PATH"\n' in script
    assert "source activate" not in script
    # In order: modules, the copy, the unpack, PATH; then the worker pool.
    order = [script.index(s) for s in ("module load rccl-net-plugin", "sbcast ", "bash -c ",
                                       "export PATH=", "process_worker_pool.py")]
    assert order == sorted(order)
    compute = batch_script(cfg, RUN_DIR, "compute")
    assert "#SBATCH --constraint=nvme\n" in compute and "sbcast " in compute
    assert " python -m stages.train.worker " in _srun(cfg)  # the env's python, on PATH
    for text in (script, compute):
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def _fake_tools(bin_dir: Path, tools: dict[str, str]) -> dict[str, str]:
    """Shell scripts standing in for cluster tools; an environment with them first on PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in tools.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_node_local_env_lines_copy_unpack_and_put_the_env_first(tmp_path):
    """The rendered lines, run by bash with sbcast and srun standing in (a copy, a local
    command), unpack a conda-pack-like tarball, run its conda-unpack and put it on PATH."""
    import tarfile

    from workflows.frontier import node_local_env_lines

    env_dir = tmp_path / "packed"
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").write_text("#!/bin/bash\n[ \"$1\" ] && touch \"$1.ran\"\n")
    (env_dir / "bin" / "conda-unpack").write_text("# conda-pack's fixer\n")
    for name in ("python", "conda-unpack"):
        (env_dir / "bin" / name).chmod(0o755)
    tarball = tmp_path / "my env's.tar.gz"  # a space and a quote: quoted on the way
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(env_dir, arcname=".")
    node = tmp_path / "nvme"
    lines = [line.replace("/mnt/bb/$USER", str(node))
             for line in node_local_env_lines(str(tarball))]
    env = _fake_tools(tmp_path / "tools", {
        "sbcast": 'while [[ $1 == -* ]]; do shift; done; mkdir -p "$(dirname "$2")"; cp "$1" "$2"',
        "srun": 'while [[ $1 == -* ]]; do shift; done; exec "$@"',
    })
    script = "\n".join([*lines, "command -v python"])
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{node}/frontier-llm-env/bin/python"
    assert (node / "frontier-llm-env" / "bin" / "conda-unpack.ran").exists()
    assert not (node / "frontier-llm-env.tar").exists()  # the copy is removed once unpacked
    # A failed copy ends the job at once, saying what failed.
    env = _fake_tools(tmp_path / "tools", {"sbcast": "exit 1"})
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                         check=False)
    assert out.returncode == 1 and "sbcast of site.node_local_env failed" in out.stderr


def test_node_local_env_is_a_checked_frontier_option():
    with pytest.raises(ConfigError, match="site.node_local_env='env.tar.gz' must be the absolute"):
        load_config(None, ["site.node_local_env=env.tar.gz"])
    with pytest.raises(ConfigError, match="tarball"):
        load_config(None, ["site.node_local_env=/lustre/orion/x/envs/frontier-llm"])
    with pytest.raises(SiteError, match="Frontier option"):
        check_site(load_config(None, ["site.name=slurm", f"site.node_local_env={NODE_LOCAL_ENV}"]))
    with pytest.raises(SiteError, match="site.conda_env and site.node_local_env are both set"):
        check_site(load_config(None, [*FRONTIER_OVERRIDES,
                                      f"site.node_local_env={NODE_LOCAL_ENV}"]))


def test_frontier_master_addr_is_the_first_nodes_address(tmp_path):
    """MASTER_ADDR is ``hostname -i`` of the step's first node: here when this node is it,
    else through a one-task step on that node; never empty."""
    from workflows.ranks import master_addr_lines

    script = "\n".join([*master_addr_lines(), 'echo "$MASTER_ADDR"'])
    tools = {
        "scontrol": "tr , '\\n' <<< \"$3\"",  # show hostnames a,b: one per line
        "hostname": 'case $1 in -s) echo frontier00002;; -i) echo "10.1.0.2 10.2.0.2";; esac',
        "srun": 'echo "10.1.0.1"; echo "$*" > "$(dirname "$0")/srun.args"',
    }
    env = _fake_tools(tmp_path / "bin", tools)

    def run(nodes: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", script], env={**env, "PARSL_MPI_NODELIST": nodes},
                              capture_output=True, text=True, check=False)

    here = run("frontier00003,frontier00002")  # Slurm's order: frontier00002 is the first
    assert here.stdout.strip() == "10.1.0.2"  # the first of hostname -i's addresses
    assert not (tmp_path / "bin" / "srun.args").exists()
    there = run("frontier00001,frontier00002")
    assert there.stdout.strip() == "10.1.0.1"
    assert "--nodelist=frontier00001" in (tmp_path / "bin" / "srun.args").read_text()
    _fake_tools(tmp_path / "bin", {"hostname": "case $1 in -s) echo frontier00002;; esac"})
    none = run("frontier00002")
    assert none.returncode == 1 and "hostname -i gave no address" in none.stderr


@pytest.mark.parametrize(("runs_dir", "words"), [
    ("runs", ("the runs dir 'runs'", "is relative", "--runs-dir /lustre/orion/<project>/")),
    ("../scratch/runs", ("is relative",)),
    ("/ccs/home/me/runs", ("is not on Frontier's Lustre filesystem (/lustre/orion)",
                           "--runs-dir /lustre/orion/<project>/scratch/$USER/runs")),
    ("/lustre/orion", ("is not on Frontier's Lustre",)),
    ("/lustre/orion/abc123/../../../tmp/runs", ("'/tmp/runs'", "is not on Frontier's Lustre")),
])
def test_frontier_refuses_a_runs_dir_off_lustre(runs_dir, words):
    cfg = load_config(None, FRONTIER_OVERRIDES + [f"tracking.runs_dir={runs_dir}"])
    with pytest.raises(SiteError) as error:
        check_site(cfg)
    for word in words:
        assert word in str(error.value)
    with pytest.raises(SiteError, match="is not on Frontier's Lustre|is relative"):
        make_parsl_config(cfg, RUN_DIR)
    # The dry run (maybe on a laptop) shows it as a warning instead.
    text = dry_run_text(cfg, RUN_DIR)
    assert text.startswith("# warning: a run refuses this: site.name=frontier: the runs dir")


def test_only_frontier_asks_for_lustre():
    for site in ("local", "slurm"):
        check_site(load_config(None, [f"site.name={site}", "tracking.runs_dir=runs"]))
    check_site(load_config(None, FRONTIER_OVERRIDES))  # /lustre/orion/abc123/...


def test_the_driver_refuses_an_off_lustre_runs_dir_before_any_work(tmp_path, monkeypatch, capsys):
    from workflows.pipeline import main

    monkeypatch.chdir(tmp_path)
    code = main(["--config", str(REPO_ROOT / "configs" / "micro.yaml"), "--site", "frontier",
                 "--set", "site.account=abc123"])
    err = capsys.readouterr().err
    assert code == 2
    assert "config error: site.name=frontier: the runs dir 'runs'" in err
    assert "--runs-dir /lustre/orion/<project>/scratch/$USER/runs" in err
    assert list(tmp_path.iterdir()) == []  # no runs dir, no store, no Parsl directory
    code = main(["--config", str(REPO_ROOT / "configs" / "micro.yaml"), "--site", "frontier",
                 "--set", "site.account=abc123", "--runs-dir", str(tmp_path / "runs"),
                 "--dry-run"])
    out = capsys.readouterr().out
    # The dry run still shows everything, and its readiness report counts the runs dir as
    # an error: exit 2.
    assert code == 2 and "# warning: a run refuses this: site.name=frontier" in out
    assert re.search(r"#   runs dir +error ", out) and "1 error(s)" in out


def test_slurm_sites_refuse_runs_dir_characters_their_scripts_cannot_carry():
    for bad in ("/scratch/a b", "/scratch/$(id)", "/scratch/run%j", "/scratch/x;y", "/s/'q'"):
        cfg = load_config(None, ["site.name=slurm", f"tracking.runs_dir={bad}"])
        with pytest.raises(SiteError, match=r"tracking.runs_dir \(--runs-dir\)=.*use only "
                                            "letters, digits"):
            check_site(cfg)
    check_site(load_config(None, ["site.name=slurm", "tracking.runs_dir=/scratch/a_b-1.2+c"]))
    check_site(load_config(None, ["tracking.runs_dir=/scratch/run%j"]))  # local: as before


def test_a_block_with_connected_workers_is_handed_back_though_its_last_poll_said_pending():
    """The retry of ranks out of time must not start in the job they stopped in: Parsl's
    status of it can be a poll old (pending), while its worker pool is already connected."""
    status = {"0": JobStatus(JobState.PENDING), "1": JobStatus(JobState.PENDING),
              "2": JobStatus(JobState.RUNNING), "3": JobStatus(JobState.CANCELLED),
              "4": JobStatus(JobState.SCALED_IN)}
    assert running_blocks(status, connected={"0", "3", "4"}) == ["0", "2"]
    assert running_blocks(status, connected=set()) == ["2"]
