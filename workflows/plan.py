"""The planner's command line: the best plans for a model on a cluster.

Command line::

    python -m workflows.plan --model CONFIG.yaml --cluster frontier --devices 3072 \\
        --global-batch 3072 [--seq-len 2048] [--json] [--explain] [--tokens N] [--rehearse]

CONFIG.yaml is a full pipeline preset or a bare mapping of model shapes (ModelConfig names
or common aliases such as num_layers / hidden_size / num_attention_heads). The choosing is
``model.planner.choose``'s, as in the plan stage; it lives here, with the drivers, because a
pipeline preset is read with the pipeline's own config loader. ``--rehearse`` rehearses as
the plan stage does, giving way to the next best plan when one does not fit, and says so.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

from model.config import ModelConfig, TrainConfig
from model.parallel.layout import LAYOUT_FIELDS, Plan
from model.planner.calibration import load_calibration
from model.planner.choose import FIX_TYPES, choose, fixed_fields, parse_fix
from model.planner.microbench import load_measured_cluster
from model.planner.model_file import read_model_file
from model.planner.run_cost import plan_run_cost
from model.planner.search import explain
from model.planner.shapes import Shapes
from model.rehearsal.plans import GiveWay, rehearse_until_one_fits


def load_model_file(path: str | Path) -> tuple[ModelConfig, TrainConfig | None, Any]:
    """(model, train or None, full PipelineConfig or None) from a preset or a bare model mapping."""
    model_cfg, _ = read_model_file(path)
    if model_cfg is not None:
        return model_cfg, None, None
    from stages.config import load_config

    cfg = load_config(Path(path))
    return cfg.model, cfg.train, cfg


def explain_text(plan: Plan, ex: dict[str, Any]) -> str:
    """The step-time and memory breakdown of one plan as printable lines."""
    step = ex["step_time_s"]
    lines = [f"plan {plan.describe()}: {step:.4g} s per step", "step time (s per step):"]
    for k, v in ex["step"].items():
        lines.append(f"  {k:<26} {v:>11.4g}  {v / step:>6.1%}")
    lines.append(f"  {'sum':<26} {sum(ex['step'].values()):>11.4g}")
    lines.append("communication hidden under compute (not in the sum):")
    for k, v in ex["overlapped"].items():
        lines.append(f"  {k:<26} {v:>11.4g}")
    lines.append("memory (GB per device):")
    for k, v in ex["memory_gb"].items():
        lines.append(f"  {k:<26} {v:>11.4g}")
    for k, v in ex["parameters"].items():
        lines.append(f"  {k + ' (count)':<26} {v:>11.4g}")
    return "\n".join(lines)


def token_count(text: str) -> float:
    """``--tokens`` as a positive number of tokens (``20e12`` or ``20000000000000``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of tokens: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"the token budget must be positive, got {text!r}")
    return value


class Priced(NamedTuple):
    """What ``main`` prints: the plan, the search's result (None when every field was fixed),
    the rehearsal's give-way (with --rehearse), the breakdown (with --explain or --json) and
    the run's cost (with --tokens or a preset's steps)."""

    plan: Plan
    result: Any
    kept: GiveWay | None
    explained: dict | None
    cost: Any


def plan_and_price(args: argparse.Namespace) -> Priced:
    """Choose (and with ``--rehearse`` rehearse) the plan ``main``'s arguments ask for, and
    price it. Raises ValueError (PlanError among them) for bad input or no plan."""
    model_cfg, train_cfg, full = load_model_file(args.model)
    cluster = load_measured_cluster(args.cluster, args.devices, cache_path=args.cache)
    seq = args.seq_len or (train_cfg.seq_len if train_cfg else model_cfg.max_seq_len)
    model_cfg.max_seq_len = max(model_cfg.max_seq_len, seq)
    dtype = args.dtype or (train_cfg.dtype if train_cfg else
                           ("float32" if cluster.measured else "bfloat16"))
    train = TrainConfig(global_batch=args.global_batch, seq_len=seq, dtype=dtype)
    cal = load_calibration(args.calibration)
    fixed = fixed_fields(full.parallel) if full is not None else {}
    fixed.update(parse_fix(args.fix))
    plan, result = choose(model_cfg, train, cluster, args.devices, fixed, cal, top_k=args.top)
    kept: GiveWay | None = None
    if args.rehearse:
        # the plan stage's rule: a plan that does not fit by its rehearsal gives way to the
        # next best; in --json mode the rehearsal's lines go to stderr, the JSON to stdout
        log_to = sys.stderr if args.json else sys.stdout
        kept = rehearse_until_one_fits(
            model_cfg, train, cluster, args.devices, plan,
            result.plans if result is not None else [], cal,
            log=lambda line: print(line, file=log_to, flush=True))
        plan = kept.plan
    ex = explain(Shapes.from_configs(model_cfg, train, cluster), cluster, plan, args.devices,
                 args.global_batch, cal) if args.explain or args.json else None
    cost = None
    if args.tokens is not None or train_cfg is not None:
        cost = plan_run_cost(plan.predictions, model_cfg, args.global_batch, seq, cluster,
                             args.devices, tokens=args.tokens,
                             steps=None if args.tokens is not None else train_cfg.steps,
                             checkpoint_every=train_cfg.checkpoint_every if train_cfg else 0)
    return Priced(plan, result, kept, ex, cost)


def main(argv: list[str] | None = None) -> int:
    """Print the best plans for a model on a cluster (or one JSON object with --json).

    ``--fix NAME=VALUE`` fixes any plan field (a preset's ``parallel:`` fields are fixed too,
    the command line winning); with every field fixed the one plan is priced. ``--explain``
    adds the step-time and memory breakdown of the chosen plan. ``--tokens N`` prices a run
    of N tokens with the chosen plan (``model.planner.run_cost``); without it a preset's
    ``train.steps`` steps are priced (a bare model file prices nothing).
    """
    ap = argparse.ArgumentParser(
        description="Choose a parallel plan from the memory and time models."
    )
    ap.add_argument("--model", required=True, help="pipeline preset or model-shape YAML")
    ap.add_argument("--cluster", required=True, help="cluster name (configs/clusters) or YAML path")
    ap.add_argument("--devices", type=int, required=True, help="number of ranks (GPUs/GCDs)")
    ap.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    ap.add_argument("--top", type=int, default=10, help="plans to show")
    ap.add_argument("--calibration", default=None, help="calibration JSON from a refined plan run")
    ap.add_argument("--cache", default=None, help="microbenchmark cache file (measured clusters)")
    ap.add_argument("--fix", action="append", default=[], metavar="NAME=VALUE",
                    help=f"fix a plan field ({', '.join(FIX_TYPES)}); repeatable")
    ap.add_argument("--explain", action="store_true",
                    help="print the step-time and memory breakdown of the chosen plan")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tokens", type=token_count, default=None, metavar="N",
                    help="price a whole run of N tokens (e.g. 20e12) with the chosen plan; "
                         "default: the preset's train.steps steps")
    ap.add_argument("--rehearse", action="store_true",
                    help="rehearse the chosen plan's first and last stage ranks on fake tensors "
                         "of the cluster's device type and report their peak memory, FLOPs "
                         "and collective bytes beside the model's; a plan that does not fit "
                         "by its rehearsal gives way to the next best, as in the plan stage "
                         "(up to 5 plans; under 2 minutes a rank)")
    args = ap.parse_args(argv)
    try:
        plan, result, kept, ex, cost = plan_and_price(args)
    except ValueError as exc:  # bad input or no plan (PlanError is one): the cause, no trace
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {k: getattr(plan, k) for k in LAYOUT_FIELDS}
        out.update({k: plan.predictions[k] for k in ("step_time_s", "tokens_per_s",
                                                     "tflops_per_device", "mfu",
                                                     "memory_gb_per_device")})
        out["search_seconds"] = result.seconds if result else 0.0
        out["breakdown"] = {**ex["step"], **ex["overlapped"]}
        out["memory_breakdown"] = {**ex["memory_gb"], **ex["parameters"]}
        if kept is not None:
            out["rehearsal"] = kept.records if kept.error is None else {"error": kept.error}
            out["rehearsal_rejected"] = kept.rejected
        out["run_cost"] = cost.to_dict() if cost is not None else None
        print(json.dumps(out))
        return 0
    if result is not None:
        print(result.table(args.top))
    else:
        pr = plan.predictions
        print(f"priced plan {plan.describe()}: {pr['step_time_s']:.4g} s/step, "
              f"{pr['tokens_per_s']:.5g} tokens/s, {pr['tflops_per_device']:.3g} TFLOPS per "
              f"device, MFU {pr['mfu']:.1%}, {pr['memory_gb_per_device']:.2f} GB per device")
    if args.explain:
        print(explain_text(plan, ex))
    if cost is not None:
        print("\n".join(cost.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
