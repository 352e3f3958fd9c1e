"""A pytest plugin for ``benchmarks/bench_suite.py``: when each test ran, and on which worker.

Loaded with ``-p benchmarks.suite_timeline``; with ``SUITE_TIMELINE`` set to a path, every
process of the run (each pytest-xdist worker) appends one JSON line per test to it:
``{"test": nodeid, "pid": the worker's pid, "start": s, "end": s}``, the times on the
kernel's boot clock (``CLOCK_BOOTTIME``), the clock ``/proc/<pid>/stat`` gives a process's
start on. Without the variable it records nothing.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Generator

import pytest

TIMELINE_VAR = "SUITE_TIMELINE"


def boot_seconds() -> float:
    """Seconds since boot on the clock of ``/proc/<pid>/stat``'s start times."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, None, None]:
    """Time the test's setup, call and teardown together."""
    path = os.environ.get(TIMELINE_VAR)
    start = boot_seconds()
    yield
    if path:
        line = {"test": item.nodeid, "pid": os.getpid(), "start": start,
                "end": boot_seconds()}
        with open(path, "a") as timeline:  # one short append per test: lines stay whole
            timeline.write(json.dumps(line) + "\n")
