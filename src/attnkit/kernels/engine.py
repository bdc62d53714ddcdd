"""A pluggable tile engine: the loop every chunked mechanism shares.

The engine walks the same plan as the chunked backend (query blocks x key tiles, fully
masked tiles skipped), computes each tile's logits ``s = scale * Q K^T`` with the score
mod and the mask applied (-inf where masked), and leaves the *mechanism's math* to a
``TileKernel``: how a block of rows turns logits into weights and outputs (online
softmax, unnormalised sigmoid gates, signed softmax, right-to-left stick-breaking
products, two-pass softmax with head mixing...), and how the backward turns ``dW = dO V^T``
into ``dS``. The engine owns GQA grouping, tile index tensors, the gradient matmuls
(``dV += W^T dO``, ``dQ += dS K``, ``dK += dS^T Q``), gradients of score-mod parameters,
and the custom autograd function with recomputation: nothing N x N is ever held.

A kernel sees one query block at a time (``Block``) and loops over its key tiles itself,
so it can carry state across tiles (running max, cumulative sums), make two passes over
a block (post-softmax head mixing needs each row's final lse first), or keep carries
across query blocks (selective attention's cumulative mask) by visiting blocks in order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..mods import band_of, index_tensors
from ..observe import AttentionTile, CallInfo, feed
from . import cpu
from .plan import FULL_SEG, Plan, QueryBlock, make_plan, single_tile_plan
from .request import Request
from .tiles import Tile, add_pv_, apply_score_, visible

Tensor = torch.Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# torch's CPU exp takes a slow path (10-20x) for inputs whose result underflows, and is
# 2x slower on -inf. Clamping first keeps the fast path: e^-87 (float32; e^-708 for
# float64) is the smallest normal number, so a weight that small relative to the row's
# largest is below the resolution of any sum it enters. Rows that see no key at all are
# detected by their running max, never by these floors.
EXP_FLOOR = {torch.float32: -87.0, torch.float64: -708.0}


def fast_exp_(x: Tensor) -> Tensor:
    """exp in place, with the argument clamped at the floor of its dtype."""
    return x.clamp_(min=EXP_FLOOR[x.dtype]).exp_()


def fast_exp(x: Tensor) -> Tensor:
    return x.clamp(min=EXP_FLOOR[x.dtype]).exp_()


@dataclass(frozen=True)
class EngineTiling:
    """Tile sizes. Small enough that a tile's logits stay in cache, large enough that the
    per-op overhead of PyTorch is amortised (measured on 2 AVX2 cores, fp32, D = 64)."""

    q_block: int = 128
    k_block: int = 128
    tile_k: int = 512
    #: calls with at most this many (query, key) pairs per head run as one tile
    single_tile: int = 256 * 256


def grouped(x: Tensor, kv_heads: int) -> Tensor:
    """(Bt, Hq, L, X) -> (Bt, Hkv, G*L, X): rows of the query heads that share a key head."""
    bt, hq, length, d = x.shape
    return x.reshape(bt, kv_heads, (hq // kv_heads) * length, d)


def ungrouped(x: Tensor, heads: int) -> Tensor:
    bt, hkv, gl, d = x.shape
    return x.reshape(bt, heads, gl * hkv // heads, d)


def online_softmax_step(z: Tensor, m: Tensor, l: Tensor, exp=fast_exp_) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One tile of the online softmax (FlashAttention-2, arXiv 2307.08691): ``z`` the
    tile's logits (B, H, L, T), consumed (it becomes ``p``); ``m``, ``l`` the running max
    and normaliser (B, H, L). Returns (p, alpha, m, l) with alpha the factor the
    accumulator is rescaled by. The C step updates ``m``, ``l`` in place where it runs;
    ``exp`` (in place or not) is the PyTorch path's exponential. Shared by this engine
    and ``tiled.py``."""
    if cpu.usable(z, m, l):
        alpha = cpu.online_softmax_step_(z, m, l)  # z becomes p; m, l updated in place
        return z, alpha, m, l
    m_new = torch.maximum(m, z.amax(dim=-1))
    m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    alpha = exp(m - m_safe)
    p = exp(z.sub_(m_safe.unsqueeze(-1)))
    return p, alpha, m_new, l * alpha + p.sum(dim=-1)


class Problem:
    """One validated call prepared for tiling: compute-dtype tensors, the plan, the mods.

    ``q`` is stored already multiplied by ``scale`` so that every tile's logits are one
    matmul. Built inside the autograd function, so none of this is recorded by autograd.
    """

    def __init__(self, req: Request, tiling: EngineTiling, score_params: Sequence[Tensor] = ()):
        self.req = req
        self.cd = compute_dtype(req.q.dtype)
        self.q = req.q.to(self.cd) * req.scale
        self.k = req.k.to(self.cd).contiguous()
        self.v = req.v.to(self.cd).contiguous()
        self.scale = req.scale
        self.mask = req.mask
        self.score = req.score
        self.score_params = list(score_params)
        # dS must be chained through the score mod unless it only adds constants
        self.track_score = req.score is not None and (bool(self.score_params) or any(a.kind != "bias" for a in req.score.atoms()))
        self.q_start = req.q_start
        self.heads, self.kv_heads = req.heads, req.kv_heads
        self.tile_k = tiling.tile_k
        if req.q_len * req.k_len <= tiling.single_tile:
            self.plan: Plan = single_tile_plan(req.mask, req.batch, req.q_len, req.k_len)
        else:
            self.plan = make_plan(req.mask, req.batch, req.q_len, req.k_len, tiling.q_block, tiling.k_block, tiling.tile_k)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, Hq, Nq, Dv) of the output."""
        return (self.req.batch, self.heads, self.req.q_len, self.req.v_dim)

    def blocks(self) -> Iterator[Block]:
        for bs, rows, qblocks in self.plan.batch_slices(self.req.batch):
            for qb in qblocks:
                if qb.segments:
                    yield Block(self, bs, rows, qb)


class Block:
    """One block of query rows (for one batch slice) and the tiles it must visit."""

    def __init__(self, prob: Problem, bs: slice, rows: Tensor, qb: QueryBlock):
        self.prob = prob
        self.bs, self.rows = bs, rows
        self.q0, self.q1 = qb.q0, qb.q1
        self.segments = qb.segments
        self.qg = grouped(prob.q[bs, :, self.q0 : self.q1], prob.kv_heads)
        self.batch = self.qg.shape[0]

    @property
    def rows_slice(self) -> tuple:
        return (self.bs, slice(None), slice(self.q0, self.q1))

    @property
    def q_positions(self) -> Tensor:
        return torch.arange(self.prob.q_start + self.q0, self.prob.q_start + self.q1)

    def zeros(self, *trailing: int, dtype=None) -> Tensor:
        """A (Bt, Hq, BQ, *trailing) accumulator in the compute dtype."""
        return torch.zeros(
            self.batch, self.prob.heads, self.q1 - self.q0, *trailing, dtype=dtype or self.prob.cd, device=self.prob.q.device
        )

    def tiles(self, reverse: bool = False) -> list[tuple[str, int, int]]:
        """(segment kind, k0, k1) of every key tile, left to right (or right to left)."""
        tk = self.prob.tile_k
        out = [(seg.kind, t0, min(t0 + tk, seg.k1)) for seg in self.segments for t0 in range(seg.k0, seg.k1, tk)]
        return out[::-1] if reverse else out

    def tile(self, k0: int, k1: int) -> Tile:
        return Tile.make(self.rows, self.prob.heads, self.prob.q_start + self.q0, self.q1 - self.q0, k0, k1)

    def raw_logits(self, k0: int, k1: int) -> Tensor:
        """scale * Q K^T of the tile, (Bt, Hq, BQ, span), before mods and mask."""
        kt = self.prob.k[self.bs, :, k0:k1]
        return ungrouped(torch.matmul(self.qg, kt.transpose(-1, -2)), self.prob.heads)

    def logits(self, kind: str, k0: int, k1: int) -> Tensor:
        """The tile's modified logits: score mod applied, -inf where the mask hides a pair."""
        s = self.raw_logits(k0, k1)
        return self.modify(s, kind, k0, k1)

    def modify(self, s: Tensor, kind: str, k0: int, k1: int) -> Tensor:
        prob = self.prob
        tile = None
        if prob.score is not None:
            tile = self.tile(k0, k1)
            s = apply_score_(prob.score, s, tile).to(prob.cd)  # s is the tile's own tensor
        if kind != FULL_SEG:
            tile = tile or self.tile(k0, k1)
            s.masked_fill_(~visible(prob.mask, tile), -math.inf)  # s is this tile's own tensor
        return s

    def visible(self, kind: str, k0: int, k1: int) -> Tensor | None:
        """Boolean visibility of the tile (broadcastable), or None when every pair is visible."""
        if kind == FULL_SEG:
            return None
        return visible(self.prob.mask, self.tile(k0, k1))

    def pv_add_(self, acc: Tensor, w: Tensor, k0: int, k1: int) -> None:
        """acc += W V in place, acc (Bt, Hq, BQ, Dv)."""
        add_pv_(acc, w, self.prob.v[self.bs, :, k0:k1])


class GradBlock(Block):
    """A block in the backward: also holds dO and accumulates dq; dk, dv are shared."""

    def __init__(self, prob: Problem, bs, rows, qb, grad_out: Tensor, grads: Grads):
        super().__init__(prob, bs, rows, qb)
        self.gog = grouped(grad_out[bs, :, self.q0 : self.q1], prob.kv_heads)
        self.grads = grads
        self.dq_acc = torch.zeros_like(self.qg)

    def dw(self, k0: int, k1: int) -> Tensor:
        """dO V^T of the tile: the gradient reaching each weight, (Bt, Hq, BQ, span)."""
        vt = self.prob.v[self.bs, :, k0:k1]
        return ungrouped(torch.matmul(self.gog, vt.transpose(-1, -2)), self.prob.heads)

    def tracked_logits(self, kind: str, k0: int, k1: int) -> tuple[Tensor, Tensor | None]:
        """(s, s_raw): the modified logits with an autograd graph back to ``s_raw`` and the
        score mod's parameters, when the mod has parameters that need gradients."""
        s_raw = self.raw_logits(k0, k1)
        if not self.prob.track_score:
            return self.modify(s_raw, kind, k0, k1), None
        with torch.enable_grad():
            s_raw = s_raw.requires_grad_(True)
            return self.modify(s_raw, kind, k0, k1), s_raw

    def add(self, k0: int, k1: int, ds: Tensor | None, w: Tensor | None, tracked: tuple | None = None) -> None:
        """Accumulate dV += W^T dO and, from dS (gradient w.r.t. the modified logits),
        dQ, dK and the score mod's parameter gradients."""
        prob, g = self.prob, self.grads
        ks = (self.bs, slice(None), slice(k0, k1))
        if w is not None:
            g.dv[ks] += torch.matmul(grouped(w, prob.kv_heads).transpose(-1, -2), self.gog)
        if ds is None:
            return
        if tracked is not None and tracked[1] is not None:
            s, s_raw = tracked
            wanted = [s_raw] + prob.score_params
            got = torch.autograd.grad(s, wanted, ds, allow_unused=True)
            ds = got[0]
            g.add_params(got[1:])
        dsg = grouped(ds, prob.kv_heads)
        self.dq_acc += torch.matmul(dsg, prob.k[ks])
        g.dk[ks] += torch.matmul(dsg.transpose(-1, -2), self.qg)

    def finish(self) -> None:
        """Write this block's dq (the logits were scale * q k, so dq carries the scale)."""
        self.grads.dq[self.rows_slice] += ungrouped(self.dq_acc, self.prob.heads) * self.prob.scale


class Grads:
    """dq, dk, dv accumulators in the compute dtype, plus parameter gradients."""

    def __init__(self, prob: Problem, n_params: int):
        cd, dev = prob.cd, prob.q.device
        self.dq = torch.zeros(prob.req.q.shape, dtype=cd, device=dev)
        self.dk = torch.zeros(prob.req.k.shape, dtype=cd, device=dev)
        self.dv = torch.zeros(prob.req.v.shape, dtype=cd, device=dev)
        self.params: list[Tensor | None] = [None] * n_params

    def add_params(self, grads) -> None:
        for i, g in enumerate(grads):
            if g is not None:
                self.params[i] = g if self.params[i] is None else self.params[i] + g


def grad_blocks(prob: Problem, grad_out: Tensor, grads: Grads, reverse: bool = False) -> Iterator[GradBlock]:
    for bs, rows, qblocks in prob.plan.batch_slices(prob.req.batch):
        for qb in reversed(qblocks) if reverse else qblocks:
            if qb.segments:
                blk = GradBlock(prob, bs, rows, qb, grad_out, grads)
                yield blk
                blk.finish()


class TileKernel:
    """A mechanism's math on blocks of rows. Subclasses implement the block methods.

    - ``stats``: names of per-row statistics (B, Hq, Nq) the forward saves (e.g. "lse"),
      returned by the autograd function and possibly differentiable;
    - ``stat_fill``: their value on rows that see no key;
    - ``params()``: the kernel's own tensors that need gradients (mixing matrices...);
    - ``forward_block(blk) -> (out (Bt, Hq, BQ, Dv), {stat: (Bt, Hq, BQ)})``;
    - ``backward_block(blk, stats, delta, grad_stats)``: accumulate through ``blk.add``;
      ``delta`` is rowsum(dO * O), which most kernels need;
    - ``observe_block(blk, stats) -> [(k0, k1, weights, scores | None)]``: the weights
      the mechanism applied, for observers, in O(tile) memory.
    """

    stats: tuple[str, ...] = ()
    differentiable_stats: tuple[str, ...] = ()  # the others are marked non-differentiable
    stat_fill: float = -math.inf
    reverse_queries_backward: bool = False  # the backward visits query blocks last to first
    tiling = EngineTiling()

    def params(self) -> list[Tensor]:
        return []

    def begin(self, prob: Problem, phase: str) -> None:
        """Called before the blocks of each pass; ``phase`` is "forward", "backward" or "observe"."""

    def forward_fused(self, prob: Problem) -> tuple[Tensor, dict[str, Tensor]] | None:
        """The whole forward in one fused kernel, where the kernel has one for this call
        (the backward still runs block by block); None: run ``forward_block`` per block."""
        return None

    def backward_fused(self, prob: Problem, grad_out: Tensor, stats: dict[str, Tensor]) -> tuple[Tensor | None, ...] | None:
        """(dq, dk, dv, then the gradient of each of ``params()``) of the whole call from one
        fused kernel, where the kernel has one (only asked when no score mod and no stat
        needs a gradient); None: run ``backward_block``."""
        return None

    def backward_fused_with_stats(
        self, prob: Problem, grad_out: Tensor, stats: dict[str, Tensor], grad_stats: dict[str, Tensor]
    ) -> tuple[Tensor | None, ...] | None:
        """``backward_fused`` when gradients also reach the stats (``grad_stats``, possibly
        zeros: a compiled graph cannot tell); None where the kernel's fused backward cannot
        take them."""
        return None if grad_stats else self.backward_fused(prob, grad_out, stats)

    def forward_block(self, blk: Block) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def backward_block(
        self, blk: GradBlock, stats: dict[str, Tensor], delta: Tensor, grad_stats: dict[str, Tensor]
    ) -> list[Tensor | None]:
        """Accumulate through ``blk.add``; return gradients of ``params()`` (or Nones)."""
        raise NotImplementedError

    def observe_block(self, blk: Block, stats: dict[str, Tensor]):
        raise NotImplementedError


def fused_band(prob: Problem) -> tuple[int | None, int | None] | None:
    """The band of keys for the whole-call C loops (kernels/cpu/), or None when the
    call needs the block loop: a score mod, a mask that is not a band, no fused C path."""
    band = band_of(prob.mask)
    if prob.score is not None or band is None or not cpu.fused_usable(prob.q, prob.k, prob.v):
        return None
    return band


def forward_pass(prob: Problem, kernel: TileKernel) -> tuple[Tensor, dict[str, Tensor]]:
    fused = kernel.forward_fused(prob)
    if fused is not None:
        return fused
    B, H, Nq, Dv = prob.shape
    out = torch.zeros(B, H, Nq, Dv, dtype=prob.cd, device=prob.q.device)
    stats = {name: torch.full((B, H, Nq), kernel.stat_fill, dtype=prob.cd, device=prob.q.device) for name in kernel.stats}
    kernel.begin(prob, "forward")
    for blk in prob.blocks():
        o, st = kernel.forward_block(blk)
        out[blk.rows_slice] = o
        for name, value in st.items():
            stats[name][blk.rows_slice] = value
    return out, stats


class _EngineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel: TileKernel, req: Request, n_score: int, q, k, v, *tensors):
        score_params = list(tensors[:n_score])
        prob = Problem(req, kernel.tiling, score_params)
        out, stats = forward_pass(prob, kernel)
        ctx.kernel, ctx.req, ctx.n_score = kernel, req, n_score
        ctx.tensors = tensors  # the very objects the mods read, so autograd.grad reaches them
        ctx.stat_names = tuple(stats)
        ctx.save_for_backward(out, *stats.values())
        ctx.mark_non_differentiable(*[s for name, s in stats.items() if name not in kernel.differentiable_stats])
        return (out.to(req.q.dtype), *stats.values())

    @staticmethod
    def backward(ctx, grad_out, *grad_stats):
        kernel, req = ctx.kernel, ctx.req
        out, *stat_values = ctx.saved_tensors
        stats = dict(zip(ctx.stat_names, stat_values))
        tensors = ctx.tensors
        prob = Problem(req, kernel.tiling, [t for t in tensors[: ctx.n_score]])
        cd = prob.cd
        go = torch.zeros_like(out) if grad_out is None else grad_out.to(cd)
        gstats = {
            n: g.to(cd)
            for n, g in zip(ctx.stat_names, grad_stats)
            if g is not None and (torch.compiler.is_compiling() or bool(g.any()))
        }
        if ctx.n_score == 0:
            fused = kernel.backward_fused_with_stats(prob, go, stats, gstats)
            if fused is not None:
                dq, dk, dv, *dparams = fused
                dparams = [None if g is None else g.to(t.dtype) for g, t in zip(dparams, tensors)]
                return (None, None, None, dq.to(req.q.dtype), dk.to(req.k.dtype), dv.to(req.v.dtype), *dparams)
        delta = (go * out).sum(dim=-1)
        grads = Grads(prob, ctx.n_score)
        kernel.begin(prob, "backward")
        kparams: list[Tensor | None] = [None] * (len(tensors) - ctx.n_score)
        for blk in grad_blocks(prob, go, grads, reverse=kernel.reverse_queries_backward):
            rs = blk.rows_slice
            got = kernel.backward_block(
                blk, {n: s[rs] for n, s in stats.items()}, delta[rs], {n: g[rs] for n, g in gstats.items()}
            )
            for i, g in enumerate(got or ()):
                if g is not None:
                    kparams[i] = g if kparams[i] is None else kparams[i] + g
        all_params = grads.params + kparams
        dparams = [None if g is None else g.to(t.dtype) for g, t in zip(all_params, tensors)]
        return (None, None, None, grads.dq.to(req.q.dtype), grads.dk.to(req.k.dtype), grads.dv.to(req.v.dtype), *dparams)


def run_kernel(req: Request, kernel: TileKernel) -> tuple[Tensor, dict[str, Tensor]]:
    """(out, stats) of a kernel on a validated request; differentiable in q, k, v, the score
    mod's parameters and the kernel's own ``params()``."""
    if req.q_len == 0 or req.k_len == 0:
        return _empty(req, kernel)
    score_params = [p for p in (req.score.parameters() if req.score is not None else []) if p.requires_grad]
    kernel_params = list(kernel.params())
    outs = _EngineFunction.apply(kernel, req, len(score_params), req.q, req.k, req.v, *score_params, *kernel_params)
    return outs[0], dict(zip(kernel.stats, outs[1:]))


def _empty(req: Request, kernel: TileKernel) -> tuple[Tensor, dict[str, Tensor]]:
    link = req.q.sum() * 0 + req.k.sum() * 0 + req.v.sum() * 0
    for p in kernel.params():
        link = link + p.sum() * 0
    out = torch.zeros(req.batch, req.heads, req.q_len, req.v_dim, dtype=req.q.dtype) + link.to(req.q.dtype)
    cd = compute_dtype(req.q.dtype)
    stats = {n: torch.full((req.batch, req.heads, req.q_len), kernel.stat_fill, dtype=cd) for n in kernel.stats}
    return out, stats


# --------------------------------------------------------------------------- observers


def observe_kernel(
    req: Request, kernel: TileKernel, stats: dict[str, Tensor], observers, layer: int | None, mechanism: str
) -> None:
    """Feed observers the weights the mechanism applied, tile by tile (no autograd)."""
    call = CallInfo(req.batch, req.heads, req.q_len, req.k_len, req.q_start, layer, mechanism)
    feed(observers, call, kernel_tiles(req, kernel, stats, call))


def kernel_tiles(req: Request, kernel: TileKernel, stats: dict[str, Tensor], call: CallInfo):
    return no_grad_steps(_kernel_tiles(req, kernel, stats, call))


def _kernel_tiles(req: Request, kernel: TileKernel, stats: dict[str, Tensor], call: CallInfo):
    if req.q_len == 0 or req.k_len == 0:
        return
    prob = Problem(req, kernel.tiling)
    stats = {n: s.detach().to(prob.cd) for n, s in stats.items()}
    kernel.begin(prob, "observe")
    for blk in prob.blocks():
        rs = blk.rows_slice
        for k0, k1, w, scores in kernel.observe_block(blk, {n: s[rs] for n, s in stats.items()}):
            yield AttentionTile(call, blk.rows, blk.q_positions, torch.arange(k0, k1), w, scores)


def no_grad_steps(gen):
    """Run each step of a generator without autograd. (A generator that yields *inside*
    ``with torch.no_grad()`` leaves grad mode off for its consumer between steps, and
    two interleaved ones, or an abandoned one closed later by the garbage collector,
    restore the wrong mode.)"""
    while True:
        with torch.no_grad():
            try:
                item = next(gen)
            except StopIteration:
                return
        yield item


# --------------------------------------------------------------------------- online softmax


class OnlineSoftmax:
    """FlashAttention-2's running max / normaliser / accumulator for one block of rows
    (Dao 2023, arXiv 2307.08691), over logits z chosen by the mechanism."""

    def __init__(self, blk: Block, dv: int):
        self.m = blk.zeros().new_full((blk.batch, blk.prob.heads, blk.q1 - blk.q0), -math.inf)
        self.l = torch.zeros_like(self.m)
        self.acc = blk.zeros(dv)

    def add(self, blk: Block, z: Tensor, k0: int, k1: int, sign: Tensor | None = None) -> None:
        """Fold in a tile of logits z (consumed); the values are weighted by exp(z - m), times ``sign``."""
        p, alpha, self.m, self.l = online_softmax_step(z, self.m, self.l)
        self.acc *= alpha.unsqueeze(-1)
        blk.pv_add_(self.acc, p if sign is None else p.mul_(sign), k0, k1)

    def result(self) -> tuple[Tensor, Tensor]:
        """(out, lse); rows that saw no key give zeros and lse = -inf."""
        live = ~torch.isneginf(self.m)
        m_safe = torch.where(live, self.m, torch.zeros_like(self.m))
        lse = torch.where(live, m_safe + torch.log(self.l), self.m)
        out = torch.where(
            live.unsqueeze(-1),
            self.acc / self.l.clamp(min=torch.finfo(self.l.dtype).tiny).unsqueeze(-1),
            torch.zeros_like(self.acc),
        )
        return out, lse


def softmax_backward_terms(stats: dict[str, Tensor], delta: Tensor, grad_stats: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(lse, delta) of a softmax backward as (..., 1) columns: the saved lse made safe
    (``safe_lse``), and rowsum(dO * O) minus any gradient reaching the lse."""
    d = delta - grad_stats["lse"] if "lse" in grad_stats else delta
    return safe_lse(stats["lse"]), d.unsqueeze(-1)


def safe_lse(lse: Tensor) -> Tensor:
    """lse with -inf (dead rows) turned into +inf, so that exp(z - lse) is 0, never NaN."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse).unsqueeze(-1)


def dense_index(req: Request):
    """Broadcastable (b, h, q_idx, kv_idx) of the whole call, for references."""
    return index_tensors(req.batch, req.heads, req.q_start, req.q_len, 0, req.k_len)


class SoftmaxKernel(TileKernel):
    """Online softmax over logits ``z = transform(s)`` chosen by the mechanism. Saves the
    lse of z.

    Backward: ``dz = p * (dW - delta)`` where ``delta = rowsum(dO * O)`` minus any
    gradient reaching the lse; ``transform`` must pass gradients through unchanged
    (a shift or a mask), as Top-theta's does.
    """

    stats: tuple[str, ...] = ("lse",)
    differentiable_stats: tuple[str, ...] = ("lse",)

    def transform(self, blk: Block, s: Tensor, kind: str, k0: int, k1: int) -> Tensor:
        return s

    def forward_block(self, blk: Block):
        acc = OnlineSoftmax(blk, blk.prob.v.shape[-1])
        for kind, k0, k1 in blk.tiles():
            acc.add(blk, self.transform(blk, blk.logits(kind, k0, k1), kind, k0, k1), k0, k1)
        out, lse = acc.result()
        return out, {"lse": lse}

    def backward_block(self, blk: GradBlock, stats, delta, grad_stats):
        lse, d = softmax_backward_terms(stats, delta, grad_stats)
        for kind, k0, k1 in blk.tiles():
            s, tracked = blk.tracked_logits(kind, k0, k1)
            p = fast_exp_(self.transform(blk, s.detach(), kind, k0, k1) - lse)
            blk.add(k0, k1, p * (blk.dw(k0, k1) - d), p, (s, tracked))
        return []

    def observe_block(self, blk: Block, stats):
        lse = safe_lse(stats["lse"])
        for kind, k0, k1 in blk.tiles():
            s = blk.logits(kind, k0, k1)
            yield k0, k1, torch.exp(self.transform(blk, s, kind, k0, k1) - lse), s  # exact zeros for observers


def dense_softmax(z: Tensor) -> tuple[Tensor, Tensor]:
    """(p, lse) of a softmax over the last dim; rows of all -inf give p = 0, lse = -inf."""
    dead = torch.isneginf(z).all(dim=-1, keepdim=True)
    lse = torch.logsumexp(z.masked_fill(dead, 0.0), dim=-1, keepdim=True)
    p = torch.exp(z - lse).masked_fill(dead, 0.0)
    return p, lse.masked_fill(dead, -math.inf).squeeze(-1)
