"""System metrics in MLflow: one sampler per node writes the host's CPU and memory (and GPUs,
where a GPU library finds them) into the train and evaluate stage runs, keyed by the node;
on by default on every site, local included."""
from __future__ import annotations

import pytest

from stages.config import ConfigError, load_config
from stages.mechanism import tracking
from tests.evalkit import micro_config, open_pipeline, run_stages

HOST_METRICS = ("cpu_utilization_percentage", "system_memory_usage_megabytes",
                "system_memory_usage_percentage")


@pytest.mark.parametrize(("value", "site", "on"), [
    ("auto", "local", True), ("auto", "slurm", True), ("auto", "frontier", True),
    ("true", "local", True), ("false", "frontier", False), ("false", "local", False)])
def test_the_switch_is_on_by_default_on_every_site(value: str, site: str, on: bool) -> None:
    cfg = load_config("micro", [f"tracking.system_metrics={value}"])
    assert cfg.tracking.system_metrics_on(site) is on


@pytest.mark.parametrize("setting", ["tracking.system_metrics=sometimes",
                                     "tracking.system_metrics=1",
                                     "tracking.system_metrics_interval_s=0"])
def test_a_bad_setting_is_refused_naming_it(setting: str) -> None:
    with pytest.raises(ConfigError, match=setting.split("=")[0].replace(".", r"\.")):
        load_config("micro", [setting])


@pytest.mark.slow
def test_two_ranks_on_one_host_log_one_nodes_metrics_into_train_and_evaluate(
        tokenized_runs_dir) -> None:
    cfg = micro_config(tokenized_runs_dir, "tracking.system_metrics=true",
                       "tracking.system_metrics_interval_s=0.2", "train.steps=30")
    assert cfg.parallel.nproc == 2
    ctx = open_pipeline(cfg)
    results = run_stages(cfg, ctx)
    tracking.end_run(ctx.tracking_uri, ctx.parent_run_id)
    node = tracking.node_id()
    for stage in ("train", "evaluate"):
        run = tracking.get_run(ctx.tracking_uri, results[stage].run_id)
        system = sorted(k for k in run.data.metrics if k.startswith("system/"))
        # every key names the one node: its two ranks sampled it once, not twice
        assert system and {k.split("/")[1] for k in system} == {node}, system
        for name in HOST_METRICS:
            assert f"system/{node}/{name}" in system, (stage, system)
        history = tracking.metric_history(ctx.tracking_uri, run.info.run_id,
                                          f"system/{node}/system_memory_usage_megabytes")
        steps = [step for step, _ in history]
        # a second sampler on the node would log its own step 0, 1, ... beside the first's
        assert len(steps) == len(set(steps)), (stage, steps)
        assert all(value > 0 for _, value in history), history
    # samplers are not the plan's business (its measurement ranks have no tracked run)
    plan = tracking.get_run(ctx.tracking_uri, results["plan"].run_id)
    assert not [k for k in plan.data.metrics if k.startswith("system/")]


@pytest.mark.parametrize("ranks_per_node, nodes, logger, samplers", [
    (2, 1, 1, [1]),  # the micro preset's pp2: the logger rank samples its node
    (2, 1, 0, [0]),
    (4, 2, 6, [0, 6]),  # node 0 by its local rank 0, node 1 by the logger rank
    (4, 2, None, [0, 4]),  # no logger (evaluation): local rank 0 of each node
])
def test_one_rank_a_node_samples_and_the_logger_rank_on_its_node(
        ranks_per_node: int, nodes: int, logger: int | None, samplers: list[int]) -> None:
    ranks = range(ranks_per_node * nodes)
    assert [r for r in ranks if tracking.samples_node(r, r % ranks_per_node, ranks_per_node,
                                                      logger)] == samplers


def test_the_monitors_store_errors_are_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """A full disk under the SQLite store: the monitor's warning would carry the SQL
    statement and every parameter of the failed write; it is the store's one line."""
    import logging

    uri = "sqlite:////runs/mlflow.db"
    emitter = logging.getLogger("test.system_metrics.one_line")
    emitter.addFilter(tracking._OneLineStoreErrors(uri))
    with caplog.at_level(logging.WARNING, logger=emitter.name):
        emitter.warning("Failed to log system metrics: (sqlite3.OperationalError) database or "
                        "disk is full\n[SQL: INSERT INTO metrics ...]\n[parameters: ...]")
        emitter.warning("could not send the last system metrics: %s", "timed out\nretry 2")
    full = tracking.store_full(RuntimeError(tracking.SQLITE_FULL), uri)
    assert [r.getMessage() for r in caplog.records] == [
        f"system metrics not logged: {full}", "could not send the last system metrics: timed out"]
    assert "/runs/mlflow.db" in str(full) and "free space" in str(full)
