"""Periodic progress lines for long work: done/total, rates and ETA."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Prints ``label: a/b MB (p%) | n docs | x docs/s | y tokens/s | ETA z`` every
    ``every_s`` seconds.

    The total is the input's size in bytes (known from metadata before anything is read);
    what is done is counted in text characters, so for JSON input (keys, escapes) or
    compressed files the percentage and ETA are estimates, and the final line says 100 %.
    """

    def __init__(self, label: str, total_bytes: int, every_s: float = 10.0,
                 stream: TextIO | None = None, tokens: bool = True) -> None:
        self.label = label
        self.total = total_bytes
        self.every = every_s
        self.stream = stream
        self.show_tokens = tokens  # False: work that counts no tokens (no tokens/s field)
        self.start = time.perf_counter()
        self.last = self.start
        self.docs = 0
        self.tokens = 0
        self.done_bytes = 0

    def update(self, docs: int, tokens: int, text_bytes: int) -> None:
        """Count ``docs`` more documents, ``tokens`` more tokens and ``text_bytes`` more of
        the input; print if it is time."""
        self.docs += docs
        self.tokens += tokens
        self.done_bytes += text_bytes
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self.emit()

    def line(self, done: bool = False) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        done_bytes = self.total if done else min(self.done_bytes, self.total)
        rate = done_bytes / elapsed
        eta = (self.total - done_bytes) / rate if rate > 0 else float("inf")
        pct = 100.0 * done_bytes / self.total if self.total else 100.0
        return (f"{self.label}: {done_bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB ({pct:.0f}%) | "
                f"{self.docs} docs | {self.docs / elapsed:,.0f} docs/s | "
                + (f"{self.tokens / elapsed:,.0f} tokens/s | " if self.show_tokens else "")
                + (f"done in {elapsed:,.1f}s" if done else f"ETA {eta:,.0f}s"))

    def emit(self, done: bool = False) -> None:
        """Print the current line now (``done``: the final line, with the elapsed time)."""
        print(self.line(done), file=self.stream or sys.stdout, flush=True)
