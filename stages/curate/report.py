"""The curate stage's picture: removed documents by reason, drawn from the final step's
summary beside the stage's MLflow logging (the selection itself never imports
matplotlib: a curate task's peak memory is the stage's budget)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from model.training.plots import plt, save_png

CHART = "removals.png"


def removals_chart(summary: dict[str, Any], path: str | Path) -> Path:
    """A horizontal bar chart of removed documents by reason (``curate_corpus``'s summary)
    written to ``path`` (PNG, atomically); returns the path."""
    reasons = list(summary["by_reason"])
    counts = [summary["by_reason"][r]["documents"] for r in reasons]
    fig, ax = plt.subplots(figsize=(7, 1.0 + 0.35 * max(1, len(reasons))))
    ax.barh(reasons or ["(none removed)"], counts or [0], color="tab:red")
    ax.invert_yaxis()
    ax.set_xlabel("documents removed")
    ax.set_title(f"{summary['removed_documents']:,} of {summary['documents']:,} documents "
                 f"removed ({summary['kept_documents']:,} kept)")
    fig.tight_layout()
    return save_png(fig, path)
