"""Does curation change how the default preset trains? The tiny preset's training loss with
curation on (the code preset on the standard library) against off, beside the noise of
training itself: the same run off with another ``train.seed``.

Three trainings of the same preset run here one after another, each through the real stages
(curate, tokenize, plan, train, in this process, ranks by the local launcher) in a runs dir
of its own: ``on`` (the default), ``off`` (``curate.enabled=false``) and ``off_reseeded``
(off, ``train.seed`` + 1). Figures: each run's mean training loss over its last
``--window`` steps, ``curation_effect`` = |on - off|, ``seed_noise`` = |off - off_reseeded|
and their ratio; ``within_noise`` when the effect is no larger than the noise. The curves
go to the results file and a PNG beside it (``--plot``).

    python benchmarks/bench_curate_training.py [--steps 300] [--window 50] [--tiny]

The last line printed is one JSON object; the same figures, with the commit and machine,
go to benchmarks/results/bench_curate_training.json (nothing with --tiny).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import RESULTS_DIR, report
from stages.config import load_config
from stages.mechanism import tracking, tracking_store
from stages.mechanism.attempt import PipelineContext
from stages.mechanism.walk import run_stage
from stages.registry import PIPELINE

STAGES = ("curate", "tokenize", "plan", "train")


def train_losses(runs_dir: Path, overrides: list[str]) -> tuple[list[float], dict]:
    """Run the tiny preset's stages up to training in ``runs_dir``; (its training losses,
    the curate stage's outputs)."""
    cfg = load_config("tiny", [f"tracking.runs_dir={runs_dir}", *overrides])
    uri = tracking_store.default_tracking_uri(cfg.runs_dir)
    experiment = tracking.ensure_experiment(uri, cfg.name, cfg.runs_dir)
    parent = tracking.start_run(uri, experiment, "bench-curate-training")
    ctx = PipelineContext(str(cfg.runs_dir), uri, experiment, parent, pipeline=PIPELINE)
    results: dict = {}
    for name in STAGES:
        stage = PIPELINE.get(name)
        results[name] = run_stage(ctx, stage, cfg, {u: results[u] for u in stage.upstream})
    tracking.end_run(uri, parent)
    summary = json.loads((Path(results["train"].out_dir) / "summary.json").read_text())
    return [float(x) for x in summary["losses"]], results["curate"].outputs


def plot(curves: dict[str, list[float]], path: Path) -> None:
    """The three loss curves in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("tiny preset: curation on vs off, and a reseeded run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1234, help="train.seed of on and off")
    parser.add_argument("--tiny", action="store_true", help="a few steps: the code path only")
    parser.add_argument("--plot", type=Path, default=None,
                        help="PNG of the curves (default: beside the results file)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    steps = 4 if args.tiny else args.steps
    window = min(args.window, steps)
    common = [f"train.steps={steps}", "train.checkpoint_every=0"]
    if args.tiny:
        common += ["data.max_documents=80", "tokenizer.vocab_size=512", "model.vocab_size=512"]
    variants = {"on": [f"train.seed={args.seed}"],
                "off": ["curate.enabled=false", f"train.seed={args.seed}"],
                "off_reseeded": ["curate.enabled=false", f"train.seed={args.seed + 1}"]}
    root = Path(tempfile.mkdtemp(prefix="bench-curate-training-"))
    curves, removed = {}, {}
    try:
        for name, overrides in variants.items():
            curves[name], curated = train_losses(root / name, [*common, *overrides])
            removed[name] = curated.get("removed_documents", 0)
            print(f"{name}: final loss {statistics.fmean(curves[name][-window:]):.4f} "
                  f"(removed {removed[name]} documents)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    final = {name: statistics.fmean(losses[-window:]) for name, losses in curves.items()}
    effect = abs(final["on"] - final["off"])
    noise = abs(final["off"] - final["off_reseeded"])
    figures = {
        "steps": steps, "window": window,
        "final_loss_on": round(final["on"], 4), "final_loss_off": round(final["off"], 4),
        "final_loss_off_reseeded": round(final["off_reseeded"], 4),
        "curation_effect": round(effect, 4), "seed_noise": round(noise, 4),
        "effect_over_noise": round(effect / noise, 3) if noise else None,
        "within_noise": effect <= noise,
        "documents_removed_on": removed["on"],
        "curves": {name: [round(x, 4) for x in losses] for name, losses in curves.items()},
    }
    if not args.tiny:
        plot(curves, args.plot or args.results_dir / "bench_curate_training.png")
    report("bench_curate_training", figures, args)


if __name__ == "__main__":
    main()
