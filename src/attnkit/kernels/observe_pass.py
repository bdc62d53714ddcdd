"""The second pass that shows observers the softmax weights, tile by tile.

With the final lse of every row known, P = exp(S - lse) of any tile is exact and
independent of the others, so the weights stream to observers in O(tile) memory
(the same plan as the chunked backend; nothing N x N is ever held). Only the heads and
query rows that some observer wants are computed (``Selection``), and nothing at all
when none wants a tile.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..mods import index_tensors
from ..mods.masks import Causal
from ..observe import AttentionTile, CallInfo, Selection, feed, interested
from .plan import FULL_SEG, make_plan
from .request import Request
from .tiles import Tile, visible

OBSERVE_Q_BLOCK = 128  # the smallest query block
OBSERVE_K_BLOCK = 512
# Unmasked key ranges are cut too, so a tile and the meters' temporaries stay a few MB
# however long the context is ...
OBSERVE_MAX_FULL_SPAN = 2048
# ... and query blocks grow until a tile holds about this many weights: a short input is
# then one tile per layer, and the meters' per-tile overhead (a few dozen small ops) is
# paid once, not once per 128 queries.
OBSERVE_TILE_WEIGHTS = 1 << 20


def call_info(req: Request, layer: int | None = None, mechanism: str = "softmax") -> CallInfo:
    return CallInfo(req.batch, req.heads, req.q_len, req.k_len, req.q_start, layer, mechanism)


def softmax_tiles(req: Request, lse: torch.Tensor, call: CallInfo, selection: Selection | None = None):
    """AttentionTiles of the softmax weights of a request, given its final lse, for the
    heads and query positions of ``selection`` (all by default)."""
    selection = selection or Selection()
    if selection.heads == ():
        return
    cd = torch.float64 if req.q.dtype == torch.float64 else torch.float32
    all_heads = selection.heads is None or list(selection.heads) == list(range(req.heads))
    heads = torch.arange(req.heads) if all_heads else torch.tensor(selection.heads, dtype=torch.long)
    groups = req.heads // req.kv_heads
    # query head h reads kv head h // groups (None: one kv head per query head, in order)
    kv_heads = None if (all_heads and groups == 1) else heads // groups
    row_lo, row_hi = 0, req.q_len
    if selection.q_range is not None:
        row_lo = max(0, selection.q_range[0] - req.q_start)
        row_hi = min(req.q_len, selection.q_range[1] - req.q_start)
    cut = None
    if selection.k_range is not None:
        lo, hi = max(selection.k_range[0], 0), min(selection.k_range[1], req.k_len)
        cut = (lo, max(lo, hi))
    span = req.k_len if cut is None else cut[1] - cut[0]
    per_query = req.batch * len(heads) * min(span, OBSERVE_MAX_FULL_SPAN)
    q_block = max(OBSERVE_Q_BLOCK, min(row_hi - row_lo, OBSERVE_TILE_WEIGHTS // max(per_query, 1)))
    plan = make_plan(req.mask, req.batch, req.q_len, req.k_len, q_block, OBSERVE_K_BLOCK, OBSERVE_K_BLOCK, OBSERVE_MAX_FULL_SPAN)
    q_all = req.q if all_heads else req.q[:, heads]
    with torch.no_grad():
        lse = lse.detach() if all_heads else lse.detach()[:, heads]
        lse = lse.to(cd)
        lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)
        for bs, rows, blocks in plan.batch_slices(req.batch):
            for block in blocks:
                r0, r1 = max(block.q0, row_lo), min(block.q1, row_hi)
                if r0 >= r1:
                    continue
                q = q_all[bs, :, r0:r1].to(cd) * req.scale  # scaled once per block, not per tile
                lb = lse[bs, :, r0:r1].unsqueeze(-1)
                rb = _RowBlock(req, call, rows, bs, r0, r1, q, lb, heads, kv_heads, all_heads, cd)
                if cut is not None:
                    yield _cut_tile(rb, block.segments, cut)
                    continue
                for seg in block.segments:
                    yield _weights_tile(rb, seg.k0, seg.k1, seg.kind != FULL_SEG)


class _RowBlock(NamedTuple):
    """What the tiles of one block of query rows share: rows r0..r1 of batch rows ``rows``
    (slice ``bs``), their scaled queries and lse (+inf for a row that sees no key)."""

    req: Request
    call: CallInfo
    rows: torch.Tensor
    bs: slice
    r0: int
    r1: int
    q: torch.Tensor
    lb: torch.Tensor
    heads: torch.Tensor
    kv_heads: torch.Tensor | None
    all_heads: bool
    cd: torch.dtype


def _cut_tile(rb: _RowBlock, segments, cut: tuple[int, int]) -> AttentionTile:
    """A block's rows as one tile over the keys ``cut`` = (lo, hi) a selection named, with
    each row's visible keys over the whole call (``AttentionTile.row_visible``), counted
    from the plan's segments: whole ones by their width, the others on their mask tile."""
    req, lo, hi = rb.req, cut[0], cut[1]
    first, n_rows = req.q_start + rb.r0, rb.r1 - rb.r0
    if type(req.mask) is Causal:  # the query at position p sees keys 0..p
        visible_count = torch.arange(first + 1, first + n_rows + 1, dtype=torch.float64).view(1, 1, -1)
    else:
        visible_count = torch.zeros((1, 1, n_rows), dtype=torch.float64)
        for seg in segments:
            if seg.kind == FULL_SEG:
                visible_count = visible_count + (seg.k1 - seg.k0)
            else:
                b, _, qi, ki = index_tensors(rb.rows, 0, first, n_rows, seg.k0, seg.k1 - seg.k0)
                seen = visible(req.mask, Tile(b, rb.heads.view(1, -1, 1, 1), qi, ki))
                visible_count = visible_count + seen.sum(-1, dtype=torch.float64)
    inside = any(seg.kind == FULL_SEG and seg.k0 <= lo and hi <= seg.k1 for seg in segments)
    masked = req.mask is not None and not inside and hi > lo
    origin = (first, lo, rb.bs.start or 0)  # the positions are ranges (a tile may hold no key)
    return _weights_tile(rb, lo, hi, masked, origin, visible_count)


def _weights_tile(rb: _RowBlock, k0: int, k1: int, masked: bool, origin=None, row_visible=None) -> AttentionTile:
    """The weights exp(S - lse) of the block's rows against keys k0..k1, the score mod
    applied and, where ``masked``, the mask evaluated on the tile."""
    req, cd = rb.req, rb.cd
    b, _, qi, ki = index_tensors(rb.rows, 0, req.q_start + rb.r0, rb.r1 - rb.r0, k0, k1 - k0)
    tile = Tile(b, rb.heads.view(1, -1, 1, 1), qi, ki)
    k = req.k[rb.bs, :, k0:k1]
    k = (k if rb.kv_heads is None else k[:, rb.kv_heads]).to(cd)
    s = torch.matmul(rb.q, k.transpose(-1, -2))
    if req.score is not None:
        s = req.score(s, tile.b, tile.h, tile.q, tile.k).to(cd)
    vis = None
    if masked:
        vis = visible(req.mask, tile)
        # an additive 0 / -inf mask at the mask's own (often 1 x 1 x BQ x span) shape: a
        # broadcast add is far cheaper than masked_fill on the tile
        s = s + torch.where(vis, 0.0, -math.inf).to(cd)
    return AttentionTile(
        rb.call,
        rb.rows,
        tile.q_flat,
        tile.k_flat,
        torch.sub(s, rb.lb).exp_(),
        s,
        None if rb.all_heads else rb.heads,
        vis is None,
        vis,
        rb.lb.squeeze(-1),
        origin,
        row_visible,
    )


def observe_softmax(req: Request, lse: torch.Tensor, observers, layer: int | None = None) -> None:
    call = call_info(req, layer)
    _, union = interested(observers, call)
    feed(observers, call, softmax_tiles(req, lse, call, union))
