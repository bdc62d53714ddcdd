"""Softmax and sigmoid attention over a process group: K/V blocks travel, partial results merge.

Forward: at step s rank r computes its query chunks against the K/V of rank r - s
(received while step s - 1 computed, ``batch_isend_irecv``), and merges the partial
results — by log-sum-exp for softmax (Milakov & Gimelshein 2018, arXiv 1805.02867;
the merge of Ring Attention, Liu et al. 2023, arXiv 2310.01889), by plain addition for
sigmoid attention (Ramapuram et al. 2024, arXiv 2409.04431), whose weights do not
normalise. Pairs that the mask leaves empty are neither sent nor computed, so a window
talks to neighbours only and a document mask to the ranks its documents span.

Backward: the same steps again. Each block pair is recomputed through attnkit's own
autograd and given the gradients it has inside the merged result: with w = exp(lse_j -
lse) the block's share, dO_j = w dO and dlse_j = w (rowsum(dO * (O_j - O)) + dlse), which
makes the split exact. dK and dV of a visiting block go back to the rank they came from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import choose_backend, make_request
from ..mods import Mask, ScoreMod
from .comm import Group, Pending, post
from .layout import Layout
from .offset import pair_mods, pair_state

Tensor = torch.Tensor


@dataclass
class RingPlan:
    """What one rank computes and exchanges; identical decisions on every rank."""

    g: Group
    layout: Layout
    kind: str  # "softmax" or "sigmoid"
    mask: Mask | None
    score: ScoreMod | None
    scale: float
    backend: str
    mechanism: object  # the sigmoid Mechanism, None for softmax

    def __post_init__(self):
        r, P = self.g.rank, self.g.world
        self.pairs = {src: self._pairs(r, src) for src in range(P)}
        # need_from[src]: rank r reads src's K/V; need_by[dst]: dst reads rank r's K/V
        self.need_from = {src: bool(self.pairs[src]) for src in range(P)}
        self.need_by = {dst: bool(self._pairs(dst, r)) for dst in range(P)}

    def _pairs(self, dst: int, src: int):
        out = []
        for qc in self.layout.rank_chunks(dst):
            for kc in self.layout.rank_chunks(src):
                state = pair_state(self.mask, qc.start, qc.length, kc.start, kc.length)
                if state != "empty":
                    out.append((qc, kc, state))
        return out

    def block(self, q, k, v, qc, kc, state):
        """(out, lse or None) of one pair, its mods seeing global positions."""
        m, s = pair_mods(self.mask, self.score, qc.start, qc.length, kc.start, kc.length)
        if state == "full":
            m = None  # every pair visible: no mask to evaluate
        # zigzag spans are strided views; the kernels' C loops want contiguous tiles
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if self.kind == "sigmoid":
            return self.mechanism(q, k, v, mask=m, score=s, scale=self.scale, backend=self.backend, check_finite=False), None
        req = make_request(q, k, v, mask=m, score=s, scale=self.scale, return_lse=True)
        chosen, _ = choose_backend(req, self.backend)
        return chosen.run(req)


def _span(x: Tensor, chunk) -> Tensor:
    return x[:, :, chunk.local : chunk.local + chunk.length]


def _merge(o: Tensor, lse: Tensor, o_j: Tensor, lse_j: Tensor) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of two partial results over disjoint keys (rows with no
    visible key keep lse = -inf and zeros)."""
    new = torch.logaddexp(lse, lse_j)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    a, b = torch.exp(lse - safe), torch.exp(lse_j - safe)
    return o * a[..., None] + o_j.to(o.dtype) * b[..., None], new


def _exchange_kv(plan: RingPlan, k: Tensor, v: Tensor, s: int) -> tuple[Pending, tuple[Tensor, Tensor] | None]:
    """Post step s's K/V traffic: send ours to r + s, receive r - s's. Returns (pending, buffers)."""
    g, P = plan.g, plan.g.world
    dst, src = (g.rank + s) % P, (g.rank - s) % P
    sends = [(k, dst), (v, dst)] if plan.need_by[dst] else []
    bufs: tuple[Tensor, Tensor] | None = None
    if plan.need_from[src]:
        n = plan.layout.local_length(src)
        bufs = (k.new_empty(k.shape[0], k.shape[1], n, k.shape[3]), v.new_empty(v.shape[0], v.shape[1], n, v.shape[3]))
    recvs = [(bufs[0], src), (bufs[1], src)] if bufs else []
    return post(sends, recvs, g, f"the K/V exchange of ring step {s}"), bufs


def ring_forward(plan: RingPlan, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None):
    """(out, lse) of this rank's queries against the whole sequence; lse None for sigmoid."""
    g, P = plan.g, plan.g.world
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H = q.shape[:2]
    chunks = plan.layout.rank_chunks(g.rank)
    outs = {c.start: torch.zeros(B, H, c.length, v.shape[3], dtype=acc_dtype, device=q.device) for c in chunks}
    lses = {c.start: torch.full((B, H, c.length), -torch.inf, dtype=acc_dtype, device=q.device) for c in chunks}
    kv: tuple[Tensor, Tensor] | None = (k, v)
    for s in range(P):
        src = (g.rank - s) % P
        pending: Pending | None = None
        nxt: tuple[Tensor, Tensor] | None = None
        if s + 1 < P:
            pending, nxt = _exchange_kv(plan, k, v, s + 1)
        if kv is not None:
            for qc, kc, state in plan.pairs[src]:
                o_j, lse_j = plan.block(_span(q, qc), _span(kv[0], kc), _span(kv[1], kc), qc, kc, state)
                if plan.kind == "sigmoid":
                    outs[qc.start] += o_j.to(acc_dtype)
                else:
                    outs[qc.start], lses[qc.start] = _merge(outs[qc.start], lses[qc.start], o_j, lse_j.to(acc_dtype))
        if pending is not None:
            pending.wait()
        kv = nxt
    out = torch.cat([outs[c.start] for c in chunks], dim=2)
    if plan.kind == "sigmoid":
        return out.to(q.dtype), None
    lse = torch.cat([lses[c.start] for c in chunks], dim=2)
    if sinks is not None:
        # the sink is one extra key with value zero, counted once, here in the merge
        total = torch.logaddexp(lse, sinks.detach().to(acc_dtype).view(1, H, 1))
        out = out * torch.exp(lse - total)[..., None]
        lse = total
    return out.to(q.dtype), lse


def _block_grads(plan, q, kv, qc, kc, state, d_out, d_lse, out, lse, params):
    """dq, dk, dv and parameter gradients of one block pair inside the merged result."""
    qs = _span(q, qc).detach().requires_grad_()
    ks = _span(kv[0], kc).detach().requires_grad_()
    vs = _span(kv[1], kc).detach().requires_grad_()
    with torch.enable_grad():
        o_j, lse_j = plan.block(qs, ks, vs, qc, kc, state)
        dO = _span(d_out, qc)
        if plan.kind == "sigmoid":
            outputs, grads = [o_j], [dO.to(o_j.dtype)]
        else:
            L = _span(lse, qc)
            finite = ~torch.isneginf(L)
            w = torch.where(finite, torch.exp(lse_j.detach().to(L.dtype) - torch.where(finite, L, 0)), 0)
            row = (dO.to(L.dtype) * (o_j.detach().to(L.dtype) - _span(out, qc).to(L.dtype))).sum(-1)
            dl = w * (row + _span(d_lse, qc).to(L.dtype))
            outputs, grads = [o_j, lse_j], [(w[..., None] * dO.to(L.dtype)).to(o_j.dtype), dl.to(lse_j.dtype)]
        found = torch.autograd.grad(outputs, [qs, ks, vs, *params], grads, allow_unused=True)
    return found


def ring_backward(plan: RingPlan, q, k, v, sinks, out, lse, d_out, d_lse, params):
    """Gradients of q, k, v (this rank's), sinks and score parameters (this rank's queries'
    share: sum them over the group for the whole)."""
    g, P = plan.g, plan.g.world
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if d_out is None:
        d_out = torch.zeros_like(out)
    if d_lse is None and lse is not None:
        d_lse = torch.zeros_like(lse)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    dparams = [None] * len(params)
    kv: tuple[Tensor, Tensor] | None = (k, v)
    for s in range(P):
        src, dst = (g.rank - s) % P, (g.rank + s) % P
        pending: Pending | None = None
        nxt: tuple[Tensor, Tensor] | None = None
        if s + 1 < P:
            pending, nxt = _exchange_kv(plan, k, v, s + 1)
        dk_src = dv_src = None
        if kv is not None and plan.pairs[src]:
            if s == 0:  # our own block: accumulate in place
                dk_src, dv_src = dk, dv
            else:
                dk_src = torch.zeros(kv[0].shape, dtype=acc, device=k.device)
                dv_src = torch.zeros(kv[1].shape, dtype=acc, device=v.device)
            for qc, kc, state in plan.pairs[src]:
                gq, gk, gv, *gp = _block_grads(plan, q, kv, qc, kc, state, d_out, d_lse, out, lse, params)
                if gq is not None:
                    dq[:, :, qc.local : qc.local + qc.length] += gq.to(acc)
                if gk is not None:
                    dk_src[:, :, kc.local : kc.local + kc.length] += gk.to(acc)
                if gv is not None:
                    dv_src[:, :, kc.local : kc.local + kc.length] += gv.to(acc)
                for i, gi in enumerate(gp):
                    if gi is not None:
                        dparams[i] = gi if dparams[i] is None else dparams[i] + gi
        if pending is not None:
            pending.wait()
        kv = nxt
        if s == 0:
            continue
        # carry the visiting block's dK/dV home; receive ours from the rank we visited
        sends = [(dk_src, src), (dv_src, src)] if dk_src is not None and dv_src is not None else []
        back = None
        if plan.need_by[dst]:
            back = (torch.empty(k.shape, dtype=acc, device=k.device), torch.empty(v.shape, dtype=acc, device=v.device))
        recvs = [(back[0], dst), (back[1], dst)] if back else []
        post(sends, recvs, g, f"the dK/dV return of ring step {s}").wait()
        if back:
            dk += back[0]
            dv += back[1]
        del dk_src, dv_src, back
    d_sinks = None
    if sinks is not None and sinks.requires_grad:
        # dL/dsink = w_sink (dlse - rowsum(dO * O)), w_sink = exp(sink - lse)
        H = q.shape[1]
        w = torch.exp(sinks.detach().to(acc).view(1, H, 1) - lse)
        row = (d_out.to(acc) * out.to(acc)).sum(-1)
        d_sinks = (w * (d_lse - row)).sum(dim=(0, 2)).to(sinks.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_sinks, dparams


class RingAttention(torch.autograd.Function):
    """Autograd wrapper: the forward and backward rings above."""

    @staticmethod
    def forward(ctx, plan, q, k, v, sinks, *params):
        out, lse = ring_forward(plan, q, k, v, sinks)
        ctx.plan = plan
        ctx.has_sinks = sinks is not None
        ctx.n_params = len(params)
        ctx.save_for_backward(q, k, v, out, lse, *((sinks,) if sinks is not None else ()), *params)
        if lse is None:
            return out
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse=None):
        saved = ctx.saved_tensors
        q, k, v, out, lse = saved[:5]
        rest = saved[5:]
        sinks = rest[0] if ctx.has_sinks else None
        params = list(rest[1:] if ctx.has_sinks else rest)
        want = [p for p in params if p.requires_grad]
        dq, dk, dv, d_sinks, dwant = ring_backward(ctx.plan, q, k, v, sinks, out, lse, d_out, d_lse, want)
        it = iter(dwant)
        dparams = [next(it) if p.requires_grad else None for p in params]
        return (None, dq, dk, dv, d_sinks, *dparams)
