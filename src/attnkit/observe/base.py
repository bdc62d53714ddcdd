"""The observer protocol between kernels (or mechanisms) and meters.

For every attention call that is observed, each observer gets ``begin(call)``, then
``update(tile)`` for tiles that together cover every visible (query, key) pair exactly
once, then ``end(call)``. Tiles carry the *normalised* weights the mechanism actually
uses (softmax probabilities, sigmoid gates, signed weights...), so meters work on any
mechanism. Masked pairs have weight 0 and score -inf.

Before a call, ``wants(call)`` lets each observer say what it needs: None (leave me out
of this call) or a ``Selection`` of heads, query positions and key positions. The
softmax pass computes only the union of what is wanted, and no tile at all when nobody
wants one, so a meter restricted to a few layers, heads or queries costs only those.
Tiles may therefore hold a subset of the heads (``AttentionTile.heads``) and rows
outside an observer's own selection: observers filter what they receive.

Key positions are a promise the other way: an observer that names them (a visual meter
needs the weights on image keys only) must also accept tiles of every key, since
producers other than the softmax pass deliver those. The softmax pass keeps to the
range: one tile per block of rows, holding the range's keys and, per row, the visible
keys of the whole call (``AttentionTile.row_visible``); the weights outside it, which
sum with the range's to 1, are not computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class CallInfo:
    batch: int
    heads: int
    q_len: int
    k_len: int
    q_start: int  # position of the first query among the keys (Nk - Nq)
    layer: int | None = None
    mechanism: str = "softmax"


@dataclass(frozen=True)
class AttentionTile:
    """Weights of queries ``q_pos`` (BQ,) against keys ``k_pos`` (span,) for batch rows
    ``batch`` (Bt,) and heads ``heads``: ``weights`` (Bt, H', BQ, span), float32 (float64
    for float64 inputs). ``scores`` are the modified logits (-inf where masked), or None
    when the mechanism has none to give."""

    call: CallInfo
    batch: Tensor
    q_pos: Tensor
    k_pos: Tensor
    weights: Tensor
    scores: Tensor | None = None
    #: (H',) indices of the heads along dim 1 of ``weights``; None: all ``call.heads`` in order
    heads: Tensor | None = None
    #: True when every (query, key) pair of the tile is visible (no mask cuts into it)
    all_visible: bool = False
    #: the mask on this tile, bool, broadcastable to ``weights``, when the kernel has it
    #: (otherwise meters read visibility from ``scores`` > -inf, or from weights != 0)
    visible: Tensor | None = None
    #: softmax only: each row's log-normaliser (Bt, H', BQ), weights = exp(scores - log_norm)
    #: (+inf for a row that sees no key)
    log_norm: Tensor | None = None
    #: (first query position, first key position, first batch row) from a producer that
    #: built the positions as ascending contiguous ranges; None: ``starts`` reads and checks them
    origin: tuple[int, int, int] | None = None
    #: set when the tile is its rows' only one, cut to the keys a selection named: the
    #: number of keys each row sees in the whole call, (Bt | 1, 1, BQ) float64
    row_visible: Tensor | None = None

    @property
    def layer(self) -> int | None:
        return self.call.layer

    @property
    def head_index(self) -> Tensor:
        return torch.arange(self.call.heads) if self.heads is None else self.heads

    @property
    def starts(self) -> tuple[int, int, int]:
        """(first query position, first key position, first batch row); checks once per
        tile, for every observer, that each is an ascending contiguous range (kept in the
        instance dict, which a frozen dataclass allows: ``functools.cached_property``
        takes a lock in Python 3.11, a few microseconds per tile of a decoding step)."""
        if self.origin is not None:
            return self.origin
        if "_starts" not in self.__dict__:
            self.__dict__["_starts"] = self._checked_starts()
        return self.__dict__["_starts"]

    def _checked_starts(self) -> tuple[int, int, int]:
        out = []
        for name, pos in (("query", self.q_pos), ("key", self.k_pos), ("batch", self.batch)):
            first = int(pos[0])
            if int(pos[-1]) - first + 1 != len(pos):
                raise ValueError(f"tile: {name} positions must be an ascending contiguous range, got {pos.tolist()[:8]}...")
            out.append(first)
        return out[0], out[1], out[2]


@dataclass(frozen=True)
class Selection:
    """What an observer needs from one call: ``heads`` (indices; None = all; () = no tile,
    only ``begin``/``end``), query positions ``q_range = (lo, hi)``, lo <= pos < hi, and
    the key positions ``k_range`` whose weights it reads (None = all; see the module's
    note on what naming them promises)."""

    heads: tuple[int, ...] | None = None
    q_range: tuple[int, int] | None = None
    k_range: tuple[int, int] | None = None

    @staticmethod
    def union(selections) -> Selection:
        selections = [s for s in selections if s.heads != ()]
        if not selections:
            return Selection(heads=())
        if len(selections) == 1:  # the common case, once per observed call
            return selections[0]
        heads = None
        if all(s.heads is not None for s in selections):
            heads = tuple(sorted(set().union(*(s.heads for s in selections))))
        q_range = k_range = None
        if all(s.q_range is not None for s in selections):
            q_range = (min(s.q_range[0] for s in selections), max(s.q_range[1] for s in selections))
        if all(s.k_range is not None for s in selections):
            k_range = (min(s.k_range[0] for s in selections), max(s.k_range[1] for s in selections))
        return Selection(heads, q_range, k_range)


class Observer:
    """Base class for meters: override what you need."""

    def wants(self, call: CallInfo) -> Selection | None:
        """What this observer needs from ``call``; None leaves it out of the call."""
        return Selection()

    def begin(self, call: CallInfo) -> None:
        pass

    def update(self, tile: AttentionTile) -> None:
        pass

    def end(self, call: CallInfo) -> None:
        pass


def interested(observers, call: CallInfo) -> tuple[list, Selection]:
    """The observers that want ``call``, and the union of what they want."""
    chosen, selections = [], []
    for o in observers or ():
        sel = o.wants(call) if hasattr(o, "wants") else Selection()
        if sel is not None:
            chosen.append(o)
            selections.append(sel)
    return chosen, Selection.union(selections)


def feed(observers, call: CallInfo, tiles) -> None:
    """Drive observers through one call's tiles (an iterable of AttentionTile).

    Only observers that want the call take part, and ``tiles`` is not consumed when none
    of them wants a tile: a lazy generator then computes nothing."""
    observers, union = interested(observers, call)
    if not observers:
        return
    for o in observers:
        o.begin(call)
    if union.heads != ():
        for tile in tiles:
            for o in observers:
                o.update(tile)
    for o in observers:
        o.end(call)
