"""A rolling window's steady state in one layer (policies that declare ``rolling``).

A policy that keeps a fixed prefix and the most recent entries evicts, once every row is
over its budget, the oldest entry after the prefix at every decoding step. When that is
the same slot ``s`` in every (row, head) of a layout in position order, slots s.. hold
the window in order, as a ring: its one empty slot (``hole``) takes the next token
(``PolicyLayer.fill``), after which the slot following it holds the oldest entry, which
goes (``roll``): one write per step instead of a selection.

The ring describes one layout of the layer's slots: it holds while the layer's
``layout`` token is the one it was found on (appending, gathering, a crop or a beam
reorder give the layer a new one)."""

from __future__ import annotations

import torch


class Ring:
    """Slots ``start .. start + size - 1`` of a layer hold the window as a ring whose empty
    slot is ``hole``."""

    __slots__ = ("hole", "layout", "size", "start")

    def __init__(self, start: int, size: int, hole: int, layout: int):
        self.start, self.size, self.hole, self.layout = start, size, hole, layout

    @classmethod
    def find(cls, layer) -> Ring | None:
        """After a decoding step appended its token and the policy evicted the oldest entry
        after its prefix: the ring, if that is the same slot in every (row, head) of a
        layout in position order; else None."""
        if not layer.ordered or not layer.one_hole_each():
            return None
        hole = (~layer.valid).to(torch.uint8).argmax(-1)
        s = int(hole.view(-1)[0])
        if not bool((hole == s).all()):
            return None
        return cls(s, layer.length - s, s, layer.layout)

    def holds(self, layer) -> bool:
        """The layer's slots are still the layout this ring was found on."""
        return self.layout == layer.layout

    def roll(self, layer) -> None:
        """Evict on the ring: the token that filled the hole is the newest, and the slot
        after it holds the oldest entry of the window, which goes."""
        self.hole = self.start + (self.hole - self.start + 1) % self.size
        layer.evict_slot(self.hole)

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.start, self.size, self.hole)
