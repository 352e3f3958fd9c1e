"""Threads per rank: the one home of the rule every launcher and rank follows.

On a CPU box the ranks share the cores, so each rank runs one thread (more only oversubscribe
the cores); a GPU rank gets the cores a site gives it (``workflows.ranks.rank_cores``).
Imports nothing heavy: launchers set it before torch starts its thread pool.
"""
from __future__ import annotations

import os

THREADS_VAR = "OMP_NUM_THREADS"
CPU_RANK_THREADS = 1


def rank_threads_env(threads: int = CPU_RANK_THREADS) -> dict[str, str]:
    """The variable a launcher exports to its ranks."""
    return {THREADS_VAR: str(threads)}


def default_rank_threads() -> int:
    """Set this process's thread count unless its launcher did; return it."""
    os.environ.setdefault(THREADS_VAR, str(CPU_RANK_THREADS))
    return int(os.environ[THREADS_VAR])
