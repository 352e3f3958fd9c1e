"""Does curation change how the default preset learns? The tiny preset with curation on (the
code preset on the standard library) against off, beside the noise of training itself: the
same run off with another ``train.seed``.

Three trainings of the same preset run here one after another, each through the real stages
(curate, tokenize, plan, train, in this process, ranks by the local launcher) in a runs dir
of its own: ``on`` (the default), ``off`` (``curate.enabled=false``) and ``off_reseeded``
(off, ``train.seed`` + 1).

Training losses cannot settle it: the runs train on different text (curation removes the
codec tables and other predictable files, so the curated run's training loss is higher on
its own). The held-out loss can, on one set for all three: the evaluation stage scores each
final checkpoint on the curated run's validation split (``common``: the held-out documents
curation keeps; the split is by document hash and the tokenizer is trained on the raw sample,
so the same documents and token ids in every run) and on the uncurated one's (``full``: the
removed documents included). Figures: each run's held-out loss on both sets, and per set
``curation_effect`` = |on - off| against ``seed_noise`` = |off - off_reseeded|;
``within_noise`` when the effect on the common set is no larger than the noise there. The
last ``--window`` steps' mean training losses and the curves go to the results file too, and
the curves to a PNG beside it (``--plot``).

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


VARIANTS = ("on", "off", "off_reseeded")
STORES = {"common": "on", "full": "off"}
HELDOUT_TOKENS = 1 << 20  # more than the tiny preset's validation split holds
"""Held-out set -> the run whose validation split it is."""


class Run:
    """One variant's stages, run up to training in a runs dir of its own."""

    def __init__(self, runs_dir: Path, overrides: list[str]) -> None:
        # No Hugging Face model logged per evaluation: only the held-out loss is read, over
        # the whole validation split (about 90k tokens; the preset scores 32k).
        self.cfg = load_config("tiny", [f"tracking.runs_dir={runs_dir}", "eval.log_model=false",
                                        f"eval.max_tokens={HELDOUT_TOKENS}", *overrides])
        uri = tracking_store.default_tracking_uri(self.cfg.runs_dir)
        experiment = tracking.ensure_experiment(uri, self.cfg.name, self.cfg.runs_dir)
        self.parent = tracking.start_run(uri, experiment, "bench-curate-training")
        self.ctx = PipelineContext(str(self.cfg.runs_dir), uri, experiment, self.parent,
                                   pipeline=PIPELINE)
        self.results: dict = {}
        for name in STAGES:
            stage = PIPELINE.get(name)
            self.results[name] = run_stage(self.ctx, stage, self.cfg,
                                           {u: self.results[u] for u in stage.upstream})

    def losses(self) -> list[float]:
        """The training loss of every step."""
        summary = json.loads((Path(self.results["train"].out_dir) / "summary.json").read_text())
        return [float(x) for x in summary["losses"]]

    def heldout_loss(self, store: Run) -> float:
        """The evaluation stage's held-out loss of this run's final checkpoint on ``store``'s
        validation split."""
        evaluated = run_stage(self.ctx, PIPELINE.get("evaluate"), self.cfg,
                              {"tokenize": store.results["tokenize"],
                               "train": self.results["train"]})
        return float(evaluated.outputs["val_loss"])

    def tokenizer_hash(self) -> str:
        """The hash of the tokenizer its store was encoded with."""
        prepared = Path(self.results["tokenize"].out_dir) / "prepared.json"
        return json.loads(prepared.read_text())["tokenizer_hash"]

    def close(self) -> None:
        tracking.end_run(self.ctx.tracking_uri, self.parent)


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
    try:
        runs = {}
        for name in VARIANTS:
            runs[name] = Run(root / name, [*common, *variants[name]])
            print(f"{name}: trained (curation removed "
                  f"{runs[name].results['curate'].outputs.get('removed_documents', 0)} "
                  "documents)", flush=True)
        hashes = {run.tokenizer_hash() for run in runs.values()}
        if len(hashes) != 1:
            raise SystemExit(f"the runs' tokenizers differ ({sorted(hashes)}): their held-out "
                             "losses are not comparable")
        heldout = {held: {name: runs[name].heldout_loss(runs[owner]) for name in VARIANTS}
                   for held, owner in STORES.items()}
        curves = {name: runs[name].losses() for name in VARIANTS}
        removed = runs["on"].results["curate"].outputs.get("removed_documents", 0)
        for run in runs.values():
            run.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for held, losses in heldout.items():
        print(f"held-out loss on the {held} set: " +
              ", ".join(f"{name} {loss:.4f}" for name, loss in losses.items()), flush=True)
    final = {name: statistics.fmean(losses[-window:]) for name, losses in curves.items()}
    effect = {held: abs(x["on"] - x["off"]) for held, x in heldout.items()}
    noise = {held: abs(x["off"] - x["off_reseeded"]) for held, x in heldout.items()}
    figures = {
        "steps": steps, "window": window,
        "heldout_loss": {held: {name: round(v, 4) for name, v in x.items()}
                         for held, x in heldout.items()},
        "curation_effect": {held: round(v, 4) for held, v in effect.items()},
        "seed_noise": {held: round(v, 4) for held, v in noise.items()},
        "effect_over_noise": round(effect["common"] / noise["common"], 3)
        if noise["common"] else None,
        "within_noise": effect["common"] <= noise["common"],
        "final_training_loss": {name: round(v, 4) for name, v in final.items()},
        "documents_removed_on": removed,
        "curves": {name: [round(x, 4) for x in losses] for name, losses in curves.items()},
    }
    if not args.tiny:
        plot(curves, args.plot or args.results_dir / "bench_curate_training.png")
    report("bench_curate_training", figures, args)


if __name__ == "__main__":
    main()
