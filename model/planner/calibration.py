"""Calibration of the time model from measured steps, used only where it predicts better.

Each measured plan gives a point (predicted compute seconds ``compute_s``, predicted
communication seconds ``comm_s``, measured seconds ``measured_s``). Two calibrated models are
tried besides the raw one (both scales 1):

- ``ratio``: one factor r on the whole prediction, ``measured ~= r (compute + comm)``, fitted
  as the mean log of measured/predicted;
- ``two_scales``: ``measured ~= compute_scale * compute + comm_scale * comm``, fitted by
  relative least squares (every plan counts the same whatever its step time).

**Shrinkage.** A factor f fitted with standard error se keeps only the part of its departure
from 1 that stands out of its own noise: ``f' = 1 + (f - 1) * max(0, 1 - se**2 / (f - 1)**2)``
(positive-part James-Stein for one coordinate: (f - 1)**2 - se**2 estimates the squared true
departure, so a departure within one standard error is dropped entirely, one of two standard
errors keeps 3/4 of itself, one of three 8/9). se is the spread of the points about the fit:
for the ratio sd(log ratios) / sqrt(n), fitted in logs and shrunk there; for the two scales
the least-squares covariance ``s**2 (X'X)^-1`` with ``s**2 = RSS / (n - 2)``. The two scales
are shrunk as a common factor (toward 1) and what communication needs beyond it (toward 0),
the common factor refitted after the second is shrunk (``fit_two_scales``): compute and comm
seconds move together across plans, so the two scales are far less determined than their
sum. The extra's se is the larger of the least-squares one and its largest change when one
point is left out and the rest refitted: one outlying plan that alone has much
communication fits the extra exactly, and only leaving it out shows that the extra is that
one plan (measured here: a tp4 plan on 4 ranks sharing 2 cores, 2.2x its prediction, gave
comm_scale 8.4, and the zero2 plan it was then applied to came out 5.5x too slow). So
measurements that scatter around the raw model give factors of exactly or nearly 1, a few
plans that barely communicate leave comm_scale at the common factor (its extra's se is
huge), and a bias well above the noise is kept.

**Selection.** ``calibrate`` computes each model's leave-one-out error (every point predicted
by the model fitted, shrinkage included, on the others; the mean absolute relative error) and
keeps the calibrated model with the lower error only when it is lower than the raw model's;
otherwise the raw model (scales 1) is kept. Fewer than 3 points give nothing to validate on:
raw. So calibration never makes held-out predictions worse on the data it has seen.

The result is stored as JSON that later searches read (``load_calibration``); the time model
reads ``compute_scale`` and ``comm_scale`` and ignores the rest.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.atomic import write_json_atomic

MIN_POINTS = 3
"""Fewest points calibration uses: below this nothing is held out to check a fit against."""
MIN_SCALE = 0.05
MODELS = ("ratio", "two_scales")
RAW = {"compute_scale": 1.0, "comm_scale": 1.0}


def shrink(factor: float, se: float, toward: float = 1.0) -> float:
    """``factor`` pulled toward ``toward`` (1) by its standard error ``se`` (the module's rule)."""
    d = factor - toward
    if not np.isfinite(se):
        return toward
    if d == 0.0:
        return factor
    return toward + d * max(0.0, 1.0 - (se / d) ** 2)


def _usable(points: list[dict[str, float]]) -> list[dict[str, float]]:
    return [p for p in points if p.get("measured_s") and p["measured_s"] > 0
            and p["compute_s"] + p["comm_s"] > 0]


def fit_ratio(points: list[dict[str, float]]) -> dict[str, float]:
    """One factor on the whole prediction, fitted in logs and shrunk toward 1 by its se."""
    pts = _usable(points)
    if len(pts) < 2:
        return {**RAW, "ratio_se": float("inf")}
    logs = np.log([p["measured_s"] / (p["compute_s"] + p["comm_s"]) for p in pts])
    mean, se = float(logs.mean()), float(logs.std(ddof=1) / np.sqrt(len(logs)))
    r = float(np.exp(shrink(1.0 + mean, se) - 1.0))
    return {"compute_scale": r, "comm_scale": r, "ratio_unshrunk": float(np.exp(mean)),
            "ratio_se": se}


def least_squares_scales(points: list[dict[str, float]]) -> tuple[np.ndarray, np.ndarray] | None:
    """(compute_scale, comm_scale) by relative least squares and their covariance; None when
    the two are not determined (fewer than 3 points, or no spread in the comm share)."""
    pts = _usable(points)
    if len(pts) < 3:
        return None
    a = np.array([[p["compute_s"], p["comm_s"]] for p in pts], dtype=float)
    y = np.array([p["measured_s"] for p in pts], dtype=float)
    x = a / y[:, None]
    if np.linalg.matrix_rank(x) < 2:
        return None
    sol, *_ = np.linalg.lstsq(x, np.ones(len(y)), rcond=None)
    rss = float(((x @ sol - 1.0) ** 2).sum())
    try:
        cov = rss / (len(y) - 2) * np.linalg.inv(x.T @ x)
    except np.linalg.LinAlgError:
        return None
    return sol, cov


def _largest_influence(pts: list[dict[str, float]]) -> float:
    """How far the communication extra (comm_scale - compute_scale) moves, at most, when one
    point is left out and the rest refitted (DFBETA); inf when leaving one out leaves it
    undetermined. Used as a floor on the extra's standard error: where one plan alone carries
    the extra (the only one with much communication, and an outlier), the least-squares se
    sees a near-exact fit, while leaving that plan out moves the extra by about its whole
    size, so it is shrunk away."""
    extras = []
    for i in range(len(pts)):
        fit = least_squares_scales(pts[:i] + pts[i + 1:])
        if fit is None:
            return float("inf")
        extras.append(float(fit[0][1] - fit[0][0]))
    full = least_squares_scales(pts)
    assert full is not None  # the caller fitted these points
    delta = float(full[0][1] - full[0][0])
    return max(abs(e - delta) for e in extras)


def fit_two_scales(points: list[dict[str, float]]) -> dict[str, float]:
    """compute_scale and comm_scale, shrunk in two steps that keep the fit consistent.

    Written as ``measured ~= c (compute + comm) + delta comm`` (``comm_scale = c + delta``):
    first ``delta``, what communication needs beyond the common factor, from the plain fit
    with its standard error, shrunk toward 0; then ``c`` refitted given the shrunk delta and
    shrunk toward 1 by its own standard error. (Shrinking the two scales one by one would
    break the fit: compute and comm seconds move together across plans, so a well-fitting
    pair can have two large errors.) Undetermined scales (fewer than 3 points, no spread in
    the comm share) give the raw model; a scale under MIN_SCALE is not physical and gives the
    shrunk ratio alone."""
    fit = least_squares_scales(points)
    if fit is None:
        return {**RAW, "comm_extra_se": float("inf")}
    sol, cov = fit
    pts = _usable(points)
    delta = float(sol[1] - sol[0])
    delta_se = max(float(np.sqrt(max(cov[0, 0] + cov[1, 1] - 2 * cov[0, 1], 0.0))),
                   _largest_influence(pts))
    delta_s = shrink(delta, delta_se, toward=0.0)
    tot = np.array([(p["compute_s"] + p["comm_s"]) / p["measured_s"] for p in pts])
    extra = np.array([delta_s * p["comm_s"] / p["measured_s"] for p in pts])
    # relative least squares of c given delta: minimise sum (c tot + extra - 1)^2
    c = float(((1 - extra) * tot).sum() / (tot * tot).sum())
    resid = c * tot + extra - 1
    c_se = float(np.sqrt((resid ** 2).sum() / max(len(pts) - 2, 1) / (tot * tot).sum()))
    c_s = shrink(c, c_se)
    stats = {"compute_unshrunk": float(sol[0]), "comm_unshrunk": float(sol[1]),
             "comm_extra": delta, "comm_extra_se": delta_se, "common": c, "common_se": c_se}
    if min(c_s, c_s + delta_s) < MIN_SCALE:  # not physical: the common ratio alone
        r = fit_ratio(points)["compute_scale"]
        return {"compute_scale": r, "comm_scale": r, **stats}
    return {"compute_scale": c_s, "comm_scale": c_s + delta_s, **stats}


FITS = {"ratio": fit_ratio, "two_scales": fit_two_scales}


def predict(scales: dict[str, float], point: dict[str, float]) -> float:
    """The calibrated prediction of one point."""
    return scales["compute_scale"] * point["compute_s"] + scales["comm_scale"] * point["comm_s"]


def loo_errors(points: list[dict[str, float]], model: str) -> list[float]:
    """Each point's relative error when predicted by ``model`` ("raw", "ratio", "two_scales")
    fitted on the other points."""
    pts = _usable(points)
    out = []
    for i, p in enumerate(pts):
        scales = RAW if model == "raw" else FITS[model](pts[:i] + pts[i + 1:])
        out.append(abs(predict(scales, p) - p["measured_s"]) / p["measured_s"])
    return out


def calibrate(points: list[dict[str, float]]) -> dict[str, Any]:
    """The model to use for these points: the calibrated one with the lowest leave-one-out
    error if it beats the raw model's, else the raw model.

    Returns {"compute_scale", "comm_scale", "model" ("raw", "ratio" or "two_scales"),
    "loo_mape" (per model, None with too few points), "n_points"} plus the chosen fit's
    unshrunk factors and standard errors."""
    pts = _usable(points)
    if len(pts) < MIN_POINTS:
        return {**RAW, "model": "raw", "loo_mape": None, "n_points": len(pts)}
    mape = {m: float(np.mean(loo_errors(pts, m))) for m in ("raw", *MODELS)}
    best = min(MODELS, key=lambda m: mape[m])
    chosen = best if mape[best] < mape["raw"] else "raw"
    fit = RAW if chosen == "raw" else FITS[chosen](pts)
    return {**fit, "model": chosen, "loo_mape": mape, "n_points": len(pts)}


def fit_scales(points: list[dict[str, float]]) -> dict[str, float]:
    """compute_scale and comm_scale for these points (``calibrate``'s choice, scales only)."""
    cal = calibrate(points)
    return {"compute_scale": cal["compute_scale"], "comm_scale": cal["comm_scale"]}


def unshrunk_scales(points: list[dict[str, float]]) -> dict[str, float]:
    """The plain two-scale least-squares fit, always applied (no shrinkage, no selection;
    a single ratio where the two are not determined): what calibration fitted before, kept to
    measure how much of the noise such a fit takes for a bias."""
    pts = _usable(points)
    if not pts:
        return dict(RAW)
    ratio = float(np.median([p["measured_s"] / (p["compute_s"] + p["comm_s"]) for p in pts]))
    fit = least_squares_scales(pts)
    if fit is None or (fit[0] <= MIN_SCALE).any():
        return {"compute_scale": ratio, "comm_scale": ratio}
    return {"compute_scale": float(fit[0][0]), "comm_scale": float(fit[0][1])}


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
    """Append measured points, recalibrate (``calibrate``) and write the JSON atomically."""
    path = Path(path)
    old = load_calibration(path) or {"points": []}
    points = (old.get("points", []) + new_points)[-keep:]
    for p in points:
        p["ratio"] = p["measured_s"] / max(p["compute_s"] + p["comm_s"], 1e-12)
    cal = calibrate(points)
    data = {k: v for k, v in cal.items() if not (isinstance(v, float) and not np.isfinite(v))}
    data["points"] = points
    write_json_atomic(path, data)
    return data
