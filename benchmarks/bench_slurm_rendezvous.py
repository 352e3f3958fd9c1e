"""What an unanswered nameserver costs a rendezvous on the multi-node test cluster.

Run on a cluster of two or more nodes started by ``.ci/start_slurm.sh --nodes 2`` (root, the
env file sourced). One srun step of 4 ranks on 2 nodes imports torch, meets (gloo, the
project's ``model.parallel.dist_env.init_distributed``), all-reduces and ends, ``--repeats``
times each way, alternating:

- ``unreachable``: the cluster as started, this machine's nameservers routed unreachable in
  every node's namespace (``unreachable_nameservers`` in the script): a lookup the hosts
  block cannot answer fails at once;
- ``timeouts``: those routes removed for the run (put back after it, whatever happens), as
  the cluster was before: such a lookup waits out the resolver's timeouts. c10d makes one
  (the reverse name of a peer's IPv4-mapped address) as ranks meet.

Printed per way: the median wall seconds of the step and of its ranks' ``init_distributed``;
the ratio timeouts / unreachable. The last line is one JSON object, also written to
benchmarks/results/bench_slurm_rendezvous.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import write_results  # noqa: E402 (needs the repository on sys.path)
from benchmarks.timing import median_figures, timed_command  # noqa: E402

RANKS = textwrap.dedent(
    """
    import json, time
    import torch
    import torch.distributed as dist
    from model.parallel.dist_env import from_environ, init_distributed

    env = from_environ()
    started = time.monotonic()
    init_distributed(env)
    met = time.monotonic() - started
    value = torch.ones(2)
    dist.all_reduce(value)
    dist.destroy_process_group()
    print(json.dumps({"rank": env.rank, "init_s": met, "sum": value.tolist()}))
    """
)


def node_namespaces() -> list[str]:
    """The cluster's compute nodes' network namespaces (``fl-<node>``, the script's names)."""
    names = subprocess.run(["sinfo", "-h", "-o", "%N"], capture_output=True, text=True,
                           check=True).stdout.strip()
    hosts = subprocess.run(["scontrol", "show", "hostnames", names], capture_output=True,
                           text=True, check=True).stdout.split()
    return [f"fl-{host}" for host in hosts]


def unreachable_routes(namespace: str) -> list[str]:
    """The unreachable routes of a node's namespace (its nameservers)."""
    out = subprocess.run(["ip", "netns", "exec", namespace, "ip", "route", "show", "type",
                          "unreachable"], capture_output=True, text=True, check=True).stdout
    return [line.split()[1] for line in out.splitlines()  # "unreachable 10.255.255.53"
            if line.startswith("unreachable ")]


def set_routes(routes: dict[str, list[str]], present: bool) -> None:
    """Add (``present``) or remove the unreachable routes in each namespace; either way
    whatever the routes were (a route already gone is not removed again)."""
    for namespace, targets in routes.items():
        for target in targets:
            if present or target in unreachable_routes(namespace):
                subprocess.run(["ip", "netns", "exec", namespace, "ip", "route",
                                "replace" if present else "del", "unreachable", target],
                               check=True)


def one_step(script: Path) -> tuple[float, float]:
    """(wall seconds of the srun step, the slowest rank's init_distributed seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    wall, _, proc = timed_command(["srun", "--nodes", "2", "--ntasks", "4", "--cpus-per-task=1",
                                   "--time=5", "--job-name=bench-rendezvous", sys.executable,
                                   str(script)], ROOT, env)
    if proc.returncode != 0:
        raise SystemExit(f"the srun step failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3], proc.stdout
    assert all(r["sum"] == [4.0, 4.0] for r in ranks), proc.stdout
    return wall, max(r["init_s"] for r in ranks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="steps each way (default 3)")
    args = ap.parse_args()
    if int(os.environ.get("FRONTIER_LLM_SLURM_NODES", "1")) < 2:
        raise SystemExit("needs the multi-node test cluster: bash .ci/start_slurm.sh --nodes 2,"
                         " then source its env file")
    routes = {ns: unreachable_routes(ns) for ns in node_namespaces()}
    if not all(routes.values()):
        raise SystemExit(f"a node has no unreachable nameserver route: {routes} (restart the "
                         "cluster with this checkout's .ci/start_slurm.sh)")
    runs: dict[str, list[tuple[float, float]]] = {"unreachable": [], "timeouts": []}
    with tempfile.TemporaryDirectory(prefix="bench-rendezvous-") as tmp:
        script = Path(tmp) / "ranks.py"
        script.write_text(RANKS)
        try:
            for k in range(args.repeats):
                ways = ["unreachable", "timeouts"] if k % 2 == 0 else ["timeouts", "unreachable"]
                for way in ways:
                    set_routes(routes, present=way == "unreachable")
                    runs[way].append(one_step(script))
                    wall, met = runs[way][-1]
                    print(f"[rendezvous] {k + 1}/{args.repeats} {way:<11} {wall:5.2f} s step, "
                          f"{met:5.2f} s to meet", flush=True)
        finally:
            set_routes(routes, present=True)
    figures = median_figures(runs, ("step_s", "meet_s"), digits=2)
    figures["step_ratio_timeouts_over_unreachable"] = round(
        figures["timeouts_step_s"] / figures["unreachable_step_s"], 2)
    write_results("bench_slurm_rendezvous", figures,
                  {"args": vars(args), "routes": routes, "runs": runs})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
