"""How a sequence of N tokens is cut into shards, one per rank of a process group.

``contiguous``: P chunks, rank r holds chunk r. ``zigzag``: 2P chunks, rank r holds chunk
r (head) and chunk 2P-1-r (tail), so that under a causal mask every rank has the same
number of visible (query, key) pairs (the load balancing of ring-flash-attention's zigzag
variant and of torch's context parallelism). Chunks differ in length by at most one
token, so any N and any P work; a rank's local tokens are its chunks concatenated in the
order listed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'zigzag' or 'contiguous', got {layout!r}")
    return layout


@dataclass(frozen=True)
class Chunk:
    """A run of global positions [start, start + length) held by ``rank`` at ``local`` offset."""

    start: int
    length: int
    rank: int
    local: int

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Layout:
    """Every chunk of an N-token sequence over P ranks, in global order."""

    n: int
    world: int
    kind: str

    def chunks(self) -> list[Chunk]:
        count = self.world * (2 if self.kind == "zigzag" else 1)
        base, extra = divmod(self.n, count)
        sizes = [base + (1 if i < extra else 0) for i in range(count)]
        owner = [i if i < self.world else count - 1 - i for i in range(count)] if self.kind == "zigzag" else list(range(count))
        out, start, used = [], 0, [0] * self.world
        for i, size in enumerate(sizes):
            r = owner[i]
            out.append(Chunk(start, size, r, used[r]))
            start += size
            used[r] += size
        return out

    def rank_chunks(self, rank: int) -> list[Chunk]:
        """The chunks of ``rank`` in local order (head before tail)."""
        return sorted((c for c in self.chunks() if c.rank == rank), key=lambda c: c.local)

    def local_length(self, rank: int) -> int:
        return sum(c.length for c in self.rank_chunks(rank))

    def positions(self, rank: int) -> torch.Tensor:
        parts = [torch.arange(c.start, c.stop) for c in self.rank_chunks(rank)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def layout_for(n: int, world: int, layout: str) -> Layout:
    check_layout(layout)
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n: expected a non-negative int (the global sequence length), got {n!r}")
    return Layout(n, world, layout)
