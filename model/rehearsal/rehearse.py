"""Rehearse one rank of a training plan on this box: the real trainer, fake tensors.

``rehearse(model_cfg, train_cfg, plan, rank)`` starts a fake process group of the plan's
world size (``torch.testing._internal.distributed.fake_pg``: collectives return at once
and move no data), builds this rank's share of the model with the trainer itself
(``Trainer``: pipeline split, TP/SP, activation recompute, FSDP2 per ``plan.sharding``,
mixed precision for ``train.dtype``, AdamW) and runs ``warmup`` + ``steps`` (default
1 + 1) full training steps (every micro-batch through the real pipeline schedule, then the
optimizer step) under ``FakeTensorMode``: every tensor has its shape, dtype and device but
no storage, so a Frontier rank of a 1T model runs on a laptop. Measured in the steps after
the warm-up (which makes the optimizer states and fills DTensor's sharding cache, see
``measure_steps``):

- peak memory by category: ``FSDPMemTracker`` (FSDP2 layouts: sharded/unsharded params
  and grads, all-gather and reduce-scatter buffers, activations, temporaries, optimizer
  states) or ``MemTracker`` (other layouts: params, grads, activations, temporaries,
  optimizer states), both from ``torch.distributed._tools``, allowed here to see a module
  called more than once per step (gradient accumulation, pipeline micro-batches);
- FLOPs per step of the ops this rank runs (``StepCounter``: torch's FLOP formulas applied
  to local shards, recomputation included, plus CPU's flash-attention kernel);
- bytes per collective kind per step, also split by mesh dimension (pp, dp, tp).

What differs from training, on purpose:

- ``train.grad_clip`` is treated as 0: clipping reads the norm back to the host
  (``float(...)``), which fake tensors cannot answer. The norm and its pipeline all-reduce
  still run; the clip itself multiplies gradients in place (no memory, no matmul FLOPs).
- The pipeline stages are given their micro-batch shapes up front (``stage_io``) and the
  schedule's P2P warm-up vote is answered locally (``bypass_warmup_vote``): the vote reads
  a received tensor with ``.item()`` and the shape exchange unpickles received bytes, and a
  fake process group delivers neither. With the shapes given, every stage would vote
  STATIC in a real run too, so this is the vote's own outcome; the trainer's real runs infer
  the same shapes at their first step and then run the same steps. Each stage's real output
  is checked against the shape it was given after the steps.
- Sharding ``ddp`` without pipelining runs ``model.rehearsal.rehearsed_ddp.RehearsedDDP``
  in DistributedDataParallel's place, whose C++ constructor and reducer read parameter
  storage: the same bucket copy of the gradients and the same all-reduce. (Under
  pipelining the trainer all-reduces gradients itself, which rehearses as it is.)
- On a GPU cluster the rank runs on device type ``cuda`` (ROCm's torch uses the same
  type) through ``model.rehearsal.fake_gpu``: this CPU-only torch is given a fake CUDA
  device, and the few calls it refuses are answered in one place (``guarded_cuda``), with
  the attention and RMSNorm kernels a GPU build takes. Any op that meets a tensor of
  another device fails the rehearsal with where that tensor was made (``DeviceCheck``).
  On the local cluster the rank runs on the CPU, like its real training.
- A plan of many micro-batches is measured at two smaller counts and extrapolated to its
  own (``rehearsed_micro_batches``): seconds per rank instead of minutes.

The vote bypass and the trackers' repeated-call rule use private torch internals
(``PRIVATE_INTERNALS``) and are pinned to the torch release they were checked on
(``CHECKED_TORCH``); ``check_torch_internals`` refuses others.
``measure_steps`` is the same measurement for a trainer on real tensors (the tests compare
the two on gloo ranks).
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import (
    FakeTensorDeviceMismatchError,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import schedules as pipelining_schedules
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.pipelining.stage import PipelineStage
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakTensorKeyDictionary

from model.config import ModelConfig, TrainConfig
from model.parallel.layout import Plan
from model.parallel.pipeline import build_schedule, chunk_ids
from model.rehearsal.rehearsed_ddp import RehearsedDDP
from model.rehearsal.torch_pin import CHECKED_TORCH, torch_release
from model.training.batches import synthetic_batch_factory
from model.training.trainer import BuildSeam, Trainer, cross_entropy

aten = torch.ops.aten
FLOP_FORMULAS: dict[Any, Any] = {
    **flop_registry,
    # CPU's fused attention takes (query, key, value, ...) like the CUDA kernels.
    aten._scaled_dot_product_flash_attention_for_cpu:
        flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_registry[aten._scaled_dot_product_flash_attention_backward],
}
"""torch.utils.flop_counter's formulas (matmuls, convolutions, attention), per op."""

COLLECTIVES: dict[str, tuple[str, int]] = {
    # c10d ops (what torch.distributed's eager API dispatches: FSDP2, P2P, plain calls)
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::allgather_": ("all_gather", 0),
    "c10d::allgather_coalesced_": ("all_gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::broadcast_": ("broadcast", 0),
    "c10d::reduce_": ("reduce", 0),
    "c10d::alltoall_": ("all_to_all", 1),
    "c10d::alltoall_base_": ("all_to_all", 1),
    "c10d::gather_": ("gather", 1),
    "c10d::scatter_": ("scatter", 0),
    "c10d::send": ("send", 0),
    "c10d::recv_": ("recv", 0),
    "c10d::recv_any_source_": ("recv", 0),
    # functional collectives (what DTensor redistributions issue: TP, SP, norms of shards)
    "_c10d_functional::all_reduce": ("all_reduce", 0),
    "_c10d_functional::all_reduce_": ("all_reduce", 0),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", 0),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", 0),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", -1),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", -1),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", -1),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", 0),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "_c10d_functional::broadcast": ("broadcast", 0),
    "_c10d_functional::broadcast_": ("broadcast", 0),
    "_c10d_functional::all_to_all_single": ("all_to_all", 0),
    "_c10d_functional::isend": ("send", 0),
    "_c10d_functional::irecv": ("recv", 0),
}
"""Collective op -> (kind, argument holding the full buffer). The bytes counted are the
collective's full buffer, as NCCL's tests size it: an all-reduce's tensor, an all-gather's
gathered output, a reduce-scatter's unreduced input, a send's or recv's tensor. Index -1:
the output is the input times the group size (functional all-gather)."""


class RehearsalError(RuntimeError):
    """A plan or a torch version that the rehearsal cannot run; the message says why."""


@dataclass
class Rehearsal:
    """What one rank did in its rehearsed (or measured) training steps."""

    rank: int
    """Global rank."""
    world_size: int
    """Ranks in the plan (the fake process group's size)."""
    coords: dict[str, int]
    """This rank's place in the mesh: pp, dp and tp rank."""
    stages: list[int]
    """Pipeline chunks this rank holds (chunk 0 has the embedding, the last the head)."""
    peak_memory_bytes: int
    """Peak bytes of tensors alive at once on the rank's device during the measured steps."""
    peak_memory_by_category: dict[str, int]
    """The tensors alive at that peak, by the memory tracker's categories (bytes)."""
    flops_per_step: list[int]
    """FLOPs the rank ran in each step (matmuls and attention; recompute included)."""
    flops_by_op: dict[str, int]
    """FLOPs of the last step by op."""
    collective_bytes_per_step: list[dict[str, int]]
    """Bytes per collective kind in each step (the collective's full buffer)."""
    collective_bytes_by_dim: dict[str, dict[str, int]]
    """Bytes of the last step by mesh dimension (pp, dp, tp, or 'world'), then kind."""
    collective_calls: dict[str, int]
    """Number of collectives of each kind in the last step."""
    tracker: str
    """Which memory tracker categorised the peak (FSDPMemTracker or MemTracker)."""
    fake: bool = True
    """True for a rehearsal on fake tensors, False for a measurement on real ones."""
    seconds: float = 0.0
    """Wall time of building and running the steps."""
    notes: list[str] = field(default_factory=list)
    """What this run did differently from training (see the module docstring)."""
    host_peak_rss_bytes: int = 0
    """Peak resident memory of the process that rehearsed the rank (set by
    ``rank_server.rehearse_isolated``; 0 for a rehearsal in the caller's process)."""

    @property
    def peak_memory_gb(self) -> float:
        return self.peak_memory_bytes / 1e9

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field, plus ``peak_memory_gb``."""
        return {**dataclasses.asdict(self), "peak_memory_gb": self.peak_memory_gb}


# --- the private torch internals --------------------------------------------------------

PRIVATE_INTERNALS: tuple[tuple[Any, str], ...] = (
    (pipelining_schedules._PipelineSchedule, "_warmup_p2p"),
    (pipelining_schedules._PipelineSchedule, "_initialize_pp_stages"),
    (InferenceMode, "STATIC"),
    (InferenceMode, "needs_dynamic"),
    (MemTracker, "_pre_fw_hook"),
    (MemTracker, "_update_peak_stats"),
    (FSDPMemTracker, "_fsdp_state_pre_forward"),
    (MemTracker, "_update_and_maybe_create_winfos"),
    (_FSDPRefType, "INP"),
    (_MemRefType, "OTH"),
    (DeviceMesh, "mesh"),
)
"""The private torch attributes the rehearsal overrides or calls."""


def check_torch_internals() -> None:
    """Raise RehearsalError unless this torch is the release the rehearsal's private hooks
    (the pipelining vote bypass, the trackers' repeated-call rule) were checked on and
    still has the attributes they use."""
    if torch_release(torch.__version__) != CHECKED_TORCH:
        raise RehearsalError(
            f"the rehearsal's private hooks were checked on torch "
            f"{'.'.join(map(str, CHECKED_TORCH))}, this is torch {torch.__version__}: check "
            "_PipelineSchedule._warmup_p2p, PipelineStage._inference_mode and the memory "
            "trackers' _pre_fw_hook / _fsdp_state_pre_forward, then update "
            "model.rehearsal.torch_pin.CHECKED_TORCH")
    missing = [f"{owner.__name__}.{name}" for owner, name in PRIVATE_INTERNALS
               if not hasattr(owner, name)]
    if missing:
        raise RehearsalError(f"torch {torch.__version__} lacks {missing}: the rehearsal's "
                             "private hooks no longer apply")


def bypass_warmup_vote(schedule: Any) -> None:
    """Answer the schedule's P2P warm-up vote locally: every stage is STATIC.

    ``_PipelineSchedule._warmup_p2p`` sends each stage's vote (STATIC when its shapes are
    known) along the pipeline and reads the result with ``.item()``. Every stage here was
    given its shapes, so the vote of a real run would be STATIC: this sets that result on
    each stage without the exchange, and refuses a stage that would vote DYNAMIC.
    """
    def vote_static(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            if not isinstance(stage, PipelineStage) or InferenceMode.needs_dynamic(
                    stage._user_meta, has_backward):
                raise RehearsalError(f"pipeline stage {stage.stage_index} lacks static shapes")
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = vote_static


@contextlib.contextmanager
def real_mesh_tensors() -> Iterator[None]:
    """Build device meshes and read their rank layout (``DeviceMesh.__init__``,
    ``DeviceMesh.mesh``: small integer tensors on the host) on real tensors while a fake
    mode is active: FSDP2 over a tensor-parallel mesh builds a mesh of both and looks its
    rank up with ``nonzero``, whose output shape fake tensors cannot know. The trainer
    parallelises its chunks inside its ``materialize`` context, which for a rehearsal is
    the fake mode (a GPU rank's FSDP2 allocates its all-gather buffer on the device)."""
    original_init, original_mesh = DeviceMesh.__init__, DeviceMesh.mesh

    def init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            original_init(self, *args, **kwargs)

    def mesh(self: DeviceMesh) -> torch.Tensor:
        with unset_fake_temporarily():
            return original_mesh.fget(self)

    DeviceMesh.__init__, DeviceMesh.mesh = init, property(mesh)
    try:
        yield
    finally:
        DeviceMesh.__init__, DeviceMesh.mesh = original_init, original_mesh


# --- memory trackers that allow repeated calls -----------------------------------------

def _is_root_call(tracker: MemTracker, fqn: str) -> bool:
    """Whether a module is being called from outside every tracked module (a root call)."""
    parents = set(tracker._mod_tracker.parents) - {fqn}
    return parents == {"Global"}


class GlobalPeakOnly:
    """Keep only the global peak on each operator (the rehearsal reads no module's peak).

    torch's trackers, after every operator, walk every tracked module to update its
    forward/backward peak: with thousands of modules (a 128-layer stage) that walk was the
    largest cost of a rehearsal and grew with the square of the layer count.
    """

    _curr_mem_snap: dict
    _peak_mem: dict
    _peak_mem_snap: dict

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)


class StepMemTracker(GlobalPeakOnly, MemTracker):
    """torch's MemTracker, allowing a root module to be called again in one step.

    MemTracker refuses a second root call (it takes it for a second iteration); gradient
    accumulation and pipeline micro-batches call the model once per micro-batch. A repeated
    root call starts that module's per-module statistics afresh; the global peak and the
    current memory, which the rehearsal reports, are not touched.
    """

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        fqn = self._mod_tracker.get_known_fqn(module)
        if (module in self.memory_tracking and not self._mod_tracker.is_bw
                and fqn is not None and _is_root_call(self, fqn)):
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)


class StepFSDPMemTracker(GlobalPeakOnly, FSDPMemTracker):
    """torch's FSDPMemTracker over several FSDP roots, allowing repeated root calls.

    ``roots`` are the FSDP-wrapped chunks of one pipeline rank (one or, interleaved,
    several); the repeated-call rule is StepMemTracker's.
    """

    def __init__(self, roots: list[nn.Module], optimizer: torch.optim.Optimizer) -> None:
        if not roots or not all(isinstance(r, FSDPModule) for r in roots):
            raise RehearsalError("StepFSDPMemTracker needs FSDP-wrapped chunks")
        super().__init__(roots[0], optimizer)
        self._root_mod = nn.ModuleList(roots)  # instrument every chunk, not only the first

    def _fsdp_state_pre_forward(self, fsdp_mod: FSDPModule, orig: Any) -> Any:
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

        def restart_on_root_call(*args: Any, **kwargs: Any) -> Any:
            fqn = self._mod_tracker.get_known_fqn(fsdp_mod)
            if (fsdp_mod in self.memory_tracking and not self._mod_tracker.is_bw
                    and fqn is not None and _is_root_call(self, fqn)):
                del self.memory_tracking[fsdp_mod]
            return inner(*args, **kwargs)

        return restart_on_root_call


def memory_tracker(trainer: Trainer) -> MemTracker:
    """The tracker for a trainer's layout: FSDP2 categories when its chunks are FSDP2. The
    pipeline stages' receive buffers (``receive_buffers``) are tracked too: made in the
    warm-up step, and never saved for backward where they hold gradients, they would be
    missed (a ddp 22B first stage's 320 float32 gradient buffers, 16 GB; under FSDP2, whose
    tracker ignores ``track_external``, the 1T tp8 pp16 il8 last rank's 112, 5.9 GB). Under
    FSDP2 they are the category ``inputs``."""
    if all(isinstance(c, FSDPModule) for c in trainer.chunks):
        tracker: MemTracker = StepFSDPMemTracker(list(trainer.chunks), trainer.optimizer)
    else:
        tracker = StepMemTracker()
        tracker.track_external(*trainer.runners, trainer.optimizer)
    track_receive_buffers(trainer, tracker)
    return tracker


def track_receive_buffers(trainer: Trainer, tracker: MemTracker) -> None:
    """Put the trainer's pipeline receive buffers in ``tracker``'s category for them
    (``memory_tracker``), however it has counted them so far."""
    category = (_FSDPRefType.INP if isinstance(tracker, FSDPMemTracker)
                else _MemRefType.OTH)  # what track_external makes of a tensor
    for buffer in receive_buffers(trainer):
        tracker._update_and_maybe_create_winfos(buffer, category)


@contextlib.contextmanager
def receive_buffers_tracked(trainer: Trainer, tracker: MemTracker) -> Iterator[None]:
    """Within the context, a schedule's first chunk forward re-files the receive buffers
    (``track_receive_buffers``): a schedule rebuilt for another micro-batch count
    (``micro_batches``) makes its stages' buffers at the start of its first step, inside the
    tracker, which would file them as activations; by the first forward they all exist."""
    handles: list[Any] = []

    def refile(*_: Any) -> None:
        track_receive_buffers(trainer, tracker)
        for handle in handles:
            handle.remove()

    handles += [chunk.register_forward_pre_hook(refile) for chunk in trainer.chunks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def receive_buffers(trainer: Trainer) -> list[torch.Tensor]:
    """The buffers torch's pipeline stages of the trainer keep for what they receive
    (activations in, gradients back), one per micro-batch and chunk boundary."""
    schedule = trainer.schedule
    if schedule is None:
        return []
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    found = []
    for stage in stages:
        for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
            found += [info.buffer for info in infos
                      if isinstance(getattr(info, "buffer", None), torch.Tensor)]
    return found


def _category_name(key: Any) -> str:
    """A tracker category as a snake_case name ('Sharded Param' -> 'sharded_param')."""
    return str(getattr(key, "value", key)).lower().replace(" ", "_")


# --- FLOPs and collectives --------------------------------------------------------------

def _tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a (nested list of) tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(x) for x in obj)
    return 0


def _schema_value(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The value of argument ``name`` of an op call, or None."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else kwargs.get(name)
    return None


class StepCounter(TorchDispatchMode):
    """Counts the FLOPs and collective bytes of the local ops a rank runs, per step.

    DTensor ops are passed down (``NotImplemented``) so that only their local shards are
    counted, and the ops DTensor runs under its own fake mode to propagate shardings are
    skipped, as torch's memory trackers do.
    """

    def __init__(self, group_dims: dict[str, str]) -> None:
        super().__init__()
        self.group_dims = group_dims
        self.steps: list[dict[str, Counter]] = []
        self._entry_fake: Any = None

    def start_step(self) -> None:
        """Count into a new step."""
        self.steps.append({"flops": Counter(), "bytes": Counter(), "calls": Counter(),
                           "dims": defaultdict(Counter)})

    def __enter__(self) -> StepCounter:
        self._entry_fake = active_fake_mode()
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        if not self.steps or active_fake_mode() is not self._entry_fake:
            return out
        step = self.steps[-1]
        formula = FLOP_FORMULAS.get(func._overloadpacket)
        if formula is not None:
            step["flops"][str(func._overloadpacket)] += int(formula(*args, **kwargs, out_val=out))
        name = func._schema.name
        if name in COLLECTIVES:
            kind, index = COLLECTIVES[name]
            nbytes = (_tensor_bytes(args[0]) * int(_schema_value(func, args, kwargs, "group_size"))
                      if index < 0 else _tensor_bytes(args[index]))
            step["bytes"][kind] += nbytes
            step["calls"][kind] += 1
            step["dims"][self._group_dim(func, args, kwargs)][kind] += nbytes
        return out

    def _group_dim(self, func: Any, args: tuple, kwargs: dict) -> str:
        """The mesh dimension (pp, dp, tp) of a collective's group; 'world' otherwise."""
        group = _schema_value(func, args, kwargs, "process_group")
        if group is not None:  # a c10d op's ProcessGroup, boxed as a ScriptObject
            name = dist.ProcessGroup.unbox(group).group_name
        else:
            name = _schema_value(func, args, kwargs, "group_name")
        return self.group_dims.get(str(name), "world")


def mesh_group_dims(trainer: Trainer) -> dict[str, str]:
    """Process-group name -> mesh dimension for a trainer's pp, dp and tp groups. The
    embedding group of tied embeddings under pipelining (pipeline ranks 0 and pp - 1 of one
    (dp, tp) coordinate; the pp group itself at pp = 2) counts as pp."""
    out = {}
    for dim in ("pp", "dp", "tp"):
        out[trainer.mesh[dim].get_group().group_name] = dim
    if trainer.tied_group is not None:
        out.setdefault(trainer.tied_group.group_name, "pp")
    return out


# --- pipeline shapes --------------------------------------------------------------------

def stage_io(trainer: Trainer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of one micro-batch for each of the trainer's pipeline chunks, as meta
    tensors: tokens [mb, T] into chunk 0, the residual stream [mb, T/tp under sequence
    parallelism, D] between chunks, logits [mb, T, V] out of the last.

    The residual stream is in the parameter dtype under FSDP2 mixed precision (FSDP casts
    the inputs and parameters) and float32 otherwise (autocast keeps the residual adds in
    float32); the logits are in the compute dtype. ``check_stage_outputs`` holds the real
    outputs to this.
    """
    plan, cfg = trainer.plan, trainer.cfg
    mb, seq = plan.micro_batch, cfg.seq_len
    tokens = seq // plan.tp if plan.sequence_parallel else seq
    compute = trainer.param_dtype or torch.float32
    residual = compute if trainer.fsdp else torch.float32
    n_chunks = plan.pp * plan.virtual_stages

    def meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # activations require grad: their gradients flow back along the pipeline
        return torch.empty(shape, dtype=dtype, device="meta",
                           requires_grad=dtype.is_floating_point)

    hidden = meta((mb, tokens, trainer.model_cfg.d_model), residual)
    out = []
    for c in chunk_ids(trainer.pp_rank, plan.pp, plan.virtual_stages):
        x = meta((mb, seq), torch.long) if c == 0 else hidden
        y = meta((mb, seq, trainer.model_cfg.vocab_size), compute) if c == n_chunks - 1 else hidden
        out.append((x, y))
    return out


def static_schedule(trainer: Trainer) -> Any:
    """The trainer's pipeline schedule rebuilt (same function and arguments) with each
    stage's shapes given and its warm-up vote answered locally."""
    plan = trainer.plan
    ids = chunk_ids(trainer.pp_rank, plan.pp, plan.virtual_stages)
    schedule = build_schedule(trainer.runners, ids, plan.pp * plan.virtual_stages,
                              trainer.device, trainer.pp_group, plan.schedule, plan.grad_accum,
                              cross_entropy, stage_io=stage_io(trainer))
    bypass_warmup_vote(schedule)
    return schedule


@contextlib.contextmanager
def recorded_outputs(modules: list[nn.Module]) -> Iterator[list[set[tuple]]]:
    """Record (shape, dtype) of every output of each module while the context is open."""
    seen: list[set[tuple]] = [set() for _ in modules]
    handles = []
    for i, module in enumerate(modules):
        def hook(_m: nn.Module, _a: Any, output: Any, i: int = i) -> None:
            if isinstance(output, torch.Tensor):
                seen[i].add((tuple(output.shape), output.dtype))
        handles.append(module.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def check_stage_outputs(declared: list[tuple[torch.Tensor, torch.Tensor]],
                        seen: list[set[tuple]]) -> None:
    """Raise RehearsalError if a chunk's real outputs differ from the shape it was given."""
    for c, ((_, y), outputs) in enumerate(zip(declared, seen, strict=True)):
        expected = {(tuple(y.shape), y.dtype)}
        if outputs and outputs != expected:
            raise RehearsalError(f"pipeline chunk {c} was given outputs {expected} but produced "
                                 f"{sorted(outputs, key=str)}")


# --- running the steps ------------------------------------------------------------------

def make_trainer(model_cfg: ModelConfig, train_cfg: TrainConfig, plan: Plan,
                 device: torch.device, fake_mode: FakeTensorMode | None = None) -> Trainer:
    """The trainer of this rank on synthetic batches (materialised under ``fake_mode``, with
    the device check of ``device``)."""
    batches = synthetic_batch_factory(model_cfg.vocab_size, train_cfg)
    materialize = ((lambda: faked(fake_mode, device)) if fake_mode is not None
                   else contextlib.nullcontext)
    return Trainer(model_cfg, train_cfg, plan, tempfile.gettempdir(), batches, device,
                   build=BuildSeam(materialize=materialize, wrap_ddp=RehearsedDDP))


@contextlib.contextmanager
def faked(fake_mode: FakeTensorMode, device: torch.device) -> Iterator[None]:
    """``fake_mode`` with the device check of a rank on ``device`` inside it."""
    with fake_mode, device_checked(device):
        yield


@dataclass
class StepFigures:
    """What one measured training step did: its peak memory (total and by category), FLOPs
    by op, and collective bytes by kind, by mesh dimension and call counts."""

    peak: int
    categories: dict[str, int]
    flops: dict[str, int]
    bytes: dict[str, int]
    dims: dict[str, dict[str, int]]
    calls: dict[str, int]

    def extrapolated(self, other: StepFigures, runs: tuple[int, int], to: int) -> StepFigures:
        """The figures of a step of ``to`` micro-batches, from this step (``runs[0]``
        micro-batches) and ``other`` (``runs[1]``), each figure affine in the count."""
        scale = (to - runs[1]) / (runs[1] - runs[0])

        def line(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {k: round(b.get(k, 0) + scale * (b.get(k, 0) - a.get(k, 0)))
                    for k in {*a, *b}}

        return StepFigures(
            peak=round(other.peak + scale * (other.peak - self.peak)),
            categories=line(self.categories, other.categories),
            flops=line(self.flops, other.flops), bytes=line(self.bytes, other.bytes),
            dims={d: line(self.dims.get(d, {}), other.dims.get(d, {}))
                  for d in {*self.dims, *other.dims}},
            calls=line(self.calls, other.calls))


def measured_step(trainer: Trainer, batch: torch.Tensor) -> tuple[StepFigures, str]:
    """One training step of ``trainer`` under a fresh memory tracker and step counter (and
    the tracker's name)."""
    counter = StepCounter(mesh_group_dims(trainer))
    tracker = memory_tracker(trainer)
    with counter, tracker, receive_buffers_tracked(trainer, tracker):
        counter.start_step()
        trainer.train_step(batch)
    peak = tracker.get_tracker_snapshot("peak").get(trainer.device, {})
    step = counter.steps[-1]
    figures = StepFigures(
        peak=int(peak.get("Total", 0)),
        categories={_category_name(k): int(v) for k, v in peak.items() if k != "Total" and v},
        flops=dict(step["flops"]), bytes=dict(step["bytes"]),
        dims={d: dict(k) for d, k in step["dims"].items()}, calls=dict(step["calls"]))
    return figures, type(tracker).__mro__[1].__name__


def rehearsed_micro_batches(plan: Plan) -> tuple[int, tuple[int, ...]]:
    """(warm-up, measured) micro-batch counts of a rehearsal of ``plan``: the warm-up step
    runs the first, one step of each of the others is measured, and two measured counts
    are extrapolated to the plan's ``grad_accum``.

    Past the schedule's warm-up every pipeline schedule repeats one micro-batch's work, so
    a step's FLOPs, collective bytes and peak memory are affine in its micro-batch count:
    1F1B holds at most pp micro-batches in flight, interleaved 1F1B (v - 1) x pp + 2 (pp - 1)
    chunks, which it runs pp micro-batches at a time, so the peak is flat beyond; GPipe
    holds them all (the peak grows by one micro-batch's activations each), and the stages'
    receive buffers are one per micro-batch. The line starts, measured on the tiny model's
    ranks (tests/test_fake_gpu.py), at pp micro-batches for GPipe, pp + 1 for 1F1B and 3 pp
    for interleaved 1F1B at any v (at 2 pp its first rank's peak lies one activation below
    it). Steps of 2 pp and 3 pp micro-batches (3 pp and 4 pp interleaved: multiples of pp,
    as it requires) fix the line; without a pipeline 2 and 3, the second accumulating onto
    the first's gradients. A plan of no more micro-batches than the second is measured at
    its own count. The warm-up step only makes the optimizer states and fills caches,
    which no micro-batch count changes: it runs pp (the pipeline's fill), or the plan's
    count when that is smaller."""
    start = 3 if plan.schedule == "interleaved_1f1b" else 2
    warm_up, first, second = plan.pp, start * plan.pp, (start + 1) * plan.pp
    if plan.grad_accum <= second:
        return min(warm_up, plan.grad_accum), (plan.grad_accum,)
    return warm_up, (first, second)


@contextlib.contextmanager
def micro_batches(trainer: Trainer, count: int, fake_mode: FakeTensorMode | None) -> Iterator[None]:
    """Run ``trainer``'s steps with ``count`` micro-batches (its plan's ``grad_accum`` and,
    pipelined, a schedule rebuilt for that count), restoring its own plan on exit."""
    plan, schedule = trainer.plan, trainer.schedule
    trainer.plan = dataclasses.replace(plan, grad_accum=count)
    if schedule is not None:
        with (faked(fake_mode, trainer.device) if fake_mode else contextlib.nullcontext()):
            trainer.schedule = static_schedule(trainer)
    try:
        yield
    finally:
        trainer.plan, trainer.schedule = plan, schedule


def measure_steps(trainer: Trainer, steps: int = 1, warmup: int = 1,
                  counts: tuple[int, tuple[int, ...]] | None = None,
                  fake_mode: FakeTensorMode | None = None) -> Rehearsal:
    """Run ``warmup`` and then ``steps`` training steps of ``trainer``, each measured step
    under a fresh memory tracker and step counter; works on real and (inside a
    FakeTensorMode) fake tensors alike.

    With ``counts`` (``rehearsed_micro_batches``: warm-up, measured) the warm-up steps run
    the first count of micro-batches, then one step of each measured count is measured and
    two are extrapolated to the plan's count (``StepFigures.extrapolated``); ``fake_mode``
    is the mode the rebuilt pipeline schedules are made in.

    The warm-up steps make the optimizer states and fill DTensor's sharding-propagation
    cache: under a FakeTensorMode, DTensor propagates shardings in that same mode, so its
    full-shape propagation ops would be counted as the rank's own until cached. Memory is
    then that of a steady step (its peak is at least the first step's, since the optimizer
    states exist from the start). Batches are drawn before the trackers start.
    """
    if steps < 1 or warmup < 0:
        raise RehearsalError(f"need steps >= 1 and warmup >= 0, got {steps} and {warmup}")
    plan = trainer.plan
    batches = [trainer.batches.next_batch() for _ in range(warmup + steps)]
    declared = stage_io(trainer) if trainer.schedule is not None else []
    figures: list[StepFigures] = []
    with recorded_outputs(trainer.chunks if declared else []) as seen:
        if counts is None:
            for batch in batches[:warmup]:
                trainer.train_step(batch)
            for batch in batches[warmup:]:
                step, tracker_name = measured_step(trainer, batch)
                figures.append(step)
        else:
            rows, (warm_up, measured_counts) = plan.micro_batch, counts
            with micro_batches(trainer, warm_up, fake_mode):
                for batch in batches[:warmup]:
                    trainer.train_step(batch[:rows * warm_up])
            measured = []
            for count in measured_counts:
                with micro_batches(trainer, count, fake_mode):
                    step, tracker_name = measured_step(trainer, batches[-1][:rows * count])
                measured.append(step)
            figures.append(measured[0] if len(measured) == 1 else
                           measured[0].extrapolated(measured[1], measured_counts, plan.grad_accum))
    if declared:
        check_stage_outputs(declared, seen)
    last = figures[-1]
    result = Rehearsal(
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        coords={"pp": trainer.pp_rank, "dp": trainer.dp_rank, "tp": trainer.tp_rank},
        stages=chunk_ids(trainer.pp_rank, plan.pp, plan.virtual_stages),
        peak_memory_bytes=last.peak, peak_memory_by_category=last.categories,
        flops_per_step=[sum(f.flops.values()) for f in figures], flops_by_op=last.flops,
        collective_bytes_per_step=[f.bytes for f in figures],
        collective_bytes_by_dim=last.dims, collective_calls=last.calls,
        tracker=tracker_name, fake=active_fake_mode() is not None)
    if counts is not None and len(counts[1]) == 2:
        result.notes.append(
            f"{plan.grad_accum} micro-batches extrapolated from steps of {counts[1][0]} and "
            f"{counts[1][1]} (warm-up {counts[0]}): memory, FLOPs and bytes are affine in the "
            "count")
    return result


def rehearsal_train_config(train_cfg: TrainConfig) -> TrainConfig:
    """The training config a rehearsal runs: clipping off (see the module docstring)."""
    return dataclasses.replace(train_cfg, grad_clip=0.0)


@contextlib.contextmanager
def on_device(device_type: str) -> Iterator[torch.device]:
    """The device a rehearsed rank runs on: the CPU, or (``cuda``) the fake GPU with
    ``torch.cuda``'s refusals answered (``model.rehearsal.fake_gpu.guarded_cuda``)."""
    if device_type == "cpu":
        yield torch.device("cpu")
        return
    if device_type != "cuda":
        raise RehearsalError(f"cannot rehearse on device type {device_type!r}: cpu or cuda")
    from model.rehearsal import fake_gpu

    if not fake_gpu.runtime_loaded():
        raise RehearsalError("rehearsing on cuda needs the fake GPU loaded before torch: use "
                             "rehearse_isolated(..., device_type='cuda')")
    with fake_gpu.guarded_cuda():
        yield torch.device("cuda", 0)


class DeviceCheck(TorchDispatchMode):
    """Fails an op that mixes the rank's device with another, naming where the stray tensor
    was made: a GPU would refuse the op at the first real step ("Expected all tensors to be
    on the same device"), fake tensors refuse it here, but neither says whose tensor it was.

    Records the making of every tensor of more than one element off the rank's device (on
    a GPU rank: the host batches, nothing else in a step), keyed weakly; DTensor ops are
    passed down to their local shards."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.origins: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        try:
            out = func(*args, **kwargs)
        except FakeTensorDeviceMismatchError as exc:
            raise RehearsalError(self.mismatch(func, [*args, *kwargs.values()], exc)) from exc
        origin = None  # one per op: DTensor's shard arithmetic makes host tensors by the
        # hundred (a chunk over a dp 512 mesh), each of which would walk the stack again
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.device != self.device
                    and t.device.type != "meta" and t.numel() > 1):
                origin = origin or caller_frames(sys._getframe(1))
                self.origins[t] = origin
        return out

    def mismatch(self, func: Any, inputs: list[Any], exc: Exception) -> str:
        """The refusal of ``func``, with each stray input's device, shape and origin."""
        lines = [f"{func} mixes devices on a {self.device.type} rank: {exc}"]
        for t in tree_leaves(inputs):
            if isinstance(t, torch.Tensor) and t.device not in (self.device,) and t.numel() > 1:
                stack = self.origins.get(t)
                where = (project_frames(stack) if stack is not None
                         else "made before the rehearsal started (not traced)")
                lines.append(f"  {tuple(t.shape)} {t.dtype} on {t.device}, made at: {where}")
        return "\n".join(lines)


Frame = tuple[str, int, str]
"""A stack frame as (file name, line number, function name)."""


def caller_frames(frame: FrameType | None, limit: int = 40) -> tuple[Frame, ...]:
    """The stack from ``frame`` outwards, innermost first, at most ``limit`` frames: what
    ``traceback.extract_stack`` gives without reading source lines, which a GPU rank, making
    host tensors by the thousand (DTensor's shard arithmetic), cannot afford for each."""
    frames = []
    while frame is not None and len(frames) < limit:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(frames)


def project_frames(stack: tuple[Frame, ...]) -> str:
    """The innermost six frames of a stack (innermost first) inside this project (the origin
    a user can fix), or of the whole stack when none is."""
    root = str(Path(__file__).resolve().parents[2])
    ours = [f for f in stack if f[0].startswith(root) and "site-packages" not in f[0]] \
        or list(stack)

    def place(name: str) -> str:
        return str(Path(name).relative_to(root)) if name.startswith(root) else name

    return " <- ".join(f"{place(name)}:{line} {function}" for name, line, function in ours[:6])


def device_checked(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``DeviceCheck`` on a GPU rank; nothing on the CPU, where every tensor is on it."""
    return DeviceCheck(device) if device.type != "cpu" else contextlib.nullcontext()


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """A fake default process group (no communication) for one rank, destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RehearsalError("a process group is already initialised in this process: "
                             "rehearse in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rehearse(model_cfg: ModelConfig, train_cfg: TrainConfig, plan: Plan, rank: int,
             world_size: int | None = None, steps: int = 1, warmup: int = 1,
             device_type: str = "cpu", extrapolate: bool = True) -> Rehearsal:
    """Run ``warmup`` + ``steps`` training steps of global ``rank`` of ``plan`` on fake
    tensors of ``device_type`` and measure the last ``steps`` (``measure_steps``).

    With ``extrapolate`` the warm-up step is short and a plan of many micro-batches is
    measured at two smaller counts and extrapolated to its own (``rehearsed_micro_batches``);
    without, both steps run every micro-batch.

    ``device_type`` ``cuda`` needs the fake GPU loaded before torch (``model.training.
    fake_gpu``; ``rehearse_isolated`` starts such a process). ``world_size`` defaults to
    the plan's. Raises RehearsalError for a plan that cannot be rehearsed and for a torch
    whose pipelining internals were not checked.
    """
    world = world_size or plan.world_size
    if world != plan.world_size:
        raise RehearsalError(f"plan {plan.describe()} needs {plan.world_size} ranks, not {world}")
    if not 0 <= rank < world:
        raise RehearsalError(f"rank {rank} is not in a world of {world} ranks")
    check_torch_internals()
    t0 = time.perf_counter()
    cfg = rehearsal_train_config(train_cfg)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with on_device(device_type) as device, fake_process_group(rank, world), \
            real_mesh_tensors():
        trainer = make_trainer(model_cfg, cfg, plan, device, fake)
        if trainer.schedule is not None:
            with faked(fake, device):
                trainer.schedule = static_schedule(trainer)
        with faked(fake, device):
            counts = rehearsed_micro_batches(plan) if extrapolate else None
            result = measure_steps(trainer, steps, warmup, counts, fake)
    result.seconds = time.perf_counter() - t0
    if train_cfg.grad_clip > 0:
        result.notes.append("grad_clip skipped (the norm and its all-reduce still run)")
    return result


def busiest_ranks(plan: Plan) -> list[int]:
    """The first pipeline stage's rank 0 and the last stage's first rank (one if pp == 1)."""
    last = (plan.pp - 1) * plan.dp * plan.tp
    return [0] if last == 0 else [0, last]
