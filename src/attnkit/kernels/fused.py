"""Tiles run by torch's fused CPU flash kernel, merged by their logsumexps.

The op ``aten::_scaled_dot_product_flash_attention_for_cpu`` returns (out, lse) and has
a backward that takes (out, lse) as inputs. Given the *final* out and lse of a row, the
backward of any subset of its keys yields exactly that subset's share of dq and the
subset's dk, dv (the FlashAttention-2 backward needs only P = exp(S - lse) and
delta = rowsum(dO * O)). So a long row can be cut into key segments, each run by the
fused op with at most a small mask tile, and merged (Rabe & Staats 2021, arXiv
2112.05682; FlashAttention-2, arXiv 2307.08691).

Scores here are affine in s: row scales are folded into q beforehand, biases become
additive mask tiles — separable ones (ALiBi off the diagonal) as a (H, 1, span) row of
per-key offsets that the op broadcasts for free, plus a per-query correction of the lse.
"""

from __future__ import annotations

import functools
import math
from typing import overload

import torch
import torch.nn.functional as F

from ..mods import AffineForm, Mask
from .machine import cpu_flags, has_bf16_units
from .plan import CAUSAL_SEG, FULL_SEG, Plan, QueryBlock, Segment
from .tiles import Tile, merge_partials, neg_inf_to_pos_inf, visible

Tensor = torch.Tensor

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@overload
def unit_last_stride(t: Tensor) -> Tensor: ...
@overload
def unit_last_stride(t: None) -> None: ...
def unit_last_stride(t: Tensor | None) -> Tensor | None:
    """``t`` itself when its last dimension is dense (stride 1), else a contiguous copy.

    The private flash op indexes the head dimension as if its stride were 1 and, unlike
    ``F.scaled_dot_product_attention``, never checks: ``x.mT.contiguous().mT`` or
    ``x[..., ::2]`` make it read memory it does not own. Other strides (transposed
    (B, N, H, D) layouts, expanded batch or head dimensions, storage offsets) it honours,
    so ordinary inputs pass through without a copy."""
    if t is None or t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def flash_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``aten::_scaled_dot_product_flash_attention_for_cpu`` with its inputs' layout made
    safe (``unit_last_stride``) and bfloat16 widened where the op cannot take it
    (``_bf16_widened``): (out, lse). Every caller of the op goes through here."""
    dtype = q.dtype
    q, k, v = (unit_last_stride(t) for t in _bf16_widened(q, k, v))
    out, lse = _flash(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out.to(dtype), lse


def _bf16_widened(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors as float32 when they are bfloat16 on a CPU whose bf16 units (AVX512-BF16,
    AMX) the op uses while ATen runs below AVX-512 (``ATEN_CPU_CAPABILITY=avx2``): it then
    packs tiles with code built for AVX-512 only and fails ("pack_vnni2 is only supported
    when avx512 is supported"). Widening is exact, and the op accumulates in float32 anyway."""
    if tensors[0].dtype != torch.bfloat16 or tensors[0].device.type != "cpu" or not _bf16_pack_mismatch():
        return tensors
    return tuple(t.float() for t in tensors)


@functools.cache
def _bf16_pack_mismatch() -> bool:
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    flags = cpu_flags()
    return flags is None or has_bf16_units(flags)  # unknown CPU: widening is always correct


def flash_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
):
    """The op's backward (dq, dk, dv), every tensor argument's layout made safe and
    bfloat16 widened where the op cannot take it (``_bf16_widened``)."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    grad_out, q, k, v, out = (unit_last_stride(t) for t in _bf16_widened(grad_out, q, k, v, out))
    grads = _flash_backward(grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return tuple(g.to(d) for g, d in zip(grads, dtypes))


class SegmentInputs:
    """What the op needs for one tile besides q, k, v."""

    __slots__ = ("attn_mask", "is_causal", "row_shift", "dead_rows")

    def __init__(self, attn_mask=None, is_causal=False, row_shift=None, dead_rows=None):
        self.attn_mask = attn_mask
        self.is_causal = is_causal
        self.row_shift = row_shift  # add to the op's lse: the part of a separable bias it never saw
        self.dead_rows = dead_rows  # rows that see no key of this tile (the op reports lse = 0)


def segment_inputs(
    mask: Mask | None,
    affine: AffineForm,
    batch_rows: Tensor,
    heads: int,
    q_start: int,
    block: QueryBlock,
    seg: Segment,
    mask_dtype: torch.dtype,
) -> SegmentInputs:
    has_bias = bool(affine.terms)
    if seg.kind == FULL_SEG and not has_bias:
        return SegmentInputs()
    if seg.kind == CAUSAL_SEG and not has_bias:
        return SegmentInputs(is_causal=True)
    tile = Tile.make(batch_rows, heads, q_start + block.q0, block.q1 - block.q0, seg.k0, seg.k1)
    if seg.kind in (FULL_SEG, CAUSAL_SEG) and affine.key_only:
        # A per-key offset row: the op broadcasts it over the queries and applies it with
        # its own causal mask (checked against the dense formula), so no dense tile is
        # formed. A -inf offset (keys hidden, as an ablation hides them) can hide a row
        # wholly: those rows are found from the offsets alone and reported dead.
        parts = affine.separable_bias(tile.b.view(-1), tile.h_flat, tile.q_flat, tile.k_flat, "left")
        assert parts is not None  # key-only biases separate on either side of the diagonal
        row, col = parts
        if not torch.compiler.is_compiling():  # compiled: the dense path (no data branch)
            per_key = col[None, :, None, :] if col.dim() == 2 else col[:, :, None, :]
            dead = None
            if bool(torch.isneginf(col).any()):
                rows = block.q1 - block.q0
                dead = _dead_causal(col, rows) if seg.kind == CAUSAL_SEG else _dead_separable(row, col)
            return SegmentInputs(attn_mask=per_key.to(mask_dtype), is_causal=seg.kind == CAUSAL_SEG, dead_rows=dead)
    if seg.kind == FULL_SEG:
        q_first, q_last = q_start + block.q0, q_start + block.q1 - 1
        side = "left" if seg.k1 - 1 <= q_first else "right" if seg.k0 >= q_last else None
        parts = affine.separable_bias(tile.b.view(-1), tile.h_flat, tile.q_flat, tile.k_flat, side) if side else None
        if parts is not None:
            row, col = parts
            per_key = col[None, :, None, :] if col.dim() == 2 else col[:, :, None, :]
            return SegmentInputs(attn_mask=per_key.to(mask_dtype), row_shift=row[None], dead_rows=_dead_separable(row, col))
        bias = affine.dense_bias(tile.b, tile.h, tile.q, tile.k)
        assert bias is not None  # has_bias: a full tile without one returned above
        attn_mask = bias.to(mask_dtype)
        return SegmentInputs(attn_mask=attn_mask, dead_rows=_dead_rows(attn_mask))
    vis = visible(mask, tile)
    if has_bias:
        bias = affine.dense_bias(tile.b, tile.h, tile.q, tile.k)
        assert bias is not None  # has_bias: at least one term
        values = bias.to(mask_dtype)
    else:
        values = torch.zeros((), dtype=mask_dtype)
    attn_mask = values.masked_fill(~vis, -math.inf)
    return SegmentInputs(attn_mask=attn_mask, dead_rows=_dead_rows(attn_mask))


def _dead_separable(row: Tensor, col: Tensor) -> Tensor | None:
    """``_dead_rows`` of the bias ``row[:, :, None] + col[:, None, :]`` without forming it."""
    dead = torch.isneginf(row) | torch.isneginf(col).all(dim=-1, keepdim=True)
    dead = dead if dead.dim() == 3 else dead[None]
    return dead if torch.compiler.is_compiling() or bool(dead.any()) else None  # compiled: no data branch


def _dead_causal(col: Tensor, rows: int) -> Tensor | None:
    """Rows of a causal segment (op row r sees the segment's keys 0..r) whose visible keys
    all have offset -inf: r below the first finite offset. ``col`` (H, span) or (B, H, span)."""
    finite = torch.isfinite(col)
    first = torch.where(finite.any(-1), finite.to(torch.uint8).argmax(-1), col.shape[-1])
    dead = torch.arange(rows) < first.unsqueeze(-1)
    dead = dead if dead.dim() == 3 else dead[None]
    return dead if bool(dead.any()) else None


def _dead_rows(attn_mask: Tensor) -> Tensor | None:
    """Rows of a tile whose every logit is -inf (hidden by the mask or by a bias of -inf),
    or None. The op reports lse = 0 for such a row, as if it held one key of logit 0: the
    caller must turn that into -inf, or merging tiles would add a phantom key."""
    dead = torch.isneginf(attn_mask).all(dim=-1)
    return dead if torch.compiler.is_compiling() or bool(dead.any()) else None  # compiled: no data branch


def fused_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    plan: Plan,
    mask: Mask | None,
    affine: AffineForm,
    q_start: int,
) -> tuple[Tensor, Tensor]:
    """(out, lse) with lse in float32 (float64 for float64 inputs)."""
    B, H, Nq, _ = q.shape
    mask_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32

    def run_block(bs, rows, block):
        qb = q[bs, :, block.q0 : block.q1]
        parts = []
        for seg in block.segments:
            inp = segment_inputs(mask, affine, rows, H, q_start, block, seg, mask_dtype)
            o, l = flash_forward(
                qb, k[bs, :, seg.k0 : seg.k1], v[bs, :, seg.k0 : seg.k1], 0.0, inp.is_causal, attn_mask=inp.attn_mask, scale=scale
            )
            l = l.to(lse_dtype)
            if inp.row_shift is not None:
                l = l + inp.row_shift.to(lse_dtype)
            if inp.dead_rows is not None:
                l = l.masked_fill(inp.dead_rows.expand_as(l), -math.inf)
            parts.append((o, l))
        return merge_partials(parts)

    blocks = plan.for_batch(0)
    if plan.shared and len(blocks) == 1 and blocks[0].segments and (blocks[0].q0, blocks[0].q1) == (0, Nq):
        o, l = run_block(slice(None), torch.arange(B), blocks[0])  # one block: no copies
        return o.to(q.dtype), l
    out = torch.zeros(B, H, Nq, v.shape[-1], dtype=q.dtype)
    lse = torch.full((B, H, Nq), -math.inf, dtype=lse_dtype)
    for bs, rows, blocks in plan.batch_slices(B):
        for block in blocks:
            if block.segments:
                o, l = run_block(bs, rows, block)
                out[bs, :, block.q0 : block.q1] = o.to(q.dtype)
                lse[bs, :, block.q0 : block.q1] = l
    return out, lse


def fused_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    plan: Plan,
    mask: Mask | None,
    affine: AffineForm,
    q_start: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv given the final out and lse of every row."""
    B, H, Nq, _ = q.shape
    mask_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc_dtype)
    dk = torch.zeros(k.shape, dtype=acc_dtype)
    dv = torch.zeros(v.shape, dtype=acc_dtype)
    lse_b = neg_inf_to_pos_inf(lse).to(acc_dtype)
    grad_out = grad_out.to(q.dtype).contiguous()
    for bs, rows, blocks in plan.batch_slices(B):
        for block in blocks:
            rs = (bs, slice(None), slice(block.q0, block.q1))
            qb, ob, gb, lb = q[rs], out[rs], grad_out[rs], lse_b[rs]
            for seg in block.segments:
                inp = segment_inputs(mask, affine, rows, H, q_start, block, seg, mask_dtype)
                l = lb if inp.row_shift is None else lb - inp.row_shift.to(lb.dtype)
                ks = (bs, slice(None), slice(seg.k0, seg.k1))
                gq, gk, gv = flash_backward(gb, qb, k[ks], v[ks], ob, l, 0.0, inp.is_causal, attn_mask=inp.attn_mask, scale=scale)
                dq[rs] += gq
                dk[ks] += gk
                dv[ks] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def backward_with_lse_grad(
    backward,
    grad_out: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *args,
    **kwargs,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of ``backward(grad_out, q, k, v, out, lse, *args, **kwargs)`` — a flash
    backward that takes only dO (``flash_backward``, ``fused_backward``) — when a gradient
    g also reaches lse (None: the plain call).

    The op derives delta = rowsum(dO * O) itself, and dS = P * (dP - delta). A gradient g
    on lse = log sum exp(S) adds P * g to dS, i.e. replaces delta by delta - g
    (FlashAttention-2, arXiv 2307.08691). So append a zero column to q, k, v (scores and
    dP unchanged), a column of ones to O and -g to dO: the op's delta becomes delta - g."""
    if grad_lse is None:
        return backward(grad_out, q, k, v, out, lse, *args, **kwargs)
    q, k, v = (F.pad(t, (0, 1)) for t in (q, k, v))
    out = torch.cat([out, torch.ones_like(out[..., :1])], dim=-1)
    grad_out = torch.cat([grad_out.to(out.dtype), -grad_lse.to(out.dtype).unsqueeze(-1)], dim=-1)
    dq, dk, dv = backward(grad_out, q, k, v, out, lse, *args, **kwargs)
    return dq[..., :-1], dk[..., :-1], dv[..., :-1]
