"""``tests.warm_cli``: a command line forked from the driver zygote behaves as ``python -m``
started by ``subprocess`` does (the standard library's ``timeit`` as the program)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests import warm_cli


def timeit_argv(statement: str) -> list[str]:
    return ["-n", "1", "-r", "1", statement]


def test_it_runs_the_module_with_the_requests_directory_environment_and_argv(tmp_path: Path):
    probe = ("import os, sys; print('probe', os.getcwd(), os.environ['WARM_PROBE'], "
             "sys.argv[0], file=sys.stderr)")
    proc = warm_cli.run("timeit", timeit_argv(probe), cwd=tmp_path,
                        env=dict(os.environ, WARM_PROBE="set-by-the-test"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "1 loop" in proc.stdout
    words = proc.stderr.split("probe ", 1)[1].split()
    assert words[:2] == [str(tmp_path), "set-by-the-test"]
    assert words[2].endswith("timeit.py")  # as ``python -m timeit`` sets it


def test_exit_codes_are_the_interpreters():
    refused = warm_cli.run("timeit", ["--no-such-option"], timeout=60)
    assert refused.returncode == 2 and "option --no-such-option not recognized" in refused.stdout
    failed = warm_cli.run("timeit", timeit_argv("1 / 0"), timeout=60)
    assert failed.returncode == 1 and "ZeroDivisionError" in failed.stderr


def test_a_signalled_process_in_its_own_session_and_its_merged_output_file(tmp_path: Path):
    log = tmp_path / "console.txt"
    with open(log, "w") as out:
        proc = warm_cli.WarmProcess(
            "timeit", timeit_argv("import sys, time; print('asleep', flush=True); "
                                  "print('on stderr', file=sys.stderr, flush=True); "
                                  "time.sleep(60)"),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while "on stderr" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.getsid(proc.pid) == proc.pid and proc.poll() is None
    assert "-m timeit -n 1" in " ".join(psutil.Process(proc.pid).cmdline())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    assert log.read_text().splitlines()[:2] == ["asleep", "on stderr"]


def test_run_past_its_timeout_kills_the_process_and_keeps_what_it_printed():
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        warm_cli.run("timeit", timeit_argv("import time; print('started', flush=True); "
                                           "time.sleep(60)"), timeout=3)
    assert expired.value.stdout == "started\n"
