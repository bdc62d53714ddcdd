"""The second pass that shows observers the softmax weights, tile by tile.

With the final lse of every row known, P = exp(S - lse) of any tile is exact and
independent of the others, so the weights stream to observers in O(tile) memory
(the same plan as the chunked backend; nothing N x N is ever held).
"""

from __future__ import annotations

import math

import torch

from ..observe import AttentionTile, CallInfo, feed
from .plan import FULL_SEG, make_plan
from .request import Request
from .tiles import Tile, visible

OBSERVE_Q_BLOCK = 128
OBSERVE_K_BLOCK = 512


def call_info(req: Request, layer: int | None = None, mechanism: str = "softmax") -> CallInfo:
    return CallInfo(req.batch, req.heads, req.q_len, req.k_len, req.q_start, layer, mechanism)


def softmax_tiles(req: Request, lse: torch.Tensor, call: CallInfo):
    """AttentionTiles of the softmax weights of a request, given its final lse."""
    cd = torch.float64 if req.q.dtype == torch.float64 else torch.float32
    plan = make_plan(req.mask, req.batch, req.q_len, req.k_len, OBSERVE_Q_BLOCK, OBSERVE_K_BLOCK, OBSERVE_K_BLOCK)
    groups = req.heads // req.kv_heads
    with torch.no_grad():
        lse = lse.detach().to(cd)
        lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)
        for bs, rows, blocks in plan.batch_slices(req.batch):
            for block in blocks:
                q = req.q[bs, :, block.q0 : block.q1].to(cd)
                lb = lse[bs, :, block.q0 : block.q1].unsqueeze(-1)
                for seg in block.segments:
                    tile = Tile.make(rows, req.heads, req.q_start + block.q0, block.q1 - block.q0, seg.k0, seg.k1)
                    k = req.k[bs, :, seg.k0 : seg.k1].to(cd).repeat_interleave(groups, dim=1)
                    s = torch.matmul(q, k.transpose(-1, -2)) * req.scale
                    if req.score is not None:
                        s = req.score(s, tile.b, tile.h, tile.q, tile.k).to(cd)
                    if seg.kind != FULL_SEG:
                        s = s.masked_fill(~visible(req.mask, tile), -math.inf)
                    yield AttentionTile(call, rows, tile.q_flat, tile.k_flat, torch.exp(s - lb), s)


def observe_softmax(req: Request, lse: torch.Tensor, observers, layer: int | None = None) -> None:
    call = call_info(req, layer)
    feed(observers, call, softmax_tiles(req, lse, call))
