"""The chunked backend: exact tiled attention with O(N) memory, forward and backward.

A plan from the mask's structure says which key segments each query block visits
(kernels/plan.py). Two engines run the tiles:

- ``fused``: torch's fused CPU flash op per segment (kernels/fused.py) — for masks of any
  kind and score mods that are affine in s (scales, ALiBi, dense and relative biases
  without gradient); the fastest path on CPU;
- ``tiled``: the online-softmax loop in PyTorch (kernels/tiled.py) — any score mod,
  learnable mod parameters, any device, bf16 matmuls where the CPU has them.

Both give the same (out, lse); learned sinks and the lse gradient are handled here, on
top of either engine.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

from ..mods import AffineForm, Mask, ScoreMod, affine_form, index_tensors
from ..mods.masks import Causal
from .fused import backward_with_lse_grad, fused_backward, fused_forward
from .machine import cpu_flags, has_bf16_units
from .plan import Plan, causal_plan, make_plan, single_tile_plan
from .request import Request
from .tiled import tiled_backward, tiled_forward
from .tiles import Tile, add_sinks, sink_grad

Tensor = torch.Tensor


@dataclass(frozen=True)
class Tiling:
    """Block sizes. Fused: large query blocks amortise the op's call overhead; the key
    grid is finer so masks skip more. Tiled: smaller tiles keep the working set in cache."""

    fused_q_block: int = 256
    fused_q_block_large: int = 1024
    fused_q_block_bias: int = 256
    fused_k_block: int = 128
    fused_max_masked_span: int = 2048
    tiled_q_block: int = 128
    tiled_k_block: int = 128
    tiled_tile_k: int = 512
    #: calls with at most this many (query, key) pairs per head run as one tile
    single_tile: int = 256 * 256


TILING = Tiling()


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX); elsewhere torch
    emulates bf16 matmuls hundreds of times slower than fp32."""
    forced = os.environ.get("ATTNKIT_BF16_MATMUL")
    if forced is not None:
        return forced == "1"
    flags = cpu_flags()
    return flags is not None and has_bf16_units(flags)


def fused_unsupported(req: Request) -> str | None:
    """Why the fused engine cannot run this call, or None."""
    if req.q.device.type != "cpu":
        return f"the fused flash op is CPU-only (device {req.q.device})"
    affine = affine_form(req.score)
    if affine is None:
        return f"score mod {req.score!r} is not affine in s, so it is evaluated on every tile"
    if affine.bias_requires_grad and req.needs_grad:
        return "a bias with learnable parameters (or a learnable row scale after a bias) needs dS, which the fused op does not expose"
    return None


def choose_engine(req: Request) -> tuple[str, str]:
    """("fused" | "tiled", why)."""
    why_not = fused_unsupported(req)
    if why_not is not None:
        return "tiled", why_not
    if req.q.dtype == torch.bfloat16 and cpu_has_fast_bf16():
        return "tiled", "this CPU has native bf16 dot products: tiles run P V in bf16, logits and softmax in fp32"
    return "fused", "every tile runs in torch's fused CPU flash kernel; masks and biases become small tiles"


def make_chunked_plan(req: Request, engine: str, tiling: Tiling = TILING) -> Plan:
    if req.q_len * req.k_len <= tiling.single_tile:
        # One tile: classifying blocks would cost more than evaluating the mask densely.
        return single_tile_plan(req.mask, req.batch, req.q_len, req.k_len)
    if engine != "fused":
        return make_plan(
            req.mask, req.batch, req.q_len, req.k_len, tiling.tiled_q_block, tiling.tiled_k_block, tiling.tiled_tile_k
        )
    plan = partial(
        make_plan,
        req.mask,
        req.batch,
        req.q_len,
        req.k_len,
        k_block=tiling.fused_k_block,
        max_masked_span=tiling.fused_max_masked_span,
    )
    affine = affine_form(req.score)
    if affine is not None and affine.terms and not affine.key_only:
        # Dense bias tiles grow with the square of the block: keep blocks moderate.
        return plan(q_block=tiling.fused_q_block_bias)
    if type(req.mask) is Causal and affine is not None and (not affine.terms or affine.key_only and not _hides_keys(req, affine)):
        # A plain causal mask with row scales (folded into q) or a per-key bias: the op
        # takes the whole causal square, the bias as one broadcast row, so one call (two
        # with cached keys before the queries) does what blocks of 1024 rows did in seven,
        # without merging partials.
        return causal_plan(req.batch, req.q_len, req.k_len)
    fine = plan(q_block=tiling.fused_q_block)
    # Larger query blocks let the op reuse each key tile across more rows (the op splits
    # its own work by 256 rows only for calls of >= 768 rows), unless they make the
    # blocks visit many more keys (bands such as sliding windows).
    coarse = plan(q_block=tiling.fused_q_block_large)
    chosen = coarse if coarse.area <= 1.1 * fine.area else fine
    return chosen.coalesced()


def _hides_keys(req: Request, affine: AffineForm) -> bool:
    """Whether a key-only bias is -inf for some key (such a segment needs a dense tile,
    which must stay block-sized)."""
    tile = Tile.make(torch.arange(req.batch), req.heads, req.q_start, 1, 0, req.k_len)
    parts = affine.separable_bias(tile.b.view(-1), tile.h_flat, tile.q_flat, tile.k_flat, "left")
    assert parts is not None  # only asked of key-only biases, which separate on either side
    _, col = parts
    return bool(torch.isneginf(col).any())


@dataclass(frozen=True)
class _Run:
    engine: str
    plan: Plan
    mask: Mask | None
    affine: AffineForm | None  # fused: biases only (row scales already folded into q)
    score: ScoreMod | None  # tiled: the whole chain
    scale: float
    q_start: int
    tile_k: int
    matmul_dtype: torch.dtype
    n_params: int


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _Run, q, k, v, sinks, *params):
        if run.engine == "fused":
            assert run.affine is not None  # the fused engine runs affine scores only
            out, lse = fused_forward(q, k, v, run.scale, run.plan, run.mask, run.affine, run.q_start)
        else:
            out, lse = tiled_forward(q, k, v, run.scale, run.plan, run.mask, run.score, run.q_start, run.tile_k, run.matmul_dtype)
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        ctx.run = run
        # Kept as the very objects the score mod reads, so autograd.grad can reach them.
        ctx.params = params
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        run: _Run = ctx.run
        q, k, v, out, lse, sinks = ctx.saved_tensors
        params = ctx.params
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if grad_lse is not None and not torch.compiler.is_compiling() and not bool(grad_lse.any()):
            grad_lse = None
        delta = (grad_out.to(cd) * out.to(cd)).sum(dim=-1)
        dsinks = sink_grad(sinks, lse, delta, grad_lse) if sinks is not None and ctx.needs_input_grad[4] else None
        dparams = [None] * run.n_params
        if run.engine == "fused":
            dq, dk, dv = backward_with_lse_grad(
                fused_backward, grad_out, grad_lse, q, k, v, out, lse, run.scale, run.plan, run.mask, run.affine, run.q_start
            )
        else:
            adj = delta if grad_lse is None else delta - grad_lse.to(cd)
            dq, dk, dv, dparams = tiled_backward(
                grad_out, q, k, v, out, lse, adj, run.scale, run.plan, run.mask, run.score, list(params), run.q_start, run.tile_k
            )
            dparams = [None if g is None else g.to(p.dtype) for g, p in zip(dparams, params)]
        return (None, dq, dk, dv, dsinks, *dparams)


def chunked_attention(req: Request, engine: str | None = None, tiling: Tiling = TILING) -> tuple[Tensor, Tensor]:
    """(out, lse) of a validated, non-empty request."""
    if engine is None:
        engine, _ = choose_engine(req)
    elif engine == "fused" and fused_unsupported(req) is not None:
        raise ValueError(f"engine='fused' cannot run this call: {fused_unsupported(req)}")
    elif engine not in ("fused", "tiled"):
        raise ValueError(f"engine: expected 'fused' or 'tiled', got {engine!r}")
    plan = make_chunked_plan(req, engine, tiling)
    q, k, v = req.q, req.k, req.v
    D, Dv = req.head_dim, req.v_dim
    if engine == "fused":
        if q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16):
            # Without native bf16/fp16 dot products the op widens every tile to float32
            # anyway; widening q, k, v once (O(N D)) is faster, and the result is the same.
            q, k, v = q.float(), k.float(), v.float()
        affine = affine_form(req.score)
        assert affine is not None  # the fused engine runs affine scores only (choose_engine, fused_unsupported)
        b, h, qi, _ = index_tensors(req.batch, req.heads, req.q_start, req.q_len, 0, 1)
        factor = affine.factor(b, h, qi)
        if factor is not None:
            q = q * factor.to(q.dtype)
        affine = replace(affine, scales=[])
        # The op wants one head size for q, k and v: pad the smaller with zero columns.
        width = max(D, Dv)
        if D < width:
            q, k = F.pad(q, (0, width - D)), F.pad(k, (0, width - D))
        if Dv < width:
            v = F.pad(v, (0, width - Dv))
        run = _Run("fused", plan, req.mask, affine, None, req.scale, req.q_start, 0, q.dtype, 0)
        params = []
    else:
        params = [p for p in (req.score.parameters() if req.score is not None else []) if p.requires_grad]
        matmul_dtype = (
            torch.bfloat16
            if q.dtype == torch.bfloat16 and q.device.type == "cpu" and cpu_has_fast_bf16()
            else (torch.float64 if q.dtype == torch.float64 else torch.float32)
        )
        if q.device.type != "cpu" and q.dtype in (torch.float16, torch.bfloat16):
            matmul_dtype = q.dtype
        run = _Run(
            "tiled", plan, req.mask, None, req.score, req.scale, req.q_start, tiling.tiled_tile_k, matmul_dtype, len(params)
        )
    out, lse = _ChunkedAttention.apply(run, q, k, v, req.sinks, *params)
    if out.shape[-1] != Dv:
        out = out[..., :Dv]
    return out.to(req.q.dtype), lse
