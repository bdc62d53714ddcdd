"""Selection helpers shared by the policies: top-k per head with a fixed tie rule,
first and last entries, grouping query heads onto KV heads, 1-D pooling.

Ties go to the earlier position (a stable sort), in the fast paths and the references
alike, so that kept sets are reproducible."""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def top(scores: Tensor, candidates: Tensor, count: Tensor) -> Tensor:
    """The ``count`` (broadcastable to scores.shape[:-1]) candidates with the highest
    scores along the last dim, as a bool mask; ties to the earlier index."""
    s = torch.where(candidates, scores.to(torch.float64), -math.inf)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(s.shape[-1], device=s.device).expand_as(order))
    count = torch.as_tensor(count, device=s.device)
    return (rank < count[..., None]) & candidates


def first(valid: Tensor, count) -> Tensor:
    """The first ``count`` valid entries along the last dim."""
    count = torch.as_tensor(count, device=valid.device)
    return valid & (valid.cumsum(-1) <= count[..., None])


def last(valid: Tensor, count) -> Tensor:
    """The last ``count`` valid entries along the last dim."""
    count = torch.as_tensor(count, device=valid.device)
    after = valid.flip(-1).cumsum(-1).flip(-1)  # valid entries at or after each slot
    return valid & (after <= count[..., None])


def group_mean(mass: Tensor, kv_heads: int) -> Tensor:
    """(B, Hq, L) -> (B, Hkv, L): the mean over each KV head's group of query heads (the
    aggregation kvpress and SnapKV's GQA variant use)."""
    B, Hq, L = mass.shape
    return mass.view(B, kv_heads, Hq // kv_heads, L).mean(2)


def pool(x: Tensor, kernel: int, how: str) -> Tensor:
    """SnapKV's clustering of scores along the last dim: stride 1, centred, same length
    (max pooling pads with -inf, average pooling with zeros counted in the mean)."""
    if kernel <= 1:
        return x
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1]).to(torch.float64)
    if how == "max":
        out = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        out = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    return out[..., : shape[-1]].reshape(shape)
