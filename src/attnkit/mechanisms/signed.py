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

from ..kernels.engine import Block, SoftmaxKernel, dense_softmax, observe_kernel, run_kernel
from ..kernels.mechanism_call import check_options, dense_logits, dense_values, finish, request
from .base import Mechanism, register

Tensor = torch.Tensor


def _abs_logits(s: Tensor) -> Tensor:
    # |-inf| would be +inf: masked pairs must stay at -inf
    return torch.where(torch.isneginf(s), s, s.abs())


class SignedKernel(SoftmaxKernel):
    def transform(self, blk: Block, s, kind, k0, k1):
        return _abs_logits(s)

    def signs(self, s):
        return torch.sign(s)

    def grad_z(self, blk: Block, s, dz, kind, k0, k1):
        return dz * torch.sign(s)  # d|s|/ds


@register("signed")
class Signed(Mechanism):
    """``sign(s) * softmax(|s|)``: weights in [-1, 1] whose absolute values sum to 1."""

    paper = "OpenReview ezRrwwbxd0 (Cog attention)"

    def forward(self, q, k, v, *, mask=None, score=None, scale=None, sinks=None, return_lse=False, backend="auto",
                check_finite=True, observers=None, layer=None):
        check_options(self.name, sinks=sinks, backend=backend)
        req = request(q, k, v, mask=mask, score=score, scale=scale)
        if backend == "reference":
            out, lse = self.reference(q, k, v, mask=mask, score=score, scale=scale, return_lse=True)
        else:
            out, stats = run_kernel(req, SignedKernel())
            lse = stats["lse"]
        if observers:
            observe_kernel(req, SignedKernel(), {"lse": lse}, observers, layer, self.name)
        finish(req, out, check_finite)
        return (out, lse) if return_lse else out

    def reference(self, q, k, v, *, mask=None, score=None, scale=None, return_lse=False, **_):
        """``A = sign(S) * softmax(|S|)``, ``O = A V``; masked pairs take no part."""
        req = request(q, k, v, mask=mask, score=score, scale=scale)
        s = dense_logits(req)
        p, lse = dense_softmax(_abs_logits(s))
        weights = torch.sign(s.masked_fill(torch.isneginf(s), 0.0)) * p
        out = torch.matmul(weights, dense_values(req)).to(q.dtype)
        return (out, lse) if return_lse else out

