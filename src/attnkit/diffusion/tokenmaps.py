"""Per-token cross-attention maps, accumulated in O(N_image x N_text) memory.

The map of text token t is, at every image position i, the attention weight A[i, t]
from image query i to text key t, averaged over the heads, layers and steps chosen —
the aggregation of Prompt-to-Prompt (Hertz et al. 2022, arXiv 2208.01626) and
Attend-and-Excite (Chefer et al. 2023, arXiv 2301.13826). The kernels hand the meter
tiles of weights; it keeps one sum of shape (B, T, h*w) per latent grid the layers run
at (a UNet's levels), never an N_image x N_image map, nor one map per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..observe.base import AttentionTile, CallInfo, Observer, Selection
from .layers import CallLayout, index_tuple

Tensor = torch.Tensor


class TokenMaps(Observer):
    """Per text token, its attention mass at every image position.

    Args:
        layers: layer numbers to aggregate (the numbers ``use`` tags calls with;
            default: every cross or joint layer the meter sees).
        heads: head indices to average (default: all).
        steps: denoising steps to aggregate (0 = the first forward of the block;
            default: all).

    Feed it through ``attnkit.diffusion.use(..., observers=[meter])``, which tells it
    (``note_call``) where the image queries and text keys of every call sit.
    """

    def __init__(self, layers=None, heads=None, steps=None):
        self.layers = _as_set(index_tuple(layers, "layers"))
        self.heads = index_tuple(heads, "heads")
        self.steps = _as_set(index_tuple(steps, "steps"))
        self._sums: dict[tuple[int, int], Tensor] = {}  # grid (h, w) -> (B, T, h*w) float64
        self._counts: dict[tuple[int, int], int] = {}  # grid -> heads x calls summed
        self._layout: CallLayout | None = None
        self._active = False

    # -- protocol -------------------------------------------------------------------------

    def note_call(self, layout: CallLayout) -> None:
        self._layout = layout

    def wants(self, call: CallInfo) -> Selection | None:
        lay = self._layout
        if lay is None or lay.layer != call.layer or lay.text_keys is None:
            return None
        if (self.layers is not None and call.layer not in self.layers) or (self.steps is not None and lay.step not in self.steps):
            return None
        if lay.grid is None:
            raise ValueError(
                f"grid: cannot tell the latent grid of {lay.name} ({lay.image_queries[1] - lay.image_queries[0]} "
                "image tokens); pass a square latent or a model input of shape (B, C, H, W)"
            )
        if self.heads is not None and self.heads[-1] >= call.heads:
            raise ValueError(f"heads: index {self.heads[-1]} out of range for {lay.name}, which has {call.heads} heads")
        lo, hi = lay.image_queries
        return Selection(self.heads, (lo + call.q_start, hi + call.q_start))

    def begin(self, call: CallInfo) -> None:
        lay = self._layout
        assert lay is not None and lay.text_keys is not None and lay.grid is not None  # wants() checked them
        t_lo, t_hi = lay.text_keys
        shape = (call.batch, t_hi - t_lo, lay.grid[0] * lay.grid[1])
        held = self._sums.get(lay.grid)
        if held is None:
            self._sums[lay.grid] = torch.zeros(shape, dtype=torch.float64)
            self._counts[lay.grid] = 0
        elif tuple(held.shape) != shape:
            raise ValueError(
                f"calls: {lay.name} has batch and text sizes {shape[:2]}, but earlier calls had {tuple(held.shape[:2])}; "
                "use one meter per prompt batch"
            )
        self._counts[lay.grid] += len(self.heads) if self.heads is not None else call.heads
        self._active = True

    def update(self, tile: AttentionTile) -> None:
        if not self._active:
            return
        lay, call = self._layout, tile.call
        assert lay is not None and lay.text_keys is not None and lay.grid is not None  # wants() checked them
        w = tile.weights
        if self.heads is not None:
            where = torch.tensor(self.heads)
            if tile.heads is not None:
                where = torch.searchsorted(tile.heads, where)
            w = w.index_select(1, where.to(w.device))
        q0, k0, b0 = tile.starts
        r0 = q0 - call.q_start  # first query row of the tile
        i_lo, i_hi = lay.image_queries
        t_lo, t_hi = lay.text_keys
        a, b = max(i_lo - r0, 0), min(i_hi - r0, w.shape[2])
        c, d = max(t_lo - k0, 0), min(t_hi - k0, w.shape[3])
        if a >= b or c >= d:
            return
        part = w[:, :, a:b, c:d].sum(1, dtype=torch.float64).transpose(1, 2).detach()  # (Bt, T', R)
        rows = slice(r0 + a - i_lo, r0 + b - i_lo)
        toks = slice(k0 + c - t_lo, k0 + d - t_lo)
        sums = self._sums[lay.grid]
        if sums.device != w.device:  # kept where the kernels run: no copy per tile
            sums = self._sums[lay.grid] = sums.to(w.device)
        sums[b0 : b0 + w.shape[0], toks, rows] += part

    def end(self, call: CallInfo) -> None:
        self._active = False

    # -- results ------------------------------------------------------------------------------

    @property
    def grids(self) -> list[tuple[int, int]]:
        return sorted(self._sums)

    def state_bytes(self) -> int:
        """Bytes of state held (the O(N_image x N_text) sums)."""
        return sum(t.numel() * t.element_size() for t in self._sums.values())

    def maps(self, size: tuple[int, int] | None = None) -> Tensor:
        """(B, T, h, w) float64: per batch row and text token, the mean weight at each
        image position over the heads, layers and steps measured. Maps of coarser grids
        are resized (bilinear) to ``size`` (default: the finest grid seen) before the
        mean, each weighted by how many head-calls it holds."""
        if not self._sums:
            raise ValueError(
                "maps: the meter saw no cross or joint attention call; run the model inside attnkit.diffusion.use "
                "with this meter among the observers and layers that attend to text"
            )
        return mean_over_grids(self._sums, self._counts, size).cpu()


def _as_set(indices: tuple[int, ...] | None) -> frozenset | None:
    return None if indices is None else frozenset(indices)


def mean_over_grids(
    sums: dict[tuple[int, int], Tensor], counts: dict[tuple[int, int], int], size: tuple[int, int] | None = None
) -> Tensor:
    """(B, T, h, w): the mean of per-grid sums ``sums[(h', w')]`` of shape (B, T, h'*w'),
    each holding ``counts[(h', w')]`` head-calls. Coarser grids are resized (bilinear) to
    ``size`` (default: the finest grid) before the mean, so every head-call weighs the
    same whatever the resolution its layer runs at."""
    if size is None:
        size = max(sums, key=lambda g: g[0] * g[1])
    total: Tensor | None = None
    count = 0
    for grid, grid_sums in sums.items():
        m = grid_sums.reshape(grid_sums.shape[0], grid_sums.shape[1], *grid)
        if tuple(grid) != tuple(size):
            m = F.interpolate(m, size=tuple(size), mode="bilinear", align_corners=False)
        total = m if total is None else total + m
        count += counts[grid]
    assert total is not None  # the callers hold at least one grid
    return total / count


__all__ = ["TokenMaps"]
