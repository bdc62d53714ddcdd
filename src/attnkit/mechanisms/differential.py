"""Differential attention (Ye, Dong, Xia, Sun, Zhu, Huang, Wei 2024, "Differential
Transformer", arXiv 2410.05258).

Two softmax maps from two halves of every head's query and key, subtracted:

    DiffAttn = (softmax(Q1 K1^T / sqrt(d)) - lambda * softmax(Q2 K2^T / sqrt(d))) V,

with ``[Q1 | Q2] = q`` and ``[K1 | K2] = k`` split along the head dimension (d = D / 2)
and V shared. The difference cancels attention noise common to both maps. ``lambda`` is
a constant, or (``lambda_dim=``) re-parameterised as in the paper,
``lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` with learned vectors, and
``lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1))`` for layer l when ``layer_index`` is given.
The paper's per-head GroupNorm and ``(1 - lambda_init)`` output scale act on the heads'
outputs and belong to the layer, not to the attention operator.

Map 1 is ``softmax([Q1 | 0] K^T s)``, map 2 ``softmax([0 | Q2] K^T s)``: the full keys
against queries with the other half zeroed. So both maps are one attention call with two
query heads per head sharing its key/value head (grouped-query attention), which the
dispatcher sends to torch's SDPA when the mask allows (plain causal), else to the chunked
backend; masks and score mods that tell heads apart get one call per map instead.
Inference with a band mask and no score mod runs both maps in one call of the C softmax
loop (kernels/cpu/), whose query and key heads may be D / 2 wide against Dv-wide values.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels import choose_backend, chunked_attention, cpu, empty_result, make_request
from ..kernels.engine import dense_softmax
from ..kernels.mechanism_call import check_options, dense_logits, dense_values, finish
from ..kernels.observe_pass import call_info, softmax_tiles
from ..kernels.request import Request
from ..mods.masks import FnMask, Mask, band_of
from ..observe import AttentionTile, feed
from ..observe.base import interested
from .base import Mechanism, register

Tensor = torch.Tensor
#: (out, lse) of one map; lse None where SDPA ran without it
_Map = tuple[Tensor, Tensor | None]


@register("differential")
class Differential(Mechanism):
    """``(softmax(Q1 K1^T) - lambda softmax(Q2 K2^T)) V`` with q, k split in halves."""

    paper = "arXiv:2410.05258"

    def __init__(self, lambda_init: float | None = 0.8, layer_index: int | None = None, lambda_dim: int | None = None):
        super().__init__()
        if layer_index is not None:
            if isinstance(layer_index, bool) or not isinstance(layer_index, int) or layer_index < 0:
                raise ValueError(f"differential(layer_index): expected an int >= 0 (0 for the first layer), got {layer_index!r}")
            lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_index)
        if isinstance(lambda_init, bool) or not isinstance(lambda_init, (int, float)) or not math.isfinite(lambda_init):
            raise ValueError(f"differential(lambda_init): expected a finite number, got {lambda_init!r}")
        self.lambda_init = float(lambda_init)
        if lambda_dim is None:
            self.lambda_q1 = self.lambda_k1 = self.lambda_q2 = self.lambda_k2 = None
        else:
            if isinstance(lambda_dim, bool) or not isinstance(lambda_dim, int) or lambda_dim < 1:
                raise ValueError(f"differential(lambda_dim): expected an int >= 1, got {lambda_dim!r}")
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                setattr(self, name, nn.Parameter(torch.randn(lambda_dim) * 0.1))

    def extra_repr(self) -> str:
        learned = "" if self.lambda_q1 is None else f", lambda_dim={self.lambda_q1.numel()}"
        return super().extra_repr() + f", lambda_init={self.lambda_init:.4g}{learned}"

    def lam(self, dtype: torch.dtype | None = None) -> Tensor:
        """The current lambda (a 0-d tensor; differentiable when re-parameterised), in
        float64 for a constant, and for learned vectors in their dtype promoted with the
        call's ``dtype``: a float64 call computes lambda in float64 even from float32
        parameters (the float32 values are exact in float64)."""
        if self.lambda_q1 is None:
            return torch.tensor(self.lambda_init, dtype=torch.float64)
        cd = self.lambda_q1.dtype if dtype is None else torch.promote_types(self.lambda_q1.dtype, dtype)
        q1, k1, q2, k2 = (t.to(cd) for t in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2))
        return torch.exp(torch.dot(q1, k1)) - torch.exp(torch.dot(q2, k2)) + self.lambda_init

    def halves(self, q, k, v, mask, score, scale) -> tuple[Request, Request]:
        for name, t in (("q", q), ("k", k)):
            if isinstance(t, Tensor) and t.dim() == 4 and t.shape[-1] % 2:
                raise ValueError(f"{name}: differential attention splits the head dim in two halves; D={t.shape[-1]} is odd")
        if isinstance(q, Tensor) and q.dim() == 4 and scale is None:
            scale = 1.0 / math.sqrt(q.shape[-1] // 2)
        q1, q2 = q.chunk(2, dim=-1)
        k1, k2 = k.chunk(2, dim=-1)
        return (
            make_request(q1, k1, v, mask=mask, score=score, scale=scale, return_lse=True),
            make_request(q2, k2, v, mask=mask, score=score, scale=scale, return_lse=True),
        )

    # not the template: two requests (one per half of q and k), run as one call whose lse is made only for observers
    def forward(
        self,
        q,
        k,
        v,
        *,
        mask=None,
        score=None,
        scale=None,
        sinks=None,
        return_lse=False,
        backend="auto",
        check_finite=True,
        observers=None,
        layer=None,
    ):
        check_options(self.name, sinks=sinks, return_lse=return_lse, backend=backend, lse=False)
        first, second = self.halves(q, k, v, mask, score, scale)
        if backend == "reference":
            out = self.reference(q, k, v, mask=mask, score=score, scale=scale)
        else:
            (o1, lse1), (o2, lse2) = _maps(q, k, first, second, backend, need_lse=bool(observers))
            out = self._combine(o1, o2)
            if observers:
                lam_value = float(self.lam(q.dtype))
                call = call_info(first, layer, self.name)
                _, union = interested(observers, call)
                with torch.no_grad():  # both tile streams restore this mode, whatever their order
                    feed(
                        observers,
                        call,
                        _difference(softmax_tiles(first, lse1, call, union), softmax_tiles(second, lse2, call, union), lam_value),
                    )
        return finish(first, out, check_finite)

    def _combine(self, o1: Tensor, o2: Tensor) -> Tensor:
        """``o1 - lambda o2``; a constant lambda is one fused pass."""
        if self.lambda_q1 is not None:
            return o1 - self.lam(o1.dtype).to(o1.dtype) * o2
        return torch.sub(o1, o2, alpha=float(self.lam()))

    def reference(self, q, k, v, *, mask=None, score=None, scale=None, **_):
        """The paper's Eq. (1): ``(softmax(Q1 K1^T s) - lambda softmax(Q2 K2^T s)) V``."""
        first, second = self.halves(q, k, v, mask, score, scale)
        p1, _ = dense_softmax(dense_logits(first))
        p2, _ = dense_softmax(dense_logits(second))
        weights = p1 - self.lam(p1.dtype).to(p1.dtype) * p2
        return torch.matmul(weights, dense_values(first)).to(q.dtype)


def _maps(q: Tensor, k: Tensor, first: Request, second: Request, backend: str, need_lse: bool) -> tuple[_Map, _Map]:
    """(out, lse) of both maps (lse None where SDPA ran without it); ``backend`` is "auto"
    or "chunked"."""
    if first.q_len == 0 or first.k_len == 0:
        return empty_result(first), empty_result(second)
    fused = _maps_in_c(first, second)
    if fused is not None:
        return fused
    if not _heads_blind(first):
        return chunked_attention(first), chunked_attention(second)
    both = make_request(_paired_queries(q), k, first.v, mask=first.mask, scale=first.scale, return_lse=need_lse)
    out, lse = choose_backend(both, backend)[0].run(both)
    out = out.unflatten(1, (first.heads, 2))
    lse = None if lse is None else lse.unflatten(1, (first.heads, 2))
    map1, map2 = ((out[:, :, i], None if lse is None else lse[:, :, i]) for i in (0, 1))
    return map1, map2


def _maps_in_c(first: Request, second: Request) -> tuple[_Map, _Map] | None:
    """Both maps in one call of the C softmax kernel (kernels/cpu/), which takes query
    and key heads of D / 2 against values of Dv — torch's fused op wants one head size, so
    elsewhere each map pays for a full-width head. Inference only (the backward is the
    fused op's), band masks, no score mod, float32 on CPU; None otherwise."""
    band = band_of(first.mask)
    if first.needs_grad or first.score is not None or band is None:
        return None
    q = torch.cat([first.q, second.q], dim=1).contiguous()  # (B, 2H, N, D/2): map 1's heads, then map 2's
    k = torch.cat([first.k, second.k], dim=1).contiguous()
    v = first.v.contiguous()
    if not cpu.fused_usable(q, k, v):
        return None
    H, Hkv = first.heads, first.kv_heads
    j = torch.arange(2 * H)
    kv = (j % H) // (H // Hkv)
    out, lse = cpu.softmax_attention(q, k, v, first.scale, first.q_start, band, k_heads=(j // H) * Hkv + kv, v_heads=kv)
    return (out[:, :H], lse[:, :H]), (out[:, H:], lse[:, H:])


def _heads_blind(req: Request) -> bool:
    """True when the call cannot tell query heads apart, so heads may be renumbered: no
    score mod, and a mask built from attnkit's own masks (a user callable may read h)."""
    if req.score is not None:
        return False
    return req.mask is None or all(type(m).__module__ == Mask.__module__ and not isinstance(m, FnMask) for m in req.mask.walk())


def _paired_queries(q: Tensor) -> Tensor:
    """(B, 2 Hq, N, D): head 2h is [Q1 | 0] of head h, head 2h + 1 is [0 | Q2], so that
    with grouped-query attention both read the key/value head of head h."""
    D = q.shape[-1]
    keep = torch.zeros(2, 1, D, dtype=q.dtype, device=q.device)
    keep[0, :, : D // 2] = 1
    keep[1, :, D // 2 :] = 1
    return (q.unsqueeze(2) * keep).flatten(1, 2)  # one pass over the output, nothing padded first


def _difference(first, second, lam: float):
    """Tiles of P1 - lambda P2 from the two maps' tile streams (same plan, same order)."""
    try:
        for a, b in zip(first, second):
            yield AttentionTile(a.call, a.batch, a.q_pos, a.k_pos, a.weights - lam * b.weights, None, a.heads)
    finally:  # close the inner generators last-opened first, so each restores its own mode
        second.close()
        first.close()
