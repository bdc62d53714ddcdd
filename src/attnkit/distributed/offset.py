"""Masks and score mods that see global positions inside a call on a slice of the sequence.

A sharded call runs attention on (query chunk, key chunk) pairs cut from the whole
sequence. Inside such a call the kernels number queries and keys locally (keys from 0,
queries bottom-right aligned), so the user's mask and score mod — bound once to the
whole sequence — are wrapped with the shift from local to global indices. The wrapped
mask also classifies tiles through the inner mask, on a grid moved to global positions,
so a kernel still skips empty tiles and a whole pair can be classified without
evaluating anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mods import Mask, ScoreMod, TileGrid, causal, window

Tensor = torch.Tensor


@dataclass(frozen=True)
class ShiftedGrid(TileGrid):
    """A TileGrid whose keys sit at ``k_start .. k_start + k_len`` instead of 0 .. k_len."""

    k_start: int = 0

    def k_bounds(self) -> tuple[Tensor, Tensor]:
        lo, hi = super().k_bounds()
        return lo + self.k_start, hi + self.k_start

    def block_min_max(self, values: Tensor, side: str) -> tuple[Tensor, Tensor]:
        if side == "q" or self.k_start == 0:
            return super().block_min_max(values, side)
        # the base class reads keys from position 0: hand it the values from k_start on
        return super().block_min_max(values[..., self.k_start :], side)


class ShiftedMask(Mask):
    """``inner`` (bound to the global sequence) at global indices ``q + q_shift``, ``kv + k_shift``."""

    def __init__(self, inner: Mask, q_shift: int, k_shift: int):
        self.inner, self.q_shift, self.k_shift = inner, q_shift, k_shift
        self.batch_dependent = inner.batch_dependent

    def __call__(self, b, h, q_idx, kv_idx):
        return self.inner(b, h, q_idx + self.q_shift, kv_idx + self.k_shift)

    def classify(self, grid: TileGrid) -> Tensor:
        moved = ShiftedGrid(
            q_start=grid.q_start + self.q_shift,
            q_len=grid.q_len,
            q_block=grid.q_block,
            k_len=grid.k_len,
            k_block=grid.k_block,
            k_start=self.k_shift,
        )
        return self.inner.classify(moved)

    def bind(self, batch, heads, q_len, k_len):
        return self  # the inner mask is bound to the whole sequence already

    def band(self):
        # kv - q is the same band shifted by the offset between the two index systems
        band = self.inner.band()
        if band is None:
            return None
        d = self.k_shift - self.q_shift
        lo, hi = band
        return (None if lo is None else lo - d, None if hi is None else hi - d)

    def __repr__(self):
        return f"shifted({self.inner!r}, q+{self.q_shift}, kv+{self.k_shift})"


class ShiftedScore(ScoreMod):
    """A score mod (bound to the global sequence) evaluated at global indices."""

    kind = "general"

    def __init__(self, inner: ScoreMod, q_shift: int, k_shift: int):
        self.inner, self.q_shift, self.k_shift = inner, q_shift, k_shift

    def __call__(self, s, b, h, q_idx, kv_idx):
        return self.inner(s, b, h, q_idx + self.q_shift, kv_idx + self.k_shift)

    def apply_(self, s, b, h, q_idx, kv_idx):
        return self.inner.apply_(s, b, h, q_idx + self.q_shift, kv_idx + self.k_shift)

    def parameters(self):
        return self.inner.parameters()

    def bind(self, batch, heads, q_len, k_len):
        return self

    def __repr__(self):
        return f"shifted({self.inner!r}, q+{self.q_shift}, kv+{self.k_shift})"


def pair_mods(mask: Mask | None, score: ScoreMod | None, q_start: int, q_len: int, k_start: int, k_len: int):
    """(mask, score) for the call of queries [q_start, +q_len) on keys [k_start, +k_len).

    Local query i sits at k_len - q_len + i among the pair's keys (bottom-right), global
    position q_start + i; local key j is global k_start + j."""
    q_shift = q_start - (k_len - q_len)
    m = None if mask is None else _band_mask(mask, k_start - q_shift) or ShiftedMask(mask, q_shift, k_start)
    s = None if score is None else ShiftedScore(score, q_shift, k_start)
    return m, s


def _band_mask(mask: Mask, d: int) -> Mask | None:
    """A fresh ``causal()`` / ``window(l, r)`` equal to ``mask`` moved by ``d`` when the
    mask is exactly a band of kv - q (translation invariant), so kernels keep their
    fast paths for it (causal diagonal tiles, SDPA's is_causal); None otherwise."""
    band = mask.band()
    if band is None:
        return None
    lo, hi = (None if band[0] is None else band[0] - d), (None if band[1] is None else band[1] - d)
    if (lo, hi) == (None, 0):
        return causal()
    if (lo is None or lo <= 0) and (hi is None or hi >= 0) and (lo, hi) != (None, None):
        return window(None if lo is None else -lo, hi)
    return None


def pair_state(mask: Mask | None, q_start: int, q_len: int, k_start: int, k_len: int) -> str:
    """ "empty", "full" or "partial" for a whole pair, from the mask's structure alone
    (for every batch row: empty only if empty for all rows, full only if full for all)."""
    if q_len == 0 or k_len == 0:
        return "empty"
    if mask is None:
        return "full"
    m, _ = pair_mods(mask, None, q_start, q_len, k_start, k_len)
    grid = TileGrid(q_start=k_len - q_len, q_len=q_len, q_block=q_len, k_len=k_len, k_block=k_len)
    states = m.classify(grid)
    if bool((states == 0).all()):
        return "empty"
    if bool((states == 2).all()):
        return "full"
    return "partial"
