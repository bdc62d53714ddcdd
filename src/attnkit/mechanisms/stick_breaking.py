"""Stick-breaking attention (Tan, Shen, Yang, Panda, Courville 2024, "Scaling
Stick-Breaking Attention: An Efficient Implementation and In-depth Study", arXiv 2410.17980).

Each query breaks a stick from the nearest key outwards: key j takes the fraction
``beta_ij = sigmoid(z_ij)`` of what the keys between it and the query left over,

    A_ij = beta_ij * prod_{j < k < i} (1 - beta_ik),

computed in log space as ``log A_ij = log sigmoid(z_ij) + sum_{j<k<i} log sigmoid(-z_ik)``.
There is no normaliser (rows sum to at most 1). A query attends to keys strictly before it
(``attend_current=True`` lets it take its own key first); the user's mask composes: a
hidden key neither takes weight nor breaks the stick.

The chunked path visits key tiles right to left, carrying per row the stick the keys
already passed left over; inside a tile the products of ``1 - beta`` are one cumulative
product (in probability space: no log or exp, and a weight below float range is exactly
0). The backward runs right to left too: with ``W = A * dA``,
``dz_ik = (1 - beta_ik) W_ik - beta_ik * sum_{j<k} W_ij`` and ``sum_{j<k} W_ij`` is
``rowsum(dO * O)`` minus the suffix sum of W, so no extra pass is needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import cpu
from ..kernels.engine import Block, GradBlock, TileKernel, observe_kernel, run_kernel
from ..kernels.mechanism_call import dense_logits, dense_values, request
from ..mods import Mask, causal
from ..mods.grid import classify_interval
from .base import Mechanism, register

Tensor = torch.Tensor


class StrictlyCausal(Mask):
    """Key position < query position."""

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx < q_idx

    def classify(self, grid):
        return classify_interval(grid, None, -1)

    def __repr__(self):
        return "strictly_causal()"


def _suffix_sum(x: Tensor) -> Tensor:
    """Inclusive sums from the right along the last dim."""
    return x.flip(-1).cumsum(-1).flip(-1)


def _stick(s: Tensor, carry: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(A, beta, carry for the tile on the left) of one tile of logits, keys right to left.

    ``carry`` (Bt, H, BQ) is the stick the keys right of the tile left over. Computed in
    probability space: products of ``1 - beta = sigmoid(-z)`` need no log or exp, reach 0
    exactly where a weight is below float range, and a hidden key (z = -inf) has beta = 0
    and 1 - beta = 1 exactly.
    """
    beta = torch.sigmoid(s)
    stick = torch.sigmoid(-s).flip(-1).cumprod(-1).flip(-1).mul_(carry.unsqueeze(-1))  # carry * prod_{k >= j}
    left_for = torch.cat([stick[..., 1:], carry.unsqueeze(-1)], dim=-1)  # carry * prod_{k > j}
    return beta * left_for, beta, stick[..., 0]


class StickBreakingKernel(TileKernel):
    def forward_block(self, blk: Block):
        acc = blk.zeros(blk.prob.v.shape[-1])
        carry = torch.ones_like(blk.zeros())
        for kind, k0, k1 in blk.tiles(reverse=True):
            s = blk.logits(kind, k0, k1)
            if cpu.usable(s, carry):
                a = cpu.stick_breaking_(s, carry)  # one pass in C; carry updated in place
            else:
                a, _, carry = _stick(s, carry)
            blk.pv_add_(acc, a, k0, k1)
        return acc, {}

    def backward_block(self, blk: GradBlock, stats, delta, grad_stats):
        carry = torch.ones_like(blk.zeros())
        carry_w = blk.zeros()
        d = delta.unsqueeze(-1)
        d_flat = delta.contiguous()
        for kind, k0, k1 in blk.tiles(reverse=True):
            s, tracked = blk.tracked_logits(kind, k0, k1)
            dw = blk.dw(k0, k1)
            if tracked is None and cpu.usable(s, dw, carry, carry_w, d_flat):
                # the whole tile in one right-to-left pass in C; carries move in place
                a, dz = cpu.stick_breaking_backward_(s, dw, carry, carry_w, d_flat)
                blk.add(k0, k1, dz, a, (s, tracked))
                continue
            a, beta, carry = _stick(s.detach(), carry)
            w = a * dw
            suffix_w = _suffix_sum(w).add_(carry_w.unsqueeze(-1))
            carry_w = suffix_w[..., 0]
            # sum over j < k of W_ij = delta_i - sum over j >= k
            dz = (1 - beta) * w - beta * (d - suffix_w)
            blk.add(k0, k1, dz, a, (s, tracked))
        return []

    def observe_block(self, blk: Block, stats):
        carry = torch.ones_like(blk.zeros())
        for kind, k0, k1 in blk.tiles(reverse=True):
            s = blk.logits(kind, k0, k1)
            a, _, carry = _stick(s, carry)
            yield k0, k1, a, s


@register("stick_breaking")
class StickBreaking(Mechanism):
    """``A_ij = sigmoid(z_ij) prod_{j<k<i} (1 - sigmoid(z_ik))``; keys before the query
    (and the query's own key with ``attend_current=True``)."""

    paper = "arXiv:2410.17980"

    def __init__(self, attend_current: bool = False):
        super().__init__()
        if not isinstance(attend_current, bool):
            raise ValueError(f"stick_breaking(attend_current): expected a bool, got {attend_current!r}")
        self.attend_current = attend_current

    def extra_repr(self) -> str:
        return super().extra_repr() + f", attend_current={self.attend_current}"

    def _mask(self, mask):
        order = causal() if self.attend_current else StrictlyCausal()
        return order if mask is None else order & mask

    has_lse = False

    def call_request(self, q, k, v, *, mask=None, score=None, scale=None, sinks=None):
        return request(q, k, v, mask=self._mask(mask), score=score, scale=scale)

    def fast_path(self, req, backend):
        out, _ = run_kernel(req, StickBreakingKernel())
        return out, None

    def observe_call(self, req, lse, observers, layer):
        observe_kernel(req, StickBreakingKernel(), {}, observers, layer, self.name)

    def reference(self, q, k, v, *, mask=None, score=None, scale=None, **_):
        """Literal: ``log A = log sigmoid(z) + (log sigmoid(-z)) U`` with U[k, j] = 1 for k > j."""
        req = request(q, k, v, mask=self._mask(mask), score=score, scale=scale)
        z = dense_logits(req)
        hidden = torch.isneginf(z)
        log_beta = F.logsigmoid(z).masked_fill(hidden, float("-inf"))
        log_rest = F.logsigmoid(-z).masked_fill(hidden, 0.0)
        n = z.shape[-1]
        later = torch.ones(n, n, dtype=z.dtype).tril(-1)  # later[k, j] = 1 when k > j
        weights = torch.exp(log_beta + torch.matmul(log_rest, later))
        return torch.matmul(weights, dense_values(req)).to(q.dtype)
