"""The rehearsal's rank server (``model.rehearsal.rank_server``): ranks forked from one warm
interpreter, their peak memory reported, a failed rank named, and no server outliving the
process that started it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.config import ModelConfig, TrainConfig
from model.parallel import fork_server
from model.parallel.layout import Plan
from model.rehearsal import rank_server

REPO = Path(__file__).resolve().parents[1]
MODEL = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=128, max_seq_len=16)
TRAIN = TrainConfig(seq_len=16, global_batch=4)


def _cpu_servers() -> list:
    return fork_server.servers(("rehearsal", sys.executable, "cpu"))


@pytest.mark.slow
def test_ranks_fork_from_one_server_and_report_their_peak_memory() -> None:
    plan = Plan(dp=2, grad_accum=2, sharding="zero2")
    first = rank_server.rehearse_isolated(MODEL, TRAIN, plan, 0)
    servers = _cpu_servers()
    second = rank_server.rehearse_isolated(MODEL, TRAIN, plan, 1)
    assert _cpu_servers() == servers and len(servers) == 1  # the same warm server
    assert first.rank == 0 and second.rank == 1
    assert first.flops_per_step == second.flops_per_step
    # the forked process holds torch and the trainer: far more than nothing, below 4 GB
    assert 100e6 < first.host_peak_rss_bytes < 4e9, first.host_peak_rss_bytes


def test_a_rank_that_fails_is_named_and_the_server_serves_the_next() -> None:
    with pytest.raises(RuntimeError, match=r"rank 0 on cpu exited with code 1"):
        rank_server._rehearse_in_child(("not", "a", "config", 0), sys.executable, "cpu")
    plan = Plan(dp=1, grad_accum=4)
    assert rank_server.rehearse_isolated(MODEL, TRAIN, plan, 0).flops_per_step[-1] > 0


SERVER_OWNER = """
import os, pickle, sys, time
from pathlib import Path
from model.rehearsal import rank_server

class Hang:  # unpickled by the rank process: it sleeps there, as a long rehearsal runs
    def __reduce__(self):
        return (time.sleep, (600,))

server = rank_server._acquire(sys.executable, "cpu")
request = Path(sys.argv[1])
request.write_bytes(pickle.dumps(Hang()))
rank = server.start({"request": str(request), "result": str(request) + ".out",
                     "env": dict(os.environ), "cwd": os.getcwd()})
print(server.proc.pid, rank, flush=True)
time.sleep(600)
"""


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # dead, unreaped
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_killed_caller_takes_its_server_and_a_running_rank_with_it(tmp_path: Path) -> None:
    """``kill -9`` of the process that asked for a rehearsal while a rank runs: the server
    and the rank's process die with it (parent-death signals), none left running."""
    owner = subprocess.Popen([sys.executable, "-c", SERVER_OWNER, str(tmp_path / "req.pkl")],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        server, rank = (int(pid) for pid in owner.stdout.readline().split())
        assert _children(server) == [rank]
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not (_gone(server) and _gone(rank)):
            assert time.monotonic() < deadline, \
                f"server {server} or rank {rank} outlived the killed caller"
            time.sleep(0.2)
    finally:
        owner.kill()
        owner.wait()
