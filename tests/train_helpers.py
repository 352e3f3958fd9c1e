"""Shared helpers for the training tests: tiny configs and real multi-rank launches."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from stages.config import load_config
from stages.launch import STACKS_SIGNAL, RankSpec, local_command, rank_environment

REPO = Path(__file__).resolve().parent.parent

TINY = [
    "model.family=llama", "model.n_layers=4", "model.d_model=32", "model.n_heads=4",
    "model.n_kv_heads=2", "model.vocab_size=384", "tokenizer.vocab_size=384",
    "model.max_seq_len=32", "train.seq_len=32", "train.steps=4", "train.global_batch=8",
    "train.warmup_steps=1", "train.checkpoint_every=0", "train.lr=0.01",
]


def tiny_config(*overrides: str):
    """A 4-layer, d_model 32 GQA LLaMA over a 384-token vocabulary, 4 steps of 8 x 32 tokens."""
    return load_config(None, TINY + list(overrides))


def run_worker(
    out_dir: Path, plan: dict[str, Any], nproc: int, *overrides: str, steps: int | None = None,
    timeout: int = 240,
) -> dict[str, Any]:
    """Run stages.train_worker on ``nproc`` gloo ranks (``stages.launch``; plain python for 1).

    Returns the summary.
    """
    cfg = tiny_config(*overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = RankSpec(worker="stages.train_worker", nproc=nproc, nodes=1,
                    out_dir=str(out_dir.resolve()), config=cfg.to_dict(), plan=plan, steps=steps)
    spec_path = spec.write(out_dir / "spec.json")
    if nproc == 1:  # no launcher: the worker runs as a single process
        cmd = [sys.executable, "-m", "stages.train_worker", "--spec", str(spec_path)]
    else:
        cmd = local_command(spec_path)
    proc = subprocess.Popen(cmd, cwd=REPO, env=rank_environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stacks_and_kill(proc)
        raise AssertionError(f"{nproc} ranks did not end in {timeout} s; their stacks "
                             f"(stages.launch.STACKS_SIGNAL):\n{stdout[-3000:]}\n{stderr[-12000:]}"
                             ) from None
    proc = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise AssertionError(f"{nproc} ranks failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}"
                             f"\n{proc.stderr[-6000:]}")
    return json.loads((out_dir / "summary.json").read_text())


def worker_ranks(root: psutil.Process) -> list[psutil.Process]:
    """The ranks at or under ``root`` (``python -m stages.<name>_worker``, not the launcher)."""
    found = []
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            args = proc.cmdline()
            module = args[args.index("-m") + 1:][:1] if "-m" in args else []
            if module and module[0].startswith("stages.") and module[0].endswith("_worker"):
                found.append(proc)
    return found


def _stacks_and_kill(proc: subprocess.Popen) -> tuple[str, str]:
    """Ask every rank under ``proc`` for its stacks, then kill them all; the output."""
    root = psutil.Process(proc.pid)
    tree = [root]
    with contextlib.suppress(psutil.Error):
        tree += root.children(recursive=True)
    for rank in worker_ranks(root):
        with contextlib.suppress(psutil.Error):
            rank.send_signal(STACKS_SIGNAL)
    time.sleep(2.0)  # the stacks are written by the ranks' own signal handlers
    for process in reversed(tree):
        with contextlib.suppress(psutil.Error):
            process.kill()
    return proc.communicate()
