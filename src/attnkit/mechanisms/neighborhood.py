"""Neighborhood attention over 1-D, 2-D and 3-D grids (NATTEN semantics), with a
learnable relative positional bias.

Every query attends to the ``kernel`` nearest keys along each axis of a grid of tokens,
the window shifted inward at the borders so that it always holds ``kernel`` keys (NAT,
Hassani et al. 2022, arXiv 2204.07143). ``dilation`` spreads the window over every d-th
position (DiNAT, arXiv 2209.15001), ``causal`` keeps keys at or before the query along an
axis (arXiv 2403.04690), and ``stride`` lets groups of queries share one window
(generalized NA, arXiv 2504.16922). NAT's relative positional bias adds
``rpb[h, dy + ky - 1, dx + kx - 1]`` to the logit of a key at offset (dy, dx) from its
query (in dilated steps); NATTEN has dropped it, and its users keep asking for it back.

Which keys a query sees is ``attnkit.mods.masks.Neighborhood`` (the mask that
``attnkit.attention(mask=neighborhood_2d(...))`` uses); this file adds the bias and a
fast path. A dilated neighbourhood is a plain one on each residue sub-grid, and a box of
``tile`` queries of a sub-grid reads a box of keys only ``kernel - 1`` wider per axis.
Boxes whose keys sit the same way around them (all but the border ones) share one small
additive mask (bias and -inf) and run together in one call of torch's fused CPU flash op;
every query's softmax is complete inside its box: no N x N work and no merging. The
backward recomputes the boxes in PyTorch, which also yields the bias gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import make_request
from ..kernels.request import all_finite, nonfinite_error
from ..mods.masks import Causal, Neighborhood
from ..observe import AttentionTile, CallInfo, feed
from .base import Mechanism, register
from .key_masks import and_parts, is_key_mask, split_key_masks

Tensor = torch.Tensor

from ..kernels.fused import flash_forward as _op  # layout-safe wrapper of the private op

# Query boxes per grid rank. On a 128 x 128 grid with kernel 13, 8 x 8 measured fastest
# (of 4x16, 8x16, 16x16, 4x32): it reads 20 x 20 keys, 2.4x the 169 it needs, in a call
# large enough to amortise the op. 1-D and 3-D boxes hold a similar number of queries.
DEFAULT_TILE = {1: (256,), 2: (8, 8), 3: (4, 4, 4)}


@dataclass(frozen=True)
class _AxisRange:
    """Queries [q0, q1) of one axis of a residue sub-grid and the keys [k0, k1) they read."""

    q0: int
    q1: int
    k0: int
    k1: int
    visible: Tensor  # (q1 - q0, k1 - k0) bool
    offset: Tensor  # (q1 - q0, k1 - k0) long: key - query + kernel - 1, clamped into the table
    pattern: tuple  # what visible and offset depend on: boxes with equal patterns share a mask


@dataclass(frozen=True)
class _Group:
    """Boxes whose keys sit the same way around their queries (all boxes away from the
    borders): one mask pattern, run together. Positions are flat grid positions."""

    q_index: Tensor  # (boxes, L): each box's queries
    k_index: Tensor  # (boxes, S): the keys each box reads
    visible: Tensor  # (L, S) bool
    table_index: Tensor  # (L, S) flat index into the bias table, clamped where not visible

    def chunks(self, row_elements: int):
        """Index slices of at most ~2^25 gathered key elements per call."""
        step = max(1, (1 << 25) // (row_elements * self.k_index.shape[1]))
        for b0 in range(0, self.q_index.shape[0], step):
            yield self.q_index[b0 : b0 + step], self.k_index[b0 : b0 + step]


def _axis_ranges(nbh: Neighborhood, axis: int, residue: int, tile: int) -> list[_AxisRange]:
    g, k, d = nbh.grid[axis], nbh.kernel[axis], nbh.dilation[axis]
    length = (g - residue + d - 1) // d
    i = torch.arange(length)
    lo, hi = nbh.axis_window(residue + d * i, axis)
    start, end = (lo - residue) // d, (hi - residue) // d  # window in sub-grid steps
    out = []
    for q0 in range(0, length, tile):
        q1 = min(q0 + tile, length)
        s, e = start[q0:q1], end[q0:q1]
        k0, k1 = int(s.min()), int(e.max()) + 1
        j = torch.arange(k0, k1)
        visible = (j >= s[:, None]) & (j <= e[:, None])
        offset = (j[None, :] - i[q0:q1, None] + k - 1).clamp(0, 2 * k - 2)
        pattern = (tuple((s - k0).tolist()), tuple((e - k0).tolist()), k1 - k0, k0 - q0)
        out.append(_AxisRange(q0, q1, k0, k1, visible, offset, pattern))
    return out


def _layout(nbh: Neighborhood, tile: tuple[int, ...]) -> list[_Group]:
    """The boxes covering a grid, grouped by pattern: per residue sub-grid of the
    dilation, every product of per-axis ranges is a box."""
    n = len(nbh.grid)
    table = [2 * k - 1 for k in nbh.kernel]
    positions = torch.arange(math.prod(nbh.grid)).view(nbh.grid)
    per_axis = [{r: _axis_ranges(nbh, a, r, tile[a]) for r in range(nbh.dilation[a])} for a in range(n)]
    found: dict[tuple, list] = {}
    for residue in _product([range(d) for d in nbh.dilation]):
        for axes in _product([per_axis[a][r] for a, r in enumerate(residue)]):
            slices = lambda lo, hi: tuple(
                slice(r + d * getattr(a, lo), r + d * (getattr(a, hi) - 1) + 1, d) for r, d, a in zip(residue, nbh.dilation, axes)
            )
            entry = found.setdefault(tuple(a.pattern for a in axes), [axes, [], []])
            entry[1].append(positions[slices("q0", "q1")].reshape(-1))
            entry[2].append(positions[slices("k0", "k1")].reshape(-1))
    groups = []
    for axes, q_index, k_index in found.values():
        visible: Tensor | None = None
        flat: Tensor | int = 0
        for a, ax in enumerate(axes):
            shape = [1] * (2 * n)
            shape[a], shape[n + a] = ax.q1 - ax.q0, ax.k1 - ax.k0
            v = ax.visible.view(shape)
            visible = v if visible is None else visible & v
            flat = flat + ax.offset.view(shape) * math.prod(table[a + 1 :])
        assert visible is not None and isinstance(flat, Tensor)  # a grid has one axis or more
        L, S = q_index[0].numel(), k_index[0].numel()
        full = tuple(ax.q1 - ax.q0 for ax in axes) + tuple(ax.k1 - ax.k0 for ax in axes)
        groups.append(
            _Group(
                torch.stack(q_index), torch.stack(k_index), visible.expand(full).reshape(L, S), flat.expand(full).reshape(L, S)
            )
        )
    return groups


def _product(iterables):
    out = [()]
    for it in iterables:
        out = [prefix + (x,) for prefix in out for x in it]
    return out


def _masks(groups: list[_Group], rpb: Tensor | None, dtype: torch.dtype) -> list[Tensor]:
    """Every group's additive mask: 0 (or the bias) where visible, -inf elsewhere;
    (1, 1, L, S) without a bias table, (1, H, L, S) with one."""
    table = None if rpb is None else rpb.detach().reshape(rpb.shape[0], -1).to(dtype)
    out = []
    for g in groups:
        if table is None:
            out.append(torch.zeros(g.visible.shape, dtype=dtype).masked_fill(~g.visible, -math.inf)[None, None])
        else:
            out.append(table[:, g.table_index].masked_fill(~g.visible, -math.inf)[None])
    return out


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """x (B, H, N, W) at positions index (boxes, L) -> (boxes * B, H, L, W), the op's layout."""
    B, H, _, W = x.shape
    nb, L = index.shape
    return x.index_select(2, index.reshape(-1)).view(B, H, nb, L, W).permute(2, 0, 1, 3, 4).reshape(nb * B, H, L, W)


def _ungather(x: Tensor, B: int) -> Tensor:
    """(boxes * B, H, L, ...) -> (B, H, boxes * L, ...), rows in the order of index.reshape(-1)."""
    nbB, H, L = x.shape[:3]
    x = x.view(nbB // B, B, H, L, *x.shape[3:]).movedim(0, 2)
    return x.reshape(B, H, (nbB // B) * L, *x.shape[4:])


def _forward(groups, q: Tensor, k: Tensor, v: Tensor, scale: float, rpb: Tensor | None) -> tuple[Tensor, Tensor]:
    B, Hq, N, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    mask_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    width = max(D, Dv)  # the op wants one head size: pad the smaller with zero columns
    q, k, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    out = torch.empty(B, Hq, N, width, dtype=q.dtype)
    lse = torch.empty(B, Hq, N, dtype=lse_dtype)
    for group, mask in zip(groups, _masks(groups, rpb, mask_dtype)):
        for q_index, k_index in group.chunks(B * Hkv * width):
            o, l = _op(_gather(q, q_index), _gather(k, k_index), _gather(v, k_index), 0.0, False, attn_mask=mask, scale=scale)
            rows = q_index.reshape(-1)
            out.index_copy_(2, rows, _ungather(o, B))
            lse.index_copy_(2, rows, _ungather(l.to(lse_dtype), B))
    return out[..., :Dv], lse


def _probabilities(q: Tensor, k: Tensor, lse: Tensor, mask: Tensor, scale: float, cd) -> tuple[Tensor, Tensor]:
    """Gathered boxes q (nb*B, Hq, L, D), k (nb*B, Hkv, S, D): scores with -inf where
    masked, and P = exp(S - lse)."""
    nbB, Hq, L, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    s = torch.matmul(q.to(cd).reshape(nbB, Hkv, (Hq // Hkv) * L, -1), k.to(cd).transpose(-1, -2)).view(nbB, Hq, L, S)
    s = s * scale + mask
    return s, torch.exp(s - lse.to(cd).unsqueeze(-1))


class _NeighborhoodFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, groups, scale, q, k, v, rpb):
        out, lse = _forward(groups, q, k, v, scale, rpb)
        ctx.groups, ctx.scale = groups, scale
        ctx.save_for_backward(q, k, v, rpb, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        groups, scale = ctx.groups, ctx.scale
        q, k, v, rpb, out, lse = ctx.saved_tensors
        B, Hq, N, D = q.shape
        Hkv, Dv = k.shape[1], v.shape[-1]
        G = Hq // Hkv
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        # dS = P * (dP - delta), delta = rowsum(dO * O) minus any gradient reaching lse.
        delta = (grad_out.to(cd) * out.to(cd)).sum(-1)
        if grad_lse is not None:
            delta = delta - grad_lse.to(cd)
        dq = torch.zeros(B, Hq, N, D, dtype=cd)
        dk = torch.zeros(B, Hkv, N, D, dtype=cd)
        dv = torch.zeros(B, Hkv, N, Dv, dtype=cd)
        drpb = None if rpb is None or not ctx.needs_input_grad[5] else torch.zeros(Hq, rpb[0].numel(), dtype=cd)
        row_stats = torch.stack([lse.to(cd), delta], dim=-1)  # gathered together
        for group, mask in zip(groups, _masks(groups, rpb, cd)):
            for q_index, k_index in group.chunks(B * Hkv * max(D, Dv)):
                nbB, L, S = q_index.shape[0] * B, q_index.shape[1], k_index.shape[1]
                qt, kt, vt, go = _gather(q, q_index), _gather(k, k_index), _gather(v, k_index), _gather(grad_out, q_index)
                stats = _gather(row_stats, q_index)
                _, p = _probabilities(qt, kt, stats[..., 0], mask, scale, cd)
                qt, kt, vt = (t.to(cd) for t in (qt, kt, vt))
                go = go.to(cd).reshape(nbB, Hkv, G * L, Dv)
                dp = torch.matmul(go, vt.transpose(-1, -2)).view(nbB, Hq, L, S)
                ds = p * (dp - stats[..., 1:])
                dsg, pg = ds.view(nbB, Hkv, G * L, S), p.view(nbB, Hkv, G * L, S)
                rows, keys = q_index.reshape(-1), k_index.reshape(-1)
                dq.index_copy_(2, rows, _ungather((torch.matmul(dsg, kt) * scale).view(nbB, Hq, L, D), B))
                dk.index_add_(2, keys, _ungather(torch.matmul(dsg.transpose(-1, -2), qt.reshape(nbB, Hkv, G * L, D)) * scale, B))
                dv.index_add_(2, keys, _ungather(torch.matmul(pg.transpose(-1, -2), go), B))
                if drpb is not None:
                    # Masked pairs have P = 0, hence dS = 0: their clamped table index is harmless.
                    drpb.index_add_(1, group.table_index.reshape(-1), ds.sum(0).reshape(Hq, L * S))
        if drpb is not None:
            drpb = drpb.view(rpb.shape).to(rpb.dtype)
        return None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), drpb


@register("neighborhood")
class NeighborhoodAttention(Mechanism):
    """Neighborhood attention (NAT, arXiv 2204.07143; DiNAT, arXiv 2209.15001).

    Args:
        kernel: window size per axis (int or one per axis).
        grid: the token grid, e.g. (height, width), flattened row-major into the sequence;
            None means 1-D over the whole sequence.
        dilation, stride, causal: per axis (or one value for all), NATTEN's meaning.
        rpb: learn a relative positional bias table ``self.rpb`` of shape
            (num_heads, 2 * kernel - 1 per axis), initialised as NAT does (truncated
            normal, std 0.02).
        num_heads: query heads; required with ``rpb=True``.
        tile: query box per axis of the fast path (default: ``DEFAULT_TILE``).

    In a decoder (``attnkit.nn``, ``attnkit.hf``) the call's causal mask needs
    ``causal=True``. A 1-D causal neighbourhood with stride 1 (any dilation) is a
    dilated sliding window whose keys depend on the query's position only, so it also
    decodes against a KV cache (Nq < Nk, queries bottom-right), runs sequences shorter
    than ``kernel * dilation``, and takes key masks (padding); these calls run the dense
    formula on the call's rows. Every other neighbourhood shifts its windows at the
    borders of the whole grid, so it is self-attention over one complete grid (Nq = Nk)
    and refuses a cache with a ValueError.
    """

    paper = "arXiv:2204.07143"

    @classmethod
    def layer_keywords(cls, params: dict) -> set[str]:
        # The layer's head count sizes the bias table; without one it is not wanted.
        return {"num_heads"} if params.get("rpb") else set()

    def __init__(
        self, kernel=7, grid=None, dilation=1, stride=1, causal=False, rpb: bool = False, num_heads: int | None = None, tile=None
    ):
        super().__init__()
        if grid is not None:
            grid = tuple(grid)
            if not 1 <= len(grid) <= 3:
                raise ValueError(f"grid: expected 1 to 3 axes, e.g. (height, width), got {grid!r}")
        rank = 1 if grid is None else len(grid)
        self.grid, self.kernel, self.dilation, self.stride, self.causal = grid, kernel, dilation, stride, causal
        # Validate every parameter now; a 1-D call without a grid is re-checked against Nk.
        probe = self._neighborhood(grid or (_axis_values(kernel, 1, "kernel")[0] * _axis_values(dilation, 1, "dilation")[0],))
        self.tile = DEFAULT_TILE[rank] if tile is None else _axis_values(tile, rank, "tile")
        if rpb:
            if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
                raise ValueError(
                    f"num_heads: expected an int >= 1 (the table has one slice per query head) with rpb=True, got {num_heads!r}"
                )
            self.rpb = nn.Parameter(torch.empty(num_heads, *(2 * k - 1 for k in probe.kernel)))
            nn.init.trunc_normal_(self.rpb, std=0.02)
        else:
            if num_heads is not None:
                raise ValueError("num_heads: only used with rpb=True")
            self.register_parameter("rpb", None)
        self._layouts: dict = {}

    def _neighborhood(self, grid) -> Neighborhood:
        return Neighborhood(grid, self.kernel, self.dilation, self.causal, self.stride)

    def mask(self, n: int) -> Neighborhood:
        """The visibility rule of a call over ``n`` tokens (a ``Neighborhood`` mask)."""
        grid = self.grid or (n,)
        if math.prod(grid) != n:
            raise ValueError(
                f"q, k, v: neighborhood attention over grid {grid} needs Nq == Nk == {math.prod(grid)} tokens, got {n}"
            )
        return self._neighborhood(grid)

    @property
    def sliding(self) -> bool:
        """1-D, causal, stride 1: a dilated sliding window that depends on the query's
        position only (so it decodes with a cache and takes padding)."""
        return self.grid is None and all(_axis_flags(self.causal, 1)) and _axis_values(self.stride, 1, "stride") == (1,)

    def _check_call(self, q, k, v, mask, score, scale, sinks, backend):
        """(request, Neighborhood mask or None for the dense sliding-window path, key mask (B, Nk) or None)."""
        req = make_request(q, k, v, scale=scale)
        keep, rest = None, []
        for part in and_parts(mask):
            if isinstance(part, Causal):
                # A causal neighbourhood hides every later token (on a grid, in raster
                # order too), so a decoder's causal mask adds nothing: accept it.
                if not all(_axis_flags(self.causal, len(self.grid or (1,)))):
                    raise ValueError(
                        f"mask: got causal() (a decoder) but this neighborhood attention has causal={self.causal!r}; "
                        "build it with causal=True so that no query sees a later token"
                    )
            elif is_key_mask(part) and self.sliding:
                _, kept = split_key_masks(part, req.batch, req.heads, req.q_len, req.k_len)
                keep = kept if keep is None else keep & kept
            else:
                rest.append(part)
        for name, value in (("mask", rest[0] if rest else None), ("score", score), ("sinks", sinks)):
            if value is not None:
                raise ValueError(
                    f"{name}: neighborhood attention defines its own visibility and bias (kernel, dilation, stride, causal, rpb); got {name}={value!r}"
                )
        if backend not in ("auto", "reference"):
            raise ValueError(f"backend: neighborhood attention runs 'auto' (its fast path) or 'reference', got {backend!r}")
        if self.rpb is not None and self.rpb.shape[0] != req.heads:
            raise ValueError(f"rpb: table has {self.rpb.shape[0]} heads but the call has Hq={req.heads}")
        if req.q_len > req.k_len or (req.q_len < req.k_len and not self.sliding):
            raise ValueError(
                f"q, k: neighborhood attention is self-attention over a grid: Nq={req.q_len} must equal Nk={req.k_len} "
                "(only a 1-D causal neighbourhood with stride 1 decodes against a cache: its windows do not depend on the grid's end)"
            )
        span = (
            _axis_values(self.kernel, 1, "kernel")[0] * _axis_values(self.dilation, 1, "dilation")[0] if self.grid is None else 0
        )
        if self.sliding and (keep is not None or req.q_len < req.k_len or req.k_len < span):
            return req, None, keep
        return req, self.mask(req.k_len), None

    def _sliding(self, req, keep, cd) -> tuple[Tensor, Tensor]:
        """Logits (B, Hq, Nq, Nk) with the bias and -inf outside the window or the key mask,
        for the call's queries at key positions Nk - Nq + i (dense: decoding, padding,
        short sequences)."""
        kernel, dilation = _axis_values(self.kernel, 1, "kernel")[0], _axis_values(self.dilation, 1, "dilation")[0]
        G = req.heads // req.kv_heads
        s = torch.matmul(req.q.to(cd), req.k.to(cd).repeat_interleave(G, 1).transpose(-1, -2)) * req.scale
        qp = torch.arange(req.k_len - req.q_len, req.k_len, device=s.device)[:, None]
        kp = torch.arange(req.k_len, device=s.device)[None, :]
        back = qp - kp  # how far back the key is
        visible = (back >= 0) & (back % dilation == 0) & (back // dilation <= kernel - 1)
        if self.rpb is not None:
            s = s + self.rpb[:, (kernel - 1 - back // dilation).clamp(0, 2 * kernel - 2)].to(cd)
        visible = visible[None, None]
        if keep is not None:
            visible = visible & keep[:, None, None, :]
        return s.masked_fill(~visible, -math.inf), visible

    def _dense_rows(self, req, keep) -> tuple[Tensor, Tensor]:
        cd = torch.float64 if req.q.dtype == torch.float64 else torch.float32
        s, visible = self._sliding(req, keep, cd)
        lse = torch.logsumexp(s, dim=-1)
        # Rows that see no key (padding) give zeros and lse = -inf, never NaN.
        p = torch.where(visible, torch.exp(s - lse.clamp(min=torch.finfo(cd).min).unsqueeze(-1)), torch.zeros((), dtype=cd))
        out = torch.matmul(p, req.v.to(cd).repeat_interleave(req.heads // req.kv_heads, 1)).to(req.q.dtype)
        return out, lse

    # not the template: its own visibility and checks (masks other than causal or padding refused), its messages
    def forward(
        self,
        q,
        k,
        v,
        *,
        mask=None,
        score=None,
        scale=None,
        sinks=None,
        return_lse=False,
        backend="auto",
        check_finite=True,
        observers=None,
        layer=None,
    ):
        req, nbh, keep = self._check_call(q, k, v, mask, score, scale, sinks, backend)
        if backend == "reference" and observers:
            raise ValueError("observers: the dense reference (backend='reference') feeds no observers; use backend='auto'")
        if nbh is None:
            out, lse = self._dense_rows(req, keep)
            if observers:
                call = CallInfo(req.batch, req.heads, req.q_len, req.k_len, req.k_len - req.q_len, layer, self.name)
                cd = torch.float64 if req.q.dtype == torch.float64 else torch.float32
                with torch.no_grad():
                    s, visible = self._sliding(req, keep, cd)
                    p = torch.where(
                        visible,
                        torch.exp(s - lse.detach().clamp(min=torch.finfo(cd).min).unsqueeze(-1)),
                        torch.zeros((), dtype=cd),
                    )
                feed(
                    observers,
                    call,
                    [
                        AttentionTile(
                            call,
                            torch.arange(req.batch),
                            torch.arange(req.k_len - req.q_len, req.k_len),
                            torch.arange(req.k_len),
                            p,
                            s,
                        )
                    ],
                )
        elif backend == "reference":
            out, lse = self.reference(q, k, v, scale=scale, return_lse=True)
        else:
            groups = self._groups(nbh)
            out, lse = _NeighborhoodFunction.apply(groups, req.scale, q, k, v, self.rpb)
            if observers:
                call = CallInfo(req.batch, req.heads, req.q_len, req.k_len, 0, layer, self.name)
                feed(observers, call, self._tiles(groups, req, lse, call))
        if check_finite and not all_finite(out):
            raise nonfinite_error(req)
        return (out, lse) if return_lse else out

    def _groups(self, nbh: Neighborhood) -> list[_Group]:
        key = (nbh.grid, self.tile)
        if key not in self._layouts:  # fixed by the grid: built once per grid, a few kept
            if len(self._layouts) >= 8:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = _layout(nbh, self.tile)
        return self._layouts[key]

    def _tiles(self, groups: list[_Group], req, lse: Tensor, call: CallInfo):
        """The softmax weights of every box, for observers (second pass, O(box) memory)."""
        cd = torch.float64 if req.q.dtype == torch.float64 else torch.float32
        B = req.batch
        with torch.no_grad():
            lse = lse.detach()
            for group, mask in zip(groups, _masks(groups, self.rpb, cd)):
                for q_index, k_index in group.chunks(B * req.kv_heads * req.head_dim):
                    s, p = _probabilities(
                        _gather(req.q, q_index),
                        _gather(req.k, k_index),
                        _gather(lse.unsqueeze(-1), q_index)[..., 0],
                        mask,
                        req.scale,
                        cd,
                    )
                    for i in range(q_index.shape[0]):
                        rows = slice(i * B, (i + 1) * B)
                        yield AttentionTile(call, torch.arange(B), q_index[i], k_index[i], p[rows], s[rows])

    def reference(self, q, k, v, *, scale=None, return_lse=False, mask=None, **_):
        """Dense literal formula: softmax(q k^T * scale + rpb[h, offset]) over the
        neighbourhood of every query, O(N^2) memory."""
        req, nbh, keep = self._check_call(q, k, v, mask, None, scale, None, "reference")
        if nbh is None:
            out, lse = self._dense_rows(req, keep)
            return (out, lse) if return_lse else out
        nbh = self.mask(req.k_len)
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        G = req.heads // req.kv_heads
        s = torch.matmul(q.to(cd), k.to(cd).repeat_interleave(G, 1).transpose(-1, -2)) * req.scale
        pos = torch.arange(req.k_len)
        visible = nbh(None, None, pos[:, None], pos[None, :])
        if self.rpb is not None:
            qc, kc = nbh.coords(pos[:, None]), nbh.coords(pos[None, :])
            index = [
                ((kc[a] - qc[a]) // nbh.dilation[a] + nbh.kernel[a] - 1).clamp(0, 2 * nbh.kernel[a] - 2)
                for a in range(len(nbh.grid))
            ]
            s = s + self.rpb[(slice(None), *index)].to(cd)
        s = s.masked_fill(~visible, -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse[..., None]), v.to(cd).repeat_interleave(G, 1)).to(q.dtype)
        return (out, lse) if return_lse else out

    def extra_repr(self) -> str:
        parts = [super().extra_repr(), f"kernel={self.kernel}", f"grid={self.grid}"]
        for name, default in (("dilation", 1), ("stride", 1), ("causal", False)):
            if getattr(self, name) != default:
                parts.append(f"{name}={getattr(self, name)}")
        if self.rpb is not None:
            parts.append(f"rpb={tuple(self.rpb.shape)}")
        return ", ".join(parts)


def _axis_flags(value, n: int) -> tuple[bool, ...]:
    return tuple(bool(x) for x in value) if isinstance(value, (tuple, list)) else (bool(value),) * n


def _axis_values(value, n: int, name: str) -> tuple[int, ...]:
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * n
    if len(values) != n or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in values):
        raise ValueError(f"{name}: expected an int >= 1 or {n} of them (one per grid axis), got {value!r}")
    return values
