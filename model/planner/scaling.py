"""The arithmetic of scaling studies: device ladders, the batch at each point, efficiency
and which step-time term explains it. Imports no torch (the planner's rule).

Weak scaling keeps the sequences per device of the configuration (its global batch over
its rank count), so the global batch grows with the devices and, for a fixed layout
family, with the data-parallel degree; strong scaling keeps the global batch.

Efficiency at ``n`` devices against the smallest point ``n0`` is the throughput per device
relative to it, ``(tokens_per_s(n) / n) / (tokens_per_s(n0) / n0)``: for weak scaling that
is ``step_time(n0) / step_time(n)``, for strong scaling ``step_time(n0) n0 / (step_time(n)
n)``, the usual definitions.

Why efficiency falls is read from the planner's step-time breakdown
(``model.planner.search.explain``): each term in device-seconds per token, compared with
the smallest point; the term that grew most is the loss term.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

MODES = ("weak", "strong")
FRONTIER_NODES = 9408
"""Frontier's compute nodes (OLCF Frontier User Guide): 9,408 x 8 GCDs = 75,264 ranks."""
FRONTIER_RANKS_PER_NODE = 8
USEFUL_TERMS = ("compute_gemm", "compute_attention", "compute_elementwise", "compute_logits")
"""Breakdown terms that are the model's own work; every other term is an overhead
(recompute, bubble, exposed communication, host overhead, optimizer, core sharing)."""


class ScalingError(ValueError):
    """A scaling study that cannot be formed; the message says what to change."""


def parse_devices(text: str) -> list[int]:
    """``"1,2,4,8"`` -> [1, 2, 4, 8] (sorted, distinct); anything else is a ScalingError."""
    try:
        values = sorted({int(item) for item in text.split(",") if item.strip()})
    except ValueError:
        raise ScalingError(f"--devices {text!r}: give device counts as integers separated "
                           "by commas, e.g. 1,2,4,8") from None
    if not values or values[0] < 1:
        raise ScalingError(f"--devices {text!r}: give one or more device counts >= 1")
    return values


def frontier_ladder(first: int = FRONTIER_RANKS_PER_NODE,
                    nodes: int = FRONTIER_NODES,
                    ranks_per_node: int = FRONTIER_RANKS_PER_NODE) -> list[int]:
    """Device counts from ``first`` doubling up to the whole machine, which ends the ladder:
    8, 16, ..., 65,536, 75,264 GCDs on Frontier."""
    whole = nodes * ranks_per_node
    ladder = [first * 2 ** k for k in range(64) if first * 2 ** k < whole]
    return ladder + [whole]


def point_batch(mode: str, global_batch: int, base_devices: int, devices: int) -> int:
    """The global batch (sequences) of the point with ``devices`` ranks.

    weak: ``global_batch * devices / base_devices`` (the configuration's sequences per
    device kept); strong: ``global_batch``."""
    if mode not in MODES:
        raise ScalingError(f"--mode {mode!r}: use one of {list(MODES)}")
    if mode == "strong":
        return global_batch
    scaled = global_batch * devices
    if scaled % base_devices:
        raise ScalingError(
            f"weak scaling keeps train.global_batch={global_batch} per {base_devices} ranks "
            f"(parallel.nproc), which is no whole batch on {devices} devices: choose a "
            f"global batch that is a multiple of {base_devices // math.gcd(base_devices, devices)}"
            f" or other device counts")
    return scaled // base_devices


def efficiencies(
    devices: Sequence[int], tokens_per_s: Sequence[float | None]
) -> list[float | None]:
    """Per point, throughput per device over the first point's that has a value (None where a
    point has none; 1.0 at that first point)."""
    base = next(((n, t) for n, t in zip(devices, tokens_per_s) if t), None)
    if base is None:
        return [None] * len(devices)
    n0, t0 = base
    return [None if not t else (t / n) / (t0 / n0) for n, t in zip(devices, tokens_per_s)]


def dominant(terms: dict[str, float], overheads_only: bool = False) -> tuple[str, float]:
    """The largest step-time term and its fraction of the step (``overheads_only``: the
    largest term that is not the model's own work, USEFUL_TERMS)."""
    total = sum(terms.values())
    pool = {k: v for k, v in terms.items() if not (overheads_only and k in USEFUL_TERMS)}
    if not pool or total <= 0:
        return "", 0.0
    name = max(pool, key=lambda k: pool[k])
    return name, pool[name] / total


def per_token(terms: dict[str, float], devices: int, tokens_per_step: float) -> dict[str, float]:
    """Step-time terms as device-seconds per token (what efficiency compares)."""
    return {k: v * devices / tokens_per_step for k, v in terms.items()}


def loss_term(terms: dict[str, float], devices: int, tokens_per_step: float,
              base_terms: dict[str, float], base_devices: int,
              base_tokens_per_step: float) -> tuple[str, float]:
    """The term whose device-seconds per token grew most from the base point, and its share
    of the whole growth (positive when efficiency fell; ``("", 0.0)`` when nothing grew)."""
    now = per_token(terms, devices, tokens_per_step)
    then = per_token(base_terms, base_devices, base_tokens_per_step)
    growth = {k: now.get(k, 0.0) - then.get(k, 0.0) for k in set(now) | set(then)}
    total = sum(growth.values())
    name = max(growth, key=lambda k: growth[k], default="")
    if not name or growth[name] <= 0 or total <= 0:
        return "", 0.0
    return name, growth[name] / total

