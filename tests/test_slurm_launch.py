"""Multi-rank launch on a real (one-node) Slurm cluster started by .ci/start_slurm.sh.

These tests skip only when that script's env file is absent; with a cluster up, any
failure is a real failure. Run by hand:

    .ci/start_slurm.sh && OMP_NUM_THREADS=1 pytest -q -m slurm tests/test_slurm_launch.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SLURM_DIR = Path(os.environ.get("FRONTIER_LLM_SLURM_DIR", "/tmp/frontier-llm-slurm"))
SLURM_ENV_FILE = SLURM_DIR / "env"

pytestmark = pytest.mark.slurm


def read_slurm_env() -> dict[str, str]:
    """KEY=VALUE pairs from the env file written by .ci/start_slurm.sh."""
    env = {}
    for line in SLURM_ENV_FILE.read_text().splitlines():
        line = line.strip()
        if line.startswith("export "):
            key, value = line[len("export "):].split("=", 1)
            env[key] = value
    return env


@pytest.fixture(scope="session")
def slurm_env():
    """Point Slurm clients (and Parsl's SlurmProvider) at the local test cluster."""
    if not SLURM_ENV_FILE.exists():
        pytest.skip(f"no local Slurm cluster: {SLURM_ENV_FILE} is absent (run .ci/start_slurm.sh)")
    env = read_slurm_env()
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def completed_jobs() -> str:
    """The job completion log (jobcomp/filetxt) as sacct -c prints it."""
    out = subprocess.run(
        ["sacct", "-c", "--noheader", "-o", "JobID,JobName%40,State"],
        capture_output=True, text=True, timeout=30, check=True,
    )
    return out.stdout


def test_mpi_executor_runs_ranks_through_srun(slurm_env, tmp_path):
    """A Parsl MPIExecutor app on the Slurm site gets distinct SLURM_PROCIDs
    via $PARSL_MPI_PREFIX."""
    import parsl
    from parsl import bash_app

    from stages.config import load_config
    from workflows.executors import make_parsl_config
    from workflows.ranks import ranks_resource_spec

    cfg = load_config(None, ["site.name=slurm", "site.walltime=00:05:00", "parallel.nproc=2"])
    from stages.registry import declaration

    spec = ranks_resource_spec(cfg, declaration("train").shape(cfg))
    assert spec == {"num_nodes": 1, "ranks_per_node": 2, "num_ranks": 2,
                    "launcher_options": "--cpus-per-task=1"}

    @bash_app(executors=["train"])
    def show_ranks(parsl_resource_specification=None, stdout=None, stderr=None):
        return (
            "echo prefix=$PARSL_MPI_PREFIX\n"
            "$PARSL_MPI_PREFIX bash -c "
            "'echo rank=$SLURM_PROCID local=$SLURM_LOCALID n=$SLURM_NTASKS job=$SLURM_JOB_ID'"
        )

    out, err = tmp_path / "ranks.out", tmp_path / "ranks.err"
    parsl.load(make_parsl_config(cfg, tmp_path))
    try:
        future = show_ranks(parsl_resource_specification=spec, stdout=str(out), stderr=str(err))
        assert future.result(timeout=240) == 0, err.read_text() if err.exists() else ""
    finally:
        parsl.dfk().cleanup()
        parsl.clear()

    lines = out.read_text().splitlines()
    prefix = [line for line in lines if line.startswith("prefix=")]
    assert prefix and prefix[0].startswith("prefix=srun --ntasks 2 --ntasks-per-node 2")
    ranks = [dict(kv.split("=") for kv in line.split())
             for line in lines if line.startswith("rank=")]
    assert sorted(r["rank"] for r in ranks) == ["0", "1"]
    assert {r["n"] for r in ranks} == {"2"}
    jobs = {r["job"] for r in ranks}
    assert len(jobs) == 1, f"ranks ran in different jobs: {jobs}"
    # The block was a real Slurm batch job, recorded by the controller.
    (job_id,) = jobs
    record = [line for line in completed_jobs().splitlines() if line.split()[:1] == [job_id]]
    assert record and "parsl.train.block-0" in record[0], completed_jobs()


ALLREDUCE_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    import torch.distributed as dist
    from model.parallel.dist_env import from_environ, init_distributed

    env = from_environ()  # SLURM_PROCID / SLURM_NTASKS / first node of the step
    init_distributed(env)
    value = torch.tensor([float(env.rank + 1), 10.0 * (env.rank + 1)])
    dist.all_reduce(value)
    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, env.rank)
    print(json.dumps({"rank": env.rank, "local": env.local_rank, "world": env.world_size,
                      "port": env.master_port, "sum": value.tolist(), "ranks": gathered}))
    dist.destroy_process_group()
    """
)


def test_gloo_allreduce_under_srun(slurm_env, tmp_path):
    """Two srun tasks form a gloo group from Slurm's rank identity (model.parallel.dist_env)
    and all-reduce."""
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE_SCRIPT)
    from stages.mechanism.launch import REPO_ROOT

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # identity must come from Slurm alone
    proc = subprocess.run(
        ["srun", "--ntasks", "2", "--cpus-per-task=1", "--time=5",
         "--job-name=gloo-allreduce", sys.executable, str(script)],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    results = sorted(
        (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in results] == [0, 1]
    assert len({r["port"] for r in results}) == 1
    for r in results:
        assert r["world"] == 2 and r["local"] == r["rank"]
        assert r["sum"] == [3.0, 30.0]
        assert r["ranks"] == [0, 1]


LOOKUP_SCRIPT = textwrap.dedent(
    """
    import json, socket, time
    started = time.monotonic()
    try:
        answer = socket.getnameinfo(("::ffff:192.0.2.1", 1, 0, 0), socket.NI_NAMEREQD)[0]
    except OSError as error:
        answer = str(error)
    print(json.dumps({"answer": answer, "seconds": time.monotonic() - started}))
    """
)


def test_a_lookup_the_hosts_block_cannot_answer_fails_at_once_on_a_node(slurm_env, tmp_path):
    """On a compute node, a reverse lookup that /etc/hosts cannot answer (c10d makes one for
    every peer as ranks meet) fails at once (.ci/start_slurm.sh routes the nameservers
    unreachable), instead of waiting out the resolver's timeouts, 5 s a try, which made every
    rendezvous on the cluster 20 s longer."""
    if int(slurm_env.get("FRONTIER_LLM_SLURM_NODES", "1")) < 2:
        pytest.skip("one-node cluster: its node is this machine, whose nameservers answer")
    script = tmp_path / "lookup.py"
    script.write_text(LOOKUP_SCRIPT)
    proc = subprocess.run(["srun", "--ntasks", "1", "--time=1", "--job-name=lookup",
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["seconds"] < 2.5, result  # under one resolver timeout (5 s)
