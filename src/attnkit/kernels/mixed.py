"""Softmax with a learned transform of the logits before it and head mixing after it.

For mechanisms whose weights are ``P~ = M softmax(T(S))``: ``T`` acts on a tile of logits
(mixing heads, as in talking heads, or a 2-D convolution over queries and keys, as in
multi-token attention, which needs a *halo* of neighbouring logits around the tile), and
``M`` (Hq x Hq) mixes the normalised maps across heads. Mixing after the softmax needs
each row's final lse first, so a block of rows takes two passes over its key tiles: the
first finds the lse of every head, the second forms ``M P`` and multiplies the values.

Backward: with ``dP = M^T (dO V^T)``, ``dZ = P * (dP - delta~)`` where ``delta~_h =
sum_j P_hj dP_hj`` is no longer rowsum(dO * O) once heads are mixed, so it takes its own
pass first. ``T``'s gradient (and its parameters') comes from autograd on each tile,
from the halo-extended raw logits, whose gradient is scattered back into dq and dk.

Where ``T`` is one the C loop knows (``CTransform``: a depthwise convolution or a head
mixing) and the mask is a band without a score mod, the whole call, forward and
backward, runs in kernels/cpu/loops_mixed.cpp instead (the same two passes around sgemm);
the block loop here is the general path and the reference for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from . import cpu
from .engine import (
    Block,
    EngineTiling,
    GradBlock,
    OnlineSoftmax,
    Problem,
    TileKernel,
    fast_exp,
    fast_exp_,
    fused_band,
    grouped,
    safe_lse,
    softmax_backward_terms,
    ungrouped,
)
from .plan import FULL_SEG
from .tiles import Tile, visible

Tensor = torch.Tensor


def _dead(lse: Tensor) -> Tensor | None:
    """(Bt, H, BQ, 1) rows that see no key, or None when there are none in the block."""
    dead = torch.isneginf(lse)
    return dead.unsqueeze(-1) if torch.compiler.is_compiling() or bool(dead.any()) else None  # compiled: no data branch


def _zero_dead(p: Tensor, dead: Tensor | None) -> Tensor:
    # the fast exp leaves e^-87 where a row has nothing; mixing must not spread it
    return p if dead is None else p.masked_fill_(dead, 0.0)


def mix_heads(m: Tensor, x: Tensor, row_scale: Tensor | None = None) -> Tensor:
    """``out[:, g] = sum_h m[g, h] x[:, h]`` for x (Bt, H, ...); with ``row_scale`` (Bt, H, R)
    for x (Bt, H, R, C), each row of x is scaled first (fused in one pass where possible).
    Differentiable in m and x."""
    m = m.to(x.dtype)
    if row_scale is None and torch.is_grad_enabled() and (m.requires_grad or x.requires_grad):
        return _MixHeads.apply(m, x)
    if _cpu_mix(m, x, row_scale):
        return cpu.mix_heads(m.contiguous(), x, row_scale)
    if row_scale is not None:
        x = x * row_scale.unsqueeze(-1)
    bt, h = x.shape[:2]
    return torch.matmul(m, x.reshape(bt, h, -1)).reshape(x.shape)


def _cpu_mix(m: Tensor, x: Tensor, row_scale: Tensor | None) -> bool:
    return x.dim() == 4 and x.shape[1] <= cpu.MAX_MIX_HEADS and cpu.usable(m, x, *(() if row_scale is None else (row_scale,)))


class _MixHeads(torch.autograd.Function):
    """Head mixing whose product and input gradient (``M^T dOut``, again a mix) run in the
    C loop, where BLAS is slow for an inner dimension of a few heads; ``dM`` is a plain
    reduction over positions."""

    @staticmethod
    def forward(ctx, m, x):
        ctx.save_for_backward(m, x)
        return mix_heads(m, x)

    @staticmethod
    def backward(ctx, grad):
        m, x = ctx.saved_tensors
        grad = grad.contiguous()
        dx = mix_heads(m.t(), grad) if ctx.needs_input_grad[1] else None
        dm = None
        if ctx.needs_input_grad[0]:
            bt, g, h = x.shape[0], m.shape[0], m.shape[1]
            dm = torch.matmul(grad.reshape(bt, g, -1), x.reshape(bt, h, -1).transpose(1, 2)).sum(0)
        return dm, dx


@dataclass
class CTransform:
    """The transform as the C loop (kernels/cpu/loops_mixed.cpp) runs it, for band masks without
    a score mod: a depthwise key-query convolution ``conv`` (H, cq, ck), a head mixing of
    the logits ``pre`` (H, H), or neither; the mixings are block-diagonal in groups of
    ``group`` heads. ``transform_params`` must be [conv], [pre] or []."""

    group: int
    conv: Tensor | None = None
    pre: Tensor | None = None


class MixedSoftmaxKernel(TileKernel):
    """``transform``: (Bt, H, BQ + q_halo, span + k_before + k_after) logits (hidden pairs
    and positions outside the call set to 0) -> (Bt, H, BQ, span); differentiable.
    ``transform_params``: the tensors it reads that need gradients. ``mix``: (H, H) or None.
    ``c_transform``: the same transform for the whole-call C loop, or None.
    """

    stats = ("lse",)
    # a block's tiles are kept between the two passes: smaller blocks, less memory
    tiling = EngineTiling(q_block=128, k_block=128, tile_k=512)

    def __init__(
        self,
        transform: Callable[[Tensor], Tensor],
        transform_params: list[Tensor],
        mix: Tensor | None,
        halo: tuple[int, int, int] = (0, 0, 0),
        c_transform: CTransform | None = None,
    ):
        self.transform = transform
        self.c_transform = c_transform
        self.transform_params = list(transform_params)
        self.mix = mix
        self.halo = halo
        # without mixing the lse is the softmax's own, and its gradient is handled
        self.differentiable_stats = ("lse",) if mix is None else ()

    def params(self) -> list[Tensor]:
        return self.transform_params + ([self.mix] if self.mix is not None else [])

    # ------------------------------------------------------------------ whole call in C

    def _c_weights(self, ct: CTransform) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """(conv, pre, post) as the C loop reads them: detached, contiguous float32."""
        conv, pre, post = (None if t is None else t.detach().float().contiguous() for t in (ct.conv, ct.pre, self.mix))
        return conv, pre, post

    def forward_fused(self, prob: Problem):
        ct = self.c_transform
        band = None if ct is None else fused_band(prob)
        if ct is None or band is None:
            return None
        out, lse = cpu.mixed_softmax_attention(prob.q, prob.k, prob.v, *self._c_weights(ct), ct.group, prob.q_start, band)
        return out, {"lse": lse}

    def backward_fused(self, prob: Problem, grad_out: Tensor, stats):
        return self.backward_fused_with_stats(prob, grad_out, stats, {})

    def backward_fused_with_stats(self, prob: Problem, grad_out: Tensor, stats, grad_stats):
        ct = self.c_transform
        band = None if ct is None else fused_band(prob)
        if ct is None or band is None or set(grad_stats) - {"lse"}:
            return None
        grad_lse = grad_stats.get("lse")
        dq, dk, dv, dconv, dpre, dpost = cpu.mixed_softmax_attention_backward(
            grad_out.contiguous(),
            prob.q,
            prob.k,
            prob.v,
            stats["lse"].contiguous(),
            *self._c_weights(ct),
            ct.group,
            prob.q_start,
            band,
            None if grad_lse is None else grad_lse.float(),
        )
        transform_grads = [g for g in (dconv, dpre) if g is not None]
        return dq.mul_(prob.scale), dk, dv, *transform_grads, *([dpost] if self.mix is not None else [])  # params()' order

    # ------------------------------------------------------------------ logits

    def _extended(self, blk: Block, kind: str, k0: int, k1: int, track: bool):
        """(s_ext, s_raw | None, (r0, c0, c1)): the halo-extended, masked-to-zero logits."""
        prob = blk.prob
        q_halo, k_before, k_after = self.halo
        r0 = max(0, blk.q0 - q_halo)
        c0, c1 = max(0, k0 - k_before), min(prob.req.k_len, k1 + k_after)
        qg = grouped(prob.q[blk.bs, :, r0 : blk.q1], prob.kv_heads)
        s_raw = ungrouped(torch.matmul(qg, prob.k[blk.bs, :, c0:c1].transpose(-1, -2)), prob.heads)
        with torch.set_grad_enabled(track):
            s = s_raw.requires_grad_(True) if track else s_raw
            needs_mask = prob.mask is not None and (kind != FULL_SEG or self.halo != (0, 0, 0))
            if prob.score is not None or needs_mask:
                tile = Tile.make(blk.rows, prob.heads, prob.q_start + r0, blk.q1 - r0, c0, c1)
                if prob.score is not None:
                    s = prob.score(s, tile.b, tile.h, tile.q, tile.k).to(prob.cd)
                if needs_mask:
                    s = s.masked_fill(~visible(prob.mask, tile), 0.0)
            pad = (k_before - (k0 - c0), k_after - (c1 - k1), q_halo - (blk.q0 - r0), 0)
            if any(pad):
                s = F.pad(s, pad)
        return s, (s_raw if track else None), (r0, c0, c1)

    def _logits(self, blk: Block, kind: str, k0: int, k1: int, track: bool = False):
        s_ext, s_raw, where = self._extended(blk, kind, k0, k1, track)
        with torch.set_grad_enabled(track):
            z = self.transform(s_ext)
            if kind != FULL_SEG:
                vis = blk.visible(kind, k0, k1)
                assert vis is not None  # None only for full tiles
                z = z.masked_fill(~vis, -math.inf)
        return z, s_raw, where

    # ------------------------------------------------------------------ forward

    def forward_block(self, blk: Block):
        dv = blk.prob.v.shape[-1]
        if self.mix is None:
            acc = OnlineSoftmax(blk, dv)
            for kind, k0, k1 in blk.tiles():
                acc.add(blk, self._logits(blk, kind, k0, k1)[0], k0, k1)
            out, lse = acc.result()
            return out, {"lse": lse}
        # Mixing needs every head's final lse: keep this block's logits (block x keys,
        # linear in N) from the first pass rather than computing them twice.
        tiles = [(k0, k1, self._logits(blk, kind, k0, k1)[0]) for kind, k0, k1 in blk.tiles()]
        lse, scales = _softmax_tiles_([z for _, _, z in tiles])
        out = blk.zeros(dv)
        mix = self.mix.detach()
        for (k0, k1, e), scale in zip(tiles, scales):
            blk.pv_add_(out, mix_heads(mix, e, scale), k0, k1)  # normalise and mix in one pass
        return out, {"lse": lse}

    def observe_block(self, blk: Block, stats):
        lse_b, dead = safe_lse(stats["lse"]), _dead(stats["lse"])
        mix = None if self.mix is None else self.mix.detach()
        for kind, k0, k1 in blk.tiles():
            z = self._logits(blk, kind, k0, k1)[0]
            p = _zero_dead(torch.exp(z - lse_b), dead)
            yield k0, k1, (p if mix is None else mix_heads(mix, p)), z

    # ------------------------------------------------------------------ backward

    def backward_block(self, blk: GradBlock, stats, delta, grad_stats):
        lse_b, dead = safe_lse(stats["lse"]), _dead(stats["lse"])
        mix = None if self.mix is None else self.mix.detach()
        grads: list[Tensor | None] = [None] * len(self.params())

        def tile_grads(k0: int, k1: int, kind: str) -> tuple[Tensor, Tensor | None, tuple[int, int, int], Tensor, Tensor, Tensor]:
            z, s_raw, where = self._logits(blk, kind, k0, k1, track=True)
            p = _zero_dead(fast_exp(z.detach() - lse_b), dead)
            dw = blk.dw(k0, k1)
            return z, s_raw, where, p, dw, (dw if mix is None else mix_heads(mix.T, dw))

        if mix is None:  # delta is rowsum(dO * O): one streaming pass
            d = softmax_backward_terms(stats, delta, grad_stats)[1]
            for kind, k0, k1 in blk.tiles():
                self._tile_backward(blk, k0, k1, *tile_grads(k0, k1, kind), d, None, grads)
            return grads
        # delta~_h = sum_j P_hj (M^T dW)_hj needs the whole row first: keep the block's tiles
        tiles = [(k0, k1, *tile_grads(k0, k1, kind)) for kind, k0, k1 in blk.tiles()]
        d_mixed = sum((p * dp).sum(dim=-1, keepdim=True) for *_, p, _, dp in tiles)
        for tile in tiles:
            self._tile_backward(blk, *tile, d_mixed, mix, grads)
        return grads

    def _tile_backward(self, blk: GradBlock, k0, k1, z, s_raw, where, p, dw, dp, d, mix, grads) -> None:
        n_t = len(self.transform_params)
        if mix is not None:
            dmix = torch.matmul(dw.transpose(0, 1).reshape(dw.shape[1], -1), p.transpose(0, 1).reshape(p.shape[1], -1).T)
            grads[n_t] = dmix if grads[n_t] is None else grads[n_t] + dmix
        dz = p * (dp - d)
        learned = [i for i, t in enumerate(self.transform_params) if t.requires_grad]
        wanted = [s_raw] + [self.transform_params[i] for i in learned] + blk.prob.score_params
        got = torch.autograd.grad(z, wanted, dz, allow_unused=True)
        for i, g in zip(learned, got[1 : 1 + len(learned)]):
            if g is not None:
                grads[i] = g if grads[i] is None else grads[i] + g
        blk.grads.add_params(got[1 + len(learned) :])
        blk.add(k0, k1, None, p if mix is None else mix_heads(mix, p))
        self._scatter_logit_grad(blk, got[0], *where)

    @staticmethod
    def _scatter_logit_grad(blk: GradBlock, ds: Tensor, r0: int, c0: int, c1: int) -> None:
        """dq and dk of the halo-extended logits (rows r0.., keys c0..c1) of one tile."""
        prob, g = blk.prob, blk.grads
        dsg = grouped(ds, prob.kv_heads)
        ks = (blk.bs, slice(None), slice(c0, c1))
        g.dq[blk.bs, :, r0 : blk.q1] += ungrouped(torch.matmul(dsg, prob.k[ks]), prob.heads) * prob.scale
        g.dk[ks] += torch.matmul(dsg.transpose(-1, -2), grouped(prob.q[blk.bs, :, r0 : blk.q1], prob.kv_heads))


def _softmax_tiles_(tiles: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """Turn a block's tiles of logits into exponentials in place; return each row's lse
    (-inf for rows that see no key) and, per tile, the row scales that make them the
    softmax weights (0 for rows that see no key). One exp per logit; the normalisation is
    left to the pass that mixes the heads. The C path runs the online softmax tile by tile
    (e^(z - running max), no separate max pass) and folds e^(running - final max) into the
    scales."""
    if cpu.usable(*tiles):
        m = torch.full(tiles[0].shape[:-1], -math.inf)
        l = torch.zeros_like(m)
        running = []
        for z in tiles:
            cpu.online_softmax_step_(z, m, l)
            running.append(m.clone())
        dead = torch.isneginf(m)
        inv = l.reciprocal().masked_fill_(dead, 0.0)
        scales = [torch.exp(r - m).mul_(inv).masked_fill_(dead, 0.0) for r in running]
        return torch.where(dead, m, m + torch.log(l)), scales
    m = tiles[0].amax(dim=-1)
    for z in tiles[1:]:
        m = torch.maximum(m, z.amax(dim=-1))
    dead = torch.isneginf(m)  # decided by the max: the fast exp never gives exact zeros
    m_safe = torch.where(dead, torch.zeros_like(m), m).unsqueeze(-1)
    l = cast(Tensor, sum(fast_exp_(z.sub_(m_safe)).sum(dim=-1) for z in tiles))  # >= 1 where a row is live; tiles: not empty
    inv = l.reciprocal().masked_fill_(dead, 0.0)
    return torch.where(dead, m, m_safe.squeeze(-1) + torch.log(l)), [inv] * len(tiles)
