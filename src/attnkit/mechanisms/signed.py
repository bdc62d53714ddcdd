"""Signed ("Cog") attention: ``sign(s) * softmax(|s|)`` (Lv et al. 2024, "More Expressive
Attention with Negative Weights", OpenReview ezRrwwbxd0; ``cog_signed`` in
x-transformers).

The softmax runs over the absolute logits, so a strongly *negative* match gets as much
mass as a strongly positive one, and then subtracts its value instead of adding it. The
normaliser is an ordinary softmax over ``|s|``: the chunked path is the online softmax
with each tile's weights multiplied by the sign before ``W V``; ``return_lse`` gives the
logsumexp of ``|s|``.
"""

from __future__ import annotations

import torch

from ..kernels.engine import (
    Block,
    GradBlock,
    OnlineSoftmax,
    SoftmaxKernel,
    dense_softmax,
    fast_exp_,
    observe_kernel,
    run_kernel,
    softmax_backward_terms,
)
from ..kernels.mechanism_call import dense_logits, dense_values, request
from ..kernels.plan import FULL_SEG
from .base import Mechanism, register

Tensor = torch.Tensor


def _abs_logits(s: Tensor) -> Tensor:
    # |-inf| would be +inf: masked pairs must stay at -inf
    return torch.where(torch.isneginf(s), s, s.abs())


class SignedKernel(SoftmaxKernel):
    """Online softmax over ``|s|`` (FlashAttention-2 bookkeeping), each tile's weights
    multiplied by ``sign(s)`` before ``W V``; the sign is computed once per tile and
    reused for ``|s|``, the weights and the backward's ``d|s|/ds``."""

    def transform(self, blk: Block, s, kind, k0, k1):
        return _abs_logits(s)

    def abs_logits_(self, blk: Block, s: Tensor, kind: str) -> Tensor:
        """|s|, in place where that is safe: an unmasked tile with no score mod has no
        -inf, and its logits are the tile's own tensor (no autograd graph holds them)."""
        if kind == FULL_SEG and blk.prob.score is None:
            return s.abs_()
        return _abs_logits(s)

    def forward_block(self, blk: Block):
        acc = OnlineSoftmax(blk, blk.prob.v.shape[-1])
        for kind, k0, k1 in blk.tiles():
            s = blk.logits(kind, k0, k1)
            sign = torch.sign(s)  # before abs_logits_ overwrites s
            acc.add(blk, self.abs_logits_(blk, s, kind), k0, k1, sign)
        out, lse = acc.result()
        return out, {"lse": lse}

    def backward_block(self, blk: GradBlock, stats, delta, grad_stats):
        # w = c p with c = sign(s), p = exp(|s| - lse); dZ = p (c dW - delta) as for any
        # signed softmax, and dS = c dZ = w (c dW - delta), formed in place in dW.
        lse, d = softmax_backward_terms(stats, delta, grad_stats)
        for kind, k0, k1 in blk.tiles():
            s, tracked = blk.tracked_logits(kind, k0, k1)
            sd = s.detach()
            sign = torch.sign(sd)
            w = fast_exp_(self.abs_logits_(blk, sd, kind).sub_(lse)).mul_(sign)
            ds = blk.dw(k0, k1).mul_(sign).sub_(d).mul_(w)
            blk.add(k0, k1, ds, w, (s, tracked))
        return []

    def observe_block(self, blk: Block, stats):
        for k0, k1, p, s in super().observe_block(blk, stats):
            yield k0, k1, p * torch.sign(s), s


@register("signed")
class Signed(Mechanism):
    """``sign(s) * softmax(|s|)``: weights in [-1, 1] whose absolute values sum to 1."""

    paper = "OpenReview ezRrwwbxd0 (Cog attention)"

    def fast_path(self, req, backend):
        out, stats = run_kernel(req, SignedKernel())
        return out, stats["lse"]

    def observe_call(self, req, lse, observers, layer):
        observe_kernel(req, SignedKernel(), {"lse": lse}, observers, layer, self.name)

    def reference(self, q, k, v, *, mask=None, score=None, scale=None, return_lse=False, **_):
        """``A = sign(S) * softmax(|S|)``, ``O = A V``; masked pairs take no part."""
        req = request(q, k, v, mask=mask, score=score, scale=scale)
        s = dense_logits(req)
        p, lse = dense_softmax(_abs_logits(s))
        weights = torch.sign(s.masked_fill(torch.isneginf(s), 0.0)) * p
        out = torch.matmul(weights, dense_values(req)).to(q.dtype)
        return (out, lse) if return_lse else out
