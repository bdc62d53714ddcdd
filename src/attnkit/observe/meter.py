"""What every attnkit meter shares: restriction to layers, heads and query positions,
per-layer state, and results as tidy rows ``(layer, head, metric, value)``.

A meter sums what it measures over every query row it observes (each batch row of each
call counted once) and reports means over those rows, so state stays O(heads) — or
O(heads x N) for the per-query meters — however many calls it sees.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .base import AttentionTile, CallInfo, Observer, Selection

Tensor = torch.Tensor
Row = tuple  # (layer, head, metric, value)

#: per-token arrays (``per_query=True`` meters) are kept, and the report's token view
#: drawn, for inputs up to this many tokens: above it the O(heads x N) state and the page
#: grow past what is useful to read. Here because both inspect/ and report/ need it.
TOKEN_VIEW_LIMIT = 512


def _index_set(value, name: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, int) else value
    try:
        items = list(items)
    except TypeError:
        items = [items]
    if not items or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in items):
        raise ValueError(f"{name}: expected None, an index or a non-empty list of indices >= 0, got {value!r}")
    return tuple(sorted(set(items)))


def _query_range(value) -> tuple[int | None, int | None] | None:
    """(lo, hi) of query positions; negative values count from the end of the keys."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, None if value == -1 else value + 1)
    if isinstance(value, (range, slice)):
        if (value.step or 1) != 1:
            raise ValueError(f"queries: expected a contiguous range (step 1), got {value!r}")
        return (value.start, value.stop)
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in value)
    ):
        return (value[0], value[1])
    raise ValueError(f"queries: expected None, a position, a range/slice or (lo, hi) of query positions, got {value!r}")


@dataclass
class TileView:
    """The part of a tile a meter asked for: weights ``w`` (Bt, H', R, span) of its own
    heads, in its order, and of the query rows in its range."""

    w: Tensor
    s: Tensor | None
    q_pos: Tensor  # (R,) ascending, contiguous
    k_pos: Tensor  # (span,) ascending, contiguous
    batch: slice  # batch rows of the call
    rows: slice  # query rows, counted from the first row of the meter's range
    all_visible: bool
    mask: Tensor | None = None  # the kernel's visibility, when it gave one
    log_norm: Tensor | None = None  # softmax rows' log-normaliser, (Bt, H', R)
    k0: int = 0  # first key position
    #: visible keys per row over the whole call, when the tile was cut to a key range
    #: (``AttentionTile.row_visible``): ``w`` then holds only that range's weights
    row_visible: Tensor | None = None

    def visible(self) -> Tensor | None:
        """Boolean visibility (broadcastable to ``w``), or None when every pair is visible.
        Without logits a pair counts as visible when its weight is non-zero."""
        if self.all_visible:
            return None
        if self.mask is not None:
            return self.mask
        return self.s != -math.inf if self.s is not None else self.w != 0

    def visible_per_row(self) -> Tensor | float:
        """Number of visible keys of every row, broadcastable to (Bt, H', R)."""
        vis = self.visible()
        if vis is None:
            return float(self.w.shape[3])
        return vis.sum(-1, dtype=torch.float64)


class Meter(Observer, ABC):
    """Base class: ``layers``, ``heads`` (indices) and ``queries`` (a position, a range or
    (lo, hi); negative positions count from the end) restrict what is measured."""

    #: prefix of this meter's metric names
    name = "meter"

    def __init__(self, layers=None, heads=None, queries=None):
        self.layers = _index_set(layers, "layers")
        self.heads = _index_set(heads, "heads")
        self.queries = _query_range(queries)
        self._head_ids: dict = {}  # layer -> tuple of head indices measured there
        self._rows_seen: dict = {}  # layer -> query rows observed (summed over calls and batch)
        self._sel: Selection | None = None
        self._wanted: tuple[CallInfo | None, Selection | None] = (None, None)  # the last call asked about

    # -- protocol -------------------------------------------------------------------------

    def wants(self, call: CallInfo) -> Selection | None:
        if self.layers is not None and call.layer not in self.layers:
            return None
        if self.heads is not None and self.heads[-1] >= call.heads:
            raise ValueError(f"heads: index {self.heads[-1]} out of range for layer {call.layer}, which has {call.heads} heads")
        lo, hi = self._positions(call)
        sel = None if lo >= hi else Selection(self.heads, (lo, hi), self.key_range(call))
        self._wanted = (call, sel)  # begin() follows for the same call: no second answer to compute
        return sel

    def begin(self, call: CallInfo) -> None:
        last_call, sel = self._wanted
        if last_call is not call:
            sel = self.wants(call)
        if sel is None:
            raise RuntimeError(f"meter: begin() for layer {call.layer}, a call it does not want (wants() gave None)")
        self._sel = sel
        heads = sel.heads if sel.heads is not None else tuple(range(call.heads))
        known = self._head_ids.setdefault(call.layer, heads)
        if known != heads:
            raise ValueError(
                f"layer {call.layer}: calls with different head counts ({len(known)} then {len(heads)}) cannot share one meter"
            )
        assert sel.q_range is not None  # wants() always gives a meter's calls a query range
        lo, hi = sel.q_range
        self._rows_seen[call.layer] = self._rows_seen.get(call.layer, 0) + call.batch * (hi - lo)
        self.begin_call(call, len(heads), lo - call.q_start, hi - call.q_start)

    def update(self, tile: AttentionTile) -> None:
        view = self.view(tile)
        if view is not None:
            self.update_view(tile.call, view)

    def end(self, call: CallInfo) -> None:
        self.end_call(call)
        self._sel = None

    # -- what subclasses implement ------------------------------------------------------------

    def begin_call(self, call: CallInfo, n_heads: int, row_lo: int, row_hi: int) -> None:
        """A call starts: ``n_heads`` measured heads, query rows ``row_lo:row_hi``."""

    @abstractmethod
    def update_view(self, call: CallInfo, view: TileView) -> None:
        """Add one tile's part to the state."""

    def end_call(self, call: CallInfo) -> None:
        pass

    @abstractmethod
    def rows(self) -> list[Row]:
        """Results as tidy ``(layer, head, metric, value)`` rows."""

    def arrays(self) -> dict:
        """Per-query results, if the meter keeps any: {name: {(layer, head): data}}."""
        return {}

    def meta(self) -> dict:
        """Parameters a reader needs to interpret the rows."""
        return {}

    # -- helpers ------------------------------------------------------------------------------

    def measured(self):
        """(layer, head ids, rows observed) of every layer seen, in layer order."""
        for layer in sorted(self._head_ids, key=lambda x: -1 if x is None else x):
            yield layer, self._head_ids[layer], self._rows_seen[layer]

    def key_range(self, call: CallInfo) -> tuple[int, int] | None:
        """The key positions whose weights this meter reads (None: all); a meter that names
        them handles tiles cut to them (``TileView.row_visible``) and whole ones alike."""
        return None

    def _positions(self, call: CallInfo) -> tuple[int, int]:
        lo, hi = call.q_start, call.k_len
        if self.queries is not None:
            a, b = self.queries
            a = lo if a is None else (a + call.k_len if a < 0 else a)
            b = hi if b is None else (b + call.k_len if b < 0 else b)
            lo, hi = max(lo, a), min(hi, b)
        return lo, hi

    def view(self, tile: AttentionTile) -> TileView | None:
        sel = self._sel
        if sel is None:
            raise RuntimeError("meter: view() before begin()")
        parts = {
            "w": tile.weights,
            "s": tile.scores,
            "mask": tile.visible,
            "log_norm": tile.log_norm,
            "row_visible": tile.row_visible,
        }
        # heads: take ours out of the tile's (a tile may hold a superset of them)
        if sel.heads is not None:
            wanted = torch.tensor(sel.heads)
            if tile.heads is None or not torch.equal(tile.heads, wanted):
                where = wanted if tile.heads is None else torch.searchsorted(tile.heads, wanted)
                parts = {k: t if t is None or t.shape[1] == 1 else t.index_select(1, where) for k, t in parts.items()}
        elif tile.heads is not None and len(tile.heads) != tile.call.heads:
            raise ValueError("tile: holds a subset of the heads but the meter measures all of them")
        # query rows: keep those in our range
        assert sel.q_range is not None  # set by wants()
        lo, hi = sel.q_range
        q_pos = tile.q_pos
        first, _, b0 = tile.starts
        a, b = max(lo - first, 0), min(hi - first, q_pos.shape[0])
        if a >= b:
            return None
        if (a, b) != (0, q_pos.shape[0]):
            q_pos = q_pos[a:b]
            parts = {k: t if t is None or t.shape[2] == 1 else t[:, :, a:b] for k, t in parts.items()}
        r0 = first + a - lo
        if parts["w"] is None:
            raise RuntimeError("tile: a meter's tile carries no weights")
        return TileView(
            parts["w"],
            parts["s"],
            q_pos,
            tile.k_pos,
            slice(b0, b0 + tile.batch.shape[0]),
            slice(r0, r0 + q_pos.shape[0]),
            tile.all_visible,
            parts["mask"],
            parts["log_norm"],
            tile.starts[1],
            parts["row_visible"],
        )
