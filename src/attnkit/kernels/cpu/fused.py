"""Python side of fused.cpp: whole attention calls in C++ around the tile products, for
keys in a diagonal band ``(lo, hi)`` (``lo <= key - query position <= hi``, None:
unbounded), float32 CPU tensors: sigmoid attention forward and backward (FlashSigmoid,
arXiv 2409.04431), a softmax forward with free head sizes, head maps, softcap and PAI's abs boost, the
top-k forward (arXiv 2106.06899). Threads: torch's intra-op pool, split by head."""

from __future__ import annotations

import torch

Tensor = torch.Tensor
Band = tuple[int | None, int | None]


def sigmoid_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: float, q_start: int, band: Band) -> Tensor:
    """sigmoid(scale Q K^T + bias) V over the keys ``lo <= key - (q_start + query) <= hi``
    of ``band``; q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) float32.
    Differentiable in q, k, v (the backward operator recomputes the gates per tile)."""
    return torch.ops.attnkit.sigmoid_attention(q, k, v, scale, bias, q_start, *band)


def sigmoid_attention_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float, bias: float, q_start: int, band: Band
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``sigmoid_attention`` for ``grad_out``."""
    return torch.ops.attnkit.sigmoid_attention_backward(grad_out, q, k, v, scale, bias, q_start, *band)


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    q_start: int,
    band: Band,
    softcap: float = 0.0,
    k_heads: Tensor | None = None,
    v_heads: Tensor | None = None,
    boost: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) of softmax(S) V over the keys of ``band``, forward only, with S =
    softcap(scale Q K^T) and then, given ``boost`` (B, H, Nk), ``S + boost[b, h, key] |S|``.
    q (B, H, Nq, D), k (B, Hk, Nk, D), v (B, Hv, Nk, Dv), D and Dv free; query head j reads
    key head ``k_heads[j]`` and value head ``v_heads[j]`` (default: grouped-query
    attention); ``softcap`` 0 means none."""
    return torch.ops.attnkit.softmax_attention(q, k, v, scale, q_start, *band, softcap, k_heads, v_heads, boost)


def topk_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, band: Band, width: int):
    """Forward of softmax attention over the ``width`` largest logits of every row within
    ``band`` (q already scaled): (out, lse, chosen, weights, kept, visible) as in
    mechanisms/topk.py."""
    return torch.ops.attnkit.topk_attention(q, k, v, q_start, *band, width)


def register() -> None:
    """Fake kernels and autograd of the operators, for torch.compile and training."""

    @torch.library.register_fake("attnkit::sigmoid_attention")
    def _(q, k, v, scale, bias, q_start, lo, hi):
        return q.new_empty(*q.shape[:3], v.shape[-1])

    @torch.library.register_fake("attnkit::sigmoid_attention_backward")
    def _(grad_out, q, k, v, scale, bias, q_start, lo, hi):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    @torch.library.register_fake("attnkit::softmax_attention")
    def _(q, k, v, scale, q_start, lo, hi, softcap, k_heads, v_heads, boost=None):
        return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(q.shape[:3])

    @torch.library.register_fake("attnkit::topk_attention")
    def _(q, k, v, q_start, lo, hi, width):
        rows = q.shape[:3]
        return (
            q.new_empty(*rows, v.shape[-1]),
            q.new_empty(rows),
            q.new_empty(*rows, width, dtype=torch.int64),
            q.new_empty(*rows, width),
            q.new_empty(rows),
            q.new_empty(rows),
        )

    def setup(ctx, inputs, output):
        q, k, v, ctx.scale, ctx.bias, ctx.q_start, ctx.lo, ctx.hi = inputs
        ctx.save_for_backward(q, k, v)

    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = torch.ops.attnkit.sigmoid_attention_backward(
            grad_out, q, k, v, ctx.scale, ctx.bias, ctx.q_start, ctx.lo, ctx.hi
        )
        return dq, dk, dv, None, None, None, None, None

    torch.library.register_autograd("attnkit::sigmoid_attention", backward, setup_context=setup)
