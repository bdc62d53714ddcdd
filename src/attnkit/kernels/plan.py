"""Which keys each block of queries must visit, from the mask's own structure.

The plan cuts the queries into blocks and, for every block, lists key *segments*:
contiguous key ranges that are entirely visible (``full``: no mask is evaluated), the
square diagonal of a plain causal mask (``causal``), or partly visible (``masked``:
the mask is evaluated on that tile only). Keys of EMPTY tiles never appear.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..mods import EMPTY, FULL, Mask, TileGrid
from ..mods.masks import Causal

FULL_SEG, CAUSAL_SEG, MASKED_SEG = "full", "causal", "masked"


@dataclass(frozen=True)
class Segment:
    k0: int
    k1: int
    kind: str


@dataclass
class QueryBlock:
    q0: int  # first query row (not position)
    q1: int
    segments: list[Segment]


@dataclass
class Plan:
    """Per-batch-row block lists (one shared list when the mask does not depend on the row)."""

    rows: list[list[QueryBlock]]
    shared: bool
    grid: TileGrid
    tiles_total: int
    tiles_skipped: int
    tiles_partial: int
    notes: list[str] = field(default_factory=list)

    def for_batch(self, b: int) -> list[QueryBlock]:
        return self.rows[0 if self.shared else b]

    def batch_slices(self, batch: int):
        """(slice of batch rows, their indices, their blocks): all rows at once when shared."""
        if self.shared:
            yield slice(None), torch.arange(batch), self.rows[0]
        else:
            for b in range(batch):
                yield slice(b, b + 1), torch.tensor([b]), self.rows[b]

    @property
    def visited_fraction(self) -> float:
        return 1.0 - self.tiles_skipped / max(self.tiles_total, 1)

    @property
    def area(self) -> int:
        """Query-key pairs the plan computes (summed over batch-row plans); a causal square
        counts half, since the kernel skips its upper triangle."""
        return sum(
            (blk.q1 - blk.q0) * (s.k1 - s.k0) // (2 if s.kind == CAUSAL_SEG else 1)
            for row in self.rows
            for blk in row
            for s in blk.segments
        )

    def coalesced(self) -> Plan:
        """Neighbouring query blocks that read the same keys, all unmasked, become one block:
        fewer, larger calls (a packed document becomes a single call)."""
        rows = []
        for row in self.rows:
            merged: list[QueryBlock] = []
            for blk in row:
                prev = merged[-1] if merged else None
                if prev is not None and prev.segments == blk.segments and all(s.kind == FULL_SEG for s in blk.segments):
                    merged[-1] = QueryBlock(prev.q0, blk.q1, prev.segments)
                else:
                    merged.append(blk)
            rows.append(merged)
        return Plan(rows, self.shared, self.grid, self.tiles_total, self.tiles_skipped, self.tiles_partial, self.notes)


def make_plan(
    mask: Mask | None,
    batch: int,
    q_len: int,
    k_len: int,
    q_block: int,
    k_block: int,
    max_masked_span: int,
    max_full_span: int | None = None,
) -> Plan:
    grid = TileGrid(q_start=k_len - q_len, q_len=q_len, q_block=q_block, k_len=k_len, k_block=k_block)
    if mask is None:
        states = torch.full((1, grid.n_q, grid.n_k), FULL, dtype=torch.int8)
    else:
        states = mask.classify(grid)
        if states.shape[1:] != (grid.n_q, grid.n_k) or states.shape[0] not in (1, batch):
            raise RuntimeError(
                f"{mask!r}.classify returned shape {tuple(states.shape)}, expected (1 or {batch}, {grid.n_q}, {grid.n_k})"
            )
    plain_causal = isinstance(mask, Causal)
    rows = [
        _row_blocks(states[r].tolist(), grid, plain_causal, max_masked_span, max_full_span or k_len)
        for r in range(states.shape[0])
    ]
    total = states.numel()
    return Plan(
        rows=rows,
        shared=states.shape[0] == 1,
        grid=grid,
        tiles_total=total,
        tiles_skipped=int((states == EMPTY).sum()),
        tiles_partial=int((states == 1).sum()),
    )


def _row_blocks(states: list[list[int]], grid: TileGrid, plain_causal: bool, max_masked: int, max_full: int) -> list[QueryBlock]:
    blocks = []
    kb = grid.k_block
    for i, row in enumerate(states):
        q0 = i * grid.q_block
        q1 = min(q0 + grid.q_block, grid.q_len)
        segments: list[Segment] = []
        j = 0
        while j < len(row):
            state = row[j]
            if state == EMPTY:
                j += 1
                continue
            start = j
            while j < len(row) and row[j] == state:
                j += 1
            k0, k1 = start * kb, min(j * kb, grid.k_len)
            kind = FULL_SEG if state == FULL else MASKED_SEG
            limit = max_full if kind == FULL_SEG else max_masked
            for a in range(k0, k1, limit):
                b = min(a + limit, k1)
                seg_kind = kind
                # The op's own causal flag is top-left aligned: exact on a square tile
                # whose keys are exactly the block's query positions.
                if kind == MASKED_SEG and plain_causal and a == q0 + grid.q_start and b == q1 + grid.q_start:
                    seg_kind = CAUSAL_SEG
                segments.append(Segment(a, b, seg_kind))
        blocks.append(QueryBlock(q0, q1, segments))
    return blocks


def single_tile_plan(mask: Mask | None, batch: int, q_len: int, k_len: int) -> Plan:
    """The whole call as one tile (masked, unless there is no mask)."""
    grid = TileGrid(q_start=k_len - q_len, q_len=q_len, q_block=q_len, k_len=k_len, k_block=k_len)
    kind = FULL_SEG if mask is None else MASKED_SEG
    block = QueryBlock(0, q_len, [Segment(0, k_len, kind)])
    return Plan(rows=[[block]], shared=True, grid=grid, tiles_total=1, tiles_skipped=0, tiles_partial=int(mask is not None))


def causal_plan(batch: int, q_len: int, k_len: int) -> Plan:
    """A plain causal mask as one query block: the keys before the queries whole, then the
    square diagonal (the op's top-left aligned causal flag is exact on it)."""
    grid = TileGrid(q_start=k_len - q_len, q_len=q_len, q_block=q_len, k_len=k_len, k_block=k_len)
    start = k_len - q_len
    segments = ([Segment(0, start, FULL_SEG)] if start else []) + [Segment(start, k_len, CAUSAL_SEG)]
    return Plan(rows=[[QueryBlock(0, q_len, segments)]], shared=True, grid=grid, tiles_total=1, tiles_skipped=0, tiles_partial=1)
