"""The online-softmax tile loop in plain PyTorch, for any score mod and any device.

FlashAttention-2's algorithm (Dao 2023, arXiv 2307.08691; memory-efficient attention,
Rabe & Staats 2021, arXiv 2112.05682): per query block, a running max ``m``, normaliser
``l`` and accumulator are updated tile by tile; nothing N x N is kept. The backward
recomputes each tile from the saved lse:  P = exp(S - lse),  dS = P * (dP - delta),
delta = rowsum(dO * O).  Score mods run on each tile under autograd, so their own
parameters (a relative-bias table, learnable slopes) get exact gradients.

On CPUs with native bf16 dot products the P V products run in bf16 (P is in [0, 1],
where bf16's relative rounding is harmless) while logits and softmax stay fp32; the
``matmul_dtype`` argument says which.
"""

from __future__ import annotations

import math

import torch

from ..mods import Mask, ScoreMod, band_of
from ..mods.scores import AbsBoost, Softcap
from . import cpu
from .engine import grouped, online_softmax_step, ungrouped
from .plan import FULL_SEG, Plan
from .tiles import Tile, add_pv_, apply_score_, neg_inf_to_pos_inf, visible

Tensor = torch.Tensor


def _tiles(block, tile_k: int):
    for seg in block.segments:
        for t0 in range(seg.k0, seg.k1, tile_k):
            yield seg, t0, min(t0 + tile_k, seg.k1)


def _modify(s: Tensor, score: ScoreMod | None, mask: Mask | None, seg_kind: str, tile: Tile, compute_dtype) -> Tensor:
    if score is not None:
        s = apply_score_(score, s, tile).to(compute_dtype)  # s is the tile's own tensor
    if seg_kind != FULL_SEG:
        s = s.masked_fill(~visible(mask, tile), -math.inf)
    return s


def _c_loop_mod(score: ScoreMod | None) -> tuple[float, AbsBoost | None] | None:
    """(softcap, abs boost) of a mod the C++ softmax loop runs itself: none (cap 0.0), a
    plain softcap, or PAI's abs boost; None for any other mod."""
    if score is None:
        return 0.0, None
    if len(score.atoms()) == 1:  # a chain of one mod (as the steering blocks build them)
        score = score.atoms()[0]
    if type(score) is Softcap:
        return score.cap, None
    if type(score) is AbsBoost:
        return 0.0, score
    return None


def c_loop_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Mask | None, score: ScoreMod | None, q_start: int
) -> tuple[Tensor, Tensor] | None:
    """(out, lse) of the whole call from the C++ softmax loop around torch's sgemm, for a
    band mask (none, causal, a window) with softcap, PAI's boost or no mod on float32 CPU
    tensors (not tracked by autograd); None when it cannot run the call."""
    band = band_of(mask)
    c_mod = _c_loop_mod(score)
    if band is None or c_mod is None or q.dtype != torch.float32 or q.device.type != "cpu":
        return None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # (B, N, H, D) layouts from transformers too
    if not cpu.fused_usable(q, k, v):
        return None
    cap, boost = c_mod
    table = None if boost is None else boost.table.to(torch.float32).contiguous()
    return cpu.softmax_attention(q, k, v, scale, q_start, band, cap, boost=table)


def tiled_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    plan: Plan,
    mask: Mask | None,
    score: ScoreMod | None,
    q_start: int,
    tile_k: int,
    matmul_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    if matmul_dtype == torch.float32:
        whole = c_loop_forward(q, k, v, scale, mask, score, q_start)
        if whole is not None:
            return whole
    B, H, Nq, _ = q.shape
    Hkv = k.shape[1]
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, H, Nq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, Nq), -math.inf, dtype=cd, device=q.device)
    for bs, rows, blocks in plan.batch_slices(B):
        for block in blocks:
            if not block.segments:
                continue
            bq = block.q1 - block.q0
            # Scale folded into q: one multiply per block instead of one per tile. The
            # logits are computed in cd even where P V runs in bf16: bf16 logits of size
            # ~1e3 are off by whole units (8-bit mantissa), which no fp32 softmax repairs,
            # and the backward (always cd) would recompute other probabilities than these.
            qg = grouped(q[bs, :, block.q0 : block.q1].to(cd) * scale, Hkv)
            bt = qg.shape[0]
            m = torch.full((bt, H, bq), -math.inf, dtype=cd, device=q.device)
            l = torch.zeros((bt, H, bq), dtype=cd, device=q.device)
            acc = torch.zeros((bt, H, bq, v.shape[-1]), dtype=cd, device=q.device)
            for seg, t0, t1 in _tiles(block, tile_k):
                tile = Tile.make(rows, H, q_start + block.q0, bq, t0, t1)
                kt = k[bs, :, t0:t1].to(cd)
                s = ungrouped(torch.matmul(qg, kt.transpose(-1, -2)), H).to(cd)
                s = _modify(s, score, mask, seg.kind, tile, cd)
                p, alpha, m, l = online_softmax_step(s, m, l, exp=torch.exp)
                acc.mul_(alpha.unsqueeze(-1))
                add_pv_(acc, p.to(matmul_dtype), v[bs, :, t0:t1].to(matmul_dtype))
            m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
            lse[bs, :, block.q0 : block.q1] = m_safe + torch.log(l)
            o = torch.where(l.unsqueeze(-1) > 0, acc / l.clamp(min=torch.finfo(cd).tiny).unsqueeze(-1), torch.zeros_like(acc))
            out[bs, :, block.q0 : block.q1] = o.to(q.dtype)
    return out, lse


def tiled_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    delta: Tensor,
    scale: float,
    plan: Plan,
    mask: Mask | None,
    score: ScoreMod | None,
    params: list[Tensor],
    q_start: int,
    tile_k: int,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:
    """dq, dk, dv and the gradients of ``params`` (the score mod's tensors needing grad).

    ``delta`` is rowsum(dO * O) minus any gradient reaching lse, shape (B, H, Nq).
    Runs in float32 (float64 for float64 inputs) whatever the input dtype.
    """
    B, H, Nq, _ = q.shape
    Hkv = k.shape[1]
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=cd, device=q.device)
    dk = torch.zeros(k.shape, dtype=cd, device=q.device)
    dv = torch.zeros(v.shape, dtype=cd, device=q.device)
    dparams: list[Tensor | None] = [None] * len(params)
    lse_b = neg_inf_to_pos_inf(lse).to(cd)
    # A plain softcap differentiates in closed form (d/ds cap tanh(s / cap) = 1 - (z / cap)^2
    # for z the capped logit): no autograd.grad per tile, which torch.compile cannot trace.
    cap = score.cap if type(score) is Softcap and not params else None
    for bs, rows, blocks in plan.batch_slices(B):
        for block in blocks:
            bq = block.q1 - block.q0
            rs = (bs, slice(None), slice(block.q0, block.q1))
            qg = grouped(q[rs].to(cd), Hkv)
            gog = grouped(grad_out[rs].to(cd), Hkv)
            lb, db = lse_b[rs].unsqueeze(-1), delta[rs].to(cd).unsqueeze(-1)
            dq_acc = torch.zeros_like(qg)
            for seg, t0, t1 in _tiles(block, tile_k):
                tile = Tile.make(rows, H, q_start + block.q0, bq, t0, t1)
                ks = (bs, slice(None), slice(t0, t1))
                kt, vt = k[ks].to(cd), v[ks].to(cd)
                s_raw = ungrouped(torch.matmul(qg, kt.transpose(-1, -2)), H) * scale
                if score is not None and cap is None:
                    with torch.enable_grad():
                        s_in = s_raw.detach().requires_grad_(True)
                        s = _modify(s_in, score, mask, seg.kind, tile, cd)
                else:
                    s = _modify(s_raw, score, mask, seg.kind, tile, cd)
                p = torch.exp(s.detach() - lb)
                dp = ungrouped(torch.matmul(gog, vt.transpose(-1, -2)), H)
                ds = p * (dp - db)
                dv[ks] += torch.matmul(grouped(p, Hkv).transpose(-1, -2), gog)
                if cap is not None:
                    t = s.detach() / cap  # -inf where hidden, where p (and so ds) is 0
                    ds = ds * torch.where(torch.isfinite(t), 1 - t * t, torch.zeros_like(t))
                elif score is not None:
                    wanted = [s_in] + params
                    grads = torch.autograd.grad(s, wanted, ds, allow_unused=True)
                    ds = grads[0]
                    for i, g in enumerate(grads[1:]):
                        if g is not None:
                            before = dparams[i]
                            dparams[i] = g if before is None else before + g
                dsg = grouped(ds, Hkv)
                dq_acc += torch.matmul(dsg, kt) * scale
                dk[ks] += torch.matmul(dsg.transpose(-1, -2), qg) * scale
            dq[rs] = ungrouped(dq_acc, H)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dparams
