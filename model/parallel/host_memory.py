"""Host memory of a CPU rank: keep what a training step frees for the next step.

glibc serves a large allocation with a fresh ``mmap`` and unmaps it when it is freed, and it
trims the heap's free top back to the kernel; a CPU rank's activations, logits and gradients
are such allocations, so a step can fault their pages in (and zero them) again, a cost that
grows with the micro-batch's bytes and that the time model does not price. Measured by
``benchmarks/bench_host_memory.py`` (the tiny preset's micro-batches 8, 4 and 2, taking turns
step by step): with glibc's default, micro-batch 8 on 2 ranks took 5 % longer (median; 7 % at
the 10th percentile) and came out slower than 4, against the time model's order; with freed
memory kept the three came in the model's order on 1 and 2 ranks. Raising both thresholds
keeps the freed memory in the process: a rank's resident memory stays at its peak, which is
what the memory model prices anyway.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

RETAIN_VAR = "FRONTIER_LLM_RETAIN_FREED_MEMORY"
"""Set to 0 to let ranks return freed memory to the kernel (glibc's default), e.g. to compare
(``benchmarks/bench_host_memory.py``) or where the memory a rank keeps is wanted elsewhere."""

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 2**31 - 1
"""The largest value mallopt takes (an int): allocations up to 2 GiB come from the heap,
and up to 2 GiB of free heap top stays mapped."""


def retain_freed_memory() -> bool:
    """Stop glibc from returning freed memory to the kernel (this process, from now on).

    Returns whether it took effect (False with RETAIN_VAR=0 or on a C library without
    glibc's ``mallopt``)."""
    if os.environ.get(RETAIN_VAR, "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                      KEEP_BYTES))
