"""Pieces every tiled engine shares: tile index tensors, mask tiles, LSE merging."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch

from ..mods import Mask, index_tensors
from ..mods.scores import AbsBoost, Chain, RowScale, Softcap
from . import cpu

Tensor = torch.Tensor


def add_pv_(acc: Tensor, w: Tensor, vt: Tensor) -> None:
    """``acc += W V`` in place for acc (Bt, Hq, BQ, Dv), w (Bt, Hq, BQ, span) and the value
    tile vt (Bt, Hkv, span, Dv): the query heads of a key head are stacked into one batched
    product written straight into acc (a contiguous accumulator of w's dtype), else a
    matmul and an add."""
    bt, hq, bq, dv = acc.shape
    hkv = vt.shape[1]
    wg = w.reshape(bt, hkv, (hq // hkv) * bq, w.shape[-1])
    if w.dtype == acc.dtype and acc.is_contiguous():
        acc.view(bt * hkv, -1, dv).baddbmm_(wg.reshape(bt * hkv, -1, w.shape[-1]), vt.reshape(bt * hkv, -1, dv))
    else:
        acc += torch.matmul(wg, vt).reshape(acc.shape).to(acc.dtype)


@dataclass(frozen=True)
class Tile:
    """Index tensors of one (query block x key segment) tile, in positions."""

    b: Tensor  # (Bt, 1, 1, 1) batch rows
    h: Tensor  # (1, H, 1, 1)
    q: Tensor  # (1, 1, BQ, 1) query positions
    k: Tensor  # (1, 1, 1, span) key positions

    @staticmethod
    def make(batch_rows: Tensor, heads: int, q_pos0: int, q_len: int, k0: int, k1: int) -> Tile:
        b, h, q, k = index_tensors(batch_rows, heads, q_pos0, q_len, k0, k1 - k0)
        return Tile(b, h, q, k)

    @property
    def q_flat(self) -> Tensor:
        return self.q.view(-1)

    @property
    def k_flat(self) -> Tensor:
        return self.k.view(-1)

    @property
    def h_flat(self) -> Tensor:
        return self.h.view(-1)


def visible(mask: Mask | None, tile: Tile) -> Tensor:
    """Boolean visibility of the tile, at least (1, 1, BQ, span), broadcastable to (Bt, H, BQ, span).
    ``mask`` is the call's: only a call with a mask has tiles that are not wholly visible."""
    assert mask is not None  # plans mark every tile of an unmasked call full: none asks here
    vis = torch.as_tensor(mask(tile.b, tile.h, tile.q, tile.k), dtype=torch.bool)
    shape = (1, 1, tile.q.shape[2], tile.k.shape[3])
    return (
        vis
        if vis.shape[-2:] == shape[-2:] and vis.dim() == 4
        else torch.broadcast_to(vis, torch.broadcast_shapes(vis.shape, shape))
    )


def merge_partials(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Combine partial softmax results over disjoint key sets by their logsumexps.

    Each part is (out (.., BQ, Dv) normalised over its keys, lse (.., BQ) float).
    Rows with lse = -inf in every part stay zero with lse = -inf.
    """
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([l for _, l in parts])
    total = torch.logsumexp(lses, dim=0)
    safe_total = torch.where(torch.isneginf(total), torch.zeros_like(total), total)
    out: Tensor | None = None
    for o, l in parts:
        w = torch.exp(l - safe_total).unsqueeze(-1)
        term = o.to(w.dtype) * w
        out = term if out is None else out + term
    assert out is not None  # two parts or more
    return out, total


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Renormalise with one extra key per head whose logit is ``sinks[h]`` and value zero."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    total = torch.logaddexp(lse, sink.expand_as(lse))
    keep = torch.exp(lse - total)  # lse = -inf gives 0: the sink takes all the mass
    return out * keep.unsqueeze(-1).to(out.dtype), total


def sink_grad(sinks: Tensor, lse_total: Tensor, delta: Tensor, grad_lse: Tensor | None) -> Tensor:
    """d loss / d sinks: the sink's probability p times (d lse - delta), summed over rows.

    With value zero the sink only shifts the normaliser: dsink_h = sum_i p_i (g_i - delta_i),
    delta_i = <dO_i, O_i>, g_i the gradient reaching lse_i.
    """
    p_sink = torch.exp(sinks.to(lse_total.dtype).view(1, -1, 1) - lse_total)
    g = -delta if grad_lse is None else grad_lse.to(delta.dtype) - delta
    return (p_sink * g).sum(dim=(0, 2)).to(sinks.dtype)


def neg_inf_to_pos_inf(lse: Tensor) -> Tensor:
    """For backward passes: a row with no visible key must give exp(s - lse) = 0, not NaN."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)


def apply_score_(score, s: Tensor, tile: Tile) -> Tensor:
    """The score mod on a tile's own logits ``s`` (free to overwrite them). The fast paths
    belong here, not in mods/ (which only describe): softcap and PAI's abs boost run in
    one C++ pass where the operators take the tile (tanh alone is ~3 ns per logit in
    PyTorch; the boost is abs, a multiply-add and a guard, each a pass); a chain
    applies its mods in order with the same rule as ``Chain.apply_``."""
    if isinstance(score, Chain):
        after_bias = False
        for m in score.mods:
            # a bias's -inf is a mask: later row scales keep it -inf (RowScale.scale_masked)
            if after_bias and m.kind == "row_scale":
                s = cast(RowScale, m).scale_masked(s, tile.b, tile.h, tile.q)  # the kind names the class
            else:
                s = apply_score_(m, s, tile)
            after_bias = after_bias or m.kind == "bias"
        return s
    if isinstance(score, Softcap) and cpu.usable(s):
        return cpu.softcap_(s, score.cap)
    if isinstance(score, AbsBoost) and s.dim() == 4 and cpu.usable(s):
        # one C++ pass instead of abs, multiply-add and the -inf guard
        t = score.table[tile.b, tile.h, tile.k].to(s.dtype)  # (Bt | 1, H, 1, span)
        return cpu.abs_boost_(s, t.expand(s.shape[0], s.shape[1], 1, s.shape[3]).reshape(-1, s.shape[3]).contiguous())
    return score.apply_(s, tile.b, tile.h, tile.q, tile.k)
