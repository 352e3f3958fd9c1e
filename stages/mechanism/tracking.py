"""The one place that talks to MLflow.

Everything goes through explicit run ids (``MlflowClient``), not MLflow's fluent
"active run" state, because a stage's run is opened by the driver, written to by stage
code in Parsl workers and by training ranks in other processes, and closed by the driver.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stages.mechanism import locks
from stages.mechanism.tracking_store import check_store, sqlite_path

# import mlflow writes a telemetry file unless told not to.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# mlflow itself is imported on first use: it takes seconds, and the driver checks the
# store (check_store) before that, so an unusable store is reported at once.
MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME = "mlflow.parentRunId", "mlflow.runName"

MAX_PARAM_CHARS = 6000  # MLflow's limit on one param value
# MLflow 3's UI opens an experiment by this tag: "custom_model_development" on its training
# runs; without it, an experiment with no runs yet opens on the GenAI overview.
EXPERIMENT_KIND, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"
STORE_LOCK_WAIT_S = 120.0  # how long a driver waits for another creating the SQLite store


def MlflowClient(uri: str):  # stands in for the class, imported on first use
    """``mlflow.tracking.MlflowClient(uri)``, whose calls raise ``store_full``'s OSError
    where a SQLite store's disk is full."""
    from mlflow.tracking import MlflowClient as client_class

    # The store's errors reach the caller as exceptions; MLflow's SQL layer also logs each
    # with its traceback (dozens of lines a write when the disk is full): drop that copy.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    return _FullDiskAware(client_class(uri), uri)


SQLITE_FULL = "database or disk is full"  # SQLite's message for SQLITE_FULL


def store_full(error: BaseException, uri: str) -> OSError | None:
    """The OSError (ENOSPC) that ``error`` stands for when it is SQLite's "database or disk
    is full" from store ``uri``, or None: one line naming the store and the fix."""
    if isinstance(error, OSError) or SQLITE_FULL not in str(error):
        return None
    where = sqlite_path(uri) or uri
    full = OSError(f"No space left on device (MLflow store {where}: {SQLITE_FULL}; free space "
                   "or pass another --runs-dir or --tracking-uri)")
    full.errno = errno.ENOSPC  # errno only: strerror or filename would change str(full)
    return full


class _FullDiskAware:
    """An MlflowClient whose calls raise ``store_full``'s one-line OSError instead of the SQL
    error of a full disk (so a full disk is told apart from any other store error)."""

    def __init__(self, client: Any, uri: str) -> None:
        self._client, self._uri = client, uri

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except Exception as error:
                full = store_full(error, self._uri)
                if full is None:
                    raise
                raise full from None

        return call


def ensure_experiment(uri: str, name: str, runs_dir: Path) -> str:
    """Return the id of experiment ``name``, creating it with artifacts beside the store.

    Checks the store first (``check_store``). A SQLite store is created (schema and
    experiment) under a lock file beside it, so pipelines starting together on one runs
    dir create it once instead of racing on its tables."""
    check_store(uri)
    db = sqlite_path(uri)
    if db is None:
        return _ensure_experiment(uri, name, runs_dir)
    with locks.hold(db.with_name(f"{db.name}.lock"), wait_s=STORE_LOCK_WAIT_S):
        return _ensure_experiment(uri, name, runs_dir)


def _ensure_experiment(uri: str, name: str, runs_dir: Path) -> str:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if EXPERIMENT_KIND not in experiment.tags:  # made before the tag: open it on its runs
            client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND, TRAINING_KIND)
        return experiment.experiment_id
    location = None
    if uri.startswith("sqlite:"):
        location = (Path(runs_dir).resolve() / "mlartifacts").as_uri()
    try:
        # Without the kind tag MLflow 3 opens new experiments on its GenAI overview page.
        return client.create_experiment(
            name,
            artifact_location=location,
            tags={EXPERIMENT_KIND: TRAINING_KIND},
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


def end_run_tree(uri: str, run_id: str, status: str, reason: str,
                 include_root: bool = True, client: Any = None) -> list[str]:
    """Mark run ``run_id`` (unless ``include_root`` is False) and each of its descendants
    that is still RUNNING ``status`` (FAILED, KILLED), with ``reason`` as their ``error``
    tag; the ids marked. ``client``: one already made for ``uri`` (making one takes a
    while)."""
    client = client or MlflowClient(uri)
    experiment = client.get_run(run_id).info.experiment_id
    marked, todo = [], [run_id]
    while todo:
        current = todo.pop()
        if (include_root or current != run_id) and \
                client.get_run(current).info.status == "RUNNING":
            client.set_tag(current, "error", reason)
            client.set_terminated(current, status)
            marked.append(current)
        children = client.search_runs([experiment],
                                      filter_string=f"tags.{MLFLOW_PARENT_RUN_ID} = '{current}'")
        todo.extend(child.info.run_id for child in children)
    return marked


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
        self._pending: list[Any] = []  # mlflow.entities.Metric
        self.flush_seconds = flush_seconds  # longest wait before buffered metrics are sent
        self._last_flush = time.monotonic()

    @functools.cached_property
    def _client(self) -> Any:
        """The MLflow client, opened on first use: importing MLflow and opening the store take
        seconds, which a training rank spends on its metrics thread, not before its first
        step (``model.training.metrics.BackgroundSink``)."""
        return MlflowClient(self.uri)

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


def node_id() -> str:
    """This node's name in system metrics: the host name up to its first dot."""
    return socket.gethostname().split(".", 1)[0]


class SystemMetricsSampler:
    """MLflow's system-metrics monitor of this host, writing into one run: CPU utilization,
    memory, disk and network, and, where pynvml (NVIDIA) or pyrsmi (AMD) finds GPUs, each
    GPU's utilization and memory, averaged over and logged every ``interval_s`` seconds as
    ``system/<node>/<metric>`` on a thread of its own. It stops by itself once the run is no
    longer RUNNING; ``stop`` sends what it holds."""

    def __init__(self, uri: str, run_id: str, interval_s: float, node: str | None = None) -> None:
        import psutil
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # Its warnings are one line each (a store that took no sample); its info lines and a
        # missing GPU library's note say nothing a run needs.
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        # a logger's filter sees only its own records: the monitor's and this class's; one
        # filter each, naming the store of the newest sampler (not one an earlier run used)
        for name in ("mlflow.system_metrics.system_metrics_monitor", "mlflow.system_metrics"):
            emitter = logging.getLogger(name)
            for old in [f for f in emitter.filters if isinstance(f, _OneLineStoreErrors)]:
                emitter.removeFilter(old)
            emitter.addFilter(_OneLineStoreErrors(uri))
        psutil.cpu_percent()  # the first sample's utilization counts from here, not from 0
        self.node = node or node_id()
        # resume_logging: a resumed attempt's samples continue after the run's last one.
        self._monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s,
                                             resume_logging=True, node_id=self.node,
                                             tracking_uri=uri)
        self._monitor.start()

    def stop(self) -> None:
        """Stop sampling; send the samples not yet sent, those of the last, unfinished
        interval included (a block shorter than one interval still logs one value); a store
        error is a warning."""
        monitor = self._monitor
        monitor.finish()  # drops the samples of an interval it had not finished
        if any(m.metrics for m in monitor.monitors):
            try:
                monitor.publish_metrics(monitor.aggregate_metrics())
                monitor.mlflow_logger.flush()
            except Exception as error:  # noqa: BLE001 - as the monitor's own sends: a warning
                logging.getLogger("mlflow.system_metrics").warning(
                    "could not send the last system metrics: %s", error)


class _OneLineStoreErrors(logging.Filter):
    """Shortens the system-metrics monitor's warnings to their first line, and a full disk
    under a SQLite store to ``store_full``'s line: its SQL error would print the statement
    and every parameter of the failed write, a dozen lines a sample."""

    def __init__(self, uri: str) -> None:
        super().__init__()
        self.uri = uri

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        full = store_full(RuntimeError(message), self.uri)
        record.msg = (f"system metrics not logged: {full}" if full is not None
                      else message.splitlines()[0])
        record.args = ()
        return True


def samples_node(rank: int, local_rank: int, ranks_per_node: int,
                 logger_rank: int | None = None) -> bool:
    """Whether ``rank`` is the one of its node that samples the node's system metrics: the
    logger rank on its own node (it has MLflow's client and store open already), local rank 0
    on every other node. Ranks are placed on nodes in blocks of ``ranks_per_node`` (the
    local launcher's and srun's default)."""
    first = rank - local_rank
    if logger_rank is not None and first <= logger_rank < first + ranks_per_node:
        return rank == logger_rank
    return local_rank == 0


def start_node_sampler(cfg: Any, run: dict[str, str] | None,
                       here: bool) -> SystemMetricsSampler | None:
    """The system-metrics sampler of this node for a stage's ranks, or None: started by one
    rank of each node only (``here``: ``samples_node``), where the stage run is tracked
    (``run``: the rank spec's {"uri", "run_id"}) and
    ``cfg.tracking.system_metrics_on(cfg.site.name)``. A sampler that cannot start is one
    line, never a failed stage."""
    if not run or not here or not cfg.tracking.system_metrics_on(cfg.site.name):
        return None
    try:
        return SystemMetricsSampler(run["uri"], run["run_id"],
                                    cfg.tracking.system_metrics_interval_s)
    except Exception as error:  # noqa: BLE001 - monitoring must not stop the work it watches
        print(f"[tracking] no system metrics on {node_id()}: {error}", flush=True)
        return None


@contextlib.contextmanager
def node_system_metrics(cfg: Any, run: dict[str, str] | None,
                        here: bool) -> Iterator[SystemMetricsSampler | None]:
    """``start_node_sampler`` around a block; the sampler is stopped when it ends."""
    sampler = start_node_sampler(cfg, run, here)
    try:
        yield sampler
    finally:
        if sampler is not None:
            sampler.stop()


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


def copy_history(uri: str, source_run_id: str, target_run_id: str, through_step: int) -> int:
    """Copy every metric value of ``source_run_id`` up to ``through_step`` into
    ``target_run_id`` (a continued training shows its whole curve in one run); the count."""
    from mlflow.entities import Metric

    client = MlflowClient(uri)
    batch = [Metric(key, m.value, m.timestamp, m.step)
             for key in client.get_run(source_run_id).data.metrics
             for m in client.get_metric_history(source_run_id, key) if m.step <= through_step]
    for start in range(0, len(batch), 1000):
        client.log_batch(target_run_id, metrics=batch[start:start + 1000])
    return len(batch)


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
