"""Delegation to torch's fused scaled_dot_product_attention, when the call reduces to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..mods.masks import Causal
from ..mods.scores import Temperature
from .few_queries import dense_visible, few_queries
from .fused import flash_forward
from .request import Request

Tensor = torch.Tensor

# Returns (output, logsumexp); SDPA itself drops the lse. Through the layout-safe wrapper.
_cpu_flash = flash_forward


def sdpa_unsupported(req: Request) -> str | None:
    """Why SDPA cannot run this call exactly, or None when it can."""
    if req.sinks is not None:
        return "SDPA has no attention sinks"
    if req.v_dim != req.head_dim:
        return f"SDPA's fused kernels need Dv == D (got D={req.head_dim}, Dv={req.v_dim})"
    if req.mask is not None and not is_plain_causal(req) and not _small_dense_mask(req):
        return f"mask {req.mask!r} is not expressible in SDPA without an N^2 tensor"
    if req.score is not None and _folded_scale(req) is None:
        return f"score mod {req.score!r} is not expressible in SDPA"
    if req.return_lse:
        if req.q.device.type != "cpu":
            return "SDPA does not return the logsumexp on this device"
        if req.needs_grad:
            return "SDPA's logsumexp carries no gradient"
    return None


def is_plain_causal(req: Request) -> bool:
    # SDPA's is_causal is top-left aligned; it matches ours when Nq == Nk, or trivially
    # when a single query sees every key.
    return isinstance(req.mask, Causal) and (req.q_len == req.k_len or req.q_len == 1)


def _small_dense_mask(req: Request) -> bool:
    """A mask SDPA takes as an Nq x Nk boolean tensor (O(N) for a decoding step): few
    queries, inference, no lse (CPU's flash kernel that returns the lse takes no mask)."""
    return few_queries(req) and not req.return_lse


def _folded_scale(req: Request) -> float | None:
    """A scalar, non-learnable temperature folds into the softmax scale."""
    assert req.score is not None  # asked of calls with a score mod only
    atoms = req.score.atoms()
    if len(atoms) == 1 and isinstance(atoms[0], Temperature):
        t = atoms[0].t
        if t.dim() == 0 and not t.requires_grad:
            return req.scale / float(t)
    return None


def sdpa_attention(req: Request) -> tuple[Tensor, Tensor | None]:
    scale = req.scale if req.score is None else _folded_scale(req)
    is_causal = req.mask is not None and req.q_len == req.k_len
    if req.return_lse:
        out, lse = _cpu_flash(req.q, req.k, req.v, 0.0, is_causal, scale=scale)
        if req.q.dtype == torch.float64:
            lse = lse.to(torch.float64)
        return out, lse
    gqa = req.heads != req.kv_heads
    dense = req.mask is not None and not is_plain_causal(req)  # a few queries: the mask as a tensor
    out = F.scaled_dot_product_attention(
        req.q,
        req.k,
        req.v,
        attn_mask=dense_visible(req) if dense else None,
        is_causal=is_causal and not dense,
        scale=scale,
        enable_gqa=gqa,
    )
    return out, None
