"""The chunked form: O(N) time and memory, forward and backward.

Keys are processed in spans of whole chunks. Inside a span every chunk's intra-chunk
product runs batched and the state is passed chunk to chunk (``core.chunk_forward``).
Autograd never sees the sequence: a custom Function keeps only its inputs and the state
at each span start, and the backward pass walks the spans in reverse, recomputing one
span's forward with autograd enabled and pulling the gradient of its end state back to
its start state (checkpointing at span granularity). Beyond the inputs, outputs and
their gradients, live memory is one span's temporaries plus one state per span. Feature
maps and gates computed from the keys run inside the spans, so a wide map (Taylor-2,
FAVOR+) or GLA's per-feature gates never exist for the whole sequence.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ...kernels.compile_constant import constant_for_compile
from .call import LinearCall
from .core import Recurrence, chunk_forward, log_gates, skip_keys
from .gates import KeyGate

Tensor = torch.Tensor

#: tokens per chunk (the quadratic block) of the sum rule; 64 as in Lightning Attention-2 and fla
CHUNK = 64
#: the delta rule's: its state passes between chunks through two small products per
#: chunk, the same work per token at any chunk size, while its intra-chunk work per token
#: (scores, UT transform and its products) grows with the chunk; 32 ran about 10% faster
#: than 64 single-threaded at N = 16384 (and strong Mamba-2 decays factor more easily)
DELTA_CHUNK = 32
#: elements of the largest per-span temporary, (B·H) x span x (D_f + Dv' + chunk), when a
#: backward pass will recompute spans (and hold one span's graph)
SPAN_ELEMENTS = 1 << 21
#: the same without gradients, per intra-op thread: nothing is kept, so spans are sized for
#: speed. Each thread's share of a span's temporaries (4 MiB in float32) then stays in cache
#: from one elementwise pass to the next (larger spans made single-threaded calls 1.3-1.6x
#: slower), while more threads get longer spans and so fewer kernel launches, each one a
#: thread-pool barrier on a busy machine.
INFERENCE_SPAN_ELEMENTS = 1 << 20
#: elements of all saved span-start states together, (B·H·D_f·Dv') x spans
SAVED_STATE_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class Plan:
    spans: tuple[tuple[int, int], ...]  # key ranges [lo, hi) processed together
    q_offset: int  # key index of the first query; spans never straddle it
    chunk: int
    start: int  # absolute position of key 0
    keep: Tensor | None = None  # (B, Nk) keys left in by a key mask


@dataclass(frozen=True)
class GateFns:
    """Functions computing g and β from a span's keys, and how many weights each takes."""

    g: Callable | None = None
    beta: Callable | None = None
    g_weights: int = 0


def default_chunk(rule: str) -> int:
    """Tokens per chunk when the caller gives none."""
    return DELTA_CHUNK if rule == "delta" else CHUNK


@constant_for_compile
def _threads() -> int:
    # torch.compile reads it once, while tracing: it sizes spans, never changes a value
    return torch.get_num_threads()


def span_length(n: int, bh: int, feature_dim: int, memory_dim: int, chunk: int, grad: bool = True) -> int:
    """Tokens per span: as many as keep the temporaries small, and enough that the
    saved span-start states stay bounded for wide feature maps."""
    elements = SPAN_ELEMENTS if grad else INFERENCE_SPAN_ELEMENTS * _threads()
    by_temporaries = elements // (bh * (feature_dim + memory_dim + chunk))
    by_saved = math.ceil(n * bh * feature_dim * memory_dim / SAVED_STATE_ELEMENTS)
    length = max(by_temporaries // chunk, math.ceil(by_saved / chunk), 1) * chunk
    return min(length, math.ceil(n / chunk) * chunk)


def make_plan(call: LinearCall, chunk: int, grad: bool = True) -> Plan:
    B, H, Nk, _ = call.k.shape
    length = span_length(Nk, B * H, call.feature_dim, call.memory_dim, chunk, grad)
    q_offset = call.q_offset if call.causal else Nk
    cuts = sorted(set(range(0, Nk, length)) | ({q_offset} if 0 < q_offset < Nk else set()))
    return Plan(tuple(zip(cuts, cuts[1:] + [Nk])), q_offset, chunk, call.start, call.keep)


def span_forward(
    rec: Recurrence, plan: Plan, fns: GateFns, lo: int, q, k, v, g, beta, memory, weights
) -> tuple[Tensor | None, Tensor]:
    """Outputs (None when the span has no queries) and end state of keys lo:lo+len(k)."""
    cd = memory.dtype
    if fns.g is not None:
        g = fns.g(k, *weights[: fns.g_weights])
    if fns.beta is not None:
        beta = fns.beta(k, *weights[fns.g_weights :])
    keep = None if plan.keep is None else plan.keep[:, lo : lo + k.shape[2]]
    kf = skip_keys(rec.keys(k.to(cd), plan.start + lo), keep)
    qf = None if q is None else rec.queries(q.to(cd), plan.start + lo)
    g = skip_keys(log_gates(g), keep)
    v = skip_keys(rec.values(v.to(cd)), keep)
    beta = None if beta is None else skip_keys(beta.to(cd), keep)
    out, memory = chunk_forward(qf, kf, v, g, beta, memory, plan.chunk, rec.delta)
    return (None if out is None else rec.finish(out)), memory


def _span_inputs(plan: Plan, lo: int, hi: int, q, k, v, g, beta):
    # Contiguous copies: batched matmuls over (B, H, chunks) would otherwise copy each operand.
    def cut(t):
        return None if t is None else t[:, :, lo:hi].contiguous()

    q_span = q[:, :, lo - plan.q_offset : hi - plan.q_offset].contiguous() if q is not None and lo >= plan.q_offset else None
    return [q_span, cut(k), cut(v), cut(g), cut(beta)]


class ChunkedScan(torch.autograd.Function):
    """(outputs, final state) of the recurrence, or only the final state when q is None.
    Gates come as tensors g, beta or from ``fns`` applied to each span's keys with
    ``weights`` (the gate modules' parameters), which then receive gradients."""

    @staticmethod
    def forward(ctx, rec, plan, fns, q, k, v, g, beta, memory, *weights):
        states = []
        # Written span by span: no list of pieces to concatenate at the end.
        width = memory.shape[-1] - int(rec.normalize and rec.divide)  # the normaliser's column divides out
        out = None if q is None else memory.new_empty(*q.shape[:3], width)
        for lo, hi in plan.spans:
            states.append(memory)
            piece, memory = span_forward(rec, plan, fns, lo, *_span_inputs(plan, lo, hi, q, k, v, g, beta), memory, weights)
            if piece is not None:
                out[:, :, lo - plan.q_offset : hi - plan.q_offset] = piece
        ctx.rec, ctx.plan, ctx.fns, ctx.has_out, ctx.n_states = rec, plan, fns, q is not None, len(states)
        ctx.save_for_backward(q, k, v, g, beta, *states, *weights)
        return memory if q is None else (out, memory)

    @staticmethod
    def backward(ctx, *grads):
        d_out, d_memory = grads if ctx.has_out else (None, grads[0])
        q, k, v, g, beta, *rest = ctx.saved_tensors
        states, weights = rest[: ctx.n_states], rest[ctx.n_states :]
        plan = ctx.plan
        needs = ctx.needs_input_grad[3:8]
        weight_needs = ctx.needs_input_grad[9:]
        full = [q, k, v, g, beta]
        result = [t.new_zeros(t.shape) if t is not None and need else None for t, need in zip(full, needs)]
        leaf_weights = [w.detach().requires_grad_(need) for w, need in zip(weights, weight_needs)]
        weight_grads = [torch.zeros_like(w) if need else None for w, need in zip(weights, weight_needs)]
        for idx in reversed(range(len(plan.spans))):
            lo, hi = plan.spans[idx]
            pieces = _span_inputs(plan, lo, hi, *full)
            with torch.enable_grad():
                pieces = [None if p is None else p.detach().requires_grad_(need) for p, need in zip(pieces, needs)]
                start = states[idx].detach().requires_grad_()
                out, end = span_forward(ctx.rec, plan, ctx.fns, lo, *pieces, start, leaf_weights)
            outputs, grad_outputs = [end], [d_memory]
            if out is not None:
                outputs.append(out)
                grad_outputs.append(d_out[:, :, lo - plan.q_offset : hi - plan.q_offset])
            inputs = [p for p, need in zip(pieces, needs) if p is not None and need]
            inputs += [w for w in leaf_weights if w.requires_grad] + [start]
            got = iter(torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True))
            for i, (p, need) in enumerate(zip(pieces, needs)):
                if p is not None and need:
                    grad = next(got)
                    if grad is not None:
                        rows = slice(lo - plan.q_offset, hi - plan.q_offset) if i == 0 else slice(lo, hi)
                        result[i][:, :, rows] = grad
            for w, acc in zip(leaf_weights, weight_grads):
                if w.requires_grad:
                    grad = next(got)
                    if grad is not None:
                        acc += grad
            d_start = next(got)
            d_memory = torch.zeros_like(start) if d_start is None else d_start
        return (None, None, None, *result, d_memory if ctx.needs_input_grad[8] else None, *weight_grads)


def traced_scan(rec, plan, fns, q, k, v, g, beta, memory, *weights):
    """``ChunkedScan`` for torch.compile, which cannot trace its backward (it calls
    ``torch.autograd.grad``): the same spans, each under activation checkpointing, so
    autograd differentiates the same operations and recomputes one span at a time."""
    grad = torch.is_grad_enabled()
    pieces = []
    for lo, hi in plan.spans:
        args = (*_span_inputs(plan, lo, hi, q, k, v, g, beta), memory, weights)
        step = functools.partial(span_forward, rec, plan, fns, lo)
        piece, memory = checkpoint(step, *args, use_reentrant=False) if grad else step(*args)
        if piece is not None:
            pieces.append(piece)
    if q is None:
        return memory
    return torch.cat(pieces, dim=2) if pieces else memory.new_zeros(
        *q.shape[:3], memory.shape[-1] - int(rec.normalize and rec.divide)
    ), memory


def chunked_form(call: LinearCall, chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """(outputs (B, H, Nq, Dv), final memory (B, H, D_f, Dv')) in the compute dtype; chunk
    None takes the rule's default."""
    if chunk is None:
        chunk = default_chunk(call.rec.rule)
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk!r}")
    rec = call.rec
    g, beta = call.g, call.beta
    weights: tuple[Tensor, ...] = ()
    g_fn = beta_fn = None
    if isinstance(g, KeyGate):
        g_fn, weights, g = g.fn, weights + g.params, None
    n_g = len(weights)
    if isinstance(beta, KeyGate):
        beta_fn, weights, beta = beta.fn, weights + beta.params, None
    fns = GateFns(g_fn, beta_fn, n_g)
    memory = call.initial_memory()
    inputs = (call.q, call.k, call.v, g, beta, memory, *weights)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    plan = make_plan(call, chunk, grad)
    scan = traced_scan if torch.compiler.is_compiling() else ChunkedScan.apply
    if call.causal and call.q.shape[2] > 0:
        return scan(rec, plan, fns, call.q, call.k, call.v, g, beta, memory, *weights)
    final = scan(rec, plan, fns, None, call.k, call.v, g, beta, memory, *weights)
    if call.causal:  # no queries: only the state moves
        return final.new_zeros(*call.q.shape[:3], call.v.shape[-1]), final
    phi_q = rec.queries(call.q.to(final.dtype), call.start + call.q_offset)
    return rec.finish(phi_q @ final), final
