"""PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling", arXiv 2406.02069): lower layers spread their attention
widely and upper layers focus, so budgets shrink with depth — an arithmetic sequence
from ``2k - k/beta`` at the first layer to ``k/beta`` at the last (mean ``k``, the
requested budget) — and each layer selects with SnapKV's observation-window votes. A
layer keeps at most the prompt: what the sequence would put above it goes to the other
layers, so the mean is the budget wherever the prompt allows (budget 1.0: the full cache).

The default ``beta`` (20) is the paper's, chosen for 32-layer models. On a shallow model
the last layers get ``k / beta`` entries: on a 2-layer model at a quarter of a
1024-token prompt, 13 entries for the last layer, fewer than its 32-query observation
window, so that layer keeps recent tokens only; measured on the needle-1k organism this
holds accuracy at 0.3 at every budget. The cache warns when the schedule puts a layer at the
window or below where the mean budget is above it (a smaller ``beta`` gives the last layers more; ``beta=1`` is SnapKV)."""

from __future__ import annotations

import warnings

from ..budget import pyramid
from .snapkv import SnapKV


class PyramidKV(SnapKV):
    name = "pyramid"
    paper = "arXiv:2406.02069"
    params = {"window": 32, "kernel": 5, "pooling": "max", "beta": 20}
    beta: float

    def check(self) -> None:
        super().check()
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or self.beta < 1:
            raise ValueError(
                f"beta: expected a number >= 1 (the first layer's budget over the last's is about 2*beta - 1), got {self.beta!r}"
            )

    def capacity(self, tokens, layer, num_layers, held=None):
        kept = pyramid(tokens, layer, num_layers, float(self.beta), held)
        # starved by the schedule: an even split (SnapKV) would have given the layer more than the window
        starved = (kept <= self.window) & (tokens > self.window)
        if bool(starved.any()) and not getattr(self, "_warned", False):
            self._warned = True  # once per cache: a warning per layer and batch would drown the message
            warnings.warn(
                f"pyramid: with {num_layers} layers and beta={self.beta}, layer {layer} keeps "
                f"{int(kept[starved].min())} entries per head, no more than its observation window "
                f"({self.window}), so it keeps recent tokens only; PyramidKV's beta was set for 32-layer "
                f"models: pass a smaller beta (beta=1 is SnapKV's even split)",
                UserWarning,
                stacklevel=2,
            )
        return kept
