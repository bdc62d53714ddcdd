"""Calls with a few queries (a decoding step, a handful of speculative tokens): the dense
formula over Nq x Nk weights is O(N) memory there, and cheaper than tiling.

Grouped-query heads read their key/value head through a view (query heads of one group
stacked as rows), so GQA copies no key.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..mods import index_tensors
from .finite import without_hidden_nonfinite
from .request import Request, all_finite

Tensor = torch.Tensor

#: up to this many queries a call is a "few-query" call (decoding, speculative tokens)
SMALL_QUERIES = 16


def few_queries(req: Request) -> bool:
    """Whether the dense few-query path serves this call: few queries, inference."""
    return req.q_len <= SMALL_QUERIES and not req.needs_grad


def dense_visible(req: Request) -> Tensor:
    """(B | 1, Hq | 1, Nq, Nk) bool: which keys each query sees (query i at Nk - Nq + i)."""
    assert req.mask is not None  # asked of masked calls only
    b, h, qi, ki = index_tensors(req.batch, req.heads, req.q_start, req.q_len, 0, req.k_len)
    visible = torch.as_tensor(req.mask(b, h, qi, ki), dtype=torch.bool, device=req.q.device)
    return visible if visible.dim() == 4 else visible.view(1, 1, req.q_len, req.k_len)


def few_query_attention(req: Request, weights: Callable[[Tensor], Tensor]) -> Tensor:
    """``weights(logits) @ v`` with logits = score(q k^T * scale), -inf where the mask hides
    a key; ``weights`` must map -inf to 0 (sigmoid(s + b) does). Output in q's dtype."""
    out = _dense(req, weights)
    if not all_finite(out) and req.mask is not None:
        clean = without_hidden_nonfinite(req)  # NaN in a hidden value: 0 * NaN in the product
        if clean is not None:
            out = _dense(clean, weights)
    return out


def _dense(req: Request, weights: Callable[[Tensor], Tensor]) -> Tensor:
    B, Hq, Nq, D = req.q.shape
    Hkv, groups = req.kv_heads, Hq // req.kv_heads
    compute = torch.float64 if req.q.dtype == torch.float64 else torch.float32
    q = req.q.to(compute).reshape(B, Hkv, groups * Nq, D)  # head h = kv * groups + g
    s = (q @ req.k.to(compute).transpose(-1, -2) * req.scale).view(B, Hq, Nq, req.k_len)
    if req.score is not None:
        b, h, qi, ki = index_tensors(req.batch, req.heads, req.q_start, req.q_len, 0, req.k_len)
        s = req.score(s, b, h, qi, ki).to(compute)
    if req.mask is not None:
        s = s.masked_fill(~dense_visible(req), -math.inf)
    w = weights(s).view(B, Hkv, groups * Nq, req.k_len)
    return (w @ req.v.to(compute)).view(B, Hq, Nq, req.v_dim).to(req.q.dtype)
