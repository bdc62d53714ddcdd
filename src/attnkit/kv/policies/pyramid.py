"""PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling", arXiv 2406.02069): lower layers spread their attention
widely and upper layers focus, so budgets shrink with depth — an arithmetic sequence
from ``2k - k/beta`` at the first layer to ``k/beta`` at the last (mean ``k``, the
requested budget) — and each layer selects with SnapKV's observation-window votes. A
layer keeps at most the prompt: what the sequence would put above it goes to the other
layers, so the mean is the budget wherever the prompt allows (budget 1.0: the full cache)."""

from __future__ import annotations

from ..budget import pyramid
from .snapkv import SnapKV


class PyramidKV(SnapKV):
    name = "pyramid"
    paper = "arXiv:2406.02069"
    params = {"window": 32, "kernel": 5, "pooling": "max", "beta": 20}

    def check(self) -> None:
        super().check()
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or self.beta < 1:
            raise ValueError(f"beta: expected a number >= 1 (the first layer's budget over the last's is about 2*beta - 1), got {self.beta!r}")

    def capacity(self, tokens, layer, num_layers, held=None):
        return pyramid(tokens, layer, num_layers, float(self.beta), held)

