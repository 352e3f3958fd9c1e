"""Cases run on the fake GPU, each in a fresh interpreter (the fake GPU loads before torch):
``python -m tests.fake_gpu_cases CASE``. Prints one JSON line; tests/test_fake_gpu.py runs
them."""
from __future__ import annotations

import json
import sys

from model.rehearsal import fake_gpu

fake_gpu.load_runtime()

import torch  # noqa: E402 (after the fake GPU, on purpose)
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from model.config import ModelConfig, TrainConfig  # noqa: E402
from model.parallel.layout import Plan  # noqa: E402
from model.rehearsal import rehearse  # noqa: E402

MODEL = dict(family="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128,
             vocab_size=256, max_seq_len=64)
PLAN = Plan(tp=1, pp=1, dp=1, micro_batch=1, grad_accum=2, sharding="none")


def stray_tensor() -> dict:
    """A block that adds a host tensor to its output: the rehearsal names where it was made."""
    from model import gpt

    forward = gpt.FeedForward.forward

    def with_host_bias(self: gpt.FeedForward, x: torch.Tensor) -> torch.Tensor:
        return forward(self, x) + torch.zeros(x.shape[-1])  # made on the host by mistake

    gpt.FeedForward.forward = with_host_bias
    try:
        rehearse.rehearse(ModelConfig(**MODEL), TrainConfig(seq_len=32, global_batch=2), PLAN,
                          0, device_type="cuda")
    except rehearse.RehearsalError as exc:
        return {"error": str(exc)}
    return {"error": None}


def attention_kernels() -> dict:
    """Which kernel the GPU attention takes, by dtype and grouped-query heads."""
    out = {}
    with fake_gpu.guarded_cuda(), FakeTensorMode():
        for name, dtype, kv in (("bf16", torch.bfloat16, 2), ("fp32", torch.float32, 4),
                                ("fp32_gqa", torch.float32, 2)):
            q = torch.randn(1, 4, 16, 8, device="cuda", dtype=dtype)
            k = torch.randn(1, kv, 16, 8, device="cuda", dtype=dtype)
            seen: list[str] = []
            with rehearse.StepCounter({}) as counter:
                counter.start_step()
                torch.nn.functional.scaled_dot_product_attention(
                    q, k, k, is_causal=True, enable_gqa=kv != 4)
            seen = sorted(counter.steps[0]["flops"])
            out[name] = seen
    return out


def backward_ops(forward, x: torch.Tensor) -> list[str]:
    """The ops ``forward(x)``'s backward dispatches on fake cuda tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.seen.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    y = forward(x)
    with Ops() as ops:
        y.backward(torch.ones_like(y))
    return [op for op in ops.seen if op != "device"]


def silu_backward_ops() -> dict:
    """The ops SwiGLU's SiLU backward dispatches on fake cuda tensors (a GPU: one kernel)."""
    with fake_gpu.guarded_cuda(), FakeTensorMode():
        x = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return {"ops": backward_ops(torch.nn.functional.silu, x)}


def rms_norm_backward_ops() -> dict:
    """The ops RMSNorm's backward dispatches on fake cuda tensors (a GPU: one kernel)."""
    with fake_gpu.guarded_cuda(), FakeTensorMode():
        norm = torch.nn.RMSNorm(8, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return {"ops": backward_ops(norm, x)}


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]]()))
