"""Plots and tables of the plan stage: predicted comparison and predicted vs measured."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from model.parallel.layout import Plan
from model.training.plots import save_png


def comparison_png(plans: list[Plan], path: Path) -> Path:
    """Bar chart of predicted tokens/s with predicted memory per device on a second axis."""
    labels = [p.describe() for p in plans]
    tps = [p.predictions["tokens_per_s"] for p in plans]
    mem = [p.predictions["memory_gb_per_device"] for p in plans]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(plans) + 1.5))
    y = range(len(plans))
    ax.barh(y, tps, color="tab:blue", label="predicted tokens/s")
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("predicted tokens/s")
    ax2 = ax.twiny()
    ax2.plot(mem, list(y), "o", color="tab:red", label="memory GB/device")
    ax2.set_xlabel("predicted memory per device (GB)", color="tab:red")
    fig.tight_layout()
    return save_png(fig, path)


def measured_report(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """measured.json, a predicted-vs-measured table and a scatter PNG."""
    out_dir = Path(out_dir)
    (out_dir / "measured.json").write_text(json.dumps(records, indent=2))
    lines = [f"{'plan':<44} {'pred s':>9} {'meas s':>9} {'ratio':>6} {'pred GB':>8} {'meas GB':>8}"]
    xs, ys = [], []
    for r in records:
        desc = Plan.from_dict({**r["plan"], "predictions": {}}).describe()
        if r["ok"]:
            xs.append(r["predicted_step_time_s"])
            ys.append(r["step_time_s"])
            lines.append(f"{desc:<44} {r['predicted_step_time_s']:>9.4f} {r['step_time_s']:>9.4f} "
                         f"{r['step_time_s'] / r['predicted_step_time_s']:>6.2f} "
                         f"{r['predicted_memory_gb']:>8.3f} {r.get('peak_memory_gb') or 0:>8.3f}")
        else:
            lines.append(f"{desc:<44} failed: {r.get('error', '')[:80]}")
    table = out_dir / "predicted_vs_measured.txt"
    table.write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(xs, ys)
    if xs:
        lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.2
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="measured = predicted")
        ax.legend()
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("measured step time (s)")
    fig.tight_layout()
    png = out_dir / "predicted_vs_measured.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return [out_dir / "measured.json", table, png]
