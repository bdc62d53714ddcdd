"""The tile grid that masks classify, and the three tile states.

Kernels cut the (query, key) plane into rectangular tiles. A mask that knows its own
structure answers, for every tile at once, whether the tile is EMPTY (skip it), FULL
(every pair visible: no mask needs evaluating) or PARTIAL (evaluate the mask there).
Answers are int8 grids so that `&`, `|` and `~` compose them with min, max and 2 - x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class TileGrid:
    """Query and key positions cut into regular blocks.

    Queries sit at positions ``q_start .. q_start + q_len`` (``q_start = Nk - Nq``:
    bottom-right alignment), keys at ``0 .. k_len``. Blocks are ``q_block`` and
    ``k_block`` long; the last one of each side may be shorter.
    """

    q_start: int
    q_len: int
    q_block: int
    k_len: int
    k_block: int

    @property
    def n_q(self) -> int:
        return -(-self.q_len // self.q_block)

    @property
    def n_k(self) -> int:
        return -(-self.k_len // self.k_block)

    def q_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """First and one-past-last query position of every query block, shape (n_q, 1)."""
        lo = torch.arange(self.n_q) * self.q_block
        hi = torch.clamp(lo + self.q_block, max=self.q_len)
        return (lo + self.q_start)[:, None], (hi + self.q_start)[:, None]

    def k_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """First and one-past-last key position of every key block, shape (1, n_k)."""
        lo = torch.arange(self.n_k) * self.k_block
        hi = torch.clamp(lo + self.k_block, max=self.k_len)
        return lo[None, :], hi[None, :]

    def block_min_max(self, values: torch.Tensor, side: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-block min and max of a per-position tensor ``values`` (..., positions).

        ``side`` is ``"q"`` or ``"k"``. Returns tensors of shape (..., n_blocks).
        """
        if side == "q":
            start, length, block, n = self.q_start, self.q_len, self.q_block, self.n_q
        else:
            start, length, block, n = 0, self.k_len, self.k_block, self.n_k
        part = values[..., start : start + length]
        pad = n * block - length
        if pad:
            # Repeat the last value: it cannot widen any block's range.
            part = torch.cat([part, part[..., -1:].expand(*part.shape[:-1], pad)], dim=-1)
        part = part.reshape(*part.shape[:-1], n, block)
        return part.amin(-1), part.amax(-1)


def classify_interval(grid: TileGrid, lo_offset: int | None, hi_offset: int | None) -> torch.Tensor:
    """Classify the band ``q + lo_offset <= kv <= q + hi_offset`` (None = unbounded)."""
    q_lo, q_hi = grid.q_bounds()
    k_lo, k_hi = grid.k_bounds()
    q_last, k_last = q_hi - 1, k_hi - 1
    full = torch.ones(q_lo.shape[0], k_lo.shape[1], dtype=torch.bool)
    empty = torch.zeros_like(full)
    if lo_offset is not None:
        full &= k_lo >= q_last + lo_offset
        empty |= k_last < q_lo + lo_offset
    if hi_offset is not None:
        full &= k_last <= q_lo + hi_offset
        empty |= k_lo > q_last + hi_offset
    return states(full, empty)


def states(full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """int8 grid from boolean FULL and EMPTY grids (EMPTY wins where both hold)."""
    out = torch.full(full.shape, PARTIAL, dtype=torch.int8)
    out[full] = FULL
    out[empty] = EMPTY
    return out if out.dim() == 3 else out[None]
