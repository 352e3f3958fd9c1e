"""Autoregressive text generation with a GPT, greedy or sampled: a plain single-process GPT,
or a ``model.evaluation.layout.LayoutModel`` spread over tp x pp ranks (every rank then
computes the same tokens).

No key/value cache: each new token reruns the model on the last ``max_seq_len`` tokens.
That is quadratic in the generated length but needs nothing from the model beyond
``forward(tokens) -> logits``, and the generations written by the evaluation are short.
"""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate_tokens(
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float | None = None,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    max_seq_len: int | None = None,
) -> list[int]:
    """Continue ``prompt`` (token ids) by up to ``max_new_tokens`` ids; returns only the new ids.

    ``temperature`` None (or 0) picks the most likely token (greedy); otherwise tokens are
    sampled from softmax(logits / temperature) with ``generator``. Stops after ``eos_id``.
    """
    if not prompt:
        raise ValueError("generation needs a non-empty prompt (at least one token)")
    limit = max_seq_len or model.cfg.max_seq_len
    tokens = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([tokens[-limit:]], dtype=torch.long)  # [1, T]
        if hasattr(model, "last_logits"):  # a LayoutModel: the same logits on every rank
            logits = model.last_logits(window)[0]  # [V]
        else:
            logits = model(window)[0, -1].float()  # [V]
        if not temperature:
            next_id = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_id = int(torch.multinomial(probs, 1, generator=generator))
        tokens.append(next_id)
        new.append(next_id)
        if eos_id is not None and next_id == eos_id:
            break
    return new


def generate_text(
    model: nn.Module,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    eos_id: int | None = None,
    with_ids: bool = False,
) -> list[dict]:
    """Greedy and sampled continuations of each prompt (``tokenizers.Tokenizer`` in and out).

    Returns one dict per prompt: {"prompt", "greedy", "sampled"} (continuations only), plus
    their token ids "greedy_ids" and "sampled_ids" with ``with_ids``. The sampled tokens
    depend only on ``seed`` and the logits: ranks of a ``LayoutModel`` (which all see the
    same logits) draw the same tokens.
    """
    generator = torch.Generator().manual_seed(seed)
    out = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt).ids
        if not ids:
            raise ValueError(f"eval.prompts entry {prompt!r} encodes to no tokens")
        greedy = generate_tokens(model, ids, max_new_tokens, None, eos_id=eos_id)
        sampled = generate_tokens(model, ids, max_new_tokens, temperature, generator, eos_id)
        item: dict = {"prompt": prompt, "greedy": tokenizer.decode(greedy),
                      "sampled": tokenizer.decode(sampled)}
        if with_ids:
            item.update(greedy_ids=greedy, sampled_ids=sampled)
        out.append(item)
    return out


def format_generations(items: list[dict[str, str]], temperature: float) -> str:
    """The generations.txt text: each prompt with its greedy and sampled continuation."""
    blocks = []
    for item in items:
        blocks.append(
            f"=== prompt: {item['prompt']!r}\n"
            f"--- greedy:\n{item['prompt']}{item['greedy']}\n"
            f"--- sampled (temperature {temperature}):\n{item['prompt']}{item['sampled']}\n"
        )
    return "\n".join(blocks)
