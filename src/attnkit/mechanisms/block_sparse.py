"""Block-sparse prefill with per-head vertical-slash patterns (MInference, Jiang et al.
2024, arXiv 2407.02490), for pretrained causal models.

Long-context attention heads mostly look at a few fixed keys (vertical lines: sinks,
separators) and at fixed distances (slash lines: local context, periodic structure).
MInference estimates both from the last ``last_q`` queries of every head: their exact
causal attention is summed down columns (vertical scores) and along diagonals key =
query - delta (slash scores); the first ``sink_tokens`` keys and the ``local_tokens``
nearest diagonals are always kept, and the top ``vertical_size`` columns and
``slash_size`` diagonals are chosen. Here the lines are rounded out to the
``block_size`` x ``block_size`` blocks they cross, and attention is computed exactly on
those blocks (causal within them).

Fast path: every query block's own (diagonal) block is one batched causal call of torch's
fused CPU flash op for all blocks and heads; its other chosen blocks lie wholly before it,
so their keys are gathered into one contiguous span per query block and run as one more
call per head, with only a key-padding mask. The two partial results merge by lse; the
backward is the op's own (``FlashWithLse``).

The share of the estimating queries' attention mass that falls inside the chosen blocks,
and the fraction of causal blocks computed, are kept per head in ``last_stats`` after a
call (``attnkit.approx_error`` measures the true recall over all queries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import make_request
from ..kernels.flash import FlashWithLse, merge_partial
from ..kernels.observe_pass import softmax_tiles
from ..kernels.request import all_finite, nonfinite_error
from ..mods.grid import EMPTY, FULL, classify_interval, states
from ..mods.masks import Causal, Mask
from ..observe import CallInfo, feed, interested
from .base import Mechanism, register
from .key_masks import and_parts, is_key_mask, padding_refused

Tensor = torch.Tensor


class BlockPattern(Mask):
    """Causal attention restricted to chosen blocks: ``blocks`` (B, H, n, n) bool over
    key positions cut into blocks of ``block_size`` (query position p is in block p // bs)."""

    batch_dependent = True

    def __init__(self, blocks: Tensor, block_size: int):
        self.blocks, self.block_size = blocks, block_size

    def __call__(self, b, h, q_idx, kv_idx):
        bs = self.block_size
        return self.blocks[b, h, q_idx // bs, kv_idx // bs] & (kv_idx <= q_idx)

    def classify(self, grid):
        bs = self.block_size
        q_lo, q_hi = grid.q_bounds()
        k_lo, k_hi = grid.k_bounds()
        r0, r1 = q_lo // bs, (q_hi - 1) // bs + 1  # pattern blocks a tile touches
        c0, c1 = k_lo // bs, (k_hi - 1) // bs + 1
        # Chosen blocks in every tile's rectangle of pattern blocks, from 2-D prefix sums.
        cum = torch.nn.functional.pad(self.blocks.long().cumsum(2).cumsum(3), (1, 0, 1, 0))
        count = cum[:, :, r1, c1] - cum[:, :, r0, c1] - cum[:, :, r1, c0] + cum[:, :, r0, c0]
        causal = classify_interval(grid, None, 0)
        empty = ~(count > 0).any(1) | (causal == EMPTY)  # no head needs the tile
        full = (count == (r1 - r0) * (c1 - c0)).all(1) & (causal == FULL)
        return states(full, empty)

    def check(self, batch, heads, q_len, k_len):
        n = -(-k_len // self.block_size)
        if self.blocks.shape != (batch, heads, n, n):
            raise ValueError(
                f"block pattern: expected blocks of shape ({batch}, {heads}, {n}, {n}), got {tuple(self.blocks.shape)}"
            )

    def __repr__(self):
        return f"block_pattern({self.blocks.shape[-1]}x{self.blocks.shape[-1]} blocks of {self.block_size})"


@dataclass(frozen=True)
class BlockSparseStats:
    """Per (batch row, query head): the estimating queries' exact attention mass inside
    the chosen blocks, and the fraction of the causal blocks of the call computed."""

    kept_mass: Tensor  # (B, Hq)
    density: Tensor  # (B, Hq)


@register("block_sparse")
class BlockSparsePrefill(Mechanism):
    """MInference vertical-slash block-sparse prefill (arXiv 2407.02490).

    Args:
        block_size: side of the attention blocks.
        last_q: queries (the last ones) that estimate each head's pattern.
        vertical_size, slash_size: columns and diagonals kept per head (forced ones included).
        sink_tokens: first keys always kept as vertical lines (MInference: 30).
        local_tokens: nearest diagonals always kept (MInference: 100; >= 1 keeps the diagonal).
    """

    paper = "arXiv:2407.02490"
    # The pattern comes from the call's last queries: a prefill method (the paper decodes
    # with dense attention), whose rows depend on the rest of the call.
    decodes = False
    decode_note = (
        "block-sparse prefill estimates its pattern from the last queries of the call, so a query's row depends on "
        "the other queries of the call; MInference prefills only and decodes with dense attention (mechanism='softmax')."
    )

    def __init__(
        self,
        block_size: int = 64,
        last_q: int = 64,
        vertical_size: int = 128,
        slash_size: int = 256,
        sink_tokens: int = 30,
        local_tokens: int = 100,
    ):
        super().__init__()
        for name, value, low in (
            ("block_size", block_size, 1),
            ("last_q", last_q, 1),
            ("vertical_size", vertical_size, 1),
            ("slash_size", slash_size, 1),
            ("sink_tokens", sink_tokens, 0),
            ("local_tokens", local_tokens, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        if sink_tokens > vertical_size:
            raise ValueError(f"sink_tokens: the forced columns must fit in vertical_size={vertical_size}, got {sink_tokens}")
        if local_tokens > slash_size:
            raise ValueError(f"local_tokens: the forced diagonals must fit in slash_size={slash_size}, got {local_tokens}")
        self.block_size, self.last_q = block_size, last_q
        self.vertical_size, self.slash_size = vertical_size, slash_size
        self.sink_tokens, self.local_tokens = sink_tokens, local_tokens
        self.last_stats: BlockSparseStats | None = None

    def estimate(self, q: Tensor, k: Tensor, scale: float) -> tuple[Tensor, BlockSparseStats]:
        """Chosen blocks (B, Hq, n, n) over positions, n = ceil(Nk / block_size), and stats."""
        B, Hq, Nq, _ = q.shape
        Nk, bs = k.shape[2], self.block_size
        G = Hq // k.shape[1]
        n = -(-Nk // bs)
        last = min(self.last_q, Nq)
        with torch.no_grad():
            pos = torch.arange(Nq - last, Nq) + Nk - Nq  # positions of the estimating queries
            key = torch.arange(Nk)
            s = torch.matmul(q[:, :, -last:].float(), k.float().repeat_interleave(G, 1).transpose(-1, -2)) * scale
            a = torch.softmax(s.masked_fill(key > pos[:, None], -math.inf), dim=-1)  # (B, Hq, last, Nk)
            vertical = a.sum(2)
            vertical[..., : self.sink_tokens] = math.inf
            columns = torch.topk(vertical, min(self.vertical_size, Nk), dim=-1).indices
            delta = (pos[:, None] - key).clamp(min=0)  # diagonal of every pair; masked pairs carry 0 mass
            slash = torch.zeros(B, Hq, Nk).scatter_add_(2, delta.reshape(1, 1, -1).expand(B, Hq, -1), a.reshape(B, Hq, -1))
            slash[..., : self.local_tokens] = math.inf
            diagonals = torch.topk(slash, min(self.slash_size, Nk), dim=-1).indices

            # A column in key block c covers (qb, c) for every query block qb >= c; a
            # diagonal delta crosses block offsets floor(delta / bs) and ceil(delta / bs).
            cols = torch.zeros(B, Hq, n, dtype=torch.bool).scatter_(2, columns // bs, True)
            offsets = torch.zeros(B, Hq, n + 1, dtype=torch.bool)
            offsets.scatter_(2, diagonals // bs, True).scatter_(2, (diagonals + bs - 1) // bs, True)
            qb, kb = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
            lower = kb <= qb
            blocks = (cols[:, :, None, :] | offsets[:, :, (qb - kb).clamp(min=0)]) & lower

            chosen = blocks[:, :, pos // bs][..., key // bs]  # (B, Hq, last, Nk)
            kept = (a * chosen).sum((2, 3)) / last
            rows = torch.zeros(n, dtype=torch.bool)
            rows[(Nk - Nq) // bs :] = True  # query blocks that hold queries
            density = (blocks & rows[:, None]).sum((2, 3)) / (lower & rows[:, None]).sum()
        return blocks, BlockSparseStats(kept, density.float())

    def _check_call(self, q, k, v, mask, score, sinks, scale, backend):
        req = make_request(q, k, v, scale=scale)
        if any(is_key_mask(p) for p in and_parts(mask)):
            raise padding_refused(
                "block-sparse prefill", "it estimates each head's pattern from the call's last queries, which padding changes."
            )
        if not isinstance(mask, Causal):
            raise ValueError(f"mask: block-sparse prefill is for causal models; pass mask=attnkit.causal(), got {mask!r}")
        for name, value in (("score", score), ("sinks", sinks)):
            if value is not None:
                raise ValueError(f"{name}: block-sparse prefill takes no {name}, got {value!r}")
        if backend not in ("auto", "reference"):
            raise ValueError(f"backend: block-sparse prefill runs 'auto' (its fast path) or 'reference', got {backend!r}")
        if req.q_len > req.k_len:
            raise ValueError(
                f"q, k: block-sparse prefill needs Nq <= Nk (queries are the last Nq positions), got Nq={req.q_len}, Nk={req.k_len}"
            )
        return req

    # not the template: its own checks and messages (causal mask only, no score or sinks, 'auto' or 'reference')
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
        req = self._check_call(q, k, v, mask, score, sinks, scale, backend)
        if backend == "reference" and observers:
            raise ValueError("observers: the dense reference (backend='reference') feeds no observers; use backend='auto'")
        if backend == "reference":
            return self.reference(q, k, v, mask=mask, scale=scale, return_lse=return_lse)
        blocks, self.last_stats = self.estimate(q, k, req.scale)
        out, lse = self._sparse(q, k, v, blocks, req)
        if observers:
            whole = make_request(q, k, v, mask=BlockPattern(blocks, self.block_size), scale=req.scale)
            call = CallInfo(req.batch, req.heads, req.q_len, req.k_len, req.q_start, layer, self.name)
            _, union = interested(observers, call)
            feed(observers, call, softmax_tiles(whole, lse, call, union))
        if check_finite and not all_finite(out):
            raise nonfinite_error(req)
        return (out, lse) if return_lse else out

    def _sparse(self, q, k, v, blocks, req) -> tuple[Tensor, Tensor]:
        """Exact attention on the chosen blocks: diagonal blocks in one causal call, the
        other chosen blocks gathered per query block."""
        bs = self.block_size
        B, Hq, Nq, D = q.shape
        Hkv, Nk, Dv = req.kv_heads, req.k_len, req.v_dim
        G = Hq // Hkv
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        n = -(-Nk // bs)
        first = req.q_start // bs  # first position block holding a query
        m = n - first
        offset = req.q_start - first * bs
        width = max(D, Dv)  # the op wants one head size: pad the smaller with zero columns
        q, k, v = (F.pad(t.to(cd), (0, width - t.shape[-1])) for t in (q, k, v))
        # Queries cut into position blocks (zero rows before q_start), keys into blocks.
        qb = F.pad(q, (0, 0, offset, m * bs - offset - Nq)).view(B, Hq, m, bs, width)
        kb, vb = (F.pad(t, (0, 0, 0, n * bs - Nk)).view(B, Hkv, n, bs, width) for t in (k, v))
        # Diagonal: each query block against its own key block. Padded keys sit after
        # every real query of their block, so the causal cut hides them.
        cut = lambda x, heads, src: x[:, :, src:].transpose(1, 2).reshape(B * m, heads, bs, width)
        o, lse = FlashWithLse.apply(cut(qb, Hq, 0), cut(kb, Hkv, first), cut(vb, Hkv, first), None, req.scale, True)
        o = o.view(B, m, Hq, bs, width).transpose(1, 2)
        lse = lse.view(B, m, Hq, bs).transpose(1, 2)
        # Other chosen blocks: below the diagonal, wholly visible; gathered per query block.
        below = blocks[:, :, first:] & (torch.arange(n) < torch.arange(first, n).view(-1, 1))
        count = below.sum(-1)  # (B, Hq, m)
        # A compiled graph cannot branch on the counts, only on whether any row could have blocks.
        traced = torch.compiler.is_compiling()
        if (n > 1) if traced else bool(count.max()):
            chosen_first = torch.sort((~below).to(torch.uint8), dim=-1, stable=True).indices  # chosen ids first
            # Key block ids as rows of k (B * Hkv * n blocks), for every query head.
            kv_row = (torch.arange(B).view(B, 1) * Hkv + torch.arange(Hq).view(1, Hq) // G) * n
            ids = (chosen_first + kv_row.view(B, Hq, 1, 1)).reshape(B * Hq * m, n)
            o2, l2 = self._gathered(
                qb.reshape(B * Hq * m, bs * width),
                kb.reshape(-1, bs * width),
                vb.reshape(-1, bs * width),
                ids,
                count.reshape(-1),
                req.scale,
                (first, m) if traced else None,
            )
            o, lse = merge_partial(o, lse.to(cd), o2.view(B, Hq, m, bs, width), l2.view(B, Hq, m, bs).to(cd))
        o = o.reshape(B, Hq, m * bs, width)[:, :, offset : offset + Nq, :Dv]
        lse = lse.reshape(B, Hq, m * bs)[:, :, offset : offset + Nq]
        return o.to(req.q.dtype), lse

    GROUP = 32  # query blocks per call, sorted by how many blocks they read (little padding)

    def _gathered(
        self,
        q_rows: Tensor,
        k_rows: Tensor,
        v_rows: Tensor,
        ids: Tensor,
        count: Tensor,
        scale: float,
        static: tuple[int, int] | None = None,
    ):
        """Query blocks (rows of q_rows, one block of bs * W each) against their key blocks
        ``ids[i, :count[i]]`` (rows of k_rows, v_rows), all wholly visible. Blocks are
        sorted by count and run ``GROUP`` at a time, padded to the group's longest.

        ``static = (first, m)`` (under torch.compile, where shapes cannot depend on the
        counts): rows in their own order, each group padded to the most blocks its rows
        could hold (row i is query block i % m, with at most first + i % m blocks before it)."""
        rows, W = q_rows.shape[0], q_rows.shape[1] // self.block_size
        bs = self.block_size
        lse_dtype = torch.float64 if q_rows.dtype == torch.float64 else torch.float32
        order = torch.arange(rows) if static else torch.sort(count, stable=True).indices
        outs, lses = [], []
        for g0 in range(0, rows, self.GROUP):
            group = order[g0 : g0 + self.GROUP]
            if static:
                first, m = static
                g = min(rows, g0 + self.GROUP) - g0
                span = first + max(r % m for r in range(g0, g0 + g))
            else:
                g, span = group.numel(), int(count[group].max())
            if span == 0:  # nothing besides the diagonal: an empty part (0, -inf)
                outs.append(q_rows.new_zeros(g, 1, bs, W))
                lses.append(torch.full((g, 1, bs), -math.inf, dtype=lse_dtype))
                continue
            sel = ids[group, :span].reshape(-1)
            empty = torch.arange(span) >= count[group].unsqueeze(1)  # padding slots of shorter rows
            mask = torch.zeros(empty.shape, dtype=q_rows.dtype).masked_fill(empty, -math.inf)
            o, l = FlashWithLse.apply(
                q_rows.index_select(0, group).view(g, 1, bs, W),
                k_rows.index_select(0, sel).view(g, 1, span * bs, W),
                v_rows.index_select(0, sel).view(g, 1, span * bs, W),
                mask.repeat_interleave(bs, dim=1).view(g, 1, 1, span * bs),
                scale,
            )
            outs.append(o)
            lses.append(l)
        if static:
            return torch.cat(outs), torch.cat(lses)
        back = torch.sort(order).indices  # inverse permutation
        return torch.cat(outs).index_select(0, back), torch.cat(lses).index_select(0, back)

    def reference(self, q, k, v, *, mask=None, scale=None, return_lse=False, **_):
        """Dense softmax over the chosen blocks (causal within them), O(N^2) memory."""
        req = self._check_call(q, k, v, mask, None, None, scale, "auto")
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        G = req.heads // req.kv_heads
        blocks, _ = self.estimate(q, k, req.scale)
        pos = torch.arange(req.q_len) + req.q_start
        key = torch.arange(req.k_len)
        visible = blocks[:, :, (pos // self.block_size)][..., key // self.block_size] & (key <= pos[:, None])
        s = torch.matmul(q.to(cd), k.to(cd).repeat_interleave(G, 1).transpose(-1, -2)) * req.scale
        s = s.masked_fill(~visible, -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse[..., None]), v.to(cd).repeat_interleave(G, 1)).to(q.dtype)
        return (out, lse) if return_lse else out
