"""Interruptions a training should expect, and the checkpoint interval that loses least to them.

A node of the allocation fails at ``rate`` failures per node-hour, independently of the
others, so the allocation of ``nodes`` nodes fails once every ``MTBF = 1 / (rate x nodes)``
hours, and a training of ``T`` hours expects ``T x rate x nodes`` interruptions.

Each interruption loses the work since the last checkpoint (on average half the interval
``tau``) and the restart (start-up and reading the checkpoint back); each checkpoint costs
its save time ``C`` (written synchronously, the trainer's default). The lost time

    failures x (tau / 2 + restart) + (T / tau) x C

is least at Young's interval ``tau = sqrt(2 x C x MTBF)`` (J. W. Young, "A first order
approximation to the optimum checkpoint interval", CACM 17(9), 1974; J. T. Daly, "A higher
order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006).
In node-hours it is multiplied by the allocation's nodes.

The default rate is Meta's Llama 3 405B pre-training (Llama Team, "The Llama 3 Herd of
Models", 2024, section 3.3.4): 419 unexpected interruptions in a 54-day snapshot on 16,384
H100 GPUs in hosts of 8, i.e. 419 / (54 x 24 h x 2,048 hosts) = 1.58e-4 per node-hour (one
interruption every 3.1 h for the whole job; a node's MTBF 6,335 h). A Frontier node (4
MI250X, 8 GCDs) is taken as one such host. No torch: arithmetic on the cluster file's figures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
LLAMA3_GPUS_PER_NODE = 8
DEFAULT_FAILURES_PER_NODE_HOUR = LLAMA3_INTERRUPTIONS / (
    LLAMA3_DAYS * 24 * LLAMA3_GPUS / LLAMA3_GPUS_PER_NODE)
"""Failures per node-hour when the site gives none: Llama 3 405B's, 1.579e-4."""
RATE_SOURCE = "Llama 3 405B: 419 interruptions in 54 days on 2,048 nodes of 8 GPUs"
"""Where the default rate comes from, as the readiness report names it."""
RESTART_STARTUP_S = 300.0
"""Seconds of an allocation a restart spends before it reads the checkpoint: the ranks'
start-up (imports, process groups, building the model) at scale. An assumption, not a
measurement; it adds the same to every interval's lost work and so moves none of them."""


def allocation_mtbf_s(rate_per_node_hour: float, nodes: int) -> float:
    """Seconds between failures of an allocation of ``nodes`` nodes: 3600 / (rate x nodes)."""
    return 3600.0 / (rate_per_node_hour * nodes)


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that loses least work, sqrt(2 x save_s x mtbf_s) seconds."""
    return math.sqrt(2.0 * save_s * mtbf_s)


@dataclass(frozen=True)
class LostWork:
    """What failures and checkpoints cost one training at one checkpoint interval."""

    interval_s: float
    """Seconds of training between checkpoints."""
    failures: float
    """Expected interruptions over the training."""
    per_failure_s: float
    """Seconds lost to each: interval / 2 + restart."""
    saves: float
    """Checkpoints written: training seconds / interval."""
    save_overhead_s: float
    """Seconds spent writing them: saves x save time."""
    lost_s: float
    """failures x per_failure_s + save_overhead_s: the allocation's seconds not training."""
    node_hours: float
    """lost_s x nodes / 3600."""


def lost_work(*, interval_s: float, run_s: float, save_s: float, restart_s: float,
              rate_per_node_hour: float, nodes: int) -> LostWork:
    """The expected cost of a training of ``run_s`` seconds on ``nodes`` nodes, checkpointed
    every ``interval_s`` seconds (see the module docstring)."""
    failures = rate_per_node_hour * nodes * run_s / 3600.0
    per_failure = interval_s / 2.0 + restart_s
    saves = run_s / interval_s
    overhead = saves * save_s
    lost = failures * per_failure + overhead
    return LostWork(interval_s=interval_s, failures=failures, per_failure_s=per_failure,
                    saves=saves, save_overhead_s=overhead, lost_s=lost,
                    node_hours=lost * nodes / 3600.0)


@dataclass(frozen=True)
class Interruptions:
    """The failure figures of one training's allocation."""

    rate_per_node_hour: float
    nodes: int
    rate_source: str
    """Where the rate comes from: the setting that gave it, or ``RATE_SOURCE``."""
    save_s: float | None
    """Seconds to write one checkpoint; None when the cluster file cannot tell."""
    unknown_save: str = ""
    """Why ``save_s`` is None, with the fix."""

    @property
    def mtbf_s(self) -> float:
        """Seconds between failures of the whole allocation."""
        return allocation_mtbf_s(self.rate_per_node_hour, self.nodes)

    @property
    def restart_s(self) -> float:
        """Seconds a restart costs: start-up, then the checkpoint read back (taken at its
        write speed)."""
        return RESTART_STARTUP_S + (self.save_s or 0.0)

    @property
    def best_interval_s(self) -> float | None:
        """Young/Daly's interval, or None when the save time is unknown."""
        if self.save_s is None:
            return None
        return young_daly_interval_s(self.save_s, self.mtbf_s)

    def lost(self, interval_s: float, run_s: float) -> LostWork:
        """``lost_work`` at ``interval_s`` over ``run_s`` seconds of training (a save time
        of 0 where it is unknown)."""
        return lost_work(interval_s=interval_s, run_s=run_s, save_s=self.save_s or 0.0,
                         restart_s=self.restart_s, rate_per_node_hour=self.rate_per_node_hour,
                         nodes=self.nodes)


def interruptions(model_cfg: Any, nodes: int, cluster_name: str,
                  rate_per_node_hour: float | None = None,
                  rate_setting: str = "site.failures_per_node_hour") -> Interruptions:
    """The failure figures of a training of ``model_cfg`` on ``nodes`` nodes of the cluster
    ``cluster_name``: the save time from its file's write bandwidth
    (``run_cost.checkpoint_seconds``), the rate ``rate_per_node_hour`` (None: Llama 3's)."""
    from model.flops import GPTParams
    from model.planner.cluster import ClusterError, load_cluster
    from model.planner.run_cost import checkpoint_seconds

    if rate_per_node_hour is None:
        rate, source = DEFAULT_FAILURES_PER_NODE_HOUR, RATE_SOURCE
    else:
        rate, source = rate_per_node_hour, f"{rate_setting}={rate_per_node_hour:g}"
    try:
        cluster = load_cluster(cluster_name)
    except ClusterError:  # measured at plan time: its file gives no write bandwidth
        return Interruptions(rate, nodes, source, None,
                             f"parallel.cluster={cluster_name} is measured at plan time and "
                             "gives no file-system write bandwidth")
    save = checkpoint_seconds(GPTParams.from_config(model_cfg).total(), nodes, cluster)
    why = "" if save is not None else (
        f"parallel.cluster={cluster_name} gives no node_write_gbps (the cluster file's "
        "checkpoint write bandwidth)")
    return Interruptions(rate, nodes, source, save, why)


def config_interruptions(cfg: Any) -> Interruptions:
    """``interruptions`` of a pipeline config's training: ``model``, ``parallel.nodes``,
    ``parallel.cluster`` and ``site.failures_per_node_hour`` (None: Llama 3's rate)."""
    return interruptions(cfg.model, cfg.parallel.nodes, cfg.parallel.cluster,
                         cfg.site.failures_per_node_hour)


def auto_checkpoint_minutes(figures: Interruptions) -> float:
    """``train.checkpoint_minutes: auto`` resolved: Young/Daly's interval in minutes.
    ValueError naming the fix when the save time is unknown."""
    best = figures.best_interval_s
    if best is None:
        raise ValueError(f"train.checkpoint_minutes=auto needs a checkpoint's save time, but "
                         f"{figures.unknown_save}: set node_write_gbps in the cluster file, or "
                         "give train.checkpoint_minutes in minutes")
    return best / 60.0


def describe_auto(minutes: float, figures: Interruptions) -> str:
    """One line saying what ``auto`` resolved to and from what."""
    return (f"train.checkpoint_minutes=auto -> {minutes:.3g} min (Young/Daly: save "
            f"{figures.save_s:.3g} s, allocation MTBF {figures.mtbf_s / 3600:,.1f} h at "
            f"{figures.rate_per_node_hour:.3g} failures per node-hour x {figures.nodes} "
            f"node(s); {figures.rate_source})")


__all__ = ["DEFAULT_FAILURES_PER_NODE_HOUR", "Interruptions", "LostWork", "RATE_SOURCE",
           "RESTART_STARTUP_S", "allocation_mtbf_s", "auto_checkpoint_minutes",
           "config_interruptions", "describe_auto", "interruptions", "lost_work",
           "young_daly_interval_s"]
