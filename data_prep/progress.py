"""Periodic progress lines for long work: done/total, rates and ETA."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Prints ``label: docs a/b (p%) | x docs/s | y tokens/s | ETA z`` every ``every_s`` seconds."""

    def __init__(self, label: str, total_docs: int, every_s: float = 10.0,
                 stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total_docs
        self.every = every_s
        self.stream = stream
        self.start = time.perf_counter()
        self.last = self.start
        self.docs = 0
        self.tokens = 0

    def update(self, docs: int, tokens: int) -> None:
        """Count ``docs`` more documents and ``tokens`` more tokens; print if it is time."""
        self.docs += docs
        self.tokens += tokens
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self.emit()

    def line(self, done: bool = False) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        docs_s = self.docs / elapsed
        eta = (self.total - self.docs) / docs_s if docs_s > 0 else float("inf")
        pct = 100.0 * self.docs / self.total if self.total else 100.0
        return (f"{self.label}: {self.docs}/{self.total} docs ({pct:.0f}%) | "
                f"{docs_s:,.0f} docs/s | "
                f"{self.tokens / elapsed:,.0f} tokens/s | "
                + (f"done in {elapsed:,.1f}s" if done else f"ETA {eta:,.0f}s"))

    def emit(self, done: bool = False) -> None:
        """Print the current line now (``done``: the final line, with the elapsed time)."""
        print(self.line(done), file=self.stream or sys.stdout, flush=True)
