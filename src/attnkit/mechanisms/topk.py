"""Sparse softmax attention: top-k per query row, and Top-θ calibrated thresholds.

**Top-k** keeps the k largest logits of every row and takes the softmax over them (as in
x-transformers' ``sparse_topk``; Gupta et al. 2021, arXiv 2106.06899, "Memory-efficient
Transformers via Top-k Attention"). The chunked path computes one block of rows at a time
against all its visible keys (O(block x Nk) memory, linear in N), selects the k keys, and
multiplies only their values: the backward needs just the saved (row, k) indices and
weights, so it never recomputes Q K^T.

**Top-θ** (Berestizshevsky, Andri, Cavigelli 2025, "Top-Theta Attention: Sparsifying
Transformers by Compensated Thresholding", arXiv 2502.08363) replaces the per-row top-k
search by static thresholds, one per head (or per head and query position), calibrated
on sample queries/keys so that a row keeps about k elements: ``s > theta`` is a pointwise
test, so it tiles like any mask. Its compensations: the softmax denominator also counts
each pruned element as if its logit were the threshold (an upper bound, scaled by
``sdc_scale``), and the mass this leaves unassigned goes to the mean of the row's visible
values ("V-mean compensation").

Both report the fraction of visible (query, key) pairs they kept (``kept_fraction``, and
per head ``kept_per_head``) after every call.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import torch

from ..kernels import chunked_attention, cpu, empty_result, make_request
from ..kernels.engine import (
    Block,
    EngineTiling,
    OnlineSoftmax,
    Problem,
    SoftmaxKernel,
    dense_softmax,
    kernel_tiles,
    no_grad_steps,
    run_kernel,
    safe_lse,
)
from ..kernels.mechanism_call import dense_logits, dense_values, request
from ..kernels.plan import FULL_SEG
from ..kernels.request import Request
from ..mods.masks import Causal, band_of
from ..observe import AttentionTile, CallInfo, feed
from .base import Mechanism, register

Tensor = torch.Tensor

# 128 query rows a block: fewer, larger logit matmuls than 64 (~10% faster forward at 4k
# keys); a block's logits, Hq x 128 x Nk floats, still grow only linearly in N
_ROW_TILING = EngineTiling(q_block=128, k_block=128, tile_k=4096)


def _spans(blk: Block) -> list[tuple[int, int, list[tuple[str, int, int]]]]:
    """The block's key tiles merged into runs of adjacent ones, (k0, k1, tiles): the whole
    visible row of a causal block is one run, so one matmul, no concatenation."""
    runs: list[tuple[int, int, list]] = []
    for kind, k0, k1 in blk.tiles():
        if runs and runs[-1][1] == k0:
            runs[-1] = (runs[-1][0], k1, runs[-1][2] + [(kind, k0, k1)])
        else:
            runs.append((k0, k1, [(kind, k0, k1)]))
    return runs


def _row_logits(blk: Block) -> tuple[Tensor, Tensor, Tensor]:
    """All visible logits of a block's rows side by side, (Bt, Hq, BQ, keys), the key
    positions of the columns, and how many of each row's logits are visible (> -inf)."""
    parts, visible, spans = [], blk.zeros(), _spans(blk)
    for r0, r1, tiles in spans:
        s = blk.raw_logits(r0, r1)
        for kind, k0, k1 in tiles:
            part = s[..., k0 - r0 : k1 - r0]
            modified = blk.modify(part, kind, k0, k1)
            if modified is not part:  # a score mod returns a new tensor
                part.copy_(modified)
            # only tiles the plan marks partial hold masked pairs: count those, never a full row
            visible += (k1 - k0) if kind == FULL_SEG else (part > -math.inf).sum(dim=-1)
        parts.append(s)
    keys = torch.cat([torch.arange(r0, r1) for r0, r1, _ in spans])
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)), keys, visible


# top-k by groups: each round shrinks a row GROUP-fold, down to rows of _GROUP_ROWS * k
_GROUP, _GROUP_ROWS = 4, 8


def _top_columns(s: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, columns) of a valid top-k set of every row of s (k <= s.shape[-1]), unsorted.

    torch.topk costs ~10 ns per element on CPU, several times the matmul that made the
    logits. So the row is cut into groups (columns j, j + g, j + 2g, ...: the group maxima
    are one vectorised reduction), the k groups with the largest maxima are found the same
    way, recursively, and topk runs on their k * GROUP columns only. Exact: any column
    outside those groups is <= its group's maximum <= the k-th largest of the k chosen
    maxima, which are k distinct columns, so it can only tie with the k-th value.
    """
    if k > 0 and cpu.usable(s):
        return cpu.topk_rows(s, k)  # the same bound in C: a bar from group maxima, one vectorised pass
    n = s.shape[-1]
    g = n // _GROUP
    if n < _GROUP_ROWS * k or g < k:
        return s.topk(k, dim=-1, sorted=False)
    body = s[..., : g * _GROUP].unflatten(-1, (_GROUP, g))
    _, groups = _top_columns(body.amax(dim=-2), k)
    cols = (torch.arange(_GROUP).unsqueeze(-1) * g + groups.unsqueeze(-2)).flatten(-2)
    if g * _GROUP < n:  # the last n mod GROUP columns belong to no group: always candidates
        cols = torch.cat([cols, torch.arange(g * _GROUP, n).expand(*cols.shape[:-1], -1)], dim=-1)
    values, picked = s.gather(-1, cols).topk(k, dim=-1, sorted=False)
    return values, cols.gather(-1, picked)


def _flat_rows(blk: Block, keys: Tensor) -> Tensor:
    """Row numbers of (batch row, key head of each query head, key) in a (B * Hkv * Nk, X) view."""
    prob = blk.prob
    kv_head = (torch.arange(prob.heads) // (prob.heads // prob.kv_heads)).view(1, -1, 1, 1)
    return (blk.rows.view(-1, 1, 1, 1) * prob.kv_heads + kv_head) * prob.req.k_len + keys


def _gather(t: Tensor, blk: Block, keys: Tensor) -> Tensor:
    """Rows ``keys`` (Bt, Hq, BQ, k) of a contiguous (B, Hkv, Nk, X) tensor: (Bt, Hq, BQ, k, X)."""
    rows = _flat_rows(blk, keys)
    return torch.index_select(t.view(-1, t.shape[-1]), 0, rows.reshape(-1)).view(*rows.shape, t.shape[-1])


def _sparse_pv(p: Tensor, rows: Tensor, t: Tensor) -> Tensor:
    """``sum_j p[..., j] * t_flat[rows[..., j]]`` for a contiguous (B, Hkv, Nk, X) tensor t,
    (..., X): P as a CSR matrix (k weights per row) times t. The sparse product reads each
    chosen row of t once, in C: ~3x faster than gathering the (row, k, X) rows into a new
    tensor and multiplying them one query at a time, and far cheaper than a dense P V."""
    width = p.shape[-1]
    n_rows = p.numel() // width
    t2 = t.view(-1, t.shape[-1])
    crow = torch.arange(0, n_rows * width + 1, width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta": this product is tested here
        a = torch.sparse_csr_tensor(crow, rows.reshape(-1), p.reshape(-1), size=(n_rows, t2.shape[0]), check_invariants=False)
    return (a @ t2).view(*p.shape[:-1], t.shape[-1])


def _kept_report(mech, kept: Tensor, visible: Tensor) -> None:
    kept, visible = kept.detach().double(), visible.detach().double()
    mech.kept_fraction = float(kept.sum() / visible.sum().clamp(min=1))
    mech.kept_per_head = kept.sum(dim=(0, 2)) / visible.sum(dim=(0, 2)).clamp(min=1)


# --------------------------------------------------------------------------- top-k


def _topk_blocks(prob: Problem, width: int):
    """The forward block by block in PyTorch (any mask, score mod or dtype):
    (out, lse, chosen, weights, kept, visible)."""
    B, H, Nq, Dv = prob.shape
    cd = prob.cd
    out = torch.zeros(B, H, Nq, Dv, dtype=cd)
    lse = torch.full((B, H, Nq), -math.inf, dtype=cd)
    chosen = torch.zeros(B, H, Nq, width, dtype=torch.long)
    weights = torch.zeros(B, H, Nq, width, dtype=cd)
    kept = torch.zeros(B, H, Nq)
    visible = torch.zeros(B, H, Nq)
    for blk in prob.blocks():
        rs = blk.rows_slice
        s, keys, visible[rs] = _row_logits(blk)
        values, idx = _top_columns(s, min(width, s.shape[-1]))
        p, lse[rs] = dense_softmax(values)
        pos = keys[idx]
        out[rs] = _sparse_pv(p, _flat_rows(blk, pos), prob.v)
        n = idx.shape[-1]
        chosen[rs][..., :n] = pos
        weights[rs][..., :n] = p
        kept[rs] = (values > -math.inf).sum(dim=-1).float()
    return out, lse, chosen, weights, kept, visible


class _TopKAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k: int, req: Request, n_score: int, q, kk, v, *score_params):
        prob = Problem(req, _ROW_TILING, list(score_params))
        width = min(k, req.k_len)
        band = band_of(req.mask)
        if req.score is None and band is not None and cpu.fused_usable(prob.q, prob.k, prob.v):
            # the whole forward in C: logits by sgemm, selection, softmax and the k value rows
            out, lse, chosen, weights, kept, visible = cpu.topk_attention(prob.q, prob.k, prob.v, req.q_start, band, width)
        else:
            out, lse, chosen, weights, kept, visible = _topk_blocks(prob, width)
        ctx.req, ctx.n_score, ctx.score_params = req, n_score, score_params
        ctx.save_for_backward(chosen, weights, out)
        ctx.mark_non_differentiable(chosen, weights, kept, visible)
        return out.to(req.q.dtype), lse, chosen, weights, kept, visible

    @staticmethod
    def backward(ctx, grad_out, grad_lse, *_):
        req = ctx.req
        chosen, weights, out = ctx.saved_tensors
        prob = Problem(req, _ROW_TILING, list(ctx.score_params))
        cd = prob.cd
        go = torch.zeros_like(out) if grad_out is None else grad_out.to(cd)
        delta = (go * out).sum(-1)
        if grad_lse is not None:
            delta = delta - grad_lse.to(cd)
        dq = torch.zeros(req.q.shape, dtype=cd)
        dk = torch.zeros(req.k.shape, dtype=cd)
        dv = torch.zeros(req.v.shape, dtype=cd)
        dparams = [None] * len(ctx.score_params)
        for blk in prob.blocks():
            rs = blk.rows_slice
            pos, p, g = chosen[rs], weights[rs], go[rs]
            k_sel, v_sel = _gather(prob.k, blk, pos), _gather(prob.v, blk, pos)
            dp = torch.matmul(v_sel, g.unsqueeze(-1)).squeeze(-1)
            ds = p * (dp - delta[rs].unsqueeze(-1))
            qs = prob.q[rs]  # scale * q
            if prob.track_score:
                with torch.enable_grad():
                    s_raw = torch.matmul(k_sel, qs.unsqueeze(-1)).squeeze(-1).requires_grad_(True)
                    tile = blk.tile(0, 1)
                    s = prob.score(s_raw, tile.b, tile.h, tile.q, pos)
                    got = torch.autograd.grad(s, [s_raw, *prob.score_params], ds, allow_unused=True)
                ds = got[0]
                for i, gp in enumerate(got[1:]):
                    if gp is not None:
                        dparams[i] = gp if dparams[i] is None else dparams[i] + gp
            rows = _flat_rows(blk, pos).reshape(-1)
            dq[rs] += torch.matmul(ds.unsqueeze(-2), k_sel).squeeze(-2) * prob.scale
            dk.view(-1, dk.shape[-1]).index_add_(0, rows, (ds.unsqueeze(-1) * qs.unsqueeze(-2)).reshape(rows.numel(), -1))
            dv.view(-1, dv.shape[-1]).index_add_(0, rows, (p.unsqueeze(-1) * g.unsqueeze(-2)).reshape(rows.numel(), -1))
        dparams = [None if d is None else d.to(t.dtype) for d, t in zip(dparams, ctx.score_params)]
        return (None, None, None, dq.to(req.q.dtype), dk.to(req.k.dtype), dv.to(req.v.dtype), *dparams)


@register("topk")
class TopK(Mechanism):
    """Softmax over the k largest logits of every row (ties broken by ``torch.topk``)."""

    paper = "arXiv:2106.06899"

    def __init__(self, k: int = 64):
        super().__init__()
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"topk(k): expected an int >= 1 (logits kept per row), got {k!r}")
        self.k = k
        self.kept_fraction: float | None = None
        self.kept_per_head: Tensor | None = None

    def extra_repr(self) -> str:
        return super().extra_repr() + f", k={self.k}"

    def fast_path(self, req, backend):
        """(out, lse) and, for observers, the kept keys and their weights of every row."""
        if req.q_len == 0 or req.k_len == 0:
            return empty_result(req)
        params = [p for p in (req.score.parameters() if req.score is not None else []) if p.requires_grad]
        out, lse, chosen, weights, kept, visible = _TopKAttention.apply(self.k, req, len(params), req.q, req.k, req.v, *params)
        _kept_report(self, kept, visible)
        return out, lse, (chosen, weights)

    def observe_call(self, req, lse, observers, layer, found=None):
        """The fast path's kept weights; the reference and an empty call feed no observers."""
        if found is None:
            return
        chosen, weights = found
        call = _call_info(req, layer, self.name)
        feed(observers, call, no_grad_steps(_topk_tiles(req, chosen, weights, call)))

    def reference(self, q, k, v, *, mask=None, score=None, scale=None, return_lse=False, **_):
        """Keep ``topk(s, k)`` of every row (masked logits are -inf and never win over a
        visible one), softmax over the kept ones."""
        req = request(q, k, v, mask=mask, score=score, scale=scale)
        s = dense_logits(req)
        _, idx = s.topk(min(self.k, req.k_len), dim=-1)
        keep = torch.zeros_like(s, dtype=torch.bool).scatter(-1, idx, True)
        p, lse = dense_softmax(s.masked_fill(~keep, -math.inf))
        kept = (keep & ~torch.isneginf(s)).sum(-1)
        _kept_report(self, kept, (~torch.isneginf(s)).sum(-1))
        out = torch.matmul(p, dense_values(req)).to(q.dtype)
        return (out, lse) if return_lse else out


def _call_info(req: Request, layer, name: str) -> CallInfo:
    return CallInfo(req.batch, req.heads, req.q_len, req.k_len, req.q_start, layer, name)


def _topk_tiles(req: Request, chosen: Tensor, weights: Tensor, call: CallInfo):
    """The kept weights scattered back onto the tiles of the plan."""
    prob = Problem(req, _ROW_TILING)
    for blk in prob.blocks():
        rs = blk.rows_slice
        pos, p = chosen[rs], weights[rs].to(prob.cd)
        for kind, k0, k1 in blk.tiles():
            inside = (pos >= k0) & (pos < k1)
            w = blk.zeros(k1 - k0).scatter_add_(-1, (pos - k0).clamp(0, k1 - k0 - 1), p * inside)
            yield AttentionTile(call, blk.rows, blk.q_positions, torch.arange(k0, k1), w, blk.logits(kind, k0, k1))


# --------------------------------------------------------------------------- Top-θ


def _thresholds_for(theta: Tensor, h: Tensor, q_pos: Tensor) -> Tensor:
    """theta[h] or theta[h, query position], broadcastable against (.., H, BQ, span)."""
    return theta[h] if theta.dim() == 1 else theta[h, q_pos]


class TopThetaKernel(SoftmaxKernel):
    """Softmax over the logits above the threshold; also counts kept and visible pairs."""

    stats = ("lse", "kept", "visible")

    def __init__(self, theta: Tensor):
        self.theta = theta

    def _threshold(self, blk: Block) -> Tensor:
        prob = blk.prob
        h = torch.arange(prob.heads).view(1, -1, 1, 1)
        q_pos = blk.q_positions.view(1, 1, -1, 1)
        return _thresholds_for(self.theta.to(prob.cd), h, q_pos)

    def transform(self, blk: Block, s, kind, k0, k1):
        return s.masked_fill(s <= self._threshold(blk), -math.inf)

    def forward_block(self, blk: Block):
        theta = self._threshold(blk)
        if bool(torch.isfinite(theta).all()):
            return self._forward_shifted(blk, theta)
        return self._forward_masked(blk, theta)

    def _forward_shifted(self, blk: Block, theta: Tensor):
        """The softmax of ``z = s - theta`` with ``z <= 0`` dropped: the same weights (theta is
        constant along a row), but the pruning is ``threshold_`` with a scalar, several times
        faster on CPU than a boolean mask broadcast against the per-row thresholds. Exact:
        ``fl(s - theta) > 0`` if and only if ``s > theta``. The lse is shifted back at the end."""
        acc = OnlineSoftmax(blk, blk.prob.v.shape[-1])
        kept, visible = blk.zeros(), blk.zeros()
        for kind, k0, k1 in blk.tiles():
            z = blk.logits(kind, k0, k1).sub_(theta)
            visible += (k1 - k0) if kind == FULL_SEG else (z > -math.inf).sum(dim=-1)
            torch.threshold_(z, 0.0, -math.inf)  # the op of torch.nn.functional.threshold_
            # kept logits are the positive z: sign(max(z, 0)) is 1 there, else 0; a float sum of
            # those is exact and much faster than reducing a boolean tensor
            kept += z.clamp(min=0.0).sign_().sum(dim=-1)
            acc.add(blk, z, k0, k1)
        out, lse = acc.result()
        return out, {"lse": lse + theta.squeeze(-1), "kept": kept, "visible": visible}

    def _forward_masked(self, blk: Block, theta: Tensor):
        """The general path, for blocks with a threshold of -inf (keep every visible logit)."""
        acc = OnlineSoftmax(blk, blk.prob.v.shape[-1])
        kept, visible = blk.zeros(), blk.zeros()
        for kind, k0, k1 in blk.tiles():
            s = blk.logits(kind, k0, k1)
            keep = s > theta
            kept += keep.sum(dim=-1)
            visible += (k1 - k0) if kind == FULL_SEG else (s > -math.inf).sum(dim=-1)
            acc.add(blk, s.masked_fill_(keep.logical_not_(), -math.inf), k0, k1)
        out, lse = acc.result()
        return out, {"lse": lse, "kept": kept, "visible": visible}

    def observe_block(self, blk: Block, stats):
        lse = safe_lse(stats["lse"])
        for kind, k0, k1 in blk.tiles():
            s = blk.logits(kind, k0, k1)
            yield k0, k1, torch.exp(self.transform(blk, s, kind, k0, k1) - lse), s


COMPENSATIONS = ("none", "denominator", "denominator+vmean")


@register("top_theta")
class TopTheta(Mechanism):
    """Softmax over the logits above a calibrated per-head (or per-head, per-position)
    threshold, with optional compensation; see ``calibrate_top_theta``."""

    paper = "arXiv:2502.08363"
    thresholds: Tensor | None  # a buffer (registered in __init__)

    def __init__(self, thresholds: Tensor | None = None, compensation: str = "denominator+vmean", sdc_scale: float = 1.0):
        super().__init__()
        if thresholds is not None:
            if not isinstance(thresholds, Tensor) or not thresholds.is_floating_point() or thresholds.dim() not in (1, 2):
                raise ValueError(
                    f"top_theta(thresholds): expected a float tensor (H,) or (H, positions), got {getattr(thresholds, 'shape', thresholds)!r}"
                )
            if torch.isnan(thresholds).any() or torch.isposinf(thresholds).any():
                raise ValueError("top_theta(thresholds): NaN or +inf would keep nothing; use -inf to keep every logit")
            thresholds = thresholds.detach()
        if compensation not in COMPENSATIONS:
            raise ValueError(f"top_theta(compensation): expected one of {COMPENSATIONS}, got {compensation!r}")
        if (
            isinstance(sdc_scale, bool)
            or not isinstance(sdc_scale, (int, float))
            or not math.isfinite(sdc_scale)
            or sdc_scale < 0
        ):
            raise ValueError(f"top_theta(sdc_scale): expected a finite number >= 0, got {sdc_scale!r}")
        self.register_buffer("thresholds", thresholds)
        self.compensation, self.sdc_scale = compensation, float(sdc_scale)
        self.kept_fraction: float | None = None
        self.kept_per_head: Tensor | None = None

    def extra_repr(self) -> str:
        shape = None if self.thresholds is None else tuple(self.thresholds.shape)
        return super().extra_repr() + f", thresholds={shape}, compensation={self.compensation!r}"

    def _check(self, req: Request) -> Tensor:
        theta = self.thresholds
        if theta is None:
            raise ValueError("top_theta: no thresholds; build TopTheta(calibrate_top_theta(q, k, keep=...)) first")
        if theta.shape[0] != req.heads:
            raise ValueError(f"top_theta(thresholds): {theta.shape[0]} heads but the call has Hq={req.heads}")
        if theta.dim() == 2 and theta.shape[1] < req.k_len:
            raise ValueError(
                f"top_theta(thresholds): calibrated for query positions < {theta.shape[1]}, but this call has positions up to {req.k_len - 1}"
            )
        return theta

    def call_request(self, q, k, v, *, mask=None, score=None, scale=None, sinks=None):
        req = request(q, k, v, mask=mask, score=score, scale=scale)
        self._check(req)
        return req

    def fast_path(self, req, backend):
        """(out, lse) with ``lse`` the log of the (compensated) softmax denominator and, for
        observers, the kernel, its statistics and each row's kept mass."""
        theta = self.thresholds
        assert theta is not None  # call_request checked
        kernel = TopThetaKernel(theta)
        out, stats = run_kernel(req, kernel)
        _kept_report(self, stats["kept"], stats["visible"])
        out, lse, kept_mass = self._compensate(req, theta, out, stats["lse"], stats["kept"], stats["visible"])
        return out, lse, (kernel, stats, kept_mass)

    def observe_call(self, req, lse, observers, layer, found=None):
        """The weights the output is made of (``_compensated_tiles``); the reference feeds no observers."""
        if found is None:
            return
        kernel, stats, kept_mass = found
        call = _call_info(req, layer, self.name)
        tiles = kernel_tiles(req, kernel, {"lse": stats["lse"]}, call)
        feed(observers, call, self._compensated_tiles(req, tiles, kept_mass, stats["visible"]))

    def _compensated_tiles(self, req: Request, tiles, kept_mass: Tensor, visible: Tensor):
        """The weights the output is made of: kept weights times the kept mass, plus (V-mean
        compensation) the missing mass spread evenly over the row's visible keys."""
        kept_mass, visible = kept_mass.detach(), visible.detach()
        for tile in tiles:
            rows = tile.q_pos - req.q_start
            m = kept_mass[tile.batch][:, :, rows].unsqueeze(-1).to(tile.weights.dtype)
            w = tile.weights * m
            if self.compensation == "denominator+vmean":
                n = visible[tile.batch][:, :, rows].unsqueeze(-1).to(w.dtype)
                w = w + (1 - m) * (tile.scores > -math.inf) / n.clamp(min=1)
            yield replace(tile, weights=w)

    def _compensate(self, req: Request, theta: Tensor, out: Tensor, lse: Tensor, kept: Tensor, visible: Tensor):
        if self.compensation == "none" or self.sdc_scale == 0:
            return out, lse, torch.ones_like(lse)
        cd = lse.dtype
        h = torch.arange(req.heads).view(1, -1, 1)
        q_pos = torch.arange(req.q_start, req.k_len).view(1, 1, -1)
        th = _thresholds_for(theta.to(cd), h, q_pos).expand_as(lse)
        pruned = (visible - kept).to(cd)
        # every pruned logit counted as if it were the threshold: sdc_scale * n_pruned * e^theta
        missing = torch.where(
            (pruned > 0) & (th > -math.inf), torch.log(self.sdc_scale * pruned.clamp(min=1)) + th, torch.full_like(lse, -math.inf)
        )
        # rows that keep nothing or see nothing take finite stand-ins, so no gradient is NaN
        live = kept > 0
        lse_live = torch.where(live, lse, torch.zeros_like(lse))
        total_live = torch.logaddexp(lse_live, torch.where(live, missing, torch.full_like(lse, -math.inf)))
        kept_mass = torch.where(live, torch.exp(lse_live - total_live), torch.zeros_like(lse))
        total = torch.where(live, total_live, missing)
        out = out * kept_mass.unsqueeze(-1).to(out.dtype)
        if self.compensation == "denominator+vmean" and req.k_len:
            missing_mass = ((1 - kept_mass) * (visible > 0)).unsqueeze(-1).to(out.dtype)
            out = out + missing_mass * _visible_mean(req).to(out.dtype)
        return out, total, kept_mass

    def reference(self, q, k, v, *, mask=None, score=None, scale=None, return_lse=False, **_):
        """``keep = s > theta``; softmax over the kept logits with the pruned ones counted in
        the denominator as ``sdc_scale * e^theta`` each; the missing mass times the mean of
        the row's visible values added back (arXiv 2502.08363, Sec. 3.3)."""
        req = request(q, k, v, mask=mask, score=score, scale=scale)
        theta = self._check(req)
        s = dense_logits(req)
        h = torch.arange(req.heads).view(1, -1, 1, 1)
        q_pos = torch.arange(req.q_start, req.k_len).view(1, 1, -1, 1)
        th = _thresholds_for(theta.to(s.dtype), h, q_pos)
        visible = ~torch.isneginf(s)
        keep = visible & (s > th)
        _kept_report(self, keep.sum(-1), visible.sum(-1))
        z = s.masked_fill(~keep, -math.inf)
        values = dense_values(req)
        p, lse = dense_softmax(z)
        if self.compensation != "none" and self.sdc_scale > 0:
            # log of: sum over kept e^s  +  sdc_scale * (number pruned) * e^theta
            pruned = (visible & ~keep).sum(-1).to(s.dtype)
            extra = torch.log(self.sdc_scale * pruned) + th.squeeze(-1).expand_as(pruned)
            lse = torch.logaddexp(lse, extra.nan_to_num(nan=-math.inf))
            p = torch.exp(z - lse.unsqueeze(-1)).nan_to_num(nan=0.0)
        out = torch.matmul(p, values)
        if self.compensation != "none" and self.sdc_scale > 0:
            if self.compensation == "denominator+vmean":
                n_visible = visible.sum(-1, keepdim=True)
                mean_v = torch.matmul(visible.to(s.dtype), values) / n_visible.clamp(min=1)
                out = out + (1 - p.sum(-1, keepdim=True)) * (n_visible > 0) * mean_v
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out


def _visible_mean(req: Request) -> Tensor:
    """Mean of the values each query can see, (B, Hq, Nq, Dv), differentiable in v: a prefix
    mean for causal masks, else softmax attention with all logits equal (uniform weights)."""
    cd = torch.float64 if req.q.dtype == torch.float64 else torch.float32
    groups = req.heads // req.kv_heads
    v = req.v.to(cd)
    if req.mask is None:
        return v.mean(dim=2, keepdim=True).repeat_interleave(groups, dim=1).expand(-1, -1, req.q_len, -1)
    if isinstance(req.mask, Causal):
        prefix = v.cumsum(dim=2)[:, :, req.q_start :] / torch.arange(req.q_start + 1, req.k_len + 1, dtype=cd).view(1, 1, -1, 1)
        return prefix.repeat_interleave(groups, dim=1)
    zeros_q = torch.zeros(req.batch, req.heads, req.q_len, 1, dtype=req.q.dtype)
    zeros_k = torch.zeros(req.batch, req.kv_heads, req.k_len, 1, dtype=req.q.dtype)
    out, _ = chunked_attention(make_request(zeros_q, zeros_k, req.v, mask=req.mask))
    return out.to(cd)


def calibrate_top_theta(
    q, k, keep: int, *, mask=None, score=None, scale=None, per_position: bool = False, add_sigma: float = 0.0
) -> Tensor:
    """Thresholds for ``TopTheta`` that keep about ``keep`` logits per row (arXiv 2502.08363, Sec. 3.2).

    q (B, Hq, N, D) and k (B, Hkv, N, D) are calibration samples (B of them). For every row
    with more than ``keep`` visible keys the calibration threshold is its (keep+1)-th
    largest logit (so that ``s > theta`` keeps ``keep``); a head's threshold is the mean
    over rows and samples plus ``add_sigma`` standard deviations. ``per_position=True``
    returns one threshold per head and query position, (Hq, Nk), as the paper does for
    rows of different lengths (positions no calibration row covered: -inf, keep all);
    else (Hq,). Runs block by block, O(N) memory.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep: expected an int >= 1 (logits kept per row), got {keep!r}")
    if isinstance(add_sigma, bool) or not isinstance(add_sigma, (int, float)) or not math.isfinite(add_sigma):
        raise ValueError(f"add_sigma: expected a finite number, got {add_sigma!r}")
    req = make_request(q, k, k[..., :1], mask=mask, score=score, scale=scale)
    H, Nq, Nk = req.heads, req.q_len, req.k_len
    sums = torch.zeros(H, Nq, dtype=torch.float64)
    squares = torch.zeros(H, Nq, dtype=torch.float64)
    counts = torch.zeros(H, Nq, dtype=torch.float64)
    with torch.no_grad():
        prob = Problem(req, _ROW_TILING)
        for blk in prob.blocks():
            s, _, _ = _row_logits(blk)
            if s.shape[-1] <= keep:
                continue
            values, _ = s.topk(keep + 1, dim=-1)
            th = values[..., keep].double()
            used = (s > -math.inf).sum(-1) > keep
            th = torch.where(used, th, torch.zeros_like(th))
            rows = slice(blk.q0, blk.q1)
            sums[:, rows] += th.sum(0)
            squares[:, rows] += (th * th).sum(0)
            counts[:, rows] += used.sum(0).double()
    if not per_position:
        sums, squares, counts = sums.sum(-1, keepdim=True), squares.sum(-1, keepdim=True), counts.sum(-1, keepdim=True)
    mean = sums / counts.clamp(min=1)
    std = (squares / counts.clamp(min=1) - mean * mean).clamp(min=0).sqrt()
    theta = torch.where(counts > 0, mean + add_sigma * std, torch.full_like(mean, -math.inf))
    if not per_position:
        if bool((counts == 0).any()):
            raise ValueError(
                f"calibrate_top_theta: no row has more than keep={keep} visible keys; use longer samples or a smaller keep"
            )
        return theta.squeeze(-1).to(torch.float32)
    table = torch.full((H, Nk), -math.inf, dtype=torch.float64)
    table[:, req.q_start :] = theta
    return table.to(torch.float32)
