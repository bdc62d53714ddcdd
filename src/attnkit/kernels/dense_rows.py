"""Softmax calls with a few queries (a decoding step, a short prompt) that the tile engine
would serve: observed ones and ones with a score modification. Their weights are
Nq x Nk per head, O(N) memory, so they are computed once, densely, and the output is
their product with v.

Observed (``attnkit.hf.use(model, observers=...)``), the observers get those weights as
one tile: one pass over the keys instead of the tiled kernel for (out, lse) followed by
the observing pass that recomputes the weights tile by tile (observe_pass.py). Where
every row sees every key (a decoding step), that pass is one C++ operator giving the
output, the logits, the weights and the log-normalisers (``observed_rows``). With a
score modification (a steering intervention while generating), it replaces the tile
engine's plan and segments, whose set-up is most of a few-row call's time. On a small
model either cost more than the step's own attention. Exact: P = softmax(S) over the
full row, as exp(S - lse) where a row may see no key or the caller wants lse.
"""

from __future__ import annotations

import math

import torch

from ..mods import index_tensors
from ..mods.masks import Causal
from ..observe import AttentionTile, CallInfo, feed
from .cpu import kv as native_kv
from .few_queries import SMALL_QUERIES, dense_logits, few_queries, weighted_values
from .finite import without_hidden_nonfinite
from .observe_pass import call_info
from .request import Request, all_finite

Tensor = torch.Tensor
FLOAT32_64 = (torch.float32, torch.float64)


def dense_rows_serve(req: Request) -> bool:
    """Whether this path can serve the call: few queries, inference, no sinks, something to see."""
    return few_queries(req) and req.sinks is None and req.q_len > 0 and req.k_len > 0


def observed_rows(q: Tensor, k: Tensor, v: Tensor, mask, scale, observers, layer: int | None) -> Tensor | None:
    """The output of an observed inference call of a few query rows that see every key (no
    mask, or the causal mask on one query: a decoding step), its weights fed to
    ``observers`` as one tile; None when the call is anything else, the operators are
    not built, or some logit or output is not finite, so that the full path validates
    the call, explains and raises."""
    if not _every_key_rows(q, k, v, mask, scale) or torch.compiler.is_compiling() or not native_kv.available():
        return None
    (B, Hq, Nq, D), Nk = q.shape, k.shape[2]
    out, s, w, lse, clean = native_kv.rows_attention(q, k, v, 1.0 / math.sqrt(D) if scale is None else float(scale))
    if not clean:
        return None
    call = CallInfo(B, Hq, Nq, Nk, Nk - Nq, layer)
    b, _, qi, ki = index_tensors(B, Hq, Nk - Nq, Nq, 0, Nk)
    feed(
        observers,
        call,
        (AttentionTile(call, b.view(-1), qi.view(-1), ki.view(-1), w, s, None, True, None, lse, (Nk - Nq, 0, 0)),),
    )
    return out


def _every_key_rows(q, k, v, mask, scale) -> bool:
    """Whether ``observed_rows`` takes the call: float32/float64 CPU tensors of consistent
    shapes, a few query rows that see every key, a finite scale, no gradient wanted."""
    if not (mask is None or (type(mask) is Causal and q.shape[2] == 1)) or not (type(q) is type(k) is type(v) is Tensor):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or not (q.dtype == k.dtype == v.dtype) or q.dtype not in FLOAT32_64:
        return False
    (B, Hq, Nq, D), (Bk, Hkv, Nk, Dk), (Bv, Hv, Nv, Dv) = q.shape, k.shape, v.shape
    if not (B == Bk == Bv and Hkv == Hv and Nk == Nv and D == Dk) or Hkv == 0 or Hq % Hkv or not (Nk and D and Dv):
        return False
    if not 0 < Nq <= SMALL_QUERIES or not q.device.type == k.device.type == v.device.type == "cpu":
        return False
    if (
        k.stride(3) != 1
        or v.stride(3) != 1
        or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    ):
        return False
    return scale is None or (type(scale) in (int, float) and math.isfinite(scale))


def dense_rows_attention(
    req: Request, observers=None, layer: int | None = None, need_lse: bool = True
) -> tuple[Tensor, Tensor | None]:
    """(out, lse) of the call, its weights fed to ``observers`` (if any) as one tile; lse
    is None when not ``need_lse`` and the softmax needed none."""
    out, lse, tile = _dense(req, layer, need_lse)
    if tile.visible is not None and not all_finite(out):  # only a hidden key can be cleaned away
        clean = without_hidden_nonfinite(req)  # NaN in a hidden value: 0 * NaN in the product
        if clean is not None:
            out, lse, tile = _dense(clean, layer, need_lse)
    if observers:
        feed(observers, tile.call, (tile,))  # feed builds nothing more when no observer wants a tile
    return out, lse


def _dense(req: Request, layer: int | None, need_lse: bool) -> tuple[Tensor, Tensor | None, AttentionTile]:
    s, visible = dense_logits(req)
    if visible is None and req.score is None and not need_lse:
        # Every row sees every key and no score mod can hide one (the commonest observed
        # decoding step): one softmax op instead of logsumexp, a guard and exp. A NaN
        # logit gives NaN as before, which the caller's finiteness check reports.
        lse = norm = None
        w = torch.softmax(s, dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
        # a row that sees no key: lse -inf, weights 0 (exp(-inf - inf)), output 0 as the kernels give
        norm = torch.where(torch.isneginf(lse), math.inf, lse)
        w = torch.sub(s, norm.unsqueeze(-1)).exp_()
    b, _, qi, ki = index_tensors(req.batch, req.heads, req.q_start, req.q_len, 0, req.k_len)
    origin = (req.q_start, 0, 0)
    tile = AttentionTile(
        call_info(req, layer), b.view(-1), qi.view(-1), ki.view(-1), w, s, None, visible is None, visible, norm, origin
    )
    return weighted_values(req, w), lse, tile


__all__ = ["dense_rows_attention", "dense_rows_serve", "observed_rows"]
