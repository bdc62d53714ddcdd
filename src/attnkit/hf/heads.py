"""Changing only some heads of a layer.

For softmax the change stays inside one call: the extra mask and score mods are gated
per head and the sinks of untouched heads carry no mass, so kernels and observers still
see the whole layer with its real head indices. Another mechanism on a subset of heads
needs its own call (``split_heads``).
"""

from __future__ import annotations

import torch

from ..mods import FULL, PARTIAL, Mask, ScoreMod

Tensor = torch.Tensor

#: the logit of a sink that takes no mass: exp(NO_SINK - lse) is exactly 0 in float32 and
#: float64 for any finite lse, and its gradient is exactly 0.
NO_SINK = -1e30


class HeadMask(Mask):
    """``inner`` on the selected heads; every key visible on the others."""

    def __init__(self, inner: Mask, selected: Tensor):
        self.inner, self.selected = inner, selected
        self.batch_dependent = inner.batch_dependent

    def __call__(self, b, h, q_idx, kv_idx):
        return torch.as_tensor(self.inner(b, h, q_idx, kv_idx), dtype=torch.bool) | ~self.selected[h]

    def classify(self, grid):
        # The other heads see every key, so no tile is EMPTY for all heads: at best FULL.
        inner = self.inner.classify(grid)
        return torch.where(inner == FULL, inner, torch.full_like(inner, PARTIAL))

    def check(self, batch, heads, q_len, k_len):
        if self.selected.shape != (heads,):
            raise ValueError(f"heads: selection made for {self.selected.shape[0]} heads but the call has Hq={heads}")

    def bind(self, *shape):
        self.check(*shape)
        inner = self.inner.bind(*shape)
        return self if inner is self.inner else HeadMask(inner, self.selected)

    def children(self):
        return (self.inner,)

    def __repr__(self):
        return f"on_heads({self.selected.nonzero().view(-1).tolist()}, {self.inner!r})"


class HeadScore(ScoreMod):
    """``inner`` on the selected heads; logits unchanged on the others."""

    def __init__(self, inner: ScoreMod, selected: Tensor):
        self.inner, self.selected = inner, selected

    def __call__(self, s, b, h, q_idx, kv_idx):
        return torch.where(self.selected[h], self.inner(s, b, h, q_idx, kv_idx), s)

    def parameters(self):
        return self.inner.parameters()

    def bind(self, batch, heads, q_len, k_len):
        if self.selected.shape != (heads,):
            raise ValueError(f"heads: selection made for {self.selected.shape[0]} heads but the call has Hq={heads}")
        return HeadScore(self.inner.bind(batch, heads, q_len, k_len), self.selected)

    def __repr__(self):
        return f"on_heads({self.selected.nonzero().view(-1).tolist()}, {self.inner!r})"


def combine_sinks(model: Tensor | None, extra: Tensor | None, selected: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """One sink logit per head equal to the model's sink and the extra one together.

    Both sinks are keys of value zero, so two of them act as one whose logit is their
    logaddexp. ``selected`` limits the extra sink to some heads."""
    if extra is None:
        return model
    extra = extra.to(dtype)
    if selected is not None:
        extra = torch.where(selected, extra, torch.full_like(extra, NO_SINK))
    return extra if model is None else torch.logaddexp(model.to(dtype), extra)


def split_heads(q: Tensor, k: Tensor, v: Tensor, idx: Tensor):
    """q, k, v of the query heads ``idx`` alone, one kv head per query head (GQA resolved)."""
    groups = q.shape[1] // k.shape[1]
    kv_idx = idx // groups
    return q[:, idx], k[:, kv_idx], v[:, kv_idx]


def merge_heads(parts: list[tuple[Tensor, Tensor]], num_heads: int) -> Tensor:
    """Reassemble (out (B, h, N, Dv), head indices (h,)) parts into (B, num_heads, N, Dv), differentiably."""
    out = torch.cat([o for o, _ in parts], dim=1)
    order = torch.cat([i for _, i in parts])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(num_heads, device=order.device)
    return out[:, inverse]
