"""A GPU for the rehearsal on a box without one: fake ``cuda`` tensors through the whole
training step, the backward pass included.

Under ``FakeTensorMode`` a CPU-only torch makes ``cuda`` tensors (shape, dtype, device, no
storage) and runs every op on them, so one rank of a GPU plan can run as it would on its
GPU: device mesh, FSDP2, pipeline stages, bf16 autocast, the GPU's attention kernels and
the optimizer all see device type ``cuda``. ROCm's torch uses the same device type, so
this stands for the MI250X as for the H100. What the CPU-only build refuses is guarded
here, in one place (docs/planner.md lists each refusal and the call that made it):

- in C++ (``fake_gpu.cpp``, built once per torch into the cache dir and loaded before
  torch is imported, so one rank per fresh process): the ``cuda`` device guard and the
  CUDA hooks that autograd's engine asks for in backward;
- in Python (``GUARDED``, installed by ``guarded_cuda``): the ``torch.cuda`` runtime
  queries, streams and events FSDP2 and autocast call.

``model.rehearsal.rank_server`` (``python -m model.rehearsal.rank_server cuda FD``) is such a
process: it loads the runtime, then imports torch, and forks a process per rank it
rehearses on ``cuda``.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from model.planner.microbench_cache import default_cache_dir

SOURCE = Path(__file__).with_suffix(".cpp")
"""The device guard and CUDA hooks of the fake GPU."""

LIBRARY_NAME = "frontier_llm_fake_gpu"


LOADED_VARIABLE = "FRONTIER_LLM_FAKE_GPU"
"""Set in a process that has loaded the fake GPU (``load_runtime``)."""


class FakeGpuError(RuntimeError):
    """The fake GPU cannot be built or loaded here; the message says what to fix."""


def library_dir() -> Path:
    """Where this torch's build of the fake GPU lives: the cache dir, by torch version and
    source digest (a new torch or a changed source builds afresh)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    version = importlib.metadata.version("torch")
    return default_cache_dir() / f"fake-gpu-torch{version}-{digest}"


def library_path() -> Path:
    """The fake GPU's shared library, built first if this torch has none yet (a few seconds,
    in a child process: building imports torch, which must not happen before loading)."""
    target = library_dir() / f"{LIBRARY_NAME}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # the interpreter's own bin dir first: pip's ninja lives there, unactivated or not
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    proc = subprocess.run([sys.executable, "-m", "model.rehearsal.fake_gpu", "--build",
                           str(target.parent)], capture_output=True, text=True, check=False,
                          cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PATH": path})
    if proc.returncode != 0 or not target.exists():
        raise FakeGpuError(
            "building the rehearsal's fake GPU (model/rehearsal/fake_gpu.cpp) failed; it needs "
            f"a C++ compiler (c++) and ninja on PATH:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return target


def build(out_dir: Path) -> Path:
    """Compile ``SOURCE`` against this torch into ``out_dir`` (torch's extension builder,
    linked with an rpath to torch's libraries so that it loads before torch). The library
    is built in a scratch dir beside ``out_dir`` and renamed into place."""
    import tempfile

    import torch.utils.cpp_extension as cpp

    torch_lib = Path(importlib.util.find_spec("torch").origin).parent / "lib"
    with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
        built = cpp.load(LIBRARY_NAME, [str(SOURCE)], build_directory=scratch,
                         extra_ldflags=[f"-Wl,-rpath,{torch_lib}"], is_python_module=False,
                         with_cuda=False)
        target = out_dir / f"{LIBRARY_NAME}.so"
        os.replace(built, target)
    return target


def load_runtime() -> None:
    """Load the fake GPU into this process. Must come before ``import torch``: torch reads
    its CUDA hooks once, at their first use."""
    if "torch" in sys.modules:
        raise FakeGpuError("the fake GPU must be loaded before torch is imported: rehearse "
                           "on cuda in a fresh process (rehearse_isolated does)")
    ctypes.CDLL(str(library_path()), mode=ctypes.RTLD_GLOBAL)
    os.environ[LOADED_VARIABLE] = "1"


def runtime_loaded() -> bool:
    """Whether this process loaded the fake GPU."""
    return os.environ.get(LOADED_VARIABLE) == "1" and "torch" in sys.modules


def _stand_ins() -> dict[str, Any]:
    """``torch.cuda`` attribute -> what the rehearsal on the fake GPU answers instead."""
    import torch

    return {
        # autocast and FSDP2 ask first; the CPU-only build says no (it has no CUDA runtime)
        "is_available": lambda: True,
        "is_bf16_supported": lambda including_emulation=True: True,
        # FSDP2 places its parameters on torch.device("cuda", current_device())
        "current_device": lambda: 0,
        "device_count": lambda: 1,
        "set_device": lambda device: None,
        # FSDP2's all-gather / reduce-scatter streams and the events that order them:
        # without storage nothing runs asynchronously, so program order is the order
        "Stream": torch.cpu.Stream,
        "Event": torch.cpu.Event,
        "current_stream": torch.cpu.current_stream,
        "stream": torch.cpu.stream,
        "synchronize": lambda device=None: None,
        # the pipeline schedule forks the device's RNG around its first step; a fake GPU
        # draws no random numbers, so there is no state to save or restore
        "get_rng_state": lambda device="cuda": torch.empty(0, dtype=torch.uint8),
        "set_rng_state": lambda new_state, device="cuda": None,
        # the trainer names the GPU to look up its peak (MFU); the rehearsal reads no MFU
        "get_device_name": lambda device=None: "",
    }


def gpu_attention(original: Callable[..., Any]) -> Callable[..., Any]:
    """``scaled_dot_product_attention`` choosing its kernel as torch's CUDA and ROCm builds
    do for the trainer's calls (no mask, no dropout): flash attention for bf16/fp16 with
    head_dim <= 256 (grouped-query heads natively), else memory-efficient attention without
    grouped-query heads, else ``original`` (the math kernel). A CPU-only torch has no CUDA
    kernel choice and would take the math kernel, which keeps every T x T score matrix."""
    import torch

    aten = torch.ops.aten

    def attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> Any:
        if query.device.type != "cuda" or attn_mask is not None:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                            enable_gqa=enable_gqa)
        if torch.is_autocast_enabled("cuda"):  # autocast casts the op's inputs on a GPU
            low = torch.get_autocast_dtype("cuda")
            query, key, value = (t.to(low) for t in (query, key, value))
        if query.dtype in (torch.float16, torch.bfloat16) and query.size(-1) <= 256:
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if not enable_gqa:
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, None, True, dropout_p, is_causal, scale=scale)[0]
        return original(query, key, value, None, dropout_p, is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    return attention


def gpu_rms_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    """``rms_norm`` as torch's GPU builds run it: one fused kernel (``_fused_rms_norm``)
    that saves its input and the per-row reciprocal RMS (float32) for backward, and one
    fused backward kernel (``_fused_rms_norm_backward``) that makes only the input's and the
    weight's gradients. A CPU-only torch decomposes both into elementwise ops that save and
    make more (float32 temporaries of the input's size). ``original`` serves the CPU."""
    import torch

    class FusedRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, eps: float) -> Any:
            # allocates what the kernel does: the output and one float32 per row
            norm = torch.linalg.vector_norm(x, 2, -1, keepdim=True, dtype=torch.float32)
            rstd = torch.rsqrt(norm.pow_(2).div_(x.shape[-1]).add_(eps))
            ctx.save_for_backward(x, weight, rstd)
            out = x * rstd.to(x.dtype)
            return out.mul_(weight) if weight is not None else out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            x, weight, rstd = ctx.saved_tensors
            dx, dw = torch.ops.aten._fused_rms_norm_backward(
                grad, x, [x.shape[-1]], rstd, weight, [True, weight is not None])
            if dw is not None and dw.dtype != weight.dtype:
                dw = dw.to(weight.dtype)
            return dx, dw, None

    def rms_norm(input: Any, normalized_shape: Any, weight: Any = None,
                 eps: float | None = None) -> Any:
        if input.device.type != "cuda" or len(normalized_shape) != 1:
            return original(input, normalized_shape, weight, eps)
        return FusedRMSNorm.apply(input, weight,
                                  torch.finfo(input.dtype).eps if eps is None else eps)

    return rms_norm


GUARDED = ("is_available", "is_bf16_supported", "current_device", "device_count",
           "set_device", "Stream", "Event", "current_stream", "stream", "synchronize",
           "get_rng_state", "set_rng_state", "get_device_name")
"""The ``torch.cuda`` attributes ``guarded_cuda`` answers for a CPU-only torch."""


def gpu_kernels() -> Any:
    """A ``torch.library`` registration of CUDA kernels for the ops a CPU-only torch
    decomposes on ``cuda`` tensors, or lacks, where a GPU build runs one kernel:
    ``silu_backward`` (SwiGLU's backward), whose composite form makes five more full-size
    temporaries the rehearsal would count, and ``_fused_rms_norm_backward`` (``gpu_rms_norm``'s
    backward). Under fake tensors the kernels themselves never run (fake mode answers the
    op); they compute what the composite forms do. ``_destroy()`` removes them."""
    import torch

    def silu_backward(grad_output: Any, x: Any) -> Any:
        sigmoid = torch.sigmoid(x)
        return grad_output * sigmoid * (1 + x * (1 - sigmoid))

    def rms_norm_backward(grad: Any, x: Any, normalized_shape: Any, rstd: Any, weight: Any,
                          output_mask: Any) -> Any:
        normed = x.float() * rstd
        g = grad.float() * weight.float() if weight is not None else grad.float()
        dx = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        dw = None
        if weight is not None and output_mask[1]:
            dw = (grad.float() * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return dx.to(x.dtype), dw

    library = torch.library.Library("aten", "IMPL")
    library.impl("silu_backward", silu_backward, "CUDA")
    library.impl("_fused_rms_norm_backward", rms_norm_backward, "CUDA")
    return library


@contextlib.contextmanager
def guarded_cuda() -> Iterator[None]:
    """Answer ``GUARDED`` on ``torch.cuda`` while open (a CPU-only torch with the fake GPU
    loaded); everything is restored on exit."""
    import torch

    if not runtime_loaded():
        raise FakeGpuError("the fake GPU is not loaded in this process (load_runtime)")
    stand_ins = _stand_ins()
    saved = {name: getattr(torch.cuda, name) for name in GUARDED}
    functional = torch.nn.functional
    sdpa, rms_norm = functional.scaled_dot_product_attention, functional.rms_norm
    kernels = gpu_kernels()
    try:
        for name in GUARDED:
            setattr(torch.cuda, name, stand_ins[name])
        functional.scaled_dot_product_attention = gpu_attention(sdpa)
        functional.rms_norm = gpu_rms_norm(rms_norm)
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.cuda, name, original)
        functional.scaled_dot_product_attention, functional.rms_norm = sdpa, rms_norm
        kernels._destroy()


if __name__ == "__main__":  # python -m model.rehearsal.fake_gpu --build DIR
    print(build(Path(sys.argv[2])))
