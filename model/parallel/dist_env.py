"""Rank identity from the local launcher, torchrun or Slurm, and process-group start-up.

The same entry point runs under ``stages.mechanism.launch``'s local launcher
(``local_rank_variables``:
RANK/LOCAL_RANK/WORLD_SIZE and a rendezvous file, ``STORE_FILE_VAR``, so that no port is
chosen and none can collide), under ``torchrun`` (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR set)
and under ``srun`` (SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS; the rendezvous host is the
first node of the step, SLURM_STEP_NODELIST, and the port is derived from SLURM_JOB_ID and
SLURM_STEP_ID). The step's nodes, not the job's: a launch that uses some nodes of a larger
job may not include the job's first node.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from model.parallel.host_memory import retain_freed_memory
from model.parallel.threads import default_rank_threads

if TYPE_CHECKING:  # torch is imported where a process group starts: launchers need none
    import torch

STORE_FILE_VAR = "FRONTIER_LLM_RANK_STORE"
"""A file the ranks of one local launch meet at (torch's FileStore), in place of a port."""


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    store_file: str | None = None  # the rendezvous file of a local launch (STORE_FILE_VAR)


def local_rank_variables(rank: int, world_size: int, store_file: str) -> dict[str, str]:
    """The identity a local launcher gives rank ``rank`` of ``world_size`` on one node, meeting
    at ``store_file`` (which must not exist yet); what ``from_environ`` reads."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), STORE_FILE_VAR: store_file}


def expand_first_host(nodelist: str) -> str:
    """First host of a Slurm node list ("nid[001-004,010],login1" -> "nid001").

    Uses ``scontrol show hostnames`` when available, else parses the bracket syntax.
    """
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    first = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if first is None:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = first.groups()
    if not ranges:
        return prefix
    start = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{start}"


def from_environ(environ: dict[str, str] | None = None) -> DistEnv:
    """Read the rank identity from the local launcher's or torchrun's variables, else from
    Slurm, else a single process."""
    env = dict(os.environ if environ is None else environ)
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env["WORLD_SIZE"]),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            store_file=env.get(STORE_FILE_VAR) or None,
        )
    if "SLURM_PROCID" in env:
        job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
        step_id = int(env.get("SLURM_STEP_ID", "0") or 0)
        nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                    or env.get("SLURM_NODELIST") or "127.0.0.1")
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=int(env.get("SLURM_NTASKS", 1)),
            master_addr=env.get("MASTER_ADDR") or expand_first_host(nodelist),
            # A port per job step: concurrent jobs on one node do not collide, and a step
            # retried in the same job does not meet a previous step's lingering store.
            master_port=int(env.get("MASTER_PORT") or 20000 + (job_id * 16 + step_id) % 20000),
        )
    return DistEnv(0, 0, 1, "127.0.0.1", int(env.get("MASTER_PORT", 29500)))


DEFAULT_TIMEOUT_S = 600.0
"""How long a collective may wait for its peers before it fails, unless the caller says
(training: ``train.collective_timeout_s``)."""
NCCL_TRACE_ENTRIES = "2000"
"""The NCCL flight recorder's ring of recent collectives per rank (``TORCH_NCCL_TRACE_BUFFER_SIZE``,
unless already set): dumped when a collective times out (``nccl_flight_recorder``)."""


def launch_id(env: DistEnv, environ: dict[str, str] | None = None) -> str:
    """What the ranks of one launch share and no other launch does: the rendezvous file of a
    local launch, the Slurm job step, torchrun's run and restart, else the rendezvous address.
    A record left by an earlier launch in the same directory is told apart by it."""
    e = os.environ if environ is None else environ
    if env.store_file:
        return env.store_file
    if e.get("SLURM_JOB_ID"):
        return f"slurm-{e['SLURM_JOB_ID']}.{e.get('SLURM_STEP_ID', '0')}"
    if e.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun-{e['TORCHELASTIC_RUN_ID']}.{e.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return f"{env.master_addr}:{env.master_port}"


def nccl_flight_recorder(trace_dir: str | Path | None) -> None:
    """Have NCCL keep its flight recorder (the last ``NCCL_TRACE_ENTRIES`` collectives of each
    rank, with their state) and dump it when a collective times out, to
    ``trace_dir/nccl_trace_rank_<rank>`` (``torch.distributed.flight_recorder`` reads the
    dumps); a setting already in the environment wins. Read by NCCL when the group starts."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", NCCL_TRACE_ENTRIES)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if trace_dir is not None:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                              str(Path(trace_dir) / "nccl_trace_rank_"))


def start_process_group(env: DistEnv, backend: str, device_id: torch.device | None = None,
                        timeout_s: float = DEFAULT_TIMEOUT_S,
                        trace_dir: str | Path | None = None) -> None:
    """Start the default process group of ``env``'s rank, meeting its peers where its
    launcher said: an in-memory store for one process (no port to collide), the rendezvous
    file of a local launch (``STORE_FILE_VAR``: concurrent launches cannot collide), else
    ``MASTER_ADDR:MASTER_PORT`` (srun, torchrun).

    A collective that waits more than ``timeout_s`` for its peers fails (an error on gloo;
    on NCCL the watchdog ends the rank after dumping the flight recorder to ``trace_dir``).
    The groups made later without a timeout of their own (the device mesh's, the background
    checkpoint writer's) get the same one, not torch's default of 30 minutes."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    timeout = timedelta(seconds=timeout_s)
    # torch's default for a new group is read from these at each new_group call
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout
    if backend == "nccl":
        nccl_flight_recorder(trace_dir)
    if env.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    elif env.store_file:
        dist.init_process_group(backend, init_method=f"file://{env.store_file}", rank=env.rank,
                                world_size=env.world_size, timeout=timeout, device_id=device_id)
    else:
        os.environ["MASTER_ADDR"] = env.master_addr
        os.environ["MASTER_PORT"] = str(env.master_port)
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                timeout=timeout, device_id=device_id)


def init_distributed(env: DistEnv, timeout_s: float = DEFAULT_TIMEOUT_S,
                     trace_dir: str | Path | None = None) -> torch.device:
    """Start the default process group (nccl/rccl on GPU, gloo on CPU), its collectives
    failing after ``timeout_s`` (``start_process_group``).

    Returns this rank's device.
    """
    import torch
    import torch.distributed as dist

    threads = default_rank_threads()
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"  # RCCL on ROCm builds
    else:
        device = torch.device("cpu")
        torch.set_num_threads(threads)
        retain_freed_memory()  # a CPU rank's tensors are host memory: no page faults a step
        backend = "gloo"
    if not dist.is_initialized():
        start_process_group(env, backend, device if device.type == "cuda" else None,
                            timeout_s, trace_dir)
    return device
