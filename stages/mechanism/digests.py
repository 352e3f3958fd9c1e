"""Digests of what a stage produced: what its downstream stages' keys hash (early cutoff).

A downstream key covers its upstream's *output*, not the upstream's key, so a stage that
reruns and makes the same output leaves every stage after it reused. Each digest reads only
what identifies the output, cheaply, and nothing that varies from run to run (times, hosts,
paths, the MLflow run):

- tokenize: the token store's manifest, tokenizer and every chunk's stored CRC32C
  (``data_prep.store.content_digest``);
- plan: the layout of plan.json (tp, pp, dp, micro-batch, schedule, sharding, recompute;
  not the predicted times, which only describe it);
- train: the final checkpoint's manifest (every file's size and CRC-32) and model.json;
- evaluate: report.json's numbers.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

LAYOUT_ONLY_DROP = ("predictions", "figures")  # plan.json fields: describe, not decide, a layout


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def token_store(outputs: dict[str, Any]) -> str:
    """The tokenize output's digest: its store's content (or the outputs' own values where
    a stage made no store)."""
    from data_prep.store import content_digest

    store = outputs.get("store")
    return content_digest(store) if store else _hash(outputs)


def plan_layout(outputs: dict[str, Any]) -> str:
    """The plan output's digest: the chosen layout, less its predictions."""
    plan = outputs.get("plan")
    if isinstance(plan, str) and Path(plan).is_file():
        plan = json.loads(Path(plan).read_text())
    if not isinstance(plan, dict):
        return _hash(outputs)
    return _hash({k: v for k, v in plan.items() if k not in LAYOUT_ONLY_DROP})


def final_checkpoint(outputs: dict[str, Any]) -> str:
    """The train output's digest: its final checkpoint's manifest and model shape."""
    from model.training.checkpoint import MANIFEST

    checkpoint = outputs.get("checkpoint")
    if not checkpoint or not (Path(checkpoint) / MANIFEST).is_file():
        return _hash({k: outputs.get(k) for k in ("final_loss", "steps_done")})
    root = Path(checkpoint)
    parts = {name: json.loads((root / name).read_text())
             for name in (MANIFEST, "model.json") if (root / name).is_file()}
    return _hash(parts)


def report(outputs: dict[str, Any]) -> str:
    """The evaluate output's digest: its report's content (nothing reads it downstream)."""
    path = outputs.get("report")
    if path and Path(path).is_file():
        return _hash(json.loads(Path(path).read_text()))
    return _hash(outputs)
