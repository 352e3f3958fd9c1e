"""The MLflow UI over a pipeline's store: a real `mlflow server` read by headless Chromium.

The store is the one of the session's user session with the pipeline CLI
(``micro_cli_history``, shared with test_pipeline.py): the tests look at its first run's
pipeline and stage runs; the store also holds the runs of the same command again and of
``--only evaluate``.

Needs Debian's chromium (`apt-get install -y --no-install-recommends chromium`). Screenshots go
to $UI_SCREENSHOT_DIR (default: the test's temporary directory; paths printed with -s).
"""
import html
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.micro_cli import History

# The first test may also run the session's pipelines (several minutes on 2 busy cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
STAGES = ("tokenize", "plan", "train", "evaluate")


def _get(url: str, payload: dict | None = None, timeout: float = 30) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def _page(url: str, work: Path, screenshot: Path | None = None, window: str = "1600,1000",
          timeout: float = 180, attempts: int = 2) -> str:
    """Load ``url`` in headless Chromium; return the rendered page's text (or save a PNG).

    A page normally renders in 4-40 s; headless Chromium occasionally stalls on a busy
    machine, so a stalled attempt is killed and retried once."""
    for attempt in range(1, attempts + 1):
        try:
            return _chromium(url, work, screenshot, window, timeout)
        except subprocess.TimeoutExpired:
            print(f"chromium stalled on {url} (attempt {attempt}/{attempts})")
    pytest.fail(f"chromium did not finish {url} in {attempts} x {timeout}s")


def _chromium(url: str, work: Path, screenshot: Path | None, window: str, timeout: float) -> str:
    profile = tempfile.mkdtemp(prefix="chromium-", dir=work)  # fresh profile each time
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", "--disable-component-update", "--no-first-run",
           "--disable-sync", f"--user-data-dir={profile}", f"--window-size={window}",
           "--virtual-time-budget=10000"]
    cmd += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    proc = subprocess.Popen(cmd + [url], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    try:
        dom, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # chromium's own process group
        proc.communicate()
        raise
    assert proc.returncode == 0, f"chromium exited {proc.returncode} on {url}"
    text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", dom, flags=re.DOTALL)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text)))


@pytest.fixture(scope="module")
def pipeline(micro_cli_history: History) -> tuple:
    """The first run of the real pipeline CLI (`python -m workflows.pipeline --config
    micro`): (ctx, {stage: StageRun}) as its driver recorded them."""
    return micro_cli_history.first_records


@pytest.fixture(scope="module")
def server(pipeline, tmp_path_factory):
    """The driver's ``mlflow server`` (``workflows.tracking_server``) over the pipeline's
    SQLite store; stopped (with its worker) after."""
    from workflows.tracking_server import TrackingServer

    ctx, results = pipeline
    work = tmp_path_factory.mktemp("mlflow-ui")
    srv = TrackingServer(ctx.tracking_uri, Path(ctx.runs_dir), "127.0.0.1", work / "server.log")
    started = time.monotonic()
    base = srv.start(timeout_s=300)
    group = [srv.proc.pid, *(c.pid for c in psutil.Process(srv.proc.pid).children(recursive=True))]
    try:
        print(f"mlflow server ready in {time.monotonic() - started:.1f}s at {base}")
        yield base, work, ctx, results
    finally:
        srv.stop(timeout_s=60)
    alive = [pid for pid in group if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"server processes still running after stop: {alive}"


def _search(base: str, experiment_id: str) -> dict[str, dict]:
    """All runs of the experiment through the REST API, by run id."""
    runs, token = {}, None
    while True:
        body = {"experiment_ids": [experiment_id], "max_results": 100}
        if token:
            body["page_token"] = token
        page = _get(f"{base}/api/2.0/mlflow/runs/search", body)
        for run in page.get("runs", []):
            runs[run["info"]["run_id"]] = run
        token = page.get("next_page_token")
        if not token:
            return runs


def _flat(run: dict, kind: str) -> dict:
    return {item["key"]: item["value"] for item in run["data"].get(kind, [])}


def test_rest_api_lists_pipeline_and_stage_runs_with_metrics(server):
    base, _, ctx, results = server
    runs = _search(base, ctx.experiment_id)
    parent = runs[ctx.parent_run_id]
    assert parent["info"]["status"] == "FINISHED"
    children = {rid: r for rid, r in runs.items()
                if _flat(r, "tags").get("mlflow.parentRunId") == ctx.parent_run_id}
    for name in STAGES:
        run = children[results[name].run_id]
        tags, metrics = _flat(run, "tags"), _flat(run, "metrics")
        assert tags["stage"] == name and tags["stage_key"] == results[name].key
        assert run["info"]["status"] == "FINISHED"
        assert run["info"]["run_name"] == f"{name}-{results[name].key[:8]}"
        assert metrics, f"{name} run has no metrics"
    metric = {n: _flat(children[results[n].run_id], "metrics") for n in STAGES}
    tok = results["tokenize"].outputs
    assert metric["tokenize"]["validation_tokens"] == tok["validation_tokens"]
    assert metric["train"]["loss"] == pytest.approx(results["train"].outputs["final_loss"])
    assert any(k.startswith("predicted_") for k in metric["plan"])
    ev = results["evaluate"].outputs
    assert metric["evaluate"]["val_loss"] == pytest.approx(ev["val_loss"])
    assert metric["evaluate"]["eval_tokens"] == ev["tokens"]


def test_experiment_pages_show_the_runs_and_their_metrics(server):
    base, work, ctx, results = server
    exp = ctx.experiment_id
    parent_name = _get(f"{base}/api/2.0/mlflow/runs/get?run_id={ctx.parent_run_id}")["run"]["info"][
        "run_name"]
    total = len(_search(base, exp))
    # Top level: the pipeline run (stage runs are nested under it) and the run count.
    page = _page(f"{base}/#/experiments/{exp}/runs", work)
    assert "Training runs" in page and parent_name in page
    assert f"{total} matching runs" in page
    # The stage runs, listed by a search on their "stage" tag; saved as a screenshot too.
    listed = f"{base}/#/experiments/{exp}/runs?" + urllib.parse.urlencode(
        # (the UI applies URL search state only together with a non-default sort key)
        {"searchFilter": "tags.stage LIKE '%'", "orderByKey": "metrics.`val_loss`",
         "orderByAsc": "true"}, quote_via=urllib.parse.quote)
    page = _page(listed, work)
    names = [f"{n}-{results[n].key[:8]}" for n in STAGES]
    assert all(name in page for name in names), page[:2000]
    shots = Path(os.environ.get("UI_SCREENSHOT_DIR", work))  # keep them for a human look
    shots.mkdir(parents=True, exist_ok=True)
    shot = shots / "mlflow-stage-runs.png"
    _page(listed, work, screenshot=shot, window="1600,900")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    print(f"screenshot: {shot}")
    # Side by side: every run's name, details and metrics on the compare page.
    ids = [ctx.parent_run_id] + [results[n].run_id for n in STAGES]
    compare = f"{base}/#/compare-runs?" + urllib.parse.urlencode(
        {"runs": json.dumps(ids), "experiments": json.dumps([exp])}, quote_via=urllib.parse.quote)
    page = _page(compare, work)
    assert f"Comparing {len(ids)} Runs" in page
    assert all(name in page for name in names + [parent_name])
    assert " Metrics " in page and " eval_tokens " in page
    # Each stage's own page lists its metrics: the evaluation's, and training's curves.
    ev = results["evaluate"]
    page = _page(f"{base}/#/experiments/{exp}/runs/{ev.run_id}", work)
    for metric in ("val_loss", "perplexity", "eval_tokens"):
        assert f" {metric} " in page, metric
    assert f" {ev.outputs['tokens']} " in page  # the eval_tokens value
    assert " Logged models (1) " in page  # the Hugging Face export as an MLflow model
    train_page = f"{base}/#/experiments/{exp}/runs/{results['train'].run_id}"
    page = _page(train_page, work)
    for metric in ("loss", "lr", "tokens_per_s"):
        assert f" {metric} " in page, metric
    shot = shots / "mlflow-train-run.png"
    _page(train_page, work, screenshot=shot, window="1600,1200")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {shot}")
