"""The observer protocol between kernels (or mechanisms) and meters.

For every attention call that is observed, each observer gets ``begin(call)``, then
``update(tile)`` for tiles that together cover every visible (query, key) pair exactly
once, then ``end(call)``. Tiles carry the *normalised* weights the mechanism actually
uses (softmax probabilities, sigmoid gates, signed weights...), so meters work on any
mechanism. Masked pairs have weight 0 and score -inf.
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
    ``batch`` (Bt,) and all heads: ``weights`` (Bt, H, BQ, span), float32 (float64 for
    float64 inputs). ``scores`` are the modified logits (-inf where masked), or None when
    the mechanism has none to give."""

    call: CallInfo
    batch: Tensor
    q_pos: Tensor
    k_pos: Tensor
    weights: Tensor
    scores: Tensor | None = None

    @property
    def layer(self) -> int | None:
        return self.call.layer


class Observer:
    """Base class for meters: override what you need."""

    def begin(self, call: CallInfo) -> None:
        pass

    def update(self, tile: AttentionTile) -> None:
        pass

    def end(self, call: CallInfo) -> None:
        pass


def feed(observers, call: CallInfo, tiles) -> None:
    """Drive observers through one call's tiles (an iterable of AttentionTile)."""
    observers = list(observers or ())
    if not observers:
        return
    for o in observers:
        o.begin(call)
    for tile in tiles:
        for o in observers:
            o.update(tile)
    for o in observers:
        o.end(call)
