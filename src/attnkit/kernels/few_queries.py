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
from ..mods.masks import Causal
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
    s, _ = dense_logits(req)
    return weighted_values(req, weights(s))


def dense_logits(req: Request) -> tuple[Tensor, Tensor | None]:
    """(S, visible): the call's logits (B, Hq, Nq, Nk) in the compute dtype (float64 for
    float64 inputs, else float32), score mod applied and -inf where the mask hides a key;
    ``visible`` the mask (bool, broadcastable) or None when every key is visible."""
    B, Hq, Nq, D = req.q.shape
    Hkv, groups = req.kv_heads, Hq // req.kv_heads
    compute = torch.float64 if req.q.dtype == torch.float64 else torch.float32
    q = _as(req.q, compute).reshape(B, Hkv, groups * Nq, D)  # head h = kv * groups + g: GQA without copying keys
    s = torch.matmul(q, _as(req.k, compute).transpose(-1, -2)).mul_(req.scale).view(B, Hq, Nq, req.k_len)
    if req.score is not None:
        b, h, qi, ki = index_tensors(req.batch, req.heads, req.q_start, req.q_len, 0, req.k_len)
        s = req.score(s, b, h, qi, ki).to(compute)
    if req.mask is None or (type(req.mask) is Causal and Nq == 1):  # one causal row sees every key
        return s, None
    visible = dense_visible(req)
    if bool(visible.all()):
        return s, None
    # masked_fill, not an added -inf: a NaN in a hidden key must not reach the row
    return s.masked_fill(~visible, -math.inf), visible


def weighted_values(req: Request, w: Tensor) -> Tensor:
    """``w @ v`` for weights (B, Hq, Nq, Nk) in the compute dtype, output in q's dtype."""
    B, Hq, Nq, _ = req.q.shape
    Hkv = req.kv_heads
    w = w.reshape(B, Hkv, (Hq // Hkv) * Nq, req.k_len)
    return _as(torch.matmul(w, _as(req.v, w.dtype)).view(B, Hq, Nq, req.v_dim), req.q.dtype)


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, skipping the call when it would change nothing (a decoding step
    is a few microseconds of work per op)."""
    return t if t.dtype == dtype else t.to(dtype)
