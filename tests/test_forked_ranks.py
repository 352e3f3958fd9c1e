"""Ranks forked from rank 0 (stages.mechanism.forked_ranks): identities, the launch's exit code, the
failure rule and dying with rank 0, on real forked processes (each case in a fresh
interpreter, never forked from pytest's)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from stages.mechanism.forked_ranks import exit_code, launch_code
from stages.mechanism.launch import OUT_OF_TIME_EXIT, REPO_ROOT

OK = (0, OUT_OF_TIME_EXIT)
GRACE_S = 1.0

PROGRAM = """
import json, os, signal, sys, time
from pathlib import Path
import stages.mechanism.forked_ranks as forked
from model.parallel.dist_env import local_rank_variables

forked.FAILED_RANKS_GRACE_S = {grace}
out = Path({out!r})
os.environ.update(local_rank_variables(0, {world}, str(out / "store")))
os.environ[forked.FORK_PEERS_VAR] = "1"
peers = forked.fork_peers(ok={ok})
rank = int(os.environ["RANK"])
(out / f"rank{{rank}}.json").write_text(json.dumps(
    {{"pid": os.getpid(), "ppid": os.getppid(), "world": os.environ["WORLD_SIZE"],
      "local_rank": os.environ["LOCAL_RANK"], "fork_var": os.environ.get(forked.FORK_PEERS_VAR)}}))
behaviours = {behaviours}
code = 0
exec(behaviours[rank])
if peers is None:
    sys.exit(code)
sys.exit(peers.finish(code))
"""


def launch(tmp_path: Path, behaviours: list[str], timeout: float = 60) -> tuple[int, float, dict]:
    """Run rank 0 with ``len(behaviours)`` ranks, rank r running ``behaviours[r]`` (Python
    that may set ``code``); (exit code, seconds, each rank's record)."""
    program = PROGRAM.format(grace=GRACE_S, out=str(tmp_path), world=len(behaviours), ok=OK,
                             behaviours=behaviours)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(program)], cwd=REPO_ROOT,
                          timeout=timeout, capture_output=True, text=True)
    seconds = time.monotonic() - started
    records = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    return proc.returncode, seconds, records


def test_peers_get_their_identities_and_the_launch_ends_when_all_do(tmp_path: Path) -> None:
    code, _, ranks = launch(tmp_path, ["time.sleep(0.5)", "code = 0", "code = 0"])
    assert code == 0 and sorted(ranks) == [0, 1, 2]
    assert {r["world"] for r in ranks.values()} == {"3"}
    assert [ranks[r]["local_rank"] for r in range(3)] == ["0", "1", "2"]
    assert len({r["pid"] for r in ranks.values()}) == 3
    assert ranks[1]["ppid"] == ranks[2]["ppid"] == ranks[0]["pid"]  # forked from rank 0
    assert all(r["fork_var"] is None for r in ranks.values())  # no rank forks again


def test_out_of_time_peers_give_the_out_of_time_code(tmp_path: Path) -> None:
    code, _, _ = launch(tmp_path, ["code = 0", f"code = {OUT_OF_TIME_EXIT}"])
    assert code == OUT_OF_TIME_EXIT


def test_a_failed_peer_stops_the_others_and_gives_its_code(tmp_path: Path) -> None:
    # rank 2 fails; rank 1 ends on SIGTERM (143 is later than 7); rank 0 is stuck (a
    # collective with the dead rank) and is ended after the grace with the first failure
    code, seconds, _ = launch(tmp_path, ["time.sleep(600)", "time.sleep(600)",
                                         "time.sleep(0.3); code = 7"])
    assert code == 7
    assert GRACE_S < seconds < 30


def test_a_peer_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    code, seconds, _ = launch(tmp_path, ["time.sleep(0.3); code = 5", ignore])
    assert code == 5 and GRACE_S < seconds < 30


def test_a_peer_killed_by_a_signal_gives_128_plus_the_signal(tmp_path: Path) -> None:
    code, _, _ = launch(tmp_path, ["time.sleep(600)", "os.kill(os.getpid(), signal.SIGKILL)"])
    assert code == 128 + 9


def test_peers_die_with_rank_0(tmp_path: Path) -> None:
    program = PROGRAM.format(grace=GRACE_S, out=str(tmp_path), world=3, ok=OK,
                             behaviours=["time.sleep(600)"] * 3)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(program)], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("rank*.json"))) < 3:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        peers = [json.loads((tmp_path / f"rank{r}.json").read_text())["pid"] for r in (1, 2)]
        proc.kill()
        proc.wait()
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in peers if psutil.pid_exists(p)],
                                        timeout=10)
        assert not alive
    finally:
        proc.kill()


@pytest.mark.parametrize(("codes", "expected"), [
    ([0, 0, 0], 0), ([0, 75, 0], 75), ([75, 3, 137], 3), ([143, 7], 143), ([0, 1, 75], 1),
])
def test_launch_code_is_the_first_failure_else_out_of_time(codes: list[int], expected: int) -> None:
    assert launch_code(codes, OK) == expected


def test_exit_code_of_a_signalled_process_is_128_plus_the_signal() -> None:
    assert exit_code(9) == 137 and exit_code(3 << 8) == 3


def test_every_forked_process_is_made_by_fork_child() -> None:
    """One way to fork a rank: the launcher's peers, the microbenchmark's, the tests' zygote's
    launches and ranks and the rehearsal's rank processes all come from
    ``fork_server.fork_child`` (their identity, their death with their parent); no other
    code of the project calls ``os.fork`` (the lock tests' ``multiprocessing`` children are
    not ranks)."""
    import ast

    forks = []
    for root in ("stages", "model", "workflows", "data_prep", "tests", "benchmarks"):
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr in ("fork", "forkpty") and \
                        isinstance(node.func.value, ast.Name) and node.func.value.id == "os":
                    forks.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert len(forks) == 1 and forks[0].startswith("model/parallel/fork_server.py:"), forks
    source = (REPO_ROOT / "model" / "parallel" / "fork_server.py").read_text()
    tree = ast.parse(source)
    (fork_child,) = [n for n in tree.body if isinstance(n, ast.FunctionDef)
                     and n.name == "fork_child"]
    assert fork_child.lineno <= int(forks[0].rsplit(":", 1)[1]) <= fork_child.end_lineno
