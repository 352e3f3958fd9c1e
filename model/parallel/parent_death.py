"""A child process that dies with its parent (Linux ``PR_SET_PDEATHSIG``).

Ranks die with their launcher, the launcher's forked peers with rank 0, the rehearsal's
rank processes with the rank server and the server with the stage that started it: none
outlives a killed parent (``kill -9`` of a driver included).
"""
from __future__ import annotations

import os
import signal
import sys


def arm_parent_death_signal() -> None:
    """SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``; kept across
    exec; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies; exit at once when the parent
    died before the signal was armed."""
    parent = os.getppid()
    arm_parent_death_signal()
    if os.getppid() != parent:
        os._exit(1)
