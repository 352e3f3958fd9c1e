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
- Sharding ``ddp`` without pipelining cannot be rehearsed: DDP's C++ constructor and
  reducer read parameter storage. (Under pipelining the trainer all-reduces gradients
  itself, which rehearses.)
- The rank runs on the CPU device: kernels whose saved tensors differ by device (the
  attention kernel's log-sum-exp) may differ slightly from a GPU's.

The vote bypass and the trackers' repeated-call rule use private torch internals
(``PRIVATE_INTERNALS``) and are pinned to the torch release they were checked on
(``CHECKED_TORCH``); ``check_torch_internals`` refuses others.
``measure_steps`` is the same measurement for a trainer on real tensors (the tests compare
the two on gloo ranks).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import schedules as pipelining_schedules
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.pipelining.stage import PipelineStage
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from model.config import ModelConfig, TrainConfig
from model.parallel.pipeline import build_schedule, chunk_ids
from model.planner.plan import Plan
from model.training.batches import synthetic_batch_factory
from model.training.trainer import Trainer, cross_entropy

CHECKED_TORCH = (2, 13)
"""The torch release (major, minor) whose pipelining internals the bypass was checked on."""

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
)
"""The private torch attributes the rehearsal overrides or calls."""


def check_torch_internals() -> None:
    """Raise RehearsalError unless this torch is the release the rehearsal's private hooks
    (the pipelining vote bypass, the trackers' repeated-call rule) were checked on and
    still has the attributes they use."""
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version != CHECKED_TORCH:
        raise RehearsalError(
            f"the rehearsal's private hooks were checked on torch "
            f"{'.'.join(map(str, CHECKED_TORCH))}, this is torch {torch.__version__}: check "
            "_PipelineSchedule._warmup_p2p, PipelineStage._inference_mode and the memory "
            "trackers' _pre_fw_hook / _fsdp_state_pre_forward, then update "
            "model.training.rehearse.CHECKED_TORCH")
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
        category: Any = _FSDPRefType.INP
    else:
        tracker = StepMemTracker()
        tracker.track_external(*trainer.runners, trainer.optimizer)
        category = _MemRefType.OTH  # what track_external makes of a tensor
    for buffer in receive_buffers(trainer):
        tracker._update_and_maybe_create_winfos(buffer, category)
    return tracker


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
    """The trainer of this rank on synthetic batches (materialised under ``fake_mode``)."""
    batches = synthetic_batch_factory(model_cfg.vocab_size, train_cfg)
    materialize = (lambda: fake_mode) if fake_mode is not None else contextlib.nullcontext
    return Trainer(model_cfg, train_cfg, plan, tempfile.gettempdir(), batches, device,
                   materialize=materialize)


def measure_steps(trainer: Trainer, steps: int = 1, warmup: int = 1) -> Rehearsal:
    """Run ``warmup`` and then ``steps`` training steps of ``trainer``, the latter under the
    memory tracker and the step counter; works on real and (inside a FakeTensorMode) fake
    tensors alike.

    The warm-up steps make the optimizer states and fill DTensor's sharding-propagation
    cache: under a FakeTensorMode, DTensor propagates shardings in that same mode, so its
    full-shape propagation ops would be counted as the rank's own until cached. Memory is
    then that of a steady step (its peak is at least the first step's, since the optimizer
    states exist from the start). Batches are drawn before the trackers start.
    """
    if steps < 1 or warmup < 0:
        raise RehearsalError(f"need steps >= 1 and warmup >= 0, got {steps} and {warmup}")
    batches = [trainer.batches.next_batch() for _ in range(warmup + steps)]
    declared = stage_io(trainer) if trainer.schedule is not None else []
    with recorded_outputs(trainer.chunks if declared else []) as seen:
        for batch in batches[:warmup]:
            trainer.train_step(batch)
        counter = StepCounter(mesh_group_dims(trainer))
        tracker = memory_tracker(trainer)
        with counter, tracker:
            for batch in batches[warmup:]:
                counter.start_step()
                trainer.train_step(batch)
    if declared:
        check_stage_outputs(declared, seen)
    peak = tracker.get_tracker_snapshot("peak").get(trainer.device, {})
    total = int(peak.get("Total", 0))
    categories = {_category_name(k): int(v) for k, v in peak.items() if k != "Total" and v}
    last = counter.steps[-1]
    return Rehearsal(
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        coords={"pp": trainer.pp_rank, "dp": trainer.dp_rank, "tp": trainer.tp_rank},
        stages=chunk_ids(trainer.pp_rank, trainer.plan.pp, trainer.plan.virtual_stages),
        peak_memory_bytes=total, peak_memory_by_category=categories,
        flops_per_step=[sum(s["flops"].values()) for s in counter.steps],
        flops_by_op=dict(last["flops"]),
        collective_bytes_per_step=[dict(s["bytes"]) for s in counter.steps],
        collective_bytes_by_dim={d: dict(k) for d, k in last["dims"].items()},
        collective_calls=dict(last["calls"]), tracker=type(tracker).__mro__[1].__name__,
        fake=active_fake_mode() is not None)


def rehearsal_train_config(train_cfg: TrainConfig) -> TrainConfig:
    """The training config a rehearsal runs: clipping off (see the module docstring)."""
    return dataclasses.replace(train_cfg, grad_clip=0.0)


def rehearsal_problems(plan: Plan) -> list[str]:
    """Why a plan cannot be rehearsed (empty when it can)."""
    if plan.sharding == "ddp" and plan.dp > 1 and plan.pp == 1:
        return [f"plan {plan.describe()}: DDP (sharding ddp without pipelining) cannot be "
                "rehearsed: its C++ constructor and reducer read parameter storage, which fake "
                "tensors do not have"]
    return []


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
             world_size: int | None = None, steps: int = 1, warmup: int = 1) -> Rehearsal:
    """Run ``warmup`` + ``steps`` training steps of global ``rank`` of ``plan`` on fake
    tensors and measure the last ``steps`` (``measure_steps``).

    ``world_size`` defaults to the plan's. Raises RehearsalError for a plan that cannot be
    rehearsed and for a torch whose pipelining internals were not checked.
    """
    world = world_size or plan.world_size
    if world != plan.world_size:
        raise RehearsalError(f"plan {plan.describe()} needs {plan.world_size} ranks, not {world}")
    if not 0 <= rank < world:
        raise RehearsalError(f"rank {rank} is not in a world of {world} ranks")
    problems = rehearsal_problems(plan)
    if problems:
        raise RehearsalError("; ".join(problems))
    check_torch_internals()
    t0 = time.perf_counter()
    cfg = rehearsal_train_config(train_cfg)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_process_group(rank, world):
        trainer = make_trainer(model_cfg, cfg, plan, torch.device("cpu"), fake)
        if trainer.schedule is not None:
            with fake:
                trainer.schedule = static_schedule(trainer)
        with fake:
            result = measure_steps(trainer, steps, warmup)
    result.seconds = time.perf_counter() - t0
    if train_cfg.grad_clip > 0:
        result.notes.append("grad_clip skipped (the norm and its all-reduce still run)")
    return result


def rehearse_isolated(model_cfg: ModelConfig, train_cfg: TrainConfig, plan: Plan, rank: int,
                      steps: int = 1, warmup: int = 1,
                      initializer: Callable[[], None] | None = None) -> Rehearsal:
    """``rehearse`` in a process of its own, its RehearsalError re-raised here.

    One rank per process: DTensor caches device meshes by value, so a second rehearsal in
    the same process would reach collectives bound to the first one's destroyed process
    group ("Could not resolve the process group registered under the name ...").
    ``initializer`` runs first in the child (the plan stage's makes it die with its parent).

    The child is forked from multiprocessing's fork server, which has imported this module
    (torch, DTensor, the trainer) once and rehearsed nothing: a plan stage's rehearsals, two
    per plan, then cost their work, not seconds of imports each.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context,
                                                initializer=initializer) as pool:
        return pool.submit(rehearse, model_cfg, train_cfg, plan, rank, None, steps,
                           warmup).result()


def busiest_ranks(plan: Plan) -> list[int]:
    """The first pipeline stage's rank 0 and the last stage's first rank (one if pp == 1)."""
    last = (plan.pp - 1) * plan.dp * plan.tp
    return [0] if last == 0 else [0, last]
