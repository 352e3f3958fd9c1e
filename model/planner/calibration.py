"""Calibration of the time model from measured steps.

Each measured plan gives (predicted compute seconds, predicted comm seconds, measured
seconds). Two non-negative scales are fitted by least squares,
``measured ~= compute_scale * compute + comm_scale * comm``, and stored as JSON that later
searches read (``load_calibration``). With fewer than two distinct points a single
measured/predicted ratio scales both. Each scale is also pulled toward that single ratio
with the weight of a tenth of a plan (``PRIOR_WEIGHT``): a few plans that barely
communicate leave comm_scale almost undetermined, and without the pull one such fit could
multiply a comm-heavy plan's prediction several times.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.atomic import write_json_atomic

PRIOR_WEIGHT = 0.1
"""How many plans' worth of evidence pulls each scale toward the single measured/predicted
ratio: a tenth of a plan moves two well-determined scales by about 1 %."""


def fit_scales(points: list[dict[str, float]]) -> dict[str, float]:
    """Fit compute_scale and comm_scale (>= 0.05) to points with compute_s, comm_s, measured_s."""
    pts = [p for p in points if p.get("measured_s") and p["compute_s"] + p["comm_s"] > 0]
    if not pts:
        return {"compute_scale": 1.0, "comm_scale": 1.0}
    a = np.array([[p["compute_s"], p["comm_s"]] for p in pts], dtype=float)
    y = np.array([p["measured_s"] for p in pts], dtype=float)
    ratio = float(np.median(y / a.sum(axis=1)))
    single = {"compute_scale": ratio, "comm_scale": ratio}
    if len(pts) < 2 or np.linalg.matrix_rank(a) < 2:
        return single
    # relative least squares: every plan counts the same whatever its step time; two prior
    # rows ask each scale to equal the single ratio
    w = 1.0 / y
    prior = PRIOR_WEIGHT * np.eye(2) / ratio
    rows = np.vstack([a * w[:, None], prior])
    target = np.concatenate([y * w, [PRIOR_WEIGHT, PRIOR_WEIGHT]])
    sol, *_ = np.linalg.lstsq(rows, target, rcond=None)
    if (sol <= 0.05).any():  # fall back to one ratio rather than a degenerate fit
        return single
    return {"compute_scale": float(sol[0]), "comm_scale": float(sol[1])}


def load_calibration(path: str | Path | None) -> dict[str, Any] | None:
    """The stored calibration (with its points), or None when there is none yet."""
    if path is None or not Path(path).exists():
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"calibration file {path} is unreadable ({exc}); delete it to start over")
    if not {"compute_scale", "comm_scale"} <= set(data):
        raise ValueError(f"calibration file {path} lacks compute_scale/comm_scale; delete it")
    return data


def update_calibration(path: str | Path, new_points: list[dict[str, Any]],
                       keep: int = 64) -> dict[str, Any]:
    """Append measured points, refit the scales and write the JSON atomically."""
    path = Path(path)
    old = load_calibration(path) or {"points": []}
    points = (old.get("points", []) + new_points)[-keep:]
    data = {**fit_scales(points), "points": points}
    for p in points:
        p["ratio"] = p["measured_s"] / max(p["compute_s"] + p["comm_s"], 1e-12)
    write_json_atomic(path, data)
    return data
