"""How far an approximate attention mechanism is from exact softmax attention.

``approx_error`` runs exact softmax attention and the mechanism on the same inputs and
reports two numbers, overall and per query head:

- the relative output error ``||O~ - O||_F / ||O||_F``;
- the attention-mass recall: the exact softmax probability mass that falls on the
  (query, key) pairs the mechanism gives any weight to, averaged over queries. It is
  streamed from the weight tiles the mechanism shows its observers (``attnkit.observe``),
  each scored against the exact logsumexp, so it costs O(N) memory at any length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kernels import make_request
from .kernels.request import Request
from .kernels.tiles import Tile, visible
from .observe import AttentionTile, Observer

Tensor = torch.Tensor


@dataclass(frozen=True)
class ApproxError:
    """``relative_error`` and ``mass_recall`` over the whole call, and per query head
    (Hq,). Recall is None for a mechanism that shows observers no weights."""

    relative_error: float
    mass_recall: float | None
    per_head_error: Tensor
    per_head_recall: Tensor | None


class MassRecall(Observer):
    """Exact softmax mass on the pairs an observed mechanism weights, per (b, h, query).

    Assumes the observer protocol: every pair the mechanism uses appears in one tile."""

    def __init__(self, req: Request, lse: Tensor):
        self.req = req
        lse = lse.detach().to(torch.float64)
        self.lse = torch.where(torch.isneginf(lse), math.inf, lse)  # rows without keys: mass 0
        self.mass = torch.zeros(req.batch, req.heads, req.q_len, dtype=torch.float64)
        self.tiles = 0

    def update(self, tile: AttentionTile) -> None:
        req = self.req
        heads, rows = tile.head_index, tile.q_pos - req.q_start
        b = tile.batch.view(-1, 1, 1, 1)
        h = heads.view(1, -1, 1, 1)
        q = req.q[b, h, rows.view(1, 1, -1, 1)].squeeze(3).to(torch.float64)  # (Bt, H', BQ, D)
        k = req.k[b, h // (req.heads // req.kv_heads), tile.k_pos.view(1, 1, 1, -1)].squeeze(2).to(torch.float64)
        s = torch.matmul(q, k.transpose(-1, -2)) * req.scale
        index = Tile(b, h, tile.q_pos.view(1, 1, -1, 1), tile.k_pos.view(1, 1, 1, -1))
        if req.score is not None:
            s = req.score(s, index.b, index.h, index.q, index.k).to(torch.float64)
        if req.mask is not None:
            s = s.masked_fill(~visible(req.mask, index), -math.inf)
        p = torch.exp(s - self.lse[b, h, rows.view(1, 1, -1, 1)])
        used = (p * (tile.weights > 0)).sum(-1)
        self.mass.index_put_((b.view(-1, 1, 1), h.view(1, -1, 1), rows.view(1, 1, -1)), used, accumulate=True)
        self.tiles += 1


def approx_error(
    q: Tensor, k: Tensor, v: Tensor, *, mechanism, mask=None, score=None, scale: float | None = None, **params
) -> ApproxError:
    """Relative output error and attention-mass recall of ``mechanism`` (a registered
    name, built with ``params``, or a Mechanism instance) against exact softmax attention
    with the same ``mask``, ``score`` and ``scale``."""
    from .api import attention
    from .mechanisms import get_mechanism

    mech = get_mechanism(mechanism, **params)
    with torch.no_grad():
        req = make_request(q, k, v, mask=mask, score=score, scale=scale)
        exact, lse = attention(q, k, v, mask=mask, score=score, scale=scale, return_lse=True)
        meter = MassRecall(req, lse)
        approx = attention(q, k, v, mask=mask, score=score, scale=scale, mechanism=mech, observers=[meter])
        if approx.shape != exact.shape:
            raise ValueError(
                f"mechanism: {mech.name!r} returned shape {tuple(approx.shape)}, exact attention {tuple(exact.shape)}"
            )
        diff = (approx.to(torch.float64) - exact.to(torch.float64)).pow(2).sum((0, 2, 3))
        norm = exact.to(torch.float64).pow(2).sum((0, 2, 3))
        per_head_error = _ratio(diff.sqrt(), norm.sqrt())
        relative_error = float(_ratio(diff.sum().sqrt(), norm.sum().sqrt()))
        if meter.tiles == 0:
            return ApproxError(relative_error, None, per_head_error, None)
        alive = torch.isfinite(lse.to(torch.float64))  # rows that see at least one key
        counted = alive.sum((0, 2)).clamp(min=1)
        per_head_recall = (meter.mass * alive).sum((0, 2)) / counted
        mass_recall = float((meter.mass * alive).sum() / alive.sum().clamp(min=1))
    return ApproxError(relative_error, mass_recall, per_head_error, per_head_recall)


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """num / den with 0/0 = 0 and x/0 = inf (an output that should be zero and is not)."""
    return torch.where(den > 0, num / den.clamp(min=torch.finfo(den.dtype).tiny), torch.where(num > 0, math.inf, 0.0))
