"""Metrics survive a killed rank: the trainer flushes its sink at every checkpoint.

The rank logs through BackgroundSink(Tracker) into a real MLflow SQLite store, with the
tracker's own time-based flush pushed out of reach, so only the checkpoint flush can put
metrics in the store before the rank is killed with SIGKILL.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from model.training.checkpoint import checkpoint_problem, load_extra
from model.training.metrics import BackgroundSink
from stages.mechanism import tracking
from tests.train_helpers import REPO, tiny_config

# One rank: the production sink wiring, then SIGKILL itself as step ``kill_at + 1`` begins.
DRIVER = """
import json, os, signal, sys
from model.parallel.dist_env import from_environ, init_distributed
from model.parallel.layout import Plan
from model.training.batches import SyntheticBatches
from model.training.metrics import BackgroundSink
from model.training.trainer import Trainer
from stages.config import config_from_dict
from stages.mechanism.tracking import Tracker

args = json.loads(sys.argv[1])
cfg = config_from_dict(args["config"])
t = cfg.train
device = init_distributed(from_environ())
trainer = Trainer(cfg.model, t, Plan.from_dict(args["plan"]), args["out_dir"],
                  lambda r, n: SyntheticBatches(cfg.model.vocab_size, t.seq_len,
                                                t.global_batch, r, n, t.seed), device)
trainer.tracker = BackgroundSink(Tracker(args["uri"], args["run_id"], flush_seconds=3600))
step = trainer.train_step

def train_step(batch):
    if trainer.step == args["kill_at"]:
        os.kill(os.getpid(), signal.SIGKILL)
    return step(batch)

trainer.train_step = train_step
trainer.fit()
"""
KEYS = ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "peak_memory_gb")


def _store(tmp_path: Path, seed_store) -> tuple[str, str]:
    """A run in a new store in ``tmp_path`` (a copy of the session's migrated store)."""
    uri = seed_store(tmp_path)
    experiment = tracking.ensure_experiment(uri, "reliability", tmp_path)
    return uri, tracking.start_run(uri, experiment, "train")


def test_killed_rank_has_delivered_every_metric_up_to_its_checkpoint(tmp_path, seed_store
                                                                     ) -> None:
    uri, run_id = _store(tmp_path, seed_store)
    cfg = tiny_config("train.steps=8", "train.checkpoint_every=3")
    args = {"config": cfg.to_dict(), "plan": {"micro_batch": 8, "sharding": "none"},
            "out_dir": str(tmp_path / "train"), "uri": uri, "run_id": run_id, "kill_at": 6}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    ckpt = tmp_path / "train" / "checkpoints" / "step-00000006"
    assert checkpoint_problem(ckpt) is None
    for key in KEYS:
        steps = [s for s, _ in tracking.metric_history(uri, run_id, key)]
        assert sorted(steps) == list(range(1, 7)), (key, steps)
    logged = dict(tracking.metric_history(uri, run_id, "loss"))
    saved = load_extra(ckpt)["losses"]
    assert [logged[s] for s in range(1, 7)] == saved  # the same numbers the checkpoint holds


class _SlowTracker(tracking.Tracker):
    """A real Tracker whose every batch write first waits (a slow tracking server)."""

    def flush(self) -> None:
        time.sleep(0.05)
        super().flush()


def test_background_flush_waits_for_every_queued_write(tmp_path, seed_store) -> None:
    uri, run_id = _store(tmp_path, seed_store)
    sink = BackgroundSink(_SlowTracker(uri, run_id, flush_seconds=0))  # a write per step
    for step in range(1, 21):
        sink.log_metrics({"loss": 1.0 / step, "lr": 0.5}, step=step)
    sink.flush()  # returns only when every queued write is in the store
    assert [s for s, _ in tracking.metric_history(uri, run_id, "loss")] == list(range(1, 21))
    assert dict(tracking.metric_history(uri, run_id, "loss"))[20] == 1.0 / 20
    sink.close()


def test_the_sink_drops_the_steps_the_run_already_holds(tmp_path, seed_store) -> None:
    """A resumed try recomputes steps 4-6 bitwise; the run keeps the first try's records of
    them, once each, and takes steps 7-8 from the second."""
    uri, run_id = _store(tmp_path, seed_store)
    first = BackgroundSink(tracking.Tracker(uri, run_id))
    for step in range(1, 7):
        first.log_metrics({"loss": float(step)}, step=step)
    first.close()
    asked: list[int] = []

    def held() -> int:
        asked.append(tracking.last_step(uri, run_id, "loss"))
        return asked[-1]

    again = BackgroundSink(tracking.Tracker(uri, run_id), logged_through=held)
    for step in range(4, 9):
        again.log_metrics({"loss": 100.0 + step}, step=step)
    again.close()
    assert asked == [6]
    history = tracking.metric_history(uri, run_id, "loss")
    assert sorted(history) == [(s, float(s)) for s in range(1, 7)] + [(7, 107.0), (8, 108.0)]


def test_a_tracker_opens_the_store_at_its_first_write(tmp_path, seed_store) -> None:
    """A rank builds its sink before training and sends from the sink's thread: building the
    tracker must not import MLflow (seconds the other ranks would wait)."""
    uri, run_id = _store(tmp_path, seed_store)
    probe = ("import sys\nfrom stages.mechanism.tracking import Tracker\n"
             f"tracker = Tracker({uri!r}, {run_id!r})\n"
             "print('mlflow' in sys.modules)\n"
             "tracker.log_metrics({'loss': 1.0}, step=1)\ntracker.flush()\n"
             "print('mlflow' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "True"]
    assert tracking.metric_history(uri, run_id, "loss") == [(1, 1.0)]


def test_a_sink_that_cannot_tell_what_the_run_holds_sends_every_step(tmp_path, seed_store,
                                                                      capsys) -> None:
    uri, run_id = _store(tmp_path, seed_store)

    def unreadable() -> int:
        raise json.JSONDecodeError("Expecting value", "{", 1)

    sink = BackgroundSink(tracking.Tracker(uri, run_id), logged_through=unreadable)
    for step in range(1, 4):
        sink.log_metrics({"loss": float(step)}, step=step)
    sink.close()
    assert [s for s, _ in tracking.metric_history(uri, run_id, "loss")] == [1, 2, 3]
    said = [line for line in capsys.readouterr().out.splitlines() if "[metrics]" in line]
    assert len(said) == 1 and "every step is sent" in said[0], said
