"""Linear attention over a process group: the state is passed, not the keys.

Every causal linear-attention mechanism (sum or delta rule, with or without decays and
gates) is a recurrence over a fixed-size state S (``LinearState``), so the sequence
splits exactly at chunk boundaries: the chunk starting at position t runs with the state
after t - 1 as its ``initial_state`` (Katharopoulos et al. 2020, arXiv 2006.16236, Sec.
3.4; the chunk-state passing of flash-linear-attention's context parallelism). Forward
walks the chunks in global order, each owner receiving the state from the previous
chunk's owner; backward walks back, the gradient of each chunk's initial state going
to the owner of the chunk before. One state per chunk boundary crosses the network —
no K/V ever moves. The chain is sequential (latency P · chunk time); a parallel scan
over the chunks' (transition, state) pairs would shorten it but needs the transition
matrices of gated delta rules, which the mechanisms do not expose.
"""

from __future__ import annotations

import torch

from ..mechanisms.linear import LinearState
from ..mods import causal
from .comm import Group, post
from .layout import Layout

Tensor = torch.Tensor
_HEADER = 32


def _header(state: LinearState) -> Tensor:
    vals = [int(state.normalizer is not None), int(state.conv is not None)]
    for t in state.tensors():
        vals += [t.dim(), *t.shape, *([0] * (4 - t.dim()))]
    vals += [0] * (_HEADER - len(vals))
    return torch.tensor(vals, dtype=torch.long)


def _empty_from_header(h: list[int], dtype, device) -> tuple[list[Tensor], bool, bool]:
    has_norm, has_conv = bool(h[0]), bool(h[1])
    n = 1 + int(has_norm) + 3 * int(has_conv)
    out, i = [], 2
    for _ in range(n):
        nd = h[i]
        out.append(torch.empty(h[i + 1 : i + 1 + nd], dtype=dtype, device=device))
        i += 5
    return out, has_norm, has_conv


def _state(tensors: list[Tensor], has_norm: bool, has_conv: bool, position: int) -> LinearState:
    memory, rest = tensors[0], tensors[1:]
    normalizer = rest.pop(0) if has_norm else None
    conv = tuple(rest) if has_conv else None
    return LinearState(memory=memory, normalizer=normalizer, position=position, conv=conv)


def _send_state(state: LinearState, peer: int, g: Group, what: str) -> None:
    post([(_header(state), peer)], [], g, what).wait()
    post([(t.detach(), peer) for t in state.tensors()], [], g, what).wait()


def _recv_state(peer: int, g: Group, dtypes: list, device, position: int, what: str) -> LinearState:
    h = torch.empty(_HEADER, dtype=torch.long)
    post([], [(h, peer)], g, what).wait()
    tensors, has_norm, has_conv = _empty_from_header(h.tolist(), dtypes[0], device)
    # conv caches hold raw q, k, v (input dtype); memory and normaliser the compute dtype
    for i, t in enumerate(tensors):
        if has_conv and i >= len(tensors) - 3:
            tensors[i] = t.to(dtypes[1])
    post([], [(t, peer) for t in tensors], g, what).wait()
    return _state(tensors, has_norm, has_conv, position)


class LinearChain(torch.autograd.Function):
    """Forward: chunks in global order with the previous chunk's state. Backward: chunks
    in reverse order, each recomputed from its saved initial state."""

    @staticmethod
    def forward(ctx, mech, g: Group, layout: Layout, q, k, v, *params):
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        dtypes = [compute, q.dtype]
        chunks = layout.chunks()
        outs, saved_states = {}, {}
        state = None
        for i, c in enumerate(chunks):
            if c.rank != g.rank:
                continue
            if i > 0 and chunks[i - 1].rank != g.rank:
                state = _recv_state(chunks[i - 1].rank, g, dtypes, q.device, c.start, f"the state hand-over into chunk {i}")
            sl = slice(c.local, c.local + c.length)
            saved_states[i] = state  # None before chunk 0
            o, state = mech(q[:, :, sl], k[:, :, sl], v[:, :, sl], mask=causal(), initial_state=saved_states[i], return_state=True)
            outs[i] = o
            if i + 1 < len(chunks) and chunks[i + 1].rank != g.rank:
                _send_state(state, chunks[i + 1].rank, g, f"the state hand-over out of chunk {i}")
        ctx.mech, ctx.g, ctx.layout, ctx.states = mech, g, layout, saved_states
        ctx.save_for_backward(q, k, v, *params)
        mine = [i for i, c in enumerate(chunks) if c.rank == g.rank]
        return torch.cat([outs[i] for i in mine], dim=2) if mine else q.new_zeros(q.shape[0], q.shape[1], 0, v.shape[3])

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, *params = ctx.saved_tensors
        g, chunks, mech = ctx.g, ctx.layout.chunks(), ctx.mech
        want = [p for p in params if p.requires_grad]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dparams = [None] * len(want)
        d_state = None  # gradient of the state after the chunk being processed
        for i in range(len(chunks) - 1, -1, -1):
            c = chunks[i]
            if c.rank != g.rank:
                continue
            sl = slice(c.local, c.local + c.length)
            state_in = ctx.states[i]
            leaves = [] if state_in is None else [t.detach().requires_grad_() for t in state_in.tensors()]
            if state_in is not None:
                state_in = _state(leaves, state_in.normalizer is not None, state_in.conv is not None, state_in.position)
            qs, ks, vs = (t[:, :, sl].detach().requires_grad_() for t in (q, k, v))
            with torch.enable_grad():
                o, state_out = mech(qs, ks, vs, mask=causal(), initial_state=state_in, return_state=True)
                outs, grads = [o], [d_out[:, :, sl]]
                if i + 1 < len(chunks):
                    if chunks[i + 1].rank != g.rank:
                        d_state = _recv_state(chunks[i + 1].rank, g, [t.dtype for t in state_out.tensors()[:1]] + [q.dtype], q.device, 0, f"the state-gradient hand-back into chunk {i}")
                    for t, dt in zip(state_out.tensors(), d_state.tensors()):
                        if t.requires_grad:
                            outs.append(t)
                            grads.append(dt.to(t.dtype))
                found = torch.autograd.grad(outs, [qs, ks, vs, *leaves, *want], grads, allow_unused=True)
            for acc, gi in ((dq, found[0]), (dk, found[1]), (dv, found[2])):
                if gi is not None:
                    acc[:, :, sl] += gi
            n_leaves = len(leaves)
            d_leaves = [torch.zeros_like(t) if gi is None else gi for t, gi in zip(leaves, found[3 : 3 + n_leaves])]
            for j, gi in enumerate(found[3 + n_leaves :]):
                if gi is not None:
                    dparams[j] = gi if dparams[j] is None else dparams[j] + gi
            if i > 0:
                d_state = _state(d_leaves, ctx.states[i].normalizer is not None, ctx.states[i].conv is not None, 0)
                if chunks[i - 1].rank != g.rank:
                    _send_state(d_state, chunks[i - 1].rank, g, f"the state-gradient hand-back out of chunk {i}")
        it = iter(dparams)
        return (None, None, None, dq, dk, dv, *[next(it) if p.requires_grad else None for p in params])


def linear_attention(mech, g: Group, layout: Layout, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    params = [p for p in mech.parameters()]
    return LinearChain.apply(mech, g, layout, q, k, v, *params)
