"""Downstream evaluation with lm-evaluation-harness (the optional ``eval`` extra).

``GPTHarnessLM`` exposes a plain (single-process, CPU) GPT and its ``tokenizers`` tokenizer
as an lm-eval ``LM``: ``loglikelihood`` (multiple choice and similar tasks),
``loglikelihood_rolling`` (perplexity tasks) and ``generate_until`` (greedy or sampled
generation with stop strings). ``write_heldout_task`` writes a perplexity task over local
documents (a jsonl file read by the ``datasets`` json builder), so a harness run needs no
download; ``run_tasks`` runs task names through ``lm_eval.simple_evaluate``.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:
    from lm_eval.api.model import LM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as err:  # the optional extra is missing
    raise ImportError(
        "eval.tasks needs lm-evaluation-harness: pip install 'frontier-llm[eval]' "
        f"(or pip install lm-eval); import failed: {err}"
    ) from err

from model.evaluation.generate import generate_tokens

HELDOUT_TASK = "heldout_perplexity"


class GPTHarnessLM(LM):
    """An lm-eval LM over our GPT. Scores each request in one forward pass (batched)."""

    def __init__(self, model: torch.nn.Module, tokenizer, eos_id: int, batch_size: int = 8) -> None:
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.batch_size = batch_size
        self.max_length = model.cfg.max_seq_len

    # -- helpers -------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (sum log p(continuation | context), greedy?)."""
        results: list[tuple[float, bool]] = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start : start + self.batch_size]
            rows, spans = [], []
            for context, cont in chunk:
                whole = (context + cont)[-(self.max_length + 1) :]  # keep the continuation
                rows.append(whole[:-1])
                spans.append(len(cont))
            width = max(len(r) for r in rows)
            # Right padding with eos: causal attention keeps padded positions out of the
            # scored ones, which all precede the padding.
            batch = torch.full((len(rows), width), self.eos_id, dtype=torch.long)
            for i, row in enumerate(rows):
                batch[i, : len(row)] = torch.tensor(row)
            logprobs = F.log_softmax(self.model(batch).float(), dim=-1)  # [B, T, V]
            for i, ((context, cont), n) in enumerate(zip(chunk, spans)):
                end = len(rows[i])
                scored = logprobs[i, end - n : end]  # [n, V] predicting cont
                target = torch.tensor(cont[-n:])
                total = float(scored.gather(1, target[:, None]).sum())
                greedy = bool((scored.argmax(-1) == target).all())
                results.append((total, greedy))
        return results

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Encode context+continuation jointly (BPE merges across the boundary) and split."""
        spaces = len(context) - len(context.rstrip())
        if spaces:  # trailing spaces belong to the continuation's first token
            continuation = context[-spaces:] + continuation
            context = context[:-spaces]
        whole = self._encode(context + continuation)
        context_ids = self._encode(context) if context else []
        cont_ids = whole[len(context_ids) :]
        return (context_ids or [self.eos_id]), cont_ids

    # -- the LM interface ----------------------------------------------------------
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """log p(continuation | context) and whether greedy decoding reproduces it."""
        return self._score([self._split(*req.args) for req in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Total log-likelihood of each string, in disjoint max_length windows after eos."""
        out = []
        for req in requests:
            (text,) = req.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self._encode(text), prefix_token=self.eos_id,
                    max_seq_len=self.max_length, context_len=1,
                )
            ]
            out.append(sum(score for score, _ in self._score(windows)))
        return out

    def generate_until(self, requests) -> list[str]:
        """Greedy (or sampled, with gen_kwargs temperature) text until a stop string."""
        out = []
        generator = torch.Generator().manual_seed(0)
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kwargs.get("temperature", 0.0) or 0.0)
            if not kwargs.get("do_sample", temperature > 0):
                temperature = 0.0
            ids = self._encode(context) or [self.eos_id]
            new = generate_tokens(self.model, ids, int(kwargs.get("max_gen_toks", 64)),
                                  temperature or None, generator, self.eos_id, self.max_length)
            text = self.tokenizer.decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(text)
        return out


def write_heldout_task(task_dir: str | Path, documents: list[str],
                       name: str = HELDOUT_TASK) -> Path:
    """A perplexity task (word/byte perplexity, bits per byte) over local documents.

    Writes ``<task_dir>/<name>.jsonl`` and ``<task_dir>/<name>.yaml``; pass ``task_dir`` to
    ``run_tasks(include_path=...)``.
    """
    if not documents:
        raise ValueError(f"task {name}: no documents to evaluate (the held-out split is empty)")
    task_dir = Path(task_dir)
    task_dir.mkdir(parents=True, exist_ok=True)
    data = task_dir / f"{name}.jsonl"
    with open(data, "w") as handle:
        handle.writelines(json.dumps({"text": text}) + "\n" for text in documents)
    spec = {
        "task": name,
        "dataset_path": "json",
        # cache_dir: the datasets json builder's cache stays beside the task, not in ~/.cache.
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())},
                           "cache_dir": str((task_dir / "hf_cache").resolve())},
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "should_decontaminate": False,
        "metric_list": [
            {"metric": "word_perplexity", "aggregation": "weighted_perplexity",
             "higher_is_better": False},
            {"metric": "byte_perplexity", "aggregation": "weighted_perplexity",
             "higher_is_better": False},
            {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
        ],
        "metadata": {"version": 1.0},
    }
    path = task_dir / f"{name}.yaml"
    path.write_text(json.dumps(spec, indent=2))  # JSON is YAML
    return path


def run_tasks(
    lm: GPTHarnessLM,
    tasks: list[str],
    include_path: str | Path | list[str | Path] | None = None,
    limit: int | None = None,
) -> dict[str, dict[str, float]]:
    """Run lm-eval ``tasks``; returns {task: {metric: value}} (numeric metrics only).

    Unknown task names raise ValueError listing them. Tasks whose data is not local need the
    hub (HF_DATASETS_OFFLINE unset) or a populated HF_HOME cache.
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    paths = [str(p) for p in ([include_path] if isinstance(include_path, (str, Path))
                              else include_path or [])]
    # Indexing the harness's own task registry takes ~30 s: skip it when local tasks suffice.
    manager = TaskManager(include_path=paths or None, include_defaults=False)
    if not paths or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=paths or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"eval.tasks: unknown lm-eval task(s) {unknown}; use names from "
            f"`lm-eval ls tasks` or '{HELDOUT_TASK}' (the held-out split)"
        )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raw = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                          bootstrap_iters=0, log_samples=False)
    results: dict[str, dict[str, float]] = {}
    for task, metrics in raw["results"].items():
        clean = {}
        for key, value in metrics.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and math.isfinite(value):
                clean[key.split(",")[0]] = float(value)  # "word_perplexity,none" -> name
        results[task] = clean
    return results


def describe(results: dict[str, dict[str, Any]]) -> str:
    """Markdown lines summarising harness results."""
    lines = []
    for task, metrics in sorted(results.items()):
        shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()))
        lines.append(f"- {task}: {shown}")
    return "\n".join(lines)
