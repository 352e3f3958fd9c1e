"""benchmarks/bench_suite.py charges each process's CPU to the test that caused it, and its
pytest plugin records when each test ran on which worker."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_suite import Process, attribute, kind_of, readme_test_command  # noqa: E402

WORKER, OTHER_WORKER = 100, 200
TIMELINE = [
    {"test": "tests/test_a.py::first", "pid": WORKER, "start": 10.0, "end": 20.0},
    {"test": "tests/test_a.py::second", "pid": WORKER, "start": 20.5, "end": 30.0},
    {"test": "tests/test_slurm_x.py::lane", "pid": OTHER_WORKER, "start": 10.0, "end": 40.0},
]


def test_cpu_goes_to_the_test_running_on_the_worker_a_process_descends_from() -> None:
    worker = Process(WORKER, 1, 5.0, "python -u -c import sys;exec(eval(sys.stdin.readline()))",
                     [(9.0, 4.0), (15.0, 5.0), (25.0, 5.5)])
    zygote = Process(101, WORKER, 12.0, "python -c from tests.rank_zygote import serve",
                     [(13.0, 2.0), (22.0, 2.25)])
    forked_rank = Process(102, 101, 22.0, "python -c from tests.rank_zygote import serve",
                          [(23.0, 0.5), (24.0, 1.5)])
    srun_rank = Process(300, 1, 14.0, "python3.11 -m stages.train.worker --spec s.json",
                        [(15.0, 3.0)])
    reused_pid = Process(101, 1, 50.0, "sleep 1", [(51.0, 0.125)])  # no worker, no test then
    account = attribute([worker, zygote, forked_rank, srun_rank, reused_pid], TIMELINE,
                        since=9.0)

    # The worker's CPU before the run is not counted; 1.0 in the first test, 0.5 in the
    # second. The zygote (2.0 in the first, 0.25 in the second) and the rank it forked
    # (1.5 in the second) are the worker's; the srun rank is the Slurm test's.
    assert account.by_test == {"tests/test_a.py::first": 3.0, "tests/test_a.py::second": 2.25,
                               "tests/test_slurm_x.py::lane": 3.0}
    assert account.unattributed == 0.125
    assert account.by_kind == {"pytest worker": 1.5, "rank zygote and the ranks it forks": 3.75,
                               "training rank": 3.0, "other": 0.125}


def test_cpu_between_a_workers_tests_is_unattributed() -> None:
    gap = Process(WORKER, 1, 5.0, "python -u -c import sys;exec(eval(sys.stdin.readline()))",
                  [(9.0, 1.0), (20.25, 3.0)])  # between the first test's end and the second's
    account = attribute([gap], TIMELINE, since=9.0)
    assert account.by_test == {} and account.unattributed == 2.0


def test_kinds_and_the_readme_command() -> None:
    assert kind_of("python -m workflows.pipeline --config micro") == "pipeline driver"
    assert kind_of("python3.11 /venv/bin/interchange.py") == "Parsl interchange"
    assert kind_of("/usr/sbin/slurmd -D") == "Slurm daemons"
    assert kind_of("/bin/bash -c true") == "other"
    command = readme_test_command()
    assert command[:3] == ["python", "-m", "pytest"] and "-n" in command


def test_the_plugin_records_each_test_with_its_worker_and_boot_clock(tmp_path: Path) -> None:
    (tmp_path / "test_two.py").write_text("def test_one():\n    pass\n\n"
                                          "def test_two():\n    pass\n")
    timeline = tmp_path / "timeline.jsonl"
    with open("/proc/uptime") as uptime:
        before = float(uptime.read().split()[0])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.suite_timeline",
         "-p", "no:cacheprovider", str(tmp_path / "test_two.py")],
        cwd=REPO, env=dict(os.environ, SUITE_TIMELINE=str(timeline)), capture_output=True,
        text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(line) for line in timeline.read_text().splitlines()]
    assert [line["test"].split("::")[1] for line in lines] == ["test_one", "test_two"]
    assert len({line["pid"] for line in lines}) == 1 and lines[0]["pid"] != os.getpid()
    for line in lines:  # the boot clock /proc/uptime counts on, within the run
        assert before - 1 <= line["start"] <= line["end"] <= before + 120
