"""The test suite against its 15-minute budget, and where its CPU goes.

Runs the README's test command once, with ``benchmarks.suite_timeline`` recording when each
test ran and on which pytest worker, while this process reads every process's CPU time from
``/proc`` once a second. The CPU a process used between two reads is charged to the test that
was running then on the pytest worker the process descends from (the worker itself, its
zygotes, the drivers and ranks they fork, the interpreters they start); a process no worker
started (a rank that slurmd started) is charged to the Slurm test running then. What runs
between tests (a worker's start, session fixtures' teardown) is ``unattributed``. A process
that ends between two reads loses at most a second of CPU from the account.

Printed: every minute, the tests done, their rate and an ETA; then the wall and CPU seconds
of the run, the VM's steal time, the wall time over the budget, and the test files and kinds
of process that cost the most CPU. The last line is one JSON object, also written to
benchmarks/results/bench_suite.json with the per-file, per-test and per-kind tables.

Start the Slurm test cluster first (``bash .ci/start_slurm.sh --nodes 2``, then source
``/tmp/frontier-llm-slurm/env``) or the Slurm tests skip and the figures leave them out.
Run it alone: it measures the whole machine.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results import write_results
from benchmarks.suite_timeline import TIMELINE_VAR, boot_seconds

BUDGET_S = 900.0
"""The suite's budget on the development box: 15 minutes."""
SLURM_TESTS = re.compile(r"tests/test_(slurm_|scaling_slurm)")
"""The Slurm lane's test files: a process no worker started is charged to one of these."""
KINDS = (
    ("training rank", "stages.train.worker"),
    ("evaluation rank", "stages.evaluate.worker"),
    ("rank zygote and the ranks it forks", "tests.rank_zygote"),
    ("driver zygote", "tests.warm_cli"),
    ("launch zygote", "tests.launch_zygote"),
    ("pipeline driver", "workflows.pipeline"),
    ("scaling driver", "workflows.scaling"),
    ("rehearsal rank server and ranks", "model.rehearsal"),
    ("Parsl interchange", "interchange.py"),
    ("Parsl worker pool", "process_worker_pool"),
    ("Parsl pool worker (spawned)", "multiprocessing.spawn"),
    ("local launcher", "stages.mechanism.launch"),
    ("MLflow server", "mlflow server"),
    ("MLflow server", "uvicorn"),
    ("pytest worker", "exec(eval(sys.stdin.readline()))"),
    ("pytest main", "-m pytest"),
    ("Chromium", "chrom"),
    ("Slurm daemons", "slurm"),
    ("other Python", "python"),
)
"""A process's kind: the first whose text is in its command line. A forked process keeps
its server's unless it sets a title of its own: the tests' forked drivers, launchers and
ranks show the command line they stand for, so a kind holds fresh and forked ones alike."""


def kind_of(command: str) -> str:
    """The ``KINDS`` name of a command line, else ``other``."""
    return next((name for name, text in KINDS if text in command), "other")


@dataclass
class Process:
    """One process seen during the run: its CPU seconds as read at boot-clock times."""

    pid: int
    ppid: int
    start: float  # boot-clock seconds
    command: str
    samples: list[tuple[float, float]] = field(default_factory=list)  # (time, CPU s so far)


def read_processes(seen: dict[tuple[int, int], Process], ticks: int, now: float) -> None:
    """Read every process's CPU time from ``/proc`` into ``seen`` (keyed by pid and start
    tick, so a reused pid is a new process); a sample only where it changed."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                text = stat.read()
            fields = text[text.rindex(")") + 2:].split()
            start_tick = int(fields[19])
            cpu = (int(fields[11]) + int(fields[12])) / ticks
            key = (int(name), start_tick)
            proc = seen.get(key)
            if proc is None:
                with open(f"/proc/{name}/cmdline", "rb") as cmdline:
                    command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
                proc = seen[key] = Process(int(name), int(fields[1]), start_tick / ticks,
                                           command.strip()[:400])
            if not proc.samples or proc.samples[-1][1] != cpu:
                proc.samples.append((now, cpu))
        except (OSError, ValueError, IndexError):  # ended while being read
            continue


@dataclass
class Account:
    """Where the run's CPU went."""

    by_test: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    unattributed: float = 0.0


def attribute(processes: list[Process], timeline: list[dict], since: float) -> Account:
    """Charge each process's CPU, read after ``since``, to the tests of ``timeline`` (the
    plugin's lines) as the module docstring says."""
    by_pid: dict[int, list[Process]] = defaultdict(list)
    for proc in processes:
        by_pid[proc.pid].append(proc)
    runs: dict[int, list[dict]] = defaultdict(list)  # worker pid -> its tests by start
    for line in sorted(timeline, key=lambda t: t["start"]):
        runs[line["pid"]].append(line)
    starts = {pid: [t["start"] for t in tests] for pid, tests in runs.items()}
    slurm = [t for t in timeline if SLURM_TESTS.match(t["test"])]

    def parent(proc: Process) -> Process | None:
        older = [p for p in by_pid.get(proc.ppid, ()) if p.start <= proc.start]
        return max(older, key=lambda p: p.start) if older else None

    def worker_of(proc: Process) -> int | None:
        seen: Process | None = proc
        for _ in range(64):  # an ancestry, not a cycle of reused pids
            if seen is None:
                return None
            if seen.pid in runs:
                return seen.pid
            seen = parent(seen)
        return None

    def test_at(worker: int | None, when: float) -> str | None:
        if worker is None:
            return next((t["test"] for t in slurm if t["start"] <= when <= t["end"]), None)
        index = bisect.bisect_right(starts[worker], when) - 1
        if index >= 0 and when <= runs[worker][index]["end"]:
            return runs[worker][index]["test"]
        return None

    account = Account()
    for proc in processes:
        worker = worker_of(proc)
        kind = kind_of(proc.command)
        before = 0.0
        for when, cpu in proc.samples:
            used, before = cpu - before, cpu
            if proc.start < since and when == proc.samples[0][0]:
                continue  # what it used before the run
            test = test_at(worker, when)
            account.by_kind[kind] += used
            if test is None:
                account.unattributed += used
            else:
                account.by_test[test] += used
    return account


def readme_test_command(readme: Path = ROOT / "README.md") -> list[str]:
    """The test command the README gives (its first ``python -m pytest`` line)."""
    for line in readme.read_text().splitlines():
        if line.startswith("python -m pytest"):
            return shlex.split(line)
    raise SystemExit(f"{readme} gives no 'python -m pytest ...' line")


def box_cpu() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine since boot, steal seconds): /proc/stat."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    return (values[0] + values[1] + values[2]) / ticks, values[7] / ticks


def count_tests() -> int:
    """How many tests the suite collects (counted before the measured run)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True)
    found = re.search(r"(\d+) tests? collected", proc.stdout)
    return int(found.group(1)) if found else 0


def table(counter: Counter, top: int) -> list[dict]:
    """The ``top`` largest entries of ``counter``, as rows."""
    return [{"name": name, "cpu_s": round(cpu, 1)} for name, cpu in counter.most_common(top)]


@dataclass
class SuiteRun:
    """What one measured run of the suite gave."""

    code: int
    wall_s: float
    cpu_s: float
    steal_s: float
    since: float  # boot-clock seconds at its start
    processes: list[Process]
    timeline: list[dict]


def run_suite(run: list[str], log_path: Path, timeline_path: Path, total: int) -> SuiteRun:
    """Run ``run`` (the suite, its console to ``log_path``) while reading ``/proc`` once a
    second; a progress line every minute."""
    env = dict(os.environ, **{TIMELINE_VAR: str(timeline_path)})
    ticks = os.sysconf("SC_CLK_TCK")
    seen: dict[tuple[int, int], Process] = {}
    since = boot_seconds()
    read_processes(seen, ticks, since)  # what already runs: only its later CPU counts
    cpu0, steal0 = box_cpu()
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        suite = subprocess.Popen(run, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    done = threading.Event()

    def sample() -> None:
        last_print = t0
        while not done.is_set():
            read_processes(seen, ticks, boot_seconds())
            if time.monotonic() - last_print >= 60:
                last_print = time.monotonic()
                finished = len(timeline_path.read_text().splitlines()) \
                    if timeline_path.exists() else 0
                rate = finished / (last_print - t0)
                eta = f"{(total - finished) / rate:.0f} s" if rate and total else "?"
                print(f"[bench_suite] {last_print - t0:5.0f} s: {finished}/{total} tests, "
                      f"{rate:.2f}/s, ETA {eta}", flush=True)
            done.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = suite.wait()
    done.set()
    sampler.join()
    read_processes(seen, ticks, boot_seconds())
    wall = time.monotonic() - t0
    cpu1, steal1 = box_cpu()
    timeline = [json.loads(line) for line in timeline_path.read_text().splitlines()] \
        if timeline_path.exists() else []
    return SuiteRun(code, wall, cpu1 - cpu0, steal1 - steal0, since, list(seen.values()),
                    timeline)


def report(done: SuiteRun, top: int) -> tuple[dict, dict]:
    """(figures, tables) of a measured run."""
    account = attribute(done.processes, done.timeline, done.since)
    by_file: Counter = Counter()
    tests_in: Counter = Counter(line["test"].split("::")[0] for line in done.timeline)
    for test, cpu in account.by_test.items():
        by_file[test.split("::")[0]] += cpu
    figures = {"wall_s": round(done.wall_s, 1), "cpu_s": round(done.cpu_s, 1),
               "steal_s": round(done.steal_s, 1), "budget_s": BUDGET_S,
               "wall_over_budget": round(done.wall_s / BUDGET_S, 3),
               "exit_code": done.code, "tests_run": len(done.timeline),
               "attributed_cpu_s": round(sum(account.by_test.values()), 1),
               "unattributed_cpu_s": round(account.unattributed, 1)}
    tables = {"by_file": [{**row, "tests": tests_in[row["name"]]}
                          for row in table(by_file, top)],
              "by_kind": table(account.by_kind, len(account.by_kind)),
              "by_test": table(account.by_test, top)}
    return figures, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, default=None,
                        help="the suite's console (default: a temporary file, path printed)")
    parser.add_argument("--top", type=int, default=25, help="rows of each table")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-suite-"))
    log_path = args.log or work / "suite.log"
    run = [sys.executable, *readme_test_command()[1:], "-p", "benchmarks.suite_timeline"]
    total = count_tests()
    print(f"[bench_suite] {shlex.join(run)}  ({total} tests; console: {log_path})", flush=True)
    done = run_suite(run, log_path, work / "timeline.jsonl", total)
    figures, tables = report(done, args.top)

    print(f"[bench_suite] {log_path.read_text().strip().splitlines()[-1]}")
    print(f"[bench_suite] wall {figures['wall_s']} s = {figures['wall_over_budget']} x the "
          f"{BUDGET_S:.0f} s budget; CPU {figures['cpu_s']} s (steal {figures['steal_s']} s)")
    for title, key in (("test file", "by_file"), ("kind of process", "by_kind")):
        print(f"[bench_suite] CPU seconds by {title}:")
        for row in tables[key][:args.top]:
            print(f"  {row['cpu_s']:8.1f}  {row['name']}")
    write_results("bench_suite", figures, {"args": {"command": shlex.join(run)}, **tables},
                  directory=args.results_dir)
    print(json.dumps(figures))
    sys.exit(done.code)


if __name__ == "__main__":
    main()
