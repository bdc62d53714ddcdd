"""Python side of mixed.cpp: softmax attention with a transform of the logits (multi-token
attention's key-query convolution, arXiv 2504.00927, or talking heads' mixing before the
softmax, arXiv 2003.02436) and head mixing after it, whole in C++, forward and backward,
for keys in a band, float32 CPU tensors."""

from __future__ import annotations

import torch

Tensor = torch.Tensor
Band = tuple[int | None, int | None]


def mixed_blocks(group: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(query rows, keys) of the blocks and tiles of the operators, forward and backward,
    for mixing groups of ``group`` heads: a block keeps every tile of its group's rows
    between two passes (the backward three per head), so larger groups take fewer rows."""
    return (max(32, min(128, 1024 // group)), 256), (max(16, min(64, 512 // group)), 256)


def mixed_softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    conv: Tensor | None,
    pre: Tensor | None,
    post: Tensor | None,
    group: int,
    q_start: int,
    band: Band,
) -> tuple[Tensor, Tensor]:
    """(out, each head's lse before the mixing) of softmax attention over the keys of
    ``band`` with its logits transformed by a depthwise key-query convolution ``conv``
    (H, cq, ck) or a head mixing ``pre`` (H, H), never both, and its weights mixed by
    ``post`` (H, H); the mixings are block-diagonal in groups of ``group`` heads. q (B, H,
    Nq, D) already scaled, k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv)."""
    return torch.ops.attnkit.mixed_softmax_attention(q, k, v, conv, pre, post, group, q_start, *band, *mixed_blocks(group)[0])


def mixed_softmax_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    conv: Tensor | None,
    pre: Tensor | None,
    post: Tensor | None,
    group: int,
    q_start: int,
    band: Band,
    grad_lse: Tensor | None = None,
):
    """(dq of the scaled q, dk, dv, dconv, dpre, dpost; None for an absent one) of
    ``mixed_softmax_attention`` for ``grad_out`` (and ``grad_lse`` reaching each head's
    lse, if any), given its per-head ``lse``."""
    dq, dk, dv, dconv, dpre, dpost = torch.ops.attnkit.mixed_softmax_attention_backward(
        grad_out, q, k, v, lse, grad_lse, conv, pre, post, group, q_start, *band, *mixed_blocks(group)[1]
    )
    return (
        dq,
        dk,
        dv,
        None if conv is None else dconv,
        None if pre is None else torch.block_diag(*dpre),
        None if post is None else torch.block_diag(*dpost),
    )


def register() -> None:
    """Fake kernels of the operators, for torch.compile."""

    @torch.library.register_fake("attnkit::mixed_softmax_attention")
    def _(q, k, v, conv, pre, post, group, q_start, lo, hi, block_q, block_k):
        return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(q.shape[:3])

    @torch.library.register_fake("attnkit::mixed_softmax_attention_backward")
    def _(grad_out, q, k, v, lse, grad_lse, conv, pre, post, group, q_start, lo, hi, block_q, block_k):
        heads = q.shape[1]
        return (
            torch.empty_like(q),
            torch.empty_like(k),
            torch.empty_like(v),
            q.new_empty(0) if conv is None else torch.empty_like(conv),
            q.new_empty(0) if pre is None else q.new_empty(heads // group, group, group),
            q.new_empty(0) if post is None else q.new_empty(heads // group, group, group),
        )
