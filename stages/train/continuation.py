"""The train stage's continuation hook: more training from the last checkpoint.

The train stage declares ``train.steps`` its extent field (``StageDeclaration.extends``) and
this module its hook (``HOOK``), so it can continue an earlier output instead of starting
over:

- **on its own** when the only difference from a published output is a larger extent
  (``--set train.steps=60`` after a 40-step training with the same code, config and
  inputs): it continues from that training's final checkpoint (the largest extent below
  the new one; the newest on a tie);
- **when asked** with ``train.resume_from``: ``auto`` takes the newest training, published
  or interrupted, that differs only by code, software or extent (a fix to the trainer
  mid-run); a stage key names one; a checkpoint directory (``.../step-N``) names one
  checkpoint. The model shape and the data (the token store, ``train.seq_len``,
  ``train.global_batch``, ``train.seed``) must be the same: a difference is refused,
  naming the field.

The continuation enters the key as ``continues`` (the source key and step and the
checkpoint's manifest digest), so a continued output never passes for a fresh one. The
attempt hard-links the source checkpoint into its own work directory (``seed``) and the
trainer resumes there as after an interruption: weights, optimizer, schedule position,
data order and loss history.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from stages.config import ConfigError, PipelineConfig
from stages.mechanism import keys, outputs
from stages.mechanism.declaration import Continuation, ContinuationHook, StageDeclaration

CHECKPOINTS_DIR = "checkpoints"  # where the train stage keeps its step-N directories
RESUME_FIELD = "resume_from"
DATA_ORDER_FIELDS = ("seq_len", "global_batch", "seed")
"""train.* fields that decide which tokens each step sees: an explicit continuation must keep
them (as it must keep the model section and the token store)."""
_STEP = re.compile(r"^step-(\d+)$")


def checkpoint_digest(checkpoint: str | Path) -> str:
    """A checkpoint's content digest: its manifest (every file's size and CRC-32) and model
    shape (``stages.train.final_checkpoint_digest``)."""
    from stages.train import final_checkpoint_digest

    return final_checkpoint_digest({"checkpoint": str(checkpoint)})


def _newest_checkpoint(directory: Path) -> tuple[Path, int] | None:
    """The newest intact ``step-N`` checkpoint under ``directory/checkpoints``, or None."""
    from model.training.checkpoint import latest_checkpoint

    latest = latest_checkpoint(directory / CHECKPOINTS_DIR)
    if latest is None:
        return None
    match = _STEP.match(latest.name)
    return (latest, int(match.group(1))) if match else None


def _resume_from(cfg: PipelineConfig) -> str | None:
    return getattr(cfg.train, RESUME_FIELD, None)


def _lineage(ingredients: dict[str, Any], explicit: bool) -> dict[str, Any]:
    """The ingredients two outputs of one training share: all but extent and continuation,
    and, for an explicit continuation, also but code and software."""
    drop = {"extent", "continues"} | ({"code", "software"} if explicit else set())
    return {k: v for k, v in ingredients.items() if k not in drop}


def _extent(ingredients: dict[str, Any]) -> int:
    return int(next(iter(ingredients.get("extent", {}).values()), 0) or 0)


def _schedule_warning(cfg: PipelineConfig, status: dict[str, Any]) -> str:
    """A warning when the learning-rate decay follows train.steps, so extending a training
    changes the decay it was on."""
    old = (status.get("config") or {}).get("train", {})
    if cfg.train.decay_steps is not None or old.get("steps") in (None, cfg.train.steps):
        return ""
    return (f"train.decay_steps is unset, so the cosine decay follows train.steps: from step "
            f"{old.get('steps')} on the learning rate follows a decay over {cfg.train.steps} "
            f"steps, unlike both the {old.get('steps')}-step training it continues and an "
            f"uninterrupted {cfg.train.steps}-step one; set train.decay_steps to the longest "
            "training you may extend to, and extensions continue exactly")


def _compatibility_problem(cfg: PipelineConfig, ingredients: dict[str, Any],
                           status: dict[str, Any], source: str) -> str | None:
    """Why an explicitly named source cannot be continued (model shape or data differ)."""
    old = status.get("ingredients") or {}
    if old.get("inputs", {}).get("tokenize") != ingredients["inputs"].get("tokenize"):
        return (f"train.resume_from={source}: it was trained on another token store (the "
                "tokenize output differs): a continuation must see the same data")
    record = status.get("config") or {}
    for section in ("model",):
        before = record.get(section, {})
        now = keys.section_values(cfg, section)
        for name in sorted(set(before) | set(now)):
            if before.get(name) != now.get(name):
                return (f"train.resume_from={source}: {section}.{name} differs "
                        f"({before.get(name)!r} there, {now.get(name)!r} here); a continuation "
                        "keeps the model's shape: set it back, or train afresh without "
                        "train.resume_from")
    before = record.get("train", {})
    for name in DATA_ORDER_FIELDS:
        if name in before and before[name] != getattr(cfg.train, name):
            return (f"train.resume_from={source}: train.{name} differs ({before[name]!r} "
                    f"there, {getattr(cfg.train, name)!r} here); a continuation keeps the "
                    "data order: set it back, or train afresh without train.resume_from")
    return None


def _from_directory(directory: Path, key: str, status: dict[str, Any], why: str,
                    cfg: PipelineConfig) -> Continuation | None:
    found = _newest_checkpoint(directory)
    if found is None:
        return None
    checkpoint, step = found
    return Continuation(key=key, step=step, checkpoint=str(checkpoint), why=why,
                        digest=checkpoint_digest(checkpoint),
                        source_run_id=status.get("run_id", ""),
                        source_store=status.get("tracking_uri", ""),
                        warning=_schedule_warning(cfg, status))


def find(runs_dir: str | Path, stage: StageDeclaration, cfg: PipelineConfig,
         ingredients: dict[str, Any]) -> Continuation | None:
    """The output stage ``stage`` with these (fresh) ingredients continues, or None to start
    afresh (see the module docstring). Raises ``ConfigError`` for a ``train.resume_from``
    that names nothing usable or an incompatible training."""
    if not stage.extends:
        return None
    target = _extent(ingredients)
    asked = _resume_from(cfg)
    if asked and asked != "auto":
        return _named(runs_dir, stage, cfg, ingredients, asked, target)
    explicit = asked == "auto"
    lineage = _lineage(ingredients, explicit)
    best: tuple[int, Continuation] | None = None
    for key, directory, status in outputs.stage_outputs(runs_dir, stage.name,
                                                        unfinished=explicit):
        old = status.get("ingredients") or {}
        if _lineage(old, explicit) != lineage:
            continue
        if directory.name.endswith(outputs.PARTIAL_SUFFIX) and key == keys.key_of(ingredients):
            continue  # this very key's unfinished attempt: it resumes on its own
        candidate = _from_directory(directory, key, status, "", cfg)
        if candidate is None or candidate.step >= target:
            continue
        if best is None or candidate.step > best[0]:
            best = (candidate.step, candidate)
    if best is None:
        if explicit:
            raise ConfigError(
                f"train.resume_from=auto: no training of this model and data with a checkpoint "
                f"below step {target} in {runs_dir}; train afresh without train.resume_from")
        return None
    found = best[1]
    if explicit:
        why = (f"train.resume_from=auto: continues {found.key} (code or software may differ) "
               f"from step {found.step}")
    else:
        why = f"train.steps raised: continues {found.key} from step {found.step}"
    return Continuation(**{**found.__dict__, "why": why})


def _named(runs_dir: str | Path, stage: StageDeclaration, cfg: PipelineConfig,
           ingredients: dict[str, Any], asked: str, target: int) -> Continuation:
    """The continuation ``train.resume_from=<key or checkpoint path>`` names."""
    path = Path(asked)
    if _STEP.match(path.name) and path.is_dir():
        directory = path.parent.parent
        status = outputs.read_status(directory) or {}
        key = status.get("key", "") if status.get("ingredients") else ""
        checkpoint, step = path, int(_STEP.match(path.name).group(1))
        from model.training.checkpoint import check_model_shape, checkpoint_problem

        problem = checkpoint_problem(path)
        if problem:
            raise ConfigError(f"train.resume_from={asked}: {problem}; name an intact "
                              "checkpoint (or auto)")
        if not key:
            check_model_shape(path, cfg.model)
        why = f"train.resume_from: continues checkpoint {path} at step {step}"
    else:
        directory = outputs.stage_dir(runs_dir, stage.name, asked)
        if not (directory / outputs.STATUS_FILE).is_file():
            directory = outputs.partial_dir(directory)
        status = outputs.read_status(directory) or {}
        if not status:
            raise ConfigError(f"train.resume_from={asked}: no train stage output with that key in "
                              f"{runs_dir} (and not a step-N checkpoint directory); use auto, a "
                              "key from --dry-run or the MLflow run's stage_key tag, or a path")
        found = _newest_checkpoint(directory)
        if found is None:
            raise ConfigError(f"train.resume_from={asked}: {directory} holds no intact "
                              "checkpoint; train afresh without train.resume_from")
        checkpoint, step = found
        key = asked
        why = f"train.resume_from={asked}: continues from step {step}"
    if status.get("ingredients"):
        problem = _compatibility_problem(cfg, ingredients, status, asked)
        if problem:
            raise ConfigError(problem)
    if step >= target:
        raise ConfigError(f"train.resume_from={asked}: its checkpoint is at step {step}, not "
                          f"below train.steps={target}: raise train.steps to train further")
    return Continuation(key=key, step=step, checkpoint=str(checkpoint), why=why,
                        digest=checkpoint_digest(checkpoint),
                        source_run_id=status.get("run_id", ""),
                        source_store=status.get("tracking_uri", ""),
                        warning=_schedule_warning(cfg, status))


def seed(continuation: Continuation, work_dir: str | Path) -> bool:
    """Place the source checkpoint in a new attempt's ``checkpoints/`` (hard links; a copy
    across file systems), unless the attempt already has checkpoints of its own (a resumed
    attempt continues from those). True when it placed it."""
    root = Path(work_dir) / CHECKPOINTS_DIR
    if root.is_dir() and any(_STEP.match(p.name) for p in root.iterdir()):
        return False
    source = Path(continuation.checkpoint)
    target = root / source.name
    tmp = root / f".{source.name}.seeding"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in sorted(source.rglob("*")):
        dest = tmp / path.relative_to(source)
        if path.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, dest)
        except OSError:
            shutil.copy2(path, dest)
    os.replace(tmp, target)
    return True


HOOK = ContinuationHook(find=find, seed=seed)
"""The train stage's continuation hook (``StageDeclaration.continuation``)."""
