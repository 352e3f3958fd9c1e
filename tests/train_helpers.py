"""Shared helpers for the training tests: tiny configs and real multi-rank launches."""
from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from stages.config import load_config
from stages.mechanism.launch import RankSpec, rank_environment
from tests.rank_zygote import local_launch_env, run_forked, torchrun_ranks

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
    """Run stages.train.worker on ``nproc`` gloo ranks, as ``stages.mechanism.launch`` starts them
    (plain
    ``python -m stages.train.worker`` for 1), forked from this worker's warm interpreter
    (``tests.rank_zygote``). Returns the summary."""
    cfg = tiny_config(*overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = RankSpec(worker="stages.train.worker", nproc=nproc, nodes=1,
                    out_dir=str(out_dir.resolve()), config=cfg.to_dict(), plan=plan, steps=steps)
    spec_path = spec.write(out_dir / "spec.json")
    code, stdout, stderr = run_ranks(spec.worker, spec_path, nproc, timeout)
    if code != 0:
        raise AssertionError(f"{nproc} ranks failed (rc {code}):\n{stdout[-3000:]}"
                             f"\n{stderr[-6000:]}")
    return json.loads((out_dir / "summary.json").read_text())


def launch_with(out: Path, cfg, plan: dict[str, Any], var: str, value: dict | None,
                nproc: int = 2, timeout: float = 240,
                tracking: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The training ranks of ``cfg`` and ``plan`` in ``out``, with the environment variable
    ``var`` set to ``value`` as JSON (a fault or stall switch; unset when None): (exit code,
    stdout, stderr)."""
    import os

    out.mkdir(parents=True, exist_ok=True)
    spec = RankSpec(worker="stages.train.worker", nproc=nproc, nodes=1,
                    out_dir=str(out.resolve()), config=cfg.to_dict(), plan=plan,
                    tracking=tracking)
    env = {k: v for k, v in os.environ.items() if k != var}
    if value is not None:
        env[var] = json.dumps(value)
    return run_ranks(spec.worker, spec.write(out / "spec.json"), nproc, timeout, env)


def run_ranks(worker: str, spec_path: Path, nproc: int, timeout: float,
              base_env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The ``nproc`` ranks of the spec at ``spec_path`` as a forked launch
    (``tests.rank_zygote``): their exit code as a shell reports it, stdout and stderr. A launch
    that runs past ``timeout`` prints its ranks' stacks and fails the test. ``base_env``:
    the environment the launch starts from (default this process's)."""
    env = rank_environment(base_env)
    with tempfile.TemporaryDirectory(prefix="launch-") as scratch:
        if nproc > 1:  # what stages.mechanism.launch.LocalRanks gives rank 0
            env = local_launch_env(env, nproc, str(Path(scratch) / "store"))
        return _forked({"module": worker}, ["--spec", str(spec_path)], env, Path(scratch),
                       f"{nproc} ranks", timeout)


def run_script_ranks(script: Path, argv: list[str], nproc: int, timeout: float
                     ) -> tuple[int, str, str]:
    """``torchrun --standalone --nproc-per-node nproc script *argv``, its ranks forked
    (``tests.rank_zygote``): their exit code as a shell reports it, stdout and stderr."""
    with tempfile.TemporaryDirectory(prefix="launch-") as scratch:
        return _forked({"path": str(script), "ranks": torchrun_ranks(nproc)}, argv,
                       rank_environment(), Path(scratch), f"{script} on {nproc} ranks", timeout)


def run_function_ranks(function: Callable[..., None], args: list[Any], nproc: int,
                       timeout: float = 240) -> tuple[int, str, str]:
    """``function(rank, *args)`` in each of ``nproc`` ranks forked (``tests.rank_zygote``) with
    the identities ``torchrun --standalone`` gives: their exit code as a shell reports it,
    stdout and stderr. ``function`` is a module-level function of an importable module;
    ``args`` go through JSON (tuples arrive as lists)."""
    target = {"call": f"{function.__module__}:{function.__qualname__}",
              "ranks": torchrun_ranks(nproc)}
    with tempfile.TemporaryDirectory(prefix="launch-") as scratch:
        return _forked(target, [json.dumps(args)], rank_environment(), Path(scratch),
                       f"{function.__qualname__} on {nproc} ranks", timeout)


def _forked(target: dict[str, Any], argv: list[str], env: dict[str, str], scratch: Path,
            what: str, timeout: float) -> tuple[int, str, str]:
    """``rank_zygote.run_forked`` with its output in ``scratch``: the exit code, stdout and
    stderr; past ``timeout``, an AssertionError with the ranks' stacks."""
    out, err = scratch / "stdout", scratch / "stderr"
    try:
        code = run_forked(target, argv, env, out, err, timeout)
    except TimeoutError:
        raise AssertionError(
            f"{what} did not end in {timeout} s; their stacks "
            "(stages.mechanism.launch.STACKS_SIGNAL):"
            f"\n{out.read_text()[-3000:]}\n{err.read_text()[-12000:]}") from None
    return code, out.read_text(errors="replace"), err.read_text(errors="replace")


def worker_ranks(root: psutil.Process) -> list[psutil.Process]:
    """The ranks at or under ``root`` (``python -m stages.<name>.worker`` or another rank
    worker of a stage, not the launcher)."""
    found = []
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            args = proc.cmdline()
            module = args[args.index("-m") + 1:][:1] if "-m" in args else []
            if module and module[0].startswith("stages.") and module[0].endswith("worker"):
                found.append(proc)
    return found
