"""A forked driver's warm launches (``tests/launch_zygote.py``) keep the launcher's contract:
the ranks command the local site runs, its exit code and killed-rank line, the ranks'
command lines, and a launch that ends with its client, by SIGTERM (forwarded) or SIGKILL.

The host is a fresh interpreter that starts the zygote as a forked driver does, then runs
the ranks command of a real rank spec (``workflows.ranks.ranks_command``) under bash, as
Parsl's bash app does."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from stages.mechanism.launch import REPO_ROOT, RankSpec

pytestmark = pytest.mark.slow  # gloo ranks

HOST = """
import subprocess, sys
from tests import launch_zygote
launch_zygote.start()
import workflows.ranks
from stages.config import load_config
from stages.mechanism.launch import RankSpec
command = workflows.ranks.ranks_command(load_config("micro"), RankSpec.read(sys.argv[1]),
                                        sys.argv[1])
print(command.splitlines()[-1], flush=True)
code = subprocess.call(["bash", "-c", command])  # negative: killed by that signal
print(f"exit {code}", flush=True)
"""


def _spec(tmp_path: Path, nproc: int, **extra: object) -> Path:
    spec = RankSpec(worker="tests.killed_rank_worker", nproc=nproc, nodes=1,
                    out_dir=str(tmp_path), config={}, extra=dict(extra), timeout_s=120)
    return spec.write(tmp_path / "spec.json")


def _host(spec: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOST, str(spec)], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _processes_of(spec: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if str(spec) in " ".join(proc.info["cmdline"] or []) and \
                proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def test_a_killed_rank_is_named_and_the_command_exits_as_the_launcher_does(tmp_path):
    host = _host(_spec(tmp_path, nproc=2, victim=1))
    out, err = host.communicate(timeout=300)
    # the launcher's line, run by the client (test_killed_rank.py: the launcher itself)
    assert out.splitlines()[0].endswith(f"-m tests.launch_client --spec {tmp_path}/spec.json")
    said = "rank 1 was killed by signal 9 (SIGKILL)"
    assert out.splitlines()[-1] == f"exit {128 + 9}", out[-3000:] + err[-3000:]
    assert f"[launch] {tmp_path.name} ranks failed (exit 137): {said}" in err, err[-3000:]
    assert said in out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_the_launch_ends_with_its_client(tmp_path, signum):
    spec = _spec(tmp_path, nproc=2, victim=-1, sleep_s=120)
    host = _host(spec)
    try:
        deadline = time.monotonic() + 120
        while True:  # the client, the launch and both ranks, by their command lines
            titles = [" ".join(p.info["cmdline"]) for p in _processes_of(spec)]
            ranks = [t for t in titles if "-m tests.killed_rank_worker --spec" in t]
            client = [p for p in _processes_of(spec)
                      if "-m tests.launch_client" in " ".join(p.info["cmdline"])]
            if len(ranks) == 2 and client:
                break
            assert time.monotonic() < deadline, titles
            time.sleep(0.2)
        assert any(" -m stages.mechanism.launch --spec " in t for t in titles), titles
        client[0].send_signal(signum)
        out, err = host.communicate(timeout=60)
        # bash execs the client, which ends by the signal it got, as the launcher would
        assert out.splitlines()[-1] == f"exit {-signum}", out[-3000:] + err[-3000:]
        deadline = time.monotonic() + 15
        while _processes_of(spec):
            assert time.monotonic() < deadline, [p.info["cmdline"] for p in _processes_of(spec)]
            time.sleep(0.2)
    finally:
        host.kill()
        for proc in _processes_of(spec):
            proc.kill()
