"""Adaptive attention span (Sukhbaatar, Grave, Bojanowski, Joulin 2019, "Adaptive
Attention Span in Transformers", arXiv 1905.07799).

Each head learns how far back it looks. With a span ``z`` in [0, 1] (a fraction of
``max_span`` keys, learned per head) and a ramp of width R, a key at distance x from the
query is weighted by the soft mask

    m_z(x) = clamp((R + z * max_span - x) / R, 0, 1)

after the softmax, and the row is renormalised: ``a = m * softmax(s) / sum(m * softmax(s))``,
which equals ``softmax(s + log m)``. A penalty ``loss_coeff * max_span * mean(z)``
(``penalty()``) pushes spans down; ``clamp_()`` keeps z in [0, 1] after optimiser steps,
as in the paper's code.

The chunked path runs softmax attention with ``log m`` as a learnable bias and a
per-head causal window of the current span as the mask: tiles beyond every head's span
are skipped without computing anything, so a short span is also a fast one. The span's
gradient comes from the bias on the ramp band.
"""

from __future__ import annotations

import math

import torch

from ..kernels import chunked_attention, empty_result
from ..kernels.engine import EngineTiling, SoftmaxKernel, dense_softmax, run_kernel
from ..kernels.mechanism_call import check_options, dense_logits, dense_values, finish, observe_softmax_as, request
from ..kernels.request import Request
from ..kernels.tiles import add_sinks
from ..mods import Mask, causal
from ..mods.grid import EMPTY, FULL, PARTIAL, classify_interval
from ..mods.scores import Bias
from ._traced import learnable
from .base import Mechanism, register

Tensor = torch.Tensor


# The ramp is a diagonal band about R keys wide: narrow tiles waste little around it.
_RAMP_TILES = EngineTiling(q_block=64, k_block=32, tile_k=64)


class SpanRamp(Bias):
    """``log m_z(q - kv)`` per head; finite everywhere (the span mask hides m = 0)."""

    def __init__(self, span: Tensor, max_span: int, ramp: float):
        self.span, self.max_span, self.ramp = span, max_span, ramp

    def bias(self, b, h, q_idx, kv_idx):
        z = self.span.clamp(0, 1)
        z = z[h] if z.dim() else z
        m = (self.ramp + z * self.max_span - (q_idx - kv_idx).to(z.dtype)) / self.ramp
        return torch.log(m.clamp(min=torch.finfo(z.dtype).tiny, max=1.0))

    def parameters(self):
        return [self.span]

    def __repr__(self):
        return f"span_ramp(max_span={self.max_span}, ramp={self.ramp:g})"


class SpanBand(Mask):
    """``lo[h] <= q - kv <= hi[h]``: a band of distances per head (or one for all heads)."""

    def __init__(self, lo: list[int], hi: list[int]):
        if len(set(lo)) == 1 and len(set(hi)) == 1:  # one band for every head: masks broadcast over heads
            lo, hi = lo[:1], hi[:1]
        self.lo, self.hi = lo, hi
        self.lo_table, self.hi_table = torch.tensor(lo), torch.tensor(hi)

    def __call__(self, b, h, q_idx, kv_idx):
        diff = q_idx - kv_idx
        lo = self.lo_table[h] if len(self.lo) > 1 else self.lo[0]
        hi = self.hi_table[h] if len(self.hi) > 1 else self.hi[0]
        return (diff >= lo) & (diff <= hi)

    def classify(self, grid):
        # full where every head's band covers the tile, empty where no head's band reaches it
        every = classify_interval(grid, -min(self.hi), -max(self.lo))
        some = classify_interval(grid, -max(self.hi), -min(self.lo))
        out = torch.full_like(some, PARTIAL)
        out[every == FULL] = FULL
        out[some == EMPTY] = EMPTY
        return out

    def __repr__(self):
        return f"span_band({list(zip(self.lo, self.hi)) if len(self.lo) <= 4 else f'{len(self.lo)} heads'})"


@register("adaptive_span")
class AdaptiveSpan(Mechanism):
    """Softmax with a learned soft causal window per head (or one shared span)."""

    paper = "arXiv:1905.07799"

    def __init__(
        self, max_span: int = 1024, ramp: float = 32, init: float = 0.0, num_heads: int | None = None, loss_coeff: float = 2e-6
    ):
        super().__init__()
        if isinstance(max_span, bool) or not isinstance(max_span, int) or max_span < 1:
            raise ValueError(f"adaptive_span(max_span): expected an int >= 1, got {max_span!r}")
        if isinstance(ramp, bool) or not isinstance(ramp, (int, float)) or not (0 < ramp < math.inf):
            raise ValueError(f"adaptive_span(ramp): expected a finite number > 0, got {ramp!r}")
        if isinstance(init, bool) or not isinstance(init, (int, float)) or not 0 <= init <= 1:
            raise ValueError(f"adaptive_span(init): expected a span fraction in [0, 1], got {init!r}")
        if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1):
            raise ValueError(f"adaptive_span(num_heads): expected an int >= 1 or None (one shared span), got {num_heads!r}")
        if isinstance(loss_coeff, bool) or not isinstance(loss_coeff, (int, float)) or not (0 <= loss_coeff < math.inf):
            raise ValueError(f"adaptive_span(loss_coeff): expected a finite number >= 0, got {loss_coeff!r}")
        self.max_span, self.ramp, self.loss_coeff = max_span, float(ramp), float(loss_coeff)
        self.span = learnable(torch.full((num_heads,) if num_heads else (), float(init)))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", max_span={self.max_span}, ramp={self.ramp:g}, heads={self.span.numel()}"

    def penalty(self) -> Tensor:
        """The paper's span loss: ``loss_coeff * max_span * mean(z)``."""
        return self.loss_coeff * self.max_span * self.span.clamp(0, 1).mean()

    @torch.no_grad()
    def clamp_(self) -> None:
        """Keep the spans in [0, 1] (call after each optimiser step)."""
        self.span.clamp_(0, 1)

    def keys_per_head(self) -> list[int]:
        """Keys each head's soft mask leaves above zero (distance < R + z * max_span),
        within the ``max_span`` keys of memory."""
        z = self.span.detach().clamp(0, 1).double().reshape(-1)
        return [min(self.max_span, max(1, math.ceil(self.ramp + float(x) * self.max_span))) for x in z]

    def flat_per_head(self) -> list[int]:
        """Largest distance at which each head's soft mask is exactly 1 (x <= z * max_span)."""
        z = self.span.detach().clamp(0, 1).double().reshape(-1)
        return [min(self.max_span - 1, math.floor(float(x) * self.max_span)) for x in z]

    def _request(self, q, k, v, mask, score, scale, sinks, band: Mask | None = None, ramp: bool = True) -> Request:
        band = band or SpanBand([0] * self.span.numel(), [n - 1 for n in self.keys_per_head()])
        if ramp:
            bias = SpanRamp(self.span, self.max_span, self.ramp)
            score = bias if score is None else [score, bias]
        req = request(q, k, v, mask=band if mask is None else band & mask, score=score, scale=scale, sinks=sinks, return_lse=True)
        if self.span.dim() and self.span.shape[0] != req.heads:
            raise ValueError(f"adaptive_span: learned spans for {self.span.shape[0]} heads but the call has Hq={req.heads}")
        return req

    def _chunked(self, q, k, v, mask, score, scale, sinks) -> tuple[Tensor, Tensor]:
        """Where the soft mask is 1 the call is plain softmax attention (fused flash tiles);
        only the ramp band, R keys wide, carries the bias and the span's gradient. The two
        parts are merged by their logsumexps."""
        flat, keys = self.flat_per_head(), self.keys_per_head()
        plain = self._request(q, k, v, mask, score, scale, sinks, SpanBand([0] * len(flat), flat), ramp=False)
        parts = [chunked_attention(plain)]
        if any(f + 1 <= n - 1 for f, n in zip(flat, keys)):
            edge = self._request(q, k, v, mask, score, scale, None, SpanBand([f + 1 for f in flat], [n - 1 for n in keys]))
            kernel = SoftmaxKernel()
            kernel.tiling = _RAMP_TILES
            out, stats = run_kernel(edge, kernel)
            parts.append((out, stats["lse"]))
        return parts[0] if len(parts) == 1 else _merge(*parts[0], *parts[1])

    def _traced(self, q, k, v, mask, score, scale, sinks) -> tuple[Tensor, Tensor]:
        """The same attention without reading the spans into Python: one kernel over each
        head's band with the ramp bias, the band's width a tensor. Under torch.compile the
        spans are graph data, so the split into flat and ramp parts (and the tiles it skips)
        is not known while tracing; only distances beyond ``max_span`` are skipped."""
        z = self.span.detach().clamp(0, 1).double().reshape(-1)
        # keys_per_head and flat_per_head as tensors, in the same float64 arithmetic
        keys = torch.ceil(self.ramp + z * self.max_span).clamp(1, self.max_span).long()
        flat = torch.floor(z * self.max_span).clamp(max=self.max_span - 1).long()
        bias = _FlatSpanRamp(self.span, self.max_span, self.ramp, flat)
        score = bias if score is None else [score, bias]
        req = self._request(q, k, v, mask, score, scale, None, _TracedSpanBand(keys - 1, self.max_span - 1), ramp=False)
        if torch.is_grad_enabled() and self.span.requires_grad:
            # The tile engine pulls a learnable bias's gradient through torch.autograd.grad
            # in its backward, which Dynamo cannot trace: the dense form, under autograd.
            p, lse = dense_softmax(dense_logits(req))
            out = torch.matmul(p, dense_values(req)).to(q.dtype)
        else:
            kernel = SoftmaxKernel()
            kernel.tiling = _RAMP_TILES
            out, stats = run_kernel(req, kernel)
            lse = stats["lse"]
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        return out, lse

    # not the template: the fast path re-requests the call as given (the user's mask and score) with other span bands
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
        check_options(self.name, sinks=sinks, backend=backend, allow_sinks=True)
        traced = torch.compiler.is_compiling()
        req = self._request(q, k, v, mask, score, scale, sinks, _TracedSpanBand(None, self.max_span - 1) if traced else None)
        if backend == "reference":
            out, lse = self.reference(q, k, v, mask=mask, score=score, scale=scale, sinks=sinks, return_lse=True)
        elif req.q_len == 0 or req.k_len == 0:
            out, lse = empty_result(req)
        elif traced:
            out, lse = self._traced(q, k, v, mask, score, scale, req.sinks)
        else:
            out, lse = self._chunked(q, k, v, mask, score, scale, sinks)
        if observers:
            observe_softmax_as(req, lse, observers, layer, self.name)
        finish(req, out, check_finite)
        return (out, lse) if return_lse else out

    def reference(self, q, k, v, *, mask=None, score=None, scale=None, sinks=None, return_lse=False, **_):
        """The paper's Eq. (5), literally: softmax over the causal memory of ``max_span``
        keys, times the soft mask, renormalised."""
        memory = causal() & _Within(self.max_span)
        req = request(q, k, v, mask=memory if mask is None else memory & mask, score=score, scale=scale, sinks=sinks)
        s = dense_logits(req)
        if req.sinks is not None:
            s = torch.cat([s, req.sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
        dead = torch.isneginf(s).all(-1, keepdim=True)
        lse_s = torch.logsumexp(s.masked_fill(dead, 0.0), dim=-1, keepdim=True)
        a = torch.exp(s - lse_s)
        x = (torch.arange(req.q_start, req.k_len)[:, None] - torch.arange(req.k_len)[None, :]).to(s.dtype)
        z = self.span.clamp(0, 1).to(s.dtype)
        z = z.view(1, -1, 1, 1) if z.dim() else z
        m = ((self.ramp + z * self.max_span - x) / self.ramp).clamp(0, 1)
        if req.sinks is not None:
            m = torch.cat([m.expand(*s.shape[:3], req.k_len), torch.ones(*s.shape[:3], 1, dtype=s.dtype)], dim=-1)
        a = a * m
        total = a.sum(-1, keepdim=True)
        weights = torch.where(total > 0, a / total.clamp(min=torch.finfo(s.dtype).tiny), torch.zeros_like(a))
        # log sum_j m_j e^{s_j} = lse(s) + log sum_j m_j a_j
        lse = (lse_s + torch.log(total.clamp(min=torch.finfo(s.dtype).tiny))).squeeze(-1)
        lse = lse.masked_fill(dead.squeeze(-1) | (total.squeeze(-1) == 0), -math.inf)
        if req.sinks is not None:
            weights = weights[..., :-1]
        out = torch.matmul(weights, dense_values(req)).to(q.dtype)
        return (out, lse) if return_lse else out


def _merge(o1: Tensor, l1: Tensor, o2: Tensor, l2: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax results over two disjoint key sets as one; rows empty in both stay zero
    with lse = -inf, and no gradient is NaN."""
    live = ~(torch.isneginf(l1) & torch.isneginf(l2))
    l1s, l2s = torch.where(live, l1, torch.zeros_like(l1)), torch.where(live, l2, torch.zeros_like(l2))
    total = torch.logaddexp(l1s, l2s)
    w1, w2 = torch.exp(l1s - total).unsqueeze(-1), torch.exp(l2s - total).unsqueeze(-1)
    out = torch.where(live.unsqueeze(-1), o1 * w1.to(o1.dtype) + o2 * w2.to(o2.dtype), torch.zeros_like(o1))
    return out, torch.where(live, total, l1)


class _FlatSpanRamp(SpanRamp):
    """The ramp bias, exactly 0 (no gradient) within each head's flat distance ``flat[h]``,
    as where the chunked path runs plain softmax tiles."""

    def __init__(self, span: Tensor, max_span: int, ramp: float, flat: Tensor):
        super().__init__(span, max_span, ramp)
        self.flat = flat

    def bias(self, b, h, q_idx, kv_idx):
        s = super().bias(b, h, q_idx, kv_idx)
        flat = self.flat.reshape(()) if self.flat.numel() == 1 else self.flat.to(s.device)[h]
        return torch.where(q_idx - kv_idx <= flat, torch.zeros_like(s), s)


class _TracedSpanBand(Mask):
    """``0 <= q - kv <= hi[h]`` with ``hi`` a tensor (one per head, or one for all), or
    ``<= bound`` alone when ``hi`` is None. Tiles are classified from ``bound`` only:
    empty beyond it, partial (the mask evaluated) elsewhere."""

    def __init__(self, hi: Tensor | None, bound: int):
        self.hi, self.bound = hi, bound

    def __call__(self, b, h, q_idx, kv_idx):
        diff = q_idx - kv_idx
        if self.hi is None:
            return (diff >= 0) & (diff <= self.bound)
        hi = self.hi.reshape(()) if self.hi.numel() == 1 else self.hi.to(diff.device)[h]
        return (diff >= 0) & (diff <= hi)

    def classify(self, grid):
        some = classify_interval(grid, -self.bound, 0)
        return torch.where(some == EMPTY, EMPTY, PARTIAL).to(torch.int8)

    def __repr__(self):
        return f"span_band(traced, <= {self.bound})"


class _Within(Mask):
    """``q - kv < n``: the keys still in a memory of n."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, b, h, q_idx, kv_idx):
        return q_idx - kv_idx < self.n

    def __repr__(self):
        return f"within({self.n})"
