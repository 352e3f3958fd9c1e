"""The one place that talks to MLflow.

Everything goes through explicit run ids (``MlflowClient``), not MLflow's fluent
"active run" state, because a stage's run is opened by the driver, written to by stage
code in Parsl workers and by training ranks in other processes, and closed by the driver.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stages.mechanism import locks
from stages.mechanism.config import ConfigError

# import mlflow writes a telemetry file unless told not to.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# mlflow itself is imported on first use: it takes seconds, and the driver checks the
# store (check_store) before that, so an unusable store is reported at once.
MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME = "mlflow.parentRunId", "mlflow.runName"

MAX_PARAM_CHARS = 6000  # MLflow's limit on one param value


def MlflowClient(uri: str):  # stands in for the class, imported on first use
    """``mlflow.tracking.MlflowClient(uri)``."""
    from mlflow.tracking import MlflowClient as client_class

    return client_class(uri)


def default_tracking_uri(runs_dir: Path, uri: str | None = None) -> str:
    """The tracking URI: an explicit one, else MLFLOW_TRACKING_URI, else SQLite in runs_dir."""
    if uri:
        return uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(runs_dir).resolve() / 'mlflow.db'}"


def server_command(store_uri: str, runs_dir: Path, host: str, port: int,
                   allowed_hosts: tuple[str, ...] = ()) -> list[str]:
    """``mlflow server`` over ``store_uri`` with artifacts in ``runs_dir/mlartifacts``,
    listening on ``host:port`` with one worker; ``allowed_hosts``: the Host headers it
    answers besides localhost and private addresses (MLflow's guard against DNS
    rebinding)."""
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server",
           "--backend-store-uri", store_uri,
           "--default-artifact-root", str(Path(runs_dir).resolve() / "mlartifacts"),
           "--host", host, "--port", str(port), "--workers", "1"]
    if allowed_hosts:
        cmd += ["--allowed-hosts", ",".join(("localhost", "127.0.0.1", *allowed_hosts))]
    return cmd


def ui_command(uri: str, runs_dir: Path) -> str:
    """The shell command that opens the MLflow UI on this store."""
    if uri.startswith("sqlite:///"):
        artifacts = Path(runs_dir).resolve() / "mlartifacts"
        return (
            f"mlflow ui --backend-store-uri {uri} --default-artifact-root {artifacts} "
            "--host 127.0.0.1 --port 5000"
        )
    return f"open {uri} in a browser"


REACH_TIMEOUT_S = 5.0  # how long the start-up check waits for a tracking server
STORE_LOCK_WAIT_S = 120.0


class TrackingError(ConfigError):
    """The MLflow store cannot be used (server unreachable, SQLite location not writable)."""


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other schemes or in-memory)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


STORE_SCHEMES = ("sqlite", "http", "https", "file", "postgresql", "mysql", "mssql",
                 "databricks")
"""URI schemes of the stores MLflow's tracking client opens (the database ones may carry a
driver: ``postgresql+psycopg2://``)."""


def check_store(uri: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Fail fast, with one line naming ``uri``, when the store cannot be used: a scheme
    MLflow has no store for, an http(s) server that does not answer within ``timeout_s``,
    or a SQLite file whose directory cannot be created or written."""
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower() if ":" in uri else uri
    if scheme not in STORE_SCHEMES:
        raise TrackingError(
            f"tracking URI {uri!r} names no MLflow store: use sqlite:///PATH, http(s)://HOST:PORT "
            f"(an MLflow server), file:///PATH or a database URI ({', '.join(STORE_SCHEMES)}); "
            "without --tracking-uri the store is SQLite in the runs dir")
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
                pass
        except urllib.error.HTTPError:
            pass  # it answered: a server is there (a proxy path may not serve /health)
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise TrackingError(
                f"MLflow tracking server {uri} is not reachable ({reason}); start it, or pass "
                "another --tracking-uri (without one the store is SQLite in the runs dir)"
            ) from None
        return
    db = _sqlite_path(uri)
    if db is None:
        return
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        probe = db.parent / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        if db.exists() and not os.access(db, os.W_OK):
            raise PermissionError(f"{db} is read-only")
    except OSError as error:
        raise TrackingError(
            f"MLflow store {uri} cannot be written ({error}); pass a writable --runs-dir "
            "or --tracking-uri"
        ) from None


def ensure_experiment(uri: str, name: str, runs_dir: Path) -> str:
    """Return the id of experiment ``name``, creating it with artifacts beside the store.

    Checks the store first (``check_store``). A SQLite store is created (schema and
    experiment) under a lock file beside it, so pipelines starting together on one runs
    dir create it once instead of racing on its tables."""
    check_store(uri)
    db = _sqlite_path(uri)
    if db is None:
        return _ensure_experiment(uri, name, runs_dir)
    with locks.hold(db.with_name(f"{db.name}.lock"), wait_s=STORE_LOCK_WAIT_S):
        return _ensure_experiment(uri, name, runs_dir)


def _ensure_experiment(uri: str, name: str, runs_dir: Path) -> str:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = None
    if uri.startswith("sqlite:"):
        location = (Path(runs_dir).resolve() / "mlartifacts").as_uri()
    try:
        # Without the kind tag MLflow 3 opens new experiments on its GenAI overview page.
        return client.create_experiment(
            name,
            artifact_location=location,
            tags={"mlflow.experimentKind": "custom_model_development"},
        )
    except Exception:  # created concurrently by another process
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def start_run(
    uri: str,
    experiment_id: str,
    run_name: str,
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
) -> str:
    """Create a run (nested under ``parent_run_id`` if given) and return its id."""
    all_tags = {MLFLOW_RUN_NAME: run_name, **(tags or {})}
    if parent_run_id:
        all_tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
    run = MlflowClient(uri).create_run(experiment_id, tags=all_tags, run_name=run_name)
    return run.info.run_id


def end_run(uri: str, run_id: str, status: str = "FINISHED") -> None:
    """Mark a run FINISHED, FAILED or KILLED."""
    MlflowClient(uri).set_terminated(run_id, status)


def find_run(uri: str, run_id: str):
    """Run ``run_id`` of this store (info, data), or None where the store has no such run or
    it was deleted: a run id recorded beside another store, or by a run since removed."""
    try:
        run = get_run(uri, run_id)
    except Exception:  # noqa: BLE001 - MlflowException (no such run) or a store error
        return None
    return run if run.info.lifecycle_stage == "active" else None


def reopen_run(uri: str, run_id: str) -> None:
    """Set an ended run back to RUNNING, so that a resumed attempt writes on into it."""
    MlflowClient(uri).update_run(run_id, status="RUNNING")


def delete_tags(uri: str, run_id: str, keys: list[str]) -> None:
    """Remove tags ``keys`` from a run (each must exist)."""
    client = MlflowClient(uri)
    for key in keys:
        client.delete_tag(run_id, key)


def last_step(uri: str, run_id: str, key: str) -> int:
    """The highest step at which run ``run_id`` holds metric ``key`` (0 when it holds none).

    Raises when the store cannot be read."""
    return max((m.step for m in MlflowClient(uri).get_metric_history(run_id, key)), default=0)


class Tracker:
    """Writes params, metrics, tags and artifacts to one MLflow run.

    Metrics are buffered and sent with ``log_batch`` (one round trip per ~2 s or per
    500 values) so per-step logging stays a small fraction of a training step.
    """

    def __init__(self, uri: str, run_id: str, flush_seconds: float = 2.0) -> None:
        self.uri = uri
        self.run_id = run_id
        self._client = MlflowClient(uri)
        self._pending: list[Any] = []  # mlflow.entities.Metric
        self.flush_seconds = flush_seconds  # longest wait before buffered metrics are sent
        self._last_flush = time.monotonic()

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [
            Param(key, str(value)[:MAX_PARAM_CHARS]) for key, value in _flatten(params).items()
        ]
        for start in range(0, len(items), 100):
            self._client.log_batch(self.run_id, params=items[start : start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        for key, value in metrics.items():
            self._pending.append(Metric(key, float(value), now_ms, step or 0))
        if len(self._pending) >= 500 or time.monotonic() - self._last_flush > self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:1000], self._pending[1000:]
            self._client.log_batch(self.run_id, metrics=batch)
        self._last_flush = time.monotonic()

    def send_metrics(self, run_id: str | None, records: list[dict[str, Any]]) -> None:
        """Write metric records ({"metrics": {key: value}, "step", "timestamp" in ms}) to
        ``run_id`` (None: this run) now, in one request (at most 1000 values); raises when the
        store does not take them."""
        from mlflow.entities import Metric

        batch = [Metric(key, float(value), int(record["timestamp"]), int(record["step"] or 0))
                 for record in records for key, value in record["metrics"].items()]
        if batch:
            self._client.log_batch(run_id or self.run_id, metrics=batch)

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(key, str(value)) for key, value in tags.items()]
        if items:
            self._client.log_batch(self.run_id, tags=items)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self._client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self._client.log_artifact(self.run_id, str(path), artifact_path)

    def log_dict(self, obj: Any, file_name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / file_name
            text = json.dumps(obj, indent=2, default=str) if file_name.endswith(".json") else None
            if text is None:
                import yaml

                text = yaml.safe_dump(obj, sort_keys=False)
            target.write_text(text)
            self.log_artifact(target)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def get_run(uri: str, run_id: str):
    """The MLflow run object (info, data) for inspection."""
    return MlflowClient(uri).get_run(run_id)


def run_metrics_or_none(uri: str, run_id: str) -> dict[str, float] | None:
    """A run's latest metric values, or None where the store does not have the run (or
    cannot be read): for looks back at other runs that must not fail the caller."""
    try:
        return dict(get_run(uri, run_id).data.metrics)
    except Exception:  # noqa: BLE001 - MlflowException or a store error: nothing to copy
        return None


def search_runs(uri: str, experiment_name: str, filter_string: str = "") -> list:
    """All runs of an experiment, newest first."""
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return []
    return client.search_runs(
        [experiment.experiment_id], filter_string=filter_string, order_by=["start_time DESC"]
    )


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric."""
    return [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key)]


def log_hf_model(
    uri: str,
    run_id: str,
    hf_dir: str | Path,
    name: str = "model",
    max_new_tokens: int = 32,
    temperature: float = 0.8,
) -> str:
    """Log a Hugging Face export as an MLflow ``transformers`` model (text-generation) of run
    ``run_id``, with a signature (string prompt -> string text, generation params); returns
    the model URI (``models:/<id>``), loadable with ``load_logged_model``."""
    import mlflow
    import mlflow.transformers
    import transformers
    from mlflow.models import infer_signature

    # A local export has no hub model card or license to look up, and its loading and
    # writing progress bars only repeat the stage's own lines: keep both off the console.
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("mlflow.transformers").setLevel(logging.ERROR)
    pipe = transformers.pipeline("text-generation", model=str(hf_dir), device="cpu")
    signature = infer_signature(
        ["def main("],
        ["def main(args):"],
        params={"max_new_tokens": max_new_tokens, "temperature": temperature, "do_sample": False},
    )
    with _global_tracking_uri(uri):  # Model.log resolves its client from the global URI
        # The logged model belongs to the run's experiment (else: experiment 0, under ./mlruns).
        mlflow.set_experiment(experiment_id=MlflowClient(uri).get_run(run_id).info.experiment_id)
        info = mlflow.transformers.log_model(
            pipe,
            name=name,
            task="text-generation",
            run_id=run_id,
            signature=signature,
            # Explicit requirements: inference probes optional packages (torchvision) and fails.
            pip_requirements=[f"transformers=={transformers.__version__}", "torch", "safetensors"],
            model_config={"max_new_tokens": max_new_tokens},
        )
    MlflowClient(uri).set_tag(run_id, "model_uri", info.model_uri)
    return info.model_uri


def load_logged_model(uri: str, model_uri: str):
    """Load a logged model as an MLflow pyfunc (``predict(list[str], params=...)``)."""
    import mlflow
    import mlflow.pyfunc

    with _global_tracking_uri(uri):
        return mlflow.pyfunc.load_model(model_uri)


@contextlib.contextmanager
def _global_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's process-wide URI at ``uri`` for a fluent-API call, then undo it.

    ``mlflow.set_tracking_uri`` and ``set_experiment`` also write environment variables
    that later code (and child processes) would inherit, so those are restored exactly.
    """
    import mlflow

    saved_env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID",
                                                 "MLFLOW_EXPERIMENT_NAME")}
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def import_metrics(spool: str | Path, uri: str | None = None) -> int:
    """Send a metrics spool that training left behind (MLflow was away) to its runs; return
    the records sent.

    ``uri`` defaults to the tracking URI in the ``spec.json`` beside the spool, then to
    MLFLOW_TRACKING_URI. When everything is sent the spool is renamed ``<spool>.imported``,
    so importing again sends nothing twice; if the store fails midway, the spool keeps only
    the records not yet sent."""
    from model.training.metrics import deliver_spool

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
    """``python -m stages.mechanism.tracking import-metrics SPOOL [--tracking-uri URI]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m stages.mechanism.tracking",
                                     description="MLflow tools of the pipeline")
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import-metrics",
                              help="send the metrics a training run kept while MLflow was away")
    imp.add_argument("spool", type=Path, help="the spool (metrics_spool.jsonl in the train dir)")
    imp.add_argument("--tracking-uri", help="default: the URI in spec.json beside the spool")
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
        from model.training.metrics import short_reason

        print(f"error: import stopped ({short_reason(error)}); the records not sent are still in "
              f"{args.spool}: run the command again", file=sys.stderr)
        return 1
    print(f"sent {sent} metric record(s) from {args.spool}; it is now marked imported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
