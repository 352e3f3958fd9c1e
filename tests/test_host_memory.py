"""A CPU rank keeps the memory a step frees (model.parallel.host_memory)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from model.parallel.host_memory import RETAIN_VAR

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, os, sys
sys.path.insert(0, {root!r})
from model.parallel.host_memory import retain_freed_memory
took = retain_freed_memory() if sys.argv[1] == "retain" else None
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * page
before = rss()
block = b"x" * (256 << 20)  # written, so its pages are resident
during = rss()
del block
print(json.dumps({{"took": took, "grew": during - before, "kept": rss() - before}}))
"""


def _child(mode: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), mode],
                         capture_output=True, text=True, check=True, env={**os.environ, **env})
    return json.loads(out.stdout)


def test_freed_memory_stays_with_the_process_only_when_retained() -> None:
    default, retained = _child("default"), _child("retain", **{RETAIN_VAR: "1"})
    declined = _child("retain", **{RETAIN_VAR: "0"})
    mib = 1 << 20
    assert default["grew"] > 250 * mib and retained["grew"] > 250 * mib
    # glibc unmaps a freed 256 MiB block at once ...
    assert default["kept"] < 16 * mib, default
    # ... unless told to keep it: the next step's tensors reuse the pages without faulting
    assert retained["took"] is True
    assert retained["kept"] > 250 * mib, retained
    # ... and the switch to compare against glibc's default
    assert declined["took"] is False
    assert declined["kept"] < 16 * mib, declined
