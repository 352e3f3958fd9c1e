"""Training-loop throughput: our Trainer vs a minimal plain-PyTorch loop, and GPU MFU.

Default mode (one rank): the same model, batches and optimizer are run through
``model.training.trainer.Trainer.fit`` (with per-step metrics going to a real MLflow store) and
through a ten-line plain PyTorch loop, alternating in rounds so machine noise hits both;
``trainer_ratio`` = trainer tokens/s / plain tokens/s (target >= 0.95).

``--gpu``: trains a ~1B-parameter LLaMA-style model on one device in bf16 and reports
``mfu`` (model FLOPs, see model/flops.py, against the device's bf16 peak; target >= 0.45
on an H200). ``--device cpu --tiny`` runs the same path with a tiny model (for tests).

The last line printed is one JSON object; the same figures, with the commit and machine, go to
benchmarks/results/bench_train.json (bench_train_gpu.json with --gpu; nothing with --tiny).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.results import RESULTS_DIR, report
from model.config import ModelConfig, TrainConfig
from model.flops import param_count
from model.gpt import GPT
from model.parallel.dist_env import DistEnv, init_distributed
from model.parallel.layout import Plan
from model.training.batches import SyntheticBatches
from model.training.metrics import BackgroundSink
from model.training.optim import lr_factor
from model.training.trainer import Trainer

# ~0.98B parameters: 18 layers x d_model 2048, GQA 16/8 heads, SwiGLU 5632, 32k vocabulary (untied).
GPU_MODEL = ModelConfig(family="llama", n_layers=18, d_model=2048, n_heads=16, n_kv_heads=8,
                        ffn_hidden=5632, vocab_size=32768, max_seq_len=2048)
CPU_MODEL = ModelConfig(family="llama", n_layers=4, d_model=128, n_heads=4, vocab_size=2048,
                        max_seq_len=128)
TINY_MODEL = ModelConfig(family="llama", n_layers=2, d_model=32, n_heads=4, vocab_size=256,
                         max_seq_len=32)


def make_tracker(tmp: Path):
    """A real MLflow run in a SQLite store under ``tmp`` (so logging cost is included)."""
    from stages.mechanism import tracking

    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    experiment = tracking.ensure_experiment(uri, "bench-train", tmp)
    return tracking.Tracker(uri, tracking.start_run(uri, experiment, "bench"))


def plain_loop(model_cfg: ModelConfig, cfg: TrainConfig, device: torch.device, steps: int):
    """A generator running ``steps`` plain PyTorch steps per next(); yields their step times."""
    with torch.device("meta"):
        model = GPT(model_cfg)
    model.to_empty(device=device)
    model.init_weights(cfg.seed)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay, **fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    batches = SyntheticBatches(model_cfg.vocab_size, cfg.seq_len, cfg.global_batch, 0, 1, cfg.seed)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")
    while True:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            batch = batches.next_batch().to(device)
            opt.zero_grad(set_to_none=True)
            with amp:
                logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            loss.item()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        yield times


def trainer_steps(trainer: Trainer, steps: int):
    """A generator running ``steps`` more Trainer steps per next(); yields their iteration times.

    Iteration times span the whole loop body (step, metric logging, progress line);
    per-run set-up and the end-of-run summary are excluded, as for the plain loop.
    """
    done = 0
    while True:
        done += steps
        trainer.fit(done, save_final=False)
        yield list(trainer.iteration_times)


def ratio_mode(args, device: torch.device, tmp: Path) -> dict:
    """Trainer vs plain loop tokens/s, alternating rounds."""
    model_cfg = TINY_MODEL if args.tiny else CPU_MODEL
    seq = model_cfg.max_seq_len
    cfg = TrainConfig(steps=10**6, global_batch=args.batch, seq_len=seq, warmup_steps=2,
                      checkpoint_every=0, dtype="float32")
    plan = Plan(micro_batch=args.batch, grad_accum=1, sharding="none")
    trainer = Trainer(model_cfg, cfg, plan, tmp / "trainer",
                      lambda r, n: SyntheticBatches(model_cfg.vocab_size, seq, args.batch, r, n,
                                                    cfg.seed),
                      device, tracker=BackgroundSink(make_tracker(tmp)))
    ours, plain = trainer_steps(trainer, args.steps), plain_loop(model_cfg, cfg, device, args.steps)
    next(ours), next(plain)  # warm-up round
    ours_t, plain_t = [], []
    for r in range(args.rounds):
        ours_t += next(ours)
        plain_t += next(plain)
        print(f"[bench] round {r + 1}/{args.rounds}: "
              f"trainer {statistics.median(ours_t):.4f} s/step, "
              f"plain {statistics.median(plain_t):.4f} s/step", flush=True)
    tokens = args.batch * seq
    # Medians: robust to other processes stealing the (shared) cores for a moment.
    ours_tps = tokens / statistics.median(ours_t)
    plain_tps = tokens / statistics.median(plain_t)
    return {"mode": "ratio", "device": device.type, "params": param_count(model_cfg),
            "tokens_per_step": tokens, "steps_each": len(ours_t),
            "trainer_tokens_per_s": ours_tps, "plain_tokens_per_s": plain_tps,
            "trainer_ratio": ours_tps / plain_tps}


def gpu_mode(args, device: torch.device, tmp: Path) -> dict:
    """Train the ~1B model (or a tiny one) in bf16 on one device; report MFU."""
    model_cfg = TINY_MODEL if args.tiny else GPU_MODEL
    seq = model_cfg.max_seq_len
    cfg = TrainConfig(steps=args.steps, global_batch=args.batch, seq_len=seq, warmup_steps=2,
                      checkpoint_every=0, dtype="bfloat16", compile=args.compile)
    plan = Plan(micro_batch=args.micro_batch or args.batch,
                grad_accum=args.batch // (args.micro_batch or args.batch), sharding="none",
                recompute=args.recompute)
    trainer = Trainer(model_cfg, cfg, plan, tmp / "gpu",
                      lambda r, n: SyntheticBatches(model_cfg.vocab_size, seq, args.batch, r, n,
                                                    cfg.seed),
                      device, peak_tflops=args.peak_tflops)
    summary = trainer.fit(args.steps, save_final=False)
    return {"mode": "gpu", "device": str(device), "params": param_count(model_cfg),
            "peak_tflops": trainer.peak_tflops, "steps": args.steps,
            **{k: summary[k] for k in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu",
                                       "peak_memory_gb", "final_loss")}}


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run one mode, print the JSON result last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true",
                        help="train the ~1B model in bf16, report mfu")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke runs, tests)")
    parser.add_argument("--steps", type=int, default=None, help="steps per round (gpu: total)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating measurement rounds")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="gpu mode: sequences per micro-batch")
    parser.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    parser.add_argument("--compile", action="store_true", help="gpu mode: torch.compile each block")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for mfu")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR),
                        help="where bench_train.json / bench_train_gpu.json go (not with --tiny)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (20 if args.gpu else 6)
    args.batch = args.batch or 8
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = init_distributed(DistEnv(0, 0, 1, "127.0.0.1", 0)) if device_type == "cuda" else None
    if device is None:
        device = torch.device("cpu")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        mode = gpu_mode if args.gpu else ratio_mode
        result = mode(args, device, Path(tmp))
    dist.destroy_process_group()
    report("bench_train_gpu" if args.gpu else "bench_train", result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
