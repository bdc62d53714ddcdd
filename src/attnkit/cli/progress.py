"""A dependency-free progress line on stderr (silent when stderr is not a terminal and --quiet)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled = total, label, enabled
        self.done = 0
        self.start = time.perf_counter()

    def step(self, what: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        end = "\n" if self.done >= self.total or not sys.stderr.isatty() else "\r"
        sys.stderr.write(
            f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {what}\033[K{end}"
            if sys.stderr.isatty()
            else f"{self.label} {self.done}/{self.total} {elapsed:.1f}s {what}{end}"
        )
        sys.stderr.flush()
