"""Shared pieces of the mechanisms that run torch's fused CPU flash op on pieces of a call
(hyper_attention, block_sparse, native_sparse): ``FlashWithLse`` gives (out, lse) with a
backward through both, ``merge_partial`` joins two partial results by their lse."""

from __future__ import annotations

import math

import torch

from .fused import backward_with_lse_grad  # layout-safe wrappers of the private op
from .fused import flash_backward as _op_backward
from .fused import flash_forward as _op

Tensor = torch.Tensor


class FlashWithLse(torch.autograd.Function):
    """(out, lse) of torch's fused CPU flash op for q (B, Hq, L, D), k, v (B, Hkv, S, D)
    with an optional additive mask (or the op's top-left ``causal`` flag), differentiable
    in both outputs. Rows whose keys are all masked give (0, -inf). The backward is the
    op's own, given the final out and lse (FlashAttention-2, arXiv 2307.08691); a gradient
    reaching lse enters as an extra column (``backward_with_lse_grad``, kernels/fused.py)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, causal=False):
        o, lse = _op(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        if mask is not None:
            dead = torch.isneginf(mask).all(dim=-1).expand_as(lse)  # the op reports lse = 0 there
            if torch.compiler.is_compiling() or bool(dead.any()):  # compiled: no data branch
                lse = lse.masked_fill(dead, -math.inf)
                o = o.masked_fill(dead.unsqueeze(-1), 0.0)
        ctx.scale, ctx.causal = scale, causal
        ctx.save_for_backward(q, k, v, o, lse, mask)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        q, k, v, o, lse, mask = ctx.saved_tensors
        lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)  # P = 0 on dead rows
        grad_o = torch.zeros_like(o) if grad_o is None else grad_o.contiguous()
        dq, dk, dv = backward_with_lse_grad(
            _op_backward, grad_o, grad_lse, q, k, v, o, lse, 0.0, ctx.causal, attn_mask=mask, scale=ctx.scale
        )
        return dq, dk, dv, None, None, None


def merge_partial(o1: Tensor, l1: Tensor, o2: Tensor, l2: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial softmax results over disjoint key sets, merged by their lse."""
    total = torch.logaddexp(l1, l2)
    safe = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    w1, w2 = torch.exp(l1 - safe).unsqueeze(-1), torch.exp(l2 - safe).unsqueeze(-1)
    return o1 * w1 + o2 * w2, total
