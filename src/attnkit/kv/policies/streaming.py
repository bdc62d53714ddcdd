"""StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention
Sinks", arXiv 2309.17453): keep the first ``sinks`` tokens (the attention sinks) and a
window of the most recent tokens; the rest is evicted, at prefill and after every
decoding step, so the cache never holds more than the budget.

Positions: with ``positions="original"`` every token keeps the RoPE position it was
encoded at (a query far from its sinks sees them at a large distance). With
``positions="cache"`` (the paper's choice, Sec. 3.2), positions are assigned within the
cache: after each eviction the kept keys are re-rotated to positions 0, 1, ... in cache
order, and new tokens are encoded at the cache's length, so no query ever sees a distance
larger than the budget. The prompt itself is encoded densely at its original positions.
"""

from __future__ import annotations

import torch

from ..select import first, last
from .base import Policy, Step, check_int


class Streaming(Policy):
    name = "streaming"
    paper = "arXiv:2309.17453"
    params = {"sinks": 4, "positions": "original"}
    sinks: int
    positions: str
    decodes = True
    rolling = True

    def check(self) -> None:
        check_int(self.sinks, "sinks", 0)
        if self.positions not in ("original", "cache"):
            raise ValueError(f"positions: expected 'original' or 'cache', got {self.positions!r}")

    @property
    def rerotates_keys(self) -> bool:  # type: ignore[override]  # Policy's class flag, here read from ``positions``
        return self.positions == "cache"

    def select(self, step: Step) -> torch.Tensor:
        cap = step.capacity
        sinks = torch.clamp(cap, max=self.sinks)
        return first(step.valid, sinks, step.order) | last(step.valid, cap - sinks, step.order)

    def reference(self, weights, keys, held, capacity, state, phase):
        keep = torch.zeros_like(held)
        B, H, _ = held.shape
        for b in range(B):
            for h in range(H):
                idx = held[b, h].nonzero().flatten().tolist()
                c = int(capacity[b, h])
                s = min(self.sinks, c)
                chosen = idx[:s] + (idx[max(len(idx) - (c - s), s) :] if c > s else [])
                keep[b, h, chosen] = True
        return keep
