"""The curate stage's continuation hook: a new selection over signals already computed.

The selection fields (``curate.thresholds``, ``curate.preset``, ``curate.languages``, ...)
are the curate stage's extent (``StageDeclaration.extends``). When they are all that
differs from a published output (same corpus, signal settings, evaluation texts, code and
software), the new attempt hard-links that output's signal files into its own directory
and only the selection runs again; the dry run says so.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from stages.mechanism import outputs
from stages.mechanism.declaration import (
    Continuation,
    ContinuationHook,
    StageDeclaration,
    json_digest,
)

SIGNALS_DIR = "signals"  # one parquet of signals per input shard


def signal_files(directory: str | Path) -> list[Path]:
    """The signal files under an output (or work) directory, in shard order."""
    return sorted((Path(directory) / SIGNALS_DIR).glob("shard-*.parquet"))


def _lineage(ingredients: dict[str, Any]) -> dict[str, Any]:
    """What two outputs with the same signals share: all but the selection and the source."""
    return {k: v for k, v in ingredients.items() if k not in ("extent", "continues")}


def find(runs_dir: str | Path, stage: StageDeclaration, cfg: Any,
         ingredients: dict[str, Any]) -> Continuation | None:
    """The newest published output whose ingredients differ only in the selection fields,
    with a signal file for every shard; None to compute the signals afresh."""
    lineage = _lineage(ingredients)
    for key, directory, status in outputs.stage_outputs(runs_dir, stage.name):
        old = status.get("ingredients") or {}
        files = signal_files(directory)
        if _lineage(old) != lineage or len(files) != cfg.data.num_shards:
            continue
        changed = sorted(name for name, value in ingredients.get("extent", {}).items()
                         if (old.get("extent") or {}).get(name) != value)
        return Continuation(
            key=key, step=0, checkpoint=str(directory / SIGNALS_DIR), history=False,
            why=f"{', '.join(changed) or 'the selection'} changed: the signals of {key} are "
                "kept and only the selection reruns",
            digest=json_digest({f.name: f.stat().st_size for f in files}),
            source_run_id=status.get("run_id", ""), source_store=status.get("tracking_uri", ""))
    return None


def seed(continuation: Continuation, work_dir: str | Path) -> bool:
    """Hard-link the source's signal files into the new attempt (a copy across file
    systems), unless it holds signals of its own already; True when it placed them."""
    target = Path(work_dir) / SIGNALS_DIR
    if signal_files(work_dir):
        return False
    target.mkdir(parents=True, exist_ok=True)
    for source in sorted(Path(continuation.checkpoint).glob("shard-*.parquet")):
        tmp = target / f".{source.name}.seeding"
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copy2(source, tmp)
        os.replace(tmp, target / source.name)
    return True


HOOK = ContinuationHook(find=find, seed=seed)
"""The curate stage's continuation hook (``StageDeclaration.continuation``)."""
