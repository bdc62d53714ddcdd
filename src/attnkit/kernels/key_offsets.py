"""Few-query calls whose score mod is a per-key offset, on torch's SDPA with the offsets
as its additive mask.

The interventions that move attention between keys (amplifying or calibrating visual
attention, PAI arXiv 2407.21771 and AVC arXiv 2405.17820; hiding image keys; PASTA's
log α outside emphasised spans, arXiv 2311.02262) are ``s + table[b, h, kv]``: the same
offset for every query. A prefill of a few tokens or a decoding step with one would
otherwise take the dense few-query formula (some ten small ops and the score mod
evaluated on the Nq x Nk logits), several times the cost of the step's attention on a
small model. Here the (B, H, 1, Nk) row of offsets — plus the causal triangle when
there are several queries — is SDPA's float mask: one op.

Exact as the dense formula: softmax(s + offset) over the visible keys. A row whose
every visible key has a -inf offset sees nothing; SDPA gives NaN there, the kernels'
convention is a zero output, so such rows are zeroed.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ..mods.masks import Causal
from ..mods.scores import Bias, affine_form
from .few_queries import SMALL_QUERIES
from .request import Request, all_finite

Tensor = torch.Tensor


def key_offset_terms(req: Request) -> list[Bias] | None:
    """The call's key-only biases when this path serves it: a few queries, inference, no
    sinks, no lse wanted, no mask or the causal one, float32/float64, and a score mod made
    of key-only biases alone (no row scale); None otherwise."""
    if req.score is None or req.sinks is not None or req.return_lse or req.needs_grad:
        return None
    if not 0 < req.q_len <= SMALL_QUERIES or req.k_len == 0 or req.q.dtype not in (torch.float32, torch.float64):
        return None
    if req.mask is not None and type(req.mask) is not Causal:
        return None
    form = affine_form(req.score)
    if form is None or form.scales or not form.key_only:
        return None
    return [bias for bias, _ in form.terms]  # no row scale: none applied after a bias either


def key_offsets_attention(req: Request, terms: list[Bias]) -> Tensor:
    """The call's output (B, Hq, Nq, Dv) in q's dtype, for its ``key_offset_terms``.

    No key is hidden from every query (the last query of a causal call sees them all), so
    NaN in any value reaches some row, and the caller's finiteness check reports it."""
    shape = (req.batch, req.heads, req.q_len, req.k_len)
    offsets = terms[0].key_row(*shape).to(req.q.dtype)  # (B | 1, H | 1, 1, Nk)
    for bias in terms[1:]:
        offsets = offsets + bias.key_row(*shape).to(req.q.dtype)
    mask = offsets
    if req.mask is not None and req.q_len > 1:  # one causal row sees every key
        mask = mask + _causal_offsets(req.q_len, req.k_len, req.q.dtype)
    out = F.scaled_dot_product_attention(
        req.q, req.k, req.v, attn_mask=mask, scale=req.scale, enable_gqa=req.heads != req.kv_heads
    )
    # an offset may hide a row's every key; a finite output has no such row left to zero
    if not all_finite(out) and bool(torch.isneginf(offsets).any()):
        dead = torch.isneginf(mask).all(-1, keepdim=True)
        out = out.masked_fill(dead, 0.0)
    return out


@functools.lru_cache(maxsize=64)
def _causal_offsets(q_len: int, k_len: int, dtype: torch.dtype) -> Tensor:
    """(Nq, Nk): 0 where query i (at position Nk - Nq + i) sees key j, else -inf (read-only)."""
    return torch.full((q_len, k_len), -math.inf, dtype=dtype).triu(k_len - q_len + 1)


__all__ = ["key_offset_terms", "key_offsets_attention"]
