"""A rank worker for the killed-rank test: every rank joins a gloo group and all-reduces;
rank ``spec.extra["victim"]`` is killed by SIGKILL (as the OOM killer would) before its
second collective, which its peers are then stuck in. With ``spec.extra["sleep_s"]`` every
rank first sleeps that long after the first collective (a launch to signal while it runs)."""
from __future__ import annotations

import os
import signal
import sys
import time

from stages.mechanism.launch import RankSpec, rank_main


def run(spec: RankSpec) -> None:
    """All-reduce twice; the victim dies by SIGKILL in between."""
    import torch
    import torch.distributed as dist

    from model.parallel.dist_env import from_environ, start_process_group

    env = from_environ()
    start_process_group(env, "gloo")
    dist.all_reduce(torch.ones(4))
    time.sleep(spec.extra.get("sleep_s", 0))
    if env.rank == spec.extra["victim"]:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4))  # the peers fail here: their peer is gone


if __name__ == "__main__":
    sys.exit(rank_main("killed-rank test worker", run))
