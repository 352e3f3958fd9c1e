"""Distributed checkpoints (torch.distributed.checkpoint) keyed by the full model's FQNs.

Layout of ``<root>/step-00000020/``: DCP files (``.metadata`` and ``__<rank>_<n>.distcp``)
holding ``model`` (the unsharded GPT's state_dict names) and ``optim`` (flattened optimizer
state, also keyed by FQN), plus ``extra.pt`` (step, scheduler, data loader and RNG state),
``model.json`` (the model shape) and ``manifest.json`` (every other file's name, size and
CRC-32). A checkpoint is written to ``step-N.tmp`` by all ranks; after every rank finished,
rank 0 writes the manifest last and renames the directory to ``step-N``. Because keys are
FQNs, a checkpoint loads into any (pp, dp, tp) layout, and into one plain process
(``load_for_inference``).

A save can also run in the background (``start_save(..., group=...)``: DCP's ``async_save``
copies the state to host memory and a thread writes it over its own gloo group);
``finish_save`` waits for it and publishes it the same way. ``prune_checkpoints`` applies
the retention rules (``train.keep_last``, ``train.keep_every``) once a save is published;
``vote`` / ``agree`` make the clock-driven save decision and the stop before the walltime
collective.

Which files are trusted input:

* ``.metadata`` is unpickled by torch, and DCP reads the non-tensor optimizer values
  (learning rates, betas) of the ``.distcp`` files with ``torch.load(weights_only=False)``:
  both are trusted, so the checkpoints directory must be writable only by whoever runs the
  training. The DCP tensor data itself is read with ``weights_only=True``.
* ``extra.pt`` is not trusted: it is loaded with ``torch.load(weights_only=True)`` (tensors
  and plain Python values only) and anything else is refused with a ``CheckpointError``;
  ``save_checkpoint`` converts numpy values to plain ones and refuses other objects.
* ``model.json`` and ``manifest.json`` are JSON and checked field by field. The manifest
  detects truncated, missing and damaged files (crashes, full disks, copies); it is not a
  signature and does not protect against someone who can write the directory.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import sys
import warnings
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from data_prep.atomic import (
    storage_error,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)
from model.config import ModelConfig
from model.gpt import GPT, HEAD_NAME, TIED_NAME

_STEP_DIR = re.compile(r"^step-(\d+)$")
# What a crashed save or an interrupted deletion leaves: never resumed from, removed by pruning.
_LEFTOVER_DIR = re.compile(r"^step-(\d+)\.(tmp|deleting)$")
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# Above this many bytes in one checkpoint only the small files' checksums are verified.
CHECKSUM_LIMIT_BYTES = 16 * 2**30
_CHUNK = 16 * 2**20


class CheckpointError(ValueError):
    """A checkpoint that cannot be used here (other model shape, missing or unsafe files)."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _on_rank0(work: Callable[[], Any]) -> None:
    """Do ``work``, a write only rank 0 makes, and end every rank alike if it fails.

    An OSError on rank 0 (a full disk) is raised there and, as an OSError of the same errno,
    on every other rank: otherwise they would wait in the next collective and die of a
    broken connection, their tracebacks hiding the cause. It costs one broadcast, which is
    also the barrier after the work.
    """
    failure: list[Any] = [None]
    error: OSError | None = None
    if _rank() == 0:
        try:
            work()
        except OSError as raised:
            error = raised
            failure[0] = (raised.errno, raised.strerror or str(raised))
    if _world() > 1:
        dist.broadcast_object_list(failure, src=0)
    if error is not None:
        raise error
    if failure[0] is not None:
        number, message = failure[0]
        raise OSError(number, f"{message} (on rank 0)")


# ---------------------------------------------------------------- manifest
def file_crc32(path: str | Path) -> str:
    """CRC-32 of a file's bytes as 8 hex digits (zlib, several GB/s, read in 16 MiB chunks)."""
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _files(ckpt_dir: Path) -> list[str]:
    """Relative names of every file under ``ckpt_dir`` but the manifest, sorted."""
    return sorted(p.relative_to(ckpt_dir).as_posix() for p in ckpt_dir.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def _describe(ckpt_dir: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: {"size": (ckpt_dir / n).stat().st_size, "crc32": file_crc32(ckpt_dir / n)}
            for n in names}


def write_manifest(ckpt_dir: str | Path) -> Path:
    """Describe every file of ``ckpt_dir`` (name, size, CRC-32) in ``manifest.json``.

    Collective when a process group is up: rank 0 lists the files, every rank checksums a
    share of them, and rank 0 writes the manifest (atomically). Call it after every other
    file of the checkpoint is complete.
    """
    ckpt_dir = Path(ckpt_dir)
    names = [_files(ckpt_dir) if _rank() == 0 else None]
    if _world() > 1:
        dist.broadcast_object_list(names, src=0)
    mine = _describe(ckpt_dir, names[0][_rank()::_world()])
    shares = [mine]
    if _world() > 1:
        shares = [None] * _world()
        dist.all_gather_object(shares, mine)
    path = ckpt_dir / MANIFEST

    def write() -> None:
        files = {k: v for share in shares for k, v in share.items()}
        write_json_atomic(path, {"format": MANIFEST_FORMAT, "checksum": "crc32",
                                 "files": dict(sorted(files.items()))})

    _on_rank0(write)
    return path


def checkpoint_problem(
    ckpt_dir: str | Path, checksum_limit: int = CHECKSUM_LIMIT_BYTES
) -> str | None:
    """What makes ``ckpt_dir`` incomplete or corrupt, or None when its manifest checks out.

    Every file named in ``manifest.json`` must exist with the recorded size. Checksums:
    every file's CRC-32 when the checkpoint holds at most ``checksum_limit`` bytes (16 GiB
    by default: a few seconds of reading); above that, only the small files' (all but the
    ``.distcp`` shards), so picking a checkpoint never reads a huge one whole. A directory
    without a manifest (an older format or an interrupted save) counts as incomplete.
    """
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        return f"no {MANIFEST} (an interrupted save or an older checkpoint format)"
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        sizes = {name: int(entry["size"]) for name, entry in files.items()}
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("checksum") != "crc32":
            raise ValueError(f"format {manifest.get('format')!r}, checksum "
                             f"{manifest.get('checksum')!r}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{MANIFEST} is unreadable ({type(err).__name__}: {err})"
    for required in (".metadata", "extra.pt", "model.json"):
        if required not in files:
            return f"{MANIFEST} does not list {required}"
    for name, size in sizes.items():
        file = ckpt_dir / name
        if not file.is_file():
            return f"{name} is missing"
        actual = file.stat().st_size
        if actual != size:
            return f"{name} is {actual} bytes but the manifest says {size} (truncated or damaged)"
    full = sum(sizes.values()) <= checksum_limit
    for name, entry in files.items():
        if full or not name.endswith(".distcp"):
            crc = file_crc32(ckpt_dir / name)
            if crc != entry.get("crc32"):
                return (f"{name} has CRC-32 {crc} but the manifest says "
                        f"{entry.get('crc32')} (damaged)")
    return None


def checkpoint_step(ckpt_dir: str | Path) -> int | None:
    """The step N of a ``step-N`` checkpoint directory (by its name), or None for another name."""
    m = _STEP_DIR.match(Path(ckpt_dir).name)
    return int(m.group(1)) if m else None


def newest_intact(
    root: str | Path, below: int | None = None, checksum_limit: int = CHECKSUM_LIMIT_BYTES,
    refuse: Callable[[Path], str | None] | None = None,
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest ``step-N`` under ``root`` that passes checkpoint_problem, or None; each
    newer one skipped, newest first, with its problem). ``below``: only steps under it;
    ``refuse``: a further reason to pass over an intact one (None: take it).

    Prints nothing: ``latest_checkpoint`` (resume) and ``model.evaluation.choice``
    (evaluation, export) each say what they skipped in their own words.
    """
    root = Path(root)
    if not root.is_dir():
        return None, []
    found = sorted(((int(m.group(1)), child) for child in root.iterdir()
                    if (m := _STEP_DIR.match(child.name)) and child.is_dir()
                    and (below is None or int(m.group(1)) < below)), reverse=True)
    skipped: list[tuple[Path, str]] = []
    for _, child in found:
        problem = checkpoint_problem(child, checksum_limit)
        if problem is None and refuse is not None:
            problem = refuse(child)
        if problem is None:
            return child, skipped
        skipped.append((child, problem))
    return None, skipped


def _choose(root: Path, checksum_limit: int,
            refuse: Callable[[Path], str | None] | None = None) -> Path | None:
    """The newest ``step-N`` under ``root`` that passes checkpoint_problem (and ``refuse``);
    report the others."""
    chosen, skipped = newest_intact(root, checksum_limit=checksum_limit, refuse=refuse)
    fallback = f"falling back to {chosen}" if chosen else "no complete checkpoint is left"
    for path, problem in skipped:
        print(f"[checkpoint] skipping {path}: {problem}; {fallback}", file=sys.stderr, flush=True)
    return chosen


def latest_checkpoint(root: str | Path, checksum_limit: int = CHECKSUM_LIMIT_BYTES,
                      refuse: Callable[[Path], str | None] | None = None) -> Path | None:
    """The newest complete, intact ``step-N`` checkpoint under ``root``, or None.

    ``refuse(path)`` may pass over an intact one with a reason (a rollback refuses one written
    inside a run of bad steps); it is asked on rank 0 only.

    ``*.tmp`` directories are never considered. Each newer checkpoint that fails
    ``checkpoint_problem`` (no manifest, a missing, truncated or damaged file) is skipped
    with one message on stderr naming its path and the problem. Under a process group
    rank 0 alone decides and broadcasts its choice, so every rank resumes from the same
    checkpoint (the directory must be on a filesystem rank 0 can read, as for saving).
    """
    root = Path(root)
    if _world() == 1:
        return _choose(root, checksum_limit, refuse)
    choice = [None]
    if _rank() == 0:
        chosen = _choose(root, checksum_limit, refuse)
        choice = [str(chosen) if chosen else None]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else None


# ---------------------------------------------------------------- extra state
def plain_state(value: Any, where: str = "extra") -> Any:
    """``value`` with numpy scalars/arrays turned into Python values, ready for weights_only.

    Raises CheckpointError naming the first value that is not a tensor, None, bool, int,
    float, str, or a dict/list/tuple of those.
    """
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist() if isinstance(value, np.ndarray) else value.item()
    if isinstance(value, dict):
        return {k: plain_state(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain_state(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}: extra checkpoint "
        "state may hold only tensors and plain Python values (it is loaded with "
        "weights_only=True); convert it in the object's state_dict()"
    )


def load_extra(ckpt_dir: str | Path) -> dict[str, Any]:
    """``extra.pt`` loaded with ``weights_only=True``; CheckpointError if it holds other objects."""
    path = Path(ckpt_dir) / "extra.pt"
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain Python values, refused "
            f"(loaded with weights_only=True: {first[0] if first else err}): it was not "
            "written by this trainer; remove the checkpoint directory"
        ) from None


# ---------------------------------------------------------------- save / load
def check_model_shape(ckpt_dir: str | Path, model_cfg: ModelConfig) -> None:
    """Raise CheckpointError naming each model field that differs from the checkpoint's.

    A field an older model.json lacks (added to ModelConfig since) counts as its default.
    """
    path = Path(ckpt_dir) / "model.json"
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir} has no model.json: not a checkpoint of this trainer")
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    saved = {**defaults, **json.loads(path.read_text())}
    mine = dataclasses.asdict(model_cfg)
    diff = [f"model.{k}: checkpoint {saved.get(k)!r} vs config {mine[k]!r}"
            for k in mine if saved.get(k) != mine[k] and k != "init_std"]
    if diff:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} was written for another model shape ({'; '.join(diff)}): "
            "use the checkpoint's model config or start from an empty checkpoints directory"
        )


class _ShardWriter(dcp.FileSystemWriter):
    """DCP's file writer, raising the OSError behind a shard it could not write.

    ``torch.save`` into a file that the disk stops taking raises its zip writer's
    ``RuntimeError`` ("unexpected pos"), the OSError only in its context; DCP then pickles
    the failure to every rank, which drops the context, and no rank could tell a full disk
    (not retried, the fix named) from a bug. This writer raises the OSError itself.
    """

    def write_data(self, plan: dcp.SavePlan, planner: dcp.SavePlanner) -> Future:
        try:
            return super().write_data(plan, planner)
        except Exception as error:
            behind = storage_error(error, errnos=None)
            if behind is None or behind is error:
                raise
            raise OSError(behind.errno, behind.strerror,
                          behind.filename or str(self.path)) from error


@dataclass
class PendingSave:
    """A save that ``start_save`` began and ``finish_save`` publishes.

    ``future`` is DCP's future of a background save (None for a synchronous one).
    """

    step: int
    tmp: Path
    final: Path
    future: Future | None = None

    def written(self) -> bool:
        """True when this rank's share is on disk (a synchronous save always is)."""
        return self.future is None or self.future.done()


def start_save(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    model_cfg: ModelConfig,
    group: dist.ProcessGroup | None = None,
    asynchronous: bool = False,
) -> PendingSave:
    """Collectively begin saving ``model``/``optimizer`` (+ rank 0's ``extra``) to ``step-N.tmp``.

    Synchronous: the DCP shards and ``.metadata`` are written before it returns. With
    ``asynchronous``, ``dcp.async_save`` copies the state to host memory and returns; a
    thread writes it, coordinating over ``group``, which must be a gloo group of every rank
    (not the training's group: its collectives would interleave with the training's).
    Either way rank 0 writes ``extra.pt`` and ``model.json`` before returning. Call
    ``finish_save`` (on every rank) to publish it.
    """
    root = Path(root)
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    extra = plain_state(extra)  # every rank refuses the same unsafe value, before any barrier

    def make_tmp() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover from an interrupted save
        tmp.mkdir()

    _on_rank0(make_tmp)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS),
    }
    future = None
    if asynchronous:
        future = dcp.async_save(state, storage_writer=_ShardWriter(tmp), process_group=group)
    else:
        try:
            dcp.save(state, storage_writer=_ShardWriter(tmp))
        except BaseException:  # DCP's CheckpointException, raised on every rank alike
            if _rank() == 0:  # nothing half-written stays: a full disk gets its space back
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def write_small_files() -> None:
        # Pickled in memory: torch.save to a file on a full disk raises a RuntimeError of
        # its zip writer, where Python's own write raises the OSError that names the cause.
        pickled = io.BytesIO()
        torch.save(extra, pickled)
        try:
            write_bytes_atomic(tmp / "extra.pt", pickled.getvalue())
            write_text_atomic(tmp / "model.json",
                              json.dumps(dataclasses.asdict(model_cfg), indent=2))
        except OSError:
            if future is None:  # nothing half-written stays (a background write may still be)
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    _on_rank0(write_small_files)
    return PendingSave(step, tmp, final, future)


def finish_save(pending: PendingSave) -> Path:
    """Collectively wait for ``pending`` and publish it: manifest, then rename to ``step-N``.

    Raises whatever the background write raised on this rank.
    """
    if pending.future is not None:
        pending.future.result()
    _barrier()  # every rank's shards are on disk
    write_manifest(pending.tmp)

    def rename() -> None:
        if pending.final.exists():
            shutil.rmtree(pending.final)
        os.replace(pending.tmp, pending.final)

    _on_rank0(rename)
    return pending.final


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    model_cfg: ModelConfig,
) -> Path:
    """Collectively save ``model``/``optimizer`` (+ rank 0's ``extra``) as ``root/step-N``.

    Order: DCP shards and ``.metadata`` into ``step-N.tmp``, rank 0's ``extra.pt`` and
    ``model.json``, then (after a barrier) the manifest, then the rename to ``step-N``.
    """
    return finish_save(start_save(root, step, model, optimizer, extra, model_cfg))


# ---------------------------------------------------------------- retention
def checkpoints_to_delete(
    complete: Iterable[int], keep_last: int, keep_every: int | None, protect: Iterable[int] = ()
) -> list[int]:
    """The steps of complete checkpoints that the retention rules let go, oldest first.

    Kept: the newest ``keep_last``, every multiple of ``keep_every``, the newest of all and
    the steps in ``protect``.
    """
    steps = sorted(set(complete))
    keep = set(steps[-max(1, keep_last):]) | set(protect)
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


def _remove(path: Path, why: str) -> None:
    """Rename first, so an interrupted deletion never leaves a ``step-N`` half there."""
    doomed = path
    if _STEP_DIR.match(path.name):
        doomed = path.with_name(f"{path.name}.deleting")
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    print(f"[checkpoint] deleted {path} ({why})", file=sys.stderr, flush=True)


def prune_checkpoints(
    root: str | Path,
    keep_last: int,
    keep_every: int | None = None,
    protect: Iterable[str | Path] = (),
) -> list[Path]:
    """Delete the checkpoints under ``root`` that the retention rules let go; return them.

    Not collective: call it on rank 0 only, after a save was published on every rank (no
    save may be in progress). Complete checkpoints (``checkpoint_problem`` by names, sizes
    and the small files' checksums) are kept by ``checkpoints_to_delete``; the newest
    complete one and the ``protect`` paths (the checkpoint this attempt resumed from) are
    never deleted. Directories that are not complete checkpoints (``step-N.tmp`` of a
    crashed save, a ``step-N`` without a valid manifest, an interrupted deletion) never
    count as kept ones: those older than the newest complete checkpoint are deleted, since
    resuming would never pick them. Newer ones are left alone. Each deletion is one line on
    stderr.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    guarded = {Path(p).resolve() for p in protect}
    complete: dict[int, Path] = {}
    broken: list[tuple[int, Path, str]] = []
    for child in root.iterdir():
        if not child.is_dir():
            continue
        if m := _STEP_DIR.match(child.name):
            problem = checkpoint_problem(child, checksum_limit=0)
            if problem is None:
                complete[int(m.group(1))] = child
            else:
                broken.append((int(m.group(1)), child, f"incomplete: {problem}"))
        elif m := _LEFTOVER_DIR.match(child.name):
            broken.append((int(m.group(1)), child, f"left by an interrupted "
                           f"{'save' if m.group(2) == 'tmp' else 'deletion'}"))
    if not complete:
        return []
    newest = max(complete)
    protected = [s for s, p in complete.items() if p.resolve() in guarded]
    deleted = []
    for step in checkpoints_to_delete(complete, keep_last, keep_every, protected):
        _remove(complete[step], f"beyond train.keep_last={keep_last}"
                + (f" and not a multiple of train.keep_every={keep_every}" if keep_every else ""))
        deleted.append(complete[step])
    for step, path, why in sorted(broken):
        if step < newest and path.resolve() not in guarded:
            _remove(path, why)
            deleted.append(path)
    return deleted


# ---------------------------------------------------------------- collective decisions
def vote(decider: bool, each: bool, device: torch.device | str = "cpu",
         group: dist.ProcessGroup | None = None) -> tuple[bool, bool]:
    """One all-reduce (MAX) that gives every rank the same two answers.

    Returns (rank 0's ``decider``, whether any rank's ``each`` is true). Used each step to
    agree whether rank 0's clock calls for a checkpoint and whether a background save is
    still being written somewhere, so ranks never disagree about saving. Without a process
    group it returns its arguments.
    """
    first, anywhere = agree(decider, each, device=device, group=group)
    return first, anywhere


def agree(decider: bool, *each: bool, device: torch.device | str = "cpu",
          group: dist.ProcessGroup | None = None) -> tuple[bool, ...]:
    """One all-reduce (MAX) of a few flags: (rank 0's ``decider``, then for each of ``each``
    whether any rank's is true). Every rank gets the same answers; without a process group
    (or with one rank) the arguments come back."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return (bool(decider), *(bool(flag) for flag in each))
    first = decider if dist.get_rank(group) == 0 else False
    flags = torch.tensor([int(first), *(int(flag) for flag in each)], dtype=torch.int32,
                         device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return tuple(bool(flag) for flag in flags.tolist())


def _renamed_head_state(optim: dict[str, Any], source: str, target: str) -> dict[str, Any]:
    """Flattened optimizer state with the entries of parameter ``source`` keyed as
    ``target``'s (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``)."""
    out = {}
    for key, value in optim.items():
        for part in ("state.", "param_groups."):
            if key.startswith(f"{part}{source}."):
                key = f"{part}{target}." + key[len(part) + len(source) + 1:]
        out[key] = value
    return out


def load_checkpoint(
    ckpt_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
    tied_head: bool = False,
) -> dict[str, Any]:
    """Collectively load a checkpoint into this rank's (sharded) model/optimizer; return extra.

    ``extra.pt`` is read first (``load_extra``: weights_only), so an unsafe one stops the
    load before any state changes.

    ``tied_head``: this rank holds the last pipeline stage's copy of a tied embedding
    (``output.weight``) and not the embedding. Its optimizer state is read from the
    embedding's entries, which every tied checkpoint has (one without pipelining keeps the
    one Parameter's state only under ``tok_embeddings.weight``; with pipelining both copies
    are saved, equal); its weights from ``output.weight``, which every checkpoint holds.
    """
    ckpt_dir = Path(ckpt_dir)
    extra = load_extra(ckpt_dir)
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
        if tied_head:
            state["optim"] = _renamed_head_state(state["optim"], HEAD_NAME, TIED_NAME)
    dcp.load(state, checkpoint_id=str(ckpt_dir))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        if tied_head:
            state["optim"] = _renamed_head_state(state["optim"], TIED_NAME, HEAD_NAME)
        set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIM_OPTIONS)
    return extra


def load_initial_weights(ckpt_dir: str | Path, model: nn.Module, model_cfg: ModelConfig) -> None:
    """Collectively load only the model weights of a checkpoint (ours or one imported from
    Hugging Face) into this rank's (sharded, possibly partial) model: ``train.init_from``.

    Raises CheckpointError if the checkpoint is incomplete or was written for another shape.
    """
    if (Path(ckpt_dir) / "config.json").is_file() and not (Path(ckpt_dir) / "model.json").is_file():
        raise CheckpointError(
            f"train.init_from {ckpt_dir} is a Hugging Face directory: the train stage imports "
            "it, or run python -m model.import_hf SRC OUT and start from OUT")
    problem = checkpoint_problem(ckpt_dir)
    if problem is not None:
        raise CheckpointError(f"train.init_from {ckpt_dir} cannot be loaded: {problem}")
    check_model_shape(ckpt_dir, model_cfg)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(ckpt_dir))
    set_model_state_dict(model, state["model"])


def load_for_inference(ckpt_dir: str | Path, model_cfg: ModelConfig) -> GPT:
    """The checkpoint's weights in a plain single-process GPT on CPU (no process group).

    Raises CheckpointError if the checkpoint fails ``checkpoint_problem`` or has another shape.
    """
    problem = checkpoint_problem(ckpt_dir)
    if problem is not None:
        raise CheckpointError(f"checkpoint {ckpt_dir} cannot be loaded: {problem}")
    check_model_shape(ckpt_dir, model_cfg)
    model = GPT(model_cfg)
    model.init_weights(0)  # rotary tables; every weight is overwritten below
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=True)
    model.load_state_dict(state["model"])
    model.eval()
    return model
