"""The definition of attention: dense scores, score mods, mask, softmax. O(N^2) memory.

Every other backend is tested against this one. It is written for clarity, not speed,
and runs in float64 when asked (``compute_dtype=torch.float64``).
"""

from __future__ import annotations

import math

import torch

from ..mods import index_tensors
from .request import Request

Tensor = torch.Tensor


def reference_scores(req: Request, compute_dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """Modified logits (B, Hq, Nq, Nk) and the visibility mask (broadcastable, or None)."""
    q, k = req.q.to(compute_dtype), req.k.to(compute_dtype)
    groups = req.heads // req.kv_heads
    k = k.repeat_interleave(groups, dim=1)  # query head h reads key head h // groups
    s = torch.matmul(q, k.transpose(-1, -2)) * req.scale
    b, h, qi, ki = index_tensors(req.batch, req.heads, req.q_start, req.q_len, 0, req.k_len)
    if req.score is not None:
        s = req.score(s, b, h, qi, ki).to(compute_dtype)
    visible = None
    if req.mask is not None:
        visible = torch.as_tensor(req.mask(b, h, qi, ki), dtype=torch.bool)
        s = s.masked_fill(~visible, -math.inf)
    return s, visible


def reference_attention(req: Request, compute_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Output (B, Hq, Nq, Dv) in the input dtype and lse (B, Hq, Nq) in the compute dtype."""
    if compute_dtype is None:
        compute_dtype = torch.float64 if req.q.dtype == torch.float64 else torch.float32
    s, _ = reference_scores(req, compute_dtype)
    logits = s
    if req.sinks is not None:
        sink = req.sinks.to(compute_dtype).view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        logits = torch.cat([s, sink], dim=-1)
    # Rows that see no key at all: softmax over nothing. Keep them out of logsumexp so
    # neither the value nor the gradient becomes NaN, then give them lse = -inf, p = 0.
    dead = torch.isneginf(logits).all(dim=-1, keepdim=True)
    safe = logits.masked_fill(dead, 0.0)
    lse = torch.logsumexp(safe, dim=-1, keepdim=True)
    p = torch.exp(s - lse).masked_fill(dead, 0.0)
    v = req.v.to(compute_dtype).repeat_interleave(req.heads // req.kv_heads, dim=1)
    out = torch.matmul(p, v)
    lse = lse.masked_fill(dead, -math.inf).squeeze(-1)
    return out.to(req.q.dtype), lse


def reference_probabilities(req: Request, compute_dtype: torch.dtype = torch.float64) -> Tensor:
    """The normalised attention weights (B, Hq, Nq, Nk) — for tests and instruments."""
    s, _ = reference_scores(req, compute_dtype)
    _, lse = reference_attention(req, compute_dtype)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.nan_to_num(p, nan=0.0)
