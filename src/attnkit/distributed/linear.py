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

The chain holds the non-empty chunks only: with N < 2P (zigzag) or N < P (contiguous)
some chunks have no token, and a rank may hold none at all; such a chunk changes no state
and has no gradient, so it takes no part in the hand-overs.

Every hand-over starts with a header. When a rank fails inside the chain (its own
computation raises, or a failure notice arrives), it still plays its remaining part of
the schedule — a failure notice instead of each state it would have sent, a receive for
each it would have received — so every rank downstream raises at once, naming the rank
and chunk that failed, instead of waiting out the group's timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mechanisms.linear import LinearState
from ..mods import causal
from .comm import Group, GroupError, post
from .layout import Chunk, Layout

Tensor = torch.Tensor
_HEADER = 32
_STATE, _FAILED = 1, 0  # header[0]: a state follows, or the sender's part of the chain failed


class ChainBroken(RuntimeError):
    """This rank stopped because rank ``origin`` failed on chunk ``chunk`` of the chain."""

    def __init__(self, g: Group, origin: int, chunk: int, what: str):
        self.origin, self.chunk = origin, chunk
        super().__init__(
            f"attnkit.distributed: rank {g.rank} of {g.world} stopped during {what}: rank {origin} failed "
            f"on chunk {chunk} of the linear-attention chain (its own error says why)"
        )


# ---- hand-overs: a header, then the state's tensors ----


def _header(state: LinearState) -> Tensor:
    vals = [_STATE, int(state.normalizer is not None), int(state.conv is not None)]
    for t in state.tensors():
        vals += [t.dim(), *t.shape, *([0] * (4 - t.dim()))]
    vals += [0] * (_HEADER - len(vals))
    return torch.tensor(vals, dtype=torch.long)


def _failure_header(origin: int, chunk: int) -> Tensor:
    return torch.tensor([_FAILED, origin, chunk] + [0] * (_HEADER - 3), dtype=torch.long)


def _empty_from_header(h: list[int], dtype, device) -> tuple[list[Tensor], bool, bool]:
    has_norm, has_conv = bool(h[1]), bool(h[2])
    n = 1 + int(has_norm) + 3 * int(has_conv)
    out, i = [], 3
    for _ in range(n):
        nd = h[i]
        out.append(torch.empty(h[i + 1 : i + 1 + nd], dtype=dtype, device=device))
        i += 5
    return out, has_norm, has_conv


def _state(tensors: list[Tensor], has_norm: bool, has_conv: bool, position: int) -> LinearState:
    memory, rest = tensors[0], tensors[1:]
    normalizer = rest.pop(0) if has_norm else None
    conv = (rest[0], rest[1], rest[2]) if has_conv else None  # the header counts three conv tensors
    return LinearState(memory=memory, normalizer=normalizer, position=position, conv=conv)


def _send_state(state: LinearState, peer: int, g: Group, what: str) -> None:
    post([(_header(state), peer)], [], g, what).wait()
    post([(t.detach(), peer) for t in state.tensors()], [], g, what).wait()


def _recv_header(peer: int, g: Group, what: str) -> list[int]:
    h = torch.empty(_HEADER, dtype=torch.long)
    post([], [(h, peer)], g, what).wait()
    return h.tolist()


def _recv_state(peer: int, g: Group, dtypes: list, device, position: int, what: str) -> LinearState:
    h = _recv_header(peer, g, what)
    if h[0] == _FAILED:
        raise ChainBroken(g, h[1], h[2], what)
    tensors, has_norm, has_conv = _empty_from_header(h, dtypes[0], device)
    # conv caches hold raw q, k, v (input dtype); memory and normaliser the compute dtype
    for i, t in enumerate(tensors):
        if has_conv and i >= len(tensors) - 3:
            tensors[i] = t.to(dtypes[1])
    post([], [(t, peer) for t in tensors], g, what).wait()
    return _state(tensors, has_norm, has_conv, position)


# ---- the schedule: what this rank does, in chain order ----


@dataclass(frozen=True)
class Step:
    """``kind`` "recv" (the carried state, from ``peer``), "compute" (chunk ``index``), or
    "send" (the carried state, to ``peer``)."""

    kind: str
    index: int
    peer: int


def chain_chunks(layout: Layout) -> list[Chunk]:
    """The chunks that hold tokens, in global order: the links of the chain."""
    return [c for c in layout.chunks() if c.length > 0]


def schedule(chunks: list[Chunk], rank: int, backward: bool = False) -> list[Step]:
    """This rank's steps: forward in global order, backward in reverse, a receive before
    a chunk whose predecessor (in walking order) is another rank's, a send after one whose
    successor is."""
    order = range(len(chunks) - 1, -1, -1) if backward else range(len(chunks))
    stride = -1 if backward else 1
    steps = []
    for i in order:
        if chunks[i].rank != rank:
            continue
        before, after = i - stride, i + stride
        if 0 <= before < len(chunks) and chunks[before].rank != rank:
            steps.append(Step("recv", i, chunks[before].rank))
        steps.append(Step("compute", i, rank))
        if 0 <= after < len(chunks) and chunks[after].rank != rank:
            steps.append(Step("send", i, chunks[after].rank))
    return steps


def run_schedule(steps: list[Step], g: Group, what: str, recv, compute, send) -> None:
    """Run the steps, carrying a state from step to step. If one fails (other than the
    group itself failing), finish this rank's part with failure notices, then re-raise."""
    carried = None
    for n, step in enumerate(steps):
        try:
            if step.kind == "recv":
                carried = recv(step)
            elif step.kind == "compute":
                carried = compute(step, carried)
            else:
                send(step, carried)
        except GroupError:
            raise  # the group is broken: further exchanges would only wait for its timeout
        except Exception as err:
            origin = (err.origin, err.chunk) if isinstance(err, ChainBroken) else (g.rank, step.index)
            _notify(steps[n + 1 :], origin, g, what)
            raise


def _notify(rest: list[Step], origin: tuple[int, int], g: Group, what: str) -> None:
    """Play the rest of this rank's schedule with failure notices: every rank after the
    failure is waiting for exactly the hand-over this rank owes it (the chain is
    sequential), so each notice is received at once."""
    try:
        for step in rest:
            if step.kind == "send":
                post([(_failure_header(*origin), step.peer)], [], g, what).wait()
            elif step.kind == "recv":
                _recv_header(step.peer, g, what)  # a notice too: its sender failed or was notified
    except GroupError:
        pass  # a peer is gone; the original error is the one to report


# ---- the autograd function ----


class LinearChain(torch.autograd.Function):
    """Forward: chunks in global order with the previous chunk's state. Backward: chunks
    in reverse order, each recomputed from its saved initial state."""

    @staticmethod
    def forward(ctx, mech, g: Group, layout: Layout, q, k, v, *params):
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        chunks = chain_chunks(layout)
        outs, states_in = {}, {}

        def recv(step):
            c = chunks[step.index]
            return _recv_state(
                step.peer, g, [compute_dtype, q.dtype], q.device, c.start, f"the state hand-over into chunk {step.index}"
            )

        def compute(step, state):
            c = chunks[step.index]
            sl = slice(c.local, c.local + c.length)
            states_in[step.index] = state  # None before the first chunk
            outs[step.index], state = mech(
                q[:, :, sl], k[:, :, sl], v[:, :, sl], mask=causal(), initial_state=state, return_state=True
            )
            return state

        def send(step, state):
            _send_state(state, step.peer, g, f"the state hand-over out of chunk {step.index}")

        run_schedule(schedule(chunks, g.rank), g, "the linear-attention forward", recv, compute, send)
        ctx.mech, ctx.g, ctx.chunks, ctx.states = mech, g, chunks, states_in
        ctx.save_for_backward(q, k, v, *params)
        mine = [i for i, c in enumerate(chunks) if c.rank == g.rank]  # local order is global order
        return torch.cat([outs[i] for i in mine], dim=2) if mine else q.new_zeros(q.shape[0], q.shape[1], 0, v.shape[3])

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, *params = ctx.saved_tensors
        g, chunks = ctx.g, ctx.chunks
        want = [p for p in params if p.requires_grad]
        grads = {"q": torch.zeros_like(q), "k": torch.zeros_like(k), "v": torch.zeros_like(v), "params": [None] * len(want)}

        def recv(step):
            # the gradient of the state after chunk ``index``, from the owner of the chunk after it
            return _recv_state(
                step.peer, g, [_state_dtype(q), q.dtype], q.device, 0, f"the state-gradient hand-back into chunk {step.index}"
            )

        def compute(step, d_state_out):
            return _chunk_backward(ctx.mech, chunks[step.index], ctx.states[step.index], q, k, v, want, d_out, d_state_out, grads)

        def send(step, d_state_in):
            _send_state(d_state_in, step.peer, g, f"the state-gradient hand-back out of chunk {step.index}")

        run_schedule(schedule(chunks, g.rank, backward=True), g, "the linear-attention backward", recv, compute, send)
        it = iter(grads["params"])
        return (None, None, None, grads["q"], grads["k"], grads["v"], *[next(it) if p.requires_grad else None for p in params])


def _state_dtype(q: Tensor):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _chunk_backward(mech, c: Chunk, state_in: LinearState | None, q, k, v, want, d_out, d_state_out, grads) -> LinearState | None:
    """Recompute one chunk from its saved initial state, add its gradients to ``grads``,
    and return the gradient of its initial state (None for the first chunk)."""
    sl = slice(c.local, c.local + c.length)
    leaves = [] if state_in is None else [t.detach().requires_grad_() for t in state_in.tensors()]
    start = (
        None
        if state_in is None
        else _state(leaves, state_in.normalizer is not None, state_in.conv is not None, state_in.position)
    )
    qs, ks, vs = (t[:, :, sl].detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        o, state_out = mech(qs, ks, vs, mask=causal(), initial_state=start, return_state=True)
        outputs, seeds = [o], [d_out[:, :, sl]]
        if d_state_out is not None:  # the chunk's final state feeds later chunks
            for t, dt in zip(state_out.tensors(), d_state_out.tensors()):
                if t.requires_grad:
                    outputs.append(t)
                    seeds.append(dt.to(t.dtype))
        found = torch.autograd.grad(outputs, [qs, ks, vs, *leaves, *want], seeds, allow_unused=True)
    for name, gi in zip("qkv", found[:3]):
        if gi is not None:
            grads[name][:, :, sl] += gi
    d_found = found[3 : 3 + len(leaves)]
    for j, gi in enumerate(found[3 + len(leaves) :]):
        if gi is not None:
            grads["params"][j] = gi if grads["params"][j] is None else grads["params"][j] + gi
    if state_in is None:
        return None
    d_leaves = [torch.zeros_like(t) if gi is None else gi for t, gi in zip(leaves, d_found)]
    return _state(d_leaves, state_in.normalizer is not None, state_in.conv is not None, 0)


def linear_attention(mech, g: Group, layout: Layout, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    params = [p for p in mech.parameters()]
    return LinearChain.apply(mech, g, layout, q, k, v, *params)
