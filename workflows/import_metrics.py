"""Send the metrics a training run kept in its spool while MLflow was away:
``python -m workflows.import_metrics SPOOL [--tracking-uri URI]``."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from model.training.metrics import deliver_spool, short_reason
from stages.mechanism.tracking import Tracker
from stages.mechanism.tracking_store import TrackingError, check_store


def import_metrics(spool: str | Path, uri: str | None = None) -> int:
    """Send a metrics spool that training left behind (MLflow was away) to its runs; return
    the records sent.

    ``uri`` defaults to the tracking URI in the ``spec.json`` beside the spool, then to
    MLFLOW_TRACKING_URI. When everything is sent the spool is renamed ``<spool>.imported``,
    so importing again sends nothing twice; if the store fails midway, the spool keeps only
    the records not yet sent."""
    spool = Path(spool)
    if not spool.is_file():
        raise FileNotFoundError(f"{spool}: no such metrics spool")
    uri = uri or _spool_tracking_uri(spool)
    check_store(uri)
    done = spool.with_name(f"{spool.name}.imported")
    for n in range(2, 1000):
        if not done.exists():
            break
        done = spool.with_name(f"{spool.name}.imported-{n}")
    return deliver_spool(spool, Tracker(uri, "").send_metrics, done_path=done)


def _spool_tracking_uri(spool: Path) -> str:
    spec = spool.parent / "spec.json"
    if spec.is_file():
        uri = (json.loads(spec.read_text()).get("tracking") or {}).get("uri")
        if uri:
            return uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    raise TrackingError(f"{spool}: no spec.json with a tracking URI beside it and no "
                        "MLFLOW_TRACKING_URI; pass --tracking-uri")


def main(argv: list[str] | None = None) -> int:
    """``python -m workflows.import_metrics SPOOL [--tracking-uri URI]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m workflows.import_metrics",
        description="send the metrics a training run kept while MLflow was away")
    parser.add_argument("spool", type=Path, help="the spool (metrics_spool.jsonl in the train dir)")
    parser.add_argument("--tracking-uri", help="default: the URI in spec.json beside the spool")
    args = parser.parse_args(argv)
    done = args.spool.with_name(f"{args.spool.name}.imported")
    if not args.spool.exists() and done.exists():
        print(f"{args.spool} was already imported ({done}); nothing to send")
        return 0
    try:
        sent = import_metrics(args.spool, args.tracking_uri)
    except (TrackingError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - what is left stays in the spool
        print(f"error: import stopped ({short_reason(error)}); the records not sent are still in "
              f"{args.spool}: run the command again", file=sys.stderr)
        return 1
    print(f"sent {sent} metric record(s) from {args.spool}; it is now marked imported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
