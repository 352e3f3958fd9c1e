"""A process's own peak resident memory, for the benchmarks and tests that measure one in a
fresh child.

``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is not it: Linux folds the parent's peak into
a child's across fork + exec (a child of a pytest worker that grew to 1.5 GB starts at
1.5 GB), so it depends on what the worker ran before. ``VmHWM`` is the peak of this
process's own address space.
"""
from __future__ import annotations


def own_peak_rss_bytes() -> int:
    """This process's peak RSS since its exec (``VmHWM`` of /proc/self/status), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")
