"""Python side of pointwise.cpp: the tile steps the PyTorch tile loops call in one pass
(sigmoid gates, softcap, the online-softmax update, PAI's abs boost, stick-breaking and its backward, in
place on contiguous float32 tiles), and head mixing, top-k of rows and the depthwise
convolution (new tensors). Callers check ``kernels.cpu.usable`` first."""

from __future__ import annotations

import torch

Tensor = torch.Tensor

#: the C++ head mixing keeps one row of coefficients on the stack
MAX_MIX_HEADS = 64


def sigmoid_(x: Tensor, bias: float) -> Tensor:
    """``x <- sigmoid(x + bias)`` in place (-inf gives 0)."""
    torch.ops.attnkit.sigmoid_(x, bias)
    return x


def softcap_(x: Tensor, cap: float) -> Tensor:
    """``x <- cap * tanh(x / cap)`` in place."""
    torch.ops.attnkit.softcap_(x, cap)
    return x


def online_softmax_step_(s: Tensor, m: Tensor, l: Tensor) -> Tensor:
    """One online-softmax tile update, rows being all leading dims of ``s``: ``s`` becomes
    exp(s - m'), ``m`` and ``l`` are updated in place; returns alpha = exp(m - m')."""
    return torch.ops.attnkit.online_softmax_(s, m, l)


def abs_boost_(s: Tensor, t: Tensor) -> Tensor:
    """``s <- s + t |s|`` in place, s (G, R, C) in any leading shape holding G groups of R
    rows, t (G, C) contiguous; -inf stays -inf."""
    torch.ops.attnkit.abs_boost_(s, t)
    return s


def stick_breaking_(s: Tensor, carry: Tensor) -> Tensor:
    """One tile of stick-breaking weights, keys right to left: ``s`` (rows in all leading
    dims) becomes A, ``carry`` (one per row) the stick left for the tile on the left."""
    torch.ops.attnkit.stick_breaking_(s, carry)
    return s


def stick_breaking_backward_(s: Tensor, dw: Tensor, carry: Tensor, carry_w: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
    """One tile of the stick-breaking backward, keys right to left: ``s`` becomes A and
    ``dw`` (dO V^T) becomes dz; ``carry`` (stick) and ``carry_w`` (sum of A dW to the right)
    move to the tile's left edge. ``delta`` = rowsum(dO * O), one per row."""
    torch.ops.attnkit.stick_breaking_backward_(s, dw, carry, carry_w, delta)
    return s, dw


def depthwise_conv2d(x: Tensor, weight: Tensor) -> Tensor:
    """Valid depthwise 2-D correlation: x (N, H, R, C), weight (H, cq, ck) -> (N, H, R-cq+1, C-ck+1)."""
    return torch.ops.attnkit.depthwise_conv2d(x, weight)


def depthwise_conv2d_weight_grad(x: Tensor, dy: Tensor, kernel_size: tuple[int, int]) -> Tensor:
    """(H, cq, ck) gradient of ``depthwise_conv2d(x, weight)``'s weight for output gradient dy."""
    return torch.ops.attnkit.depthwise_conv2d_weight_grad(x, dy, *kernel_size)


def topk_rows(s: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, columns) of the k largest entries of every row of s (1 <= k <= s.shape[-1]),
    unsorted; which of tied entries is kept is unspecified."""
    return torch.ops.attnkit.topk_rows(s, k)


def mix_heads(mix: Tensor, x: Tensor, row_scale: Tensor | None = None) -> Tensor:
    """``out[:, g] = sum_h mix[g, h] * row_scale[:, h, :, None] * x[:, h]`` for x (Bt, H, R, C),
    mix (G, H) and row_scale (Bt, H, R) or None."""
    return torch.ops.attnkit.mix_heads(mix, x, row_scale)


def register() -> None:
    """Fake kernels (shapes only) of the functional operators, for torch.compile."""

    @torch.library.register_fake("attnkit::depthwise_conv2d")
    def _(x, weight):
        n, h, r, c = x.shape
        return x.new_empty(n, h, max(r - weight.shape[1] + 1, 0), max(c - weight.shape[2] + 1, 0))

    @torch.library.register_fake("attnkit::depthwise_conv2d_weight_grad")
    def _(x, dy, cq, ck):
        return x.new_empty(x.shape[1], cq, ck)

    @torch.library.register_fake("attnkit::topk_rows")
    def _(s, k):
        shape = (*s.shape[:-1], k)
        return s.new_empty(shape), s.new_empty(shape, dtype=torch.int64)

    @torch.library.register_fake("attnkit::mix_heads")
    def _(mix, x, row_scale):
        return x.new_empty(x.shape[0], mix.shape[0], x.shape[2], x.shape[3])

    @torch.library.register_fake("attnkit::online_softmax_")
    def _(s, m, l):
        return torch.empty_like(m)
