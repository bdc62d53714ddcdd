"""Native Sparse Attention (Yuan et al., DeepSeek 2025, arXiv 2502.11089).

Every query t (causal) mixes three attentions with per-head gates g in [0, 1]:

    o_t = g_cmp * Attn(q_t, K~cmp, V~cmp) + g_slc * Attn(q_t, K_slc, V_slc) + g_win * Attn(q_t, K_win, V_win)

- compression: the keys (and values) of every block of ``compress_block`` tokens, taken
  every ``compress_stride`` tokens, are squeezed into one key by phi — the block mean, or
  a learned MLP over the block with an intra-block position embedding (eq. 7). A query
  sees the compressed blocks that are complete at its position.
- selection: the compression branch's probabilities p_cmp score the selection blocks of
  ``select_block`` tokens. Block j gets the mass of the compressed blocks that overlap it
  (eq. 9's "spatial relationship"; p_slc = p_cmp when all three sizes are equal), summed
  over the query heads of a GQA group so the group shares one choice (eq. 10). The
  ``initial_blocks`` first blocks and ``local_blocks`` most recent ones (the query's own
  block included) are always taken, as in the paper's 1 + 2; the rest of the
  ``num_selected`` are the top-scoring earlier blocks (eq. 11). The query then attends to
  the raw tokens of its blocks (causally within its own).
- sliding window: the ``window`` most recent tokens, the query included.

Gates come from the caller (``gates=`` of shape (B, Hq, Nq, 3), the paper's sigmoid MLP
on the input), or from a learnable per-head table ``gate_logits`` (with ``num_heads``),
or are 1/2 each (sigmoid(0)). Any GQA ratio works.

Inference (no gradients, float32, the C library loaded: ``cpu.fused_usable``) runs
three C loops of kernels/cpu/loops_sparse.cpp around torch's sgemm, each adding its gated
share into one output (``_native_forward``): the scoring pass, per chunk of
``SELECT_Q_CHUNK`` queries and GQA group, one sgemm against the compressed keys complete
by the chunk's end, the causal softmax, one sgemm with the compressed values (the
compression branch), the block importance (strided sums of the group's summed p) and
each query's choice (forced blocks, then the top of the rest: a bisected bar, the few
entries that reach it ranked; ties go to the lower block, as in ``reference``); the
selection branch by key block, in spans of ``SELECTED_SPAN_ROWS`` (query, head) rows
whose accumulators stay in cache: the own blocks first (causal), then every block that
a query of the span chose, its rows gathered into tiles of ``SELECTED_TILE_ROWS`` (two
sgemm each) and merged against a fixed per-row reference, as below; the window as one
tile of window - 1 + ``WINDOW_BLOCK_NATIVE`` keys per block of queries. The same
selection and values as the PyTorch path (within float32 rounding), which everything
else takes.

PyTorch path: the compression branch comes out of the pass that scores the blocks (a
softmax over the compressed keys complete by each query-chunk's end, in chunks of
``SELECT_Q_CHUNK`` queries; a selection block's importance is a strided sum of the
compressed blocks overlapping it); with gradients it is an ``attnkit.attention`` call
instead (the compressed causal rule is a structured mask, and the backward keeps O(N)
memory). The sliding window runs query blocks against overlapping strided views of the
keys, with one band mask shared by all but the first blocks. The selection branch groups
queries by key block instead of keys by query: for every key block, the (query, head)
rows that selected it form entries of torch's fused flash op, and the partial results
merge by their lse. Its backward runs the op's backward per block against the final out
and lse. Selection itself is discrete and carries no gradient. Calls and gathers are
kept to ``CALL_ELEMENTS`` each: at long lengths, fresh buffers above glibc's mmap
threshold cost more in page faults than in compute.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu, make_request
from ..kernels.flash import FlashWithLse
from ..kernels.request import all_finite, nonfinite_error
from ..kernels.run import softmax_attention
from ..mods.grid import states
from ..mods.masks import Causal, Mask
from ..observe import AttentionTile, CallInfo, feed
from .base import Mechanism, register
from .key_masks import is_right_padding, padding_refused, split_key_masks

Tensor = torch.Tensor

from ..kernels.fused import flash_backward as _op_backward  # layout-safe wrappers of the private op
from ..kernels.fused import flash_forward as _op

# Query rows per chunk when scoring blocks: little causal waste, and the scores of a chunk
# (4 MiB at N=16384, H=8) stay in cache through the softmax and the block sums.
SELECT_Q_CHUNK = 128
# Queries per block of the sliding-window call, without and with gradients: each block
# computes window - 1 + block keys per query, so smaller blocks waste less (32 measured 5-10%
# faster than 64 or 128 at N=16384, window 512), but the op's backward runs short query
# blocks slowly (128 measured ~2x faster than 32 at N=4096).
WINDOW_BLOCK, WINDOW_BLOCK_GRAD = 32, 128
# Elements of one fused-op call's gathered queries or output (8 MB in float32). Kept under
# glibc's mmap threshold (32 MiB at most) on purpose: a larger buffer is a fresh mapping on
# every call, and its page faults cost more than the copy that fills it.
CALL_ELEMENTS = 1 << 21
# A partial result of the selection branch may outweigh its row's reference by up to
# exp(RESCALE_ABOVE) before the reference moves: 16 such terms stay far below float32's max.
RESCALE_ABOVE = 30.0
# (query, head) rows per tile of the C selection branch and per span of queries whose rows
# stay in cache while the blocks they chose run, and queries per block of the C window (its
# window - 1 + WINDOW_BLOCK_NATIVE keys are one tile).
SELECTED_TILE_ROWS, SELECTED_SPAN_ROWS, WINDOW_BLOCK_NATIVE = 256, 2048, 64
OBSERVE_Q_BLOCK = 128
OBSERVE_K_BLOCK = 512


class CompressedCausal(Mask):
    """Compressed key i (tokens [i * stride, i * stride + block)) is visible to the query at
    token position p once its block is complete: ``i * stride + block - 1 <= p``.

    ``shift`` = Nk - Ncmp turns the query index the kernels pass (a position among the
    Ncmp compressed keys) back into a token position."""

    def __init__(self, block: int, stride: int, shift: int):
        self.block, self.stride, self.shift = block, stride, shift

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx * self.stride + self.block - 1 <= q_idx + self.shift

    def classify(self, grid):
        q_lo, q_hi = grid.q_bounds()
        k_lo, k_hi = grid.k_bounds()
        full = (k_hi - 1) * self.stride + self.block - 1 <= q_lo + self.shift
        empty = k_lo * self.stride + self.block - 1 > q_hi - 1 + self.shift
        return states(full, empty)

    def __repr__(self):
        return f"compressed_causal(block={self.block}, stride={self.stride})"


class CompressMLP(nn.Module):
    """phi of the paper: a block of ``block`` vectors plus a learned intra-block position
    embedding, flattened, through a two-layer MLP to one vector."""

    def __init__(self, block: int, dim: int, hidden: int):
        super().__init__()
        self.position = nn.Parameter(torch.zeros(block, dim))
        self.net = nn.Sequential(nn.Linear(block * dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, blocks: Tensor) -> Tensor:  # (..., block, dim) -> (..., dim)
        x = blocks + self.position.to(blocks.dtype)
        return self.net.to(blocks.dtype)(x.flatten(-2))


class _SelectedAttention(torch.autograd.Function):
    """Causal attention of every query to the raw tokens of its selected blocks.

    ``selection`` (B, Hkv, Nq, n) holds block ids, -1 for an empty slot; the query's own
    block is always among them. The own blocks of all queries are one batched causal call
    (block-diagonal attention). Every other selected block lies wholly before its query,
    so queries are grouped by key block instead of keys by query: the rows (a query with
    the G heads of its group) that chose a block are cut into entries (``_Entries``), and
    each fused-op call runs many entries at once, each against its block's keys.
    Partial results merge by lse against a per-row reference, at first the own block's
    lse: each adds its output times exp(lse - reference). Weights up to exp(RESCALE_ABOVE)
    are harmless (16 of them stay far from overflow), so the reference rises, and the rows
    whose reference rose are rescaled, only when a call brings a block above that margin,
    which ordinary inputs never do: no running max is kept per call, and no (row, slot)
    array is held."""

    @staticmethod
    def forward(ctx, q, k, v, selection, scale, block, q_start):
        B, Hq, Nq, W = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        G = Hq // Hkv
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        diagonal = _Diagonal(block, q_start, Nq, Nk)
        o_own, l_own = diagonal.forward(q, k, v, scale)
        entries = _Entries(selection, diagonal.own, -(-Nk // block))
        # Rows r = (b, kv head, query) hold the G heads of a group; row R is a zero dummy.
        acc = _rows(o_own.to(cd), Hkv)
        top = _rows(l_own.to(cd).unsqueeze(-1), Hkv).squeeze(-1)  # each row's reference, first its own block's lse
        den = torch.ones_like(top)
        q_rows, k_blocks, v_blocks = _rows(q, Hkv), _blocks(k, block), _blocks(v, block)
        for rows, blocks in entries.chunks(G * W):
            o, l = _op(
                _take(q_rows, rows),
                k_blocks.index_select(0, blocks).unsqueeze(1),
                v_blocks.index_select(0, blocks).unsqueeze(1),
                0.0,
                False,
                scale=scale,
            )
            flat = rows.reshape(-1)
            o = o.reshape(-1, G, W).to(cd)
            l = l.reshape(-1, G).to(cd)
            shift = l - top.index_select(0, flat)
            if float(shift.max()) > RESCALE_ABOVE:  # rare: a block far above the row's reference
                new_top = top.scatter_reduce(0, flat.unsqueeze(1).expand(-1, G), l, "amax")
                risen = (new_top > top).any(-1).nonzero().squeeze(1)
                alpha = torch.exp(top.index_select(0, risen) - new_top.index_select(0, risen))
                acc.index_copy_(0, risen, acc.index_select(0, risen).mul_(alpha.unsqueeze(-1)))
                den.index_copy_(0, risen, den.index_select(0, risen).mul_(alpha))
                top = new_top
                shift = l - top.index_select(0, flat)
            w = torch.exp(shift)
            acc.index_add_(0, flat, o.mul_(w.unsqueeze(-1)))
            den.index_add_(0, flat, w)
        out = _unrows(acc.div_(den.unsqueeze(-1)), B, Hkv).to(q.dtype)
        lse = _unrows((top + torch.log(den)).unsqueeze(-1), B, Hkv).squeeze(-1)
        ctx.scale, ctx.entries, ctx.diagonal = scale, entries, diagonal
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        B, Hq, Nq, W = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        block = ctx.diagonal.block
        grad_out = grad_out.to(q.dtype).contiguous()
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        # Given each row's final out and lse, the op's backward over any subset of its keys
        # is exactly that subset's share of dq and its dk, dv (FlashAttention-2).
        dq, dk, dv = ctx.diagonal.backward(grad_out, q, k, v, out, lse, ctx.scale)
        dq_rows = _rows(dq, Hkv)
        dk_blocks, dv_blocks = _blocks(dk, block), _blocks(dv, block)
        q_rows, o_rows, g_rows = _rows(q, Hkv), _rows(out, Hkv), _rows(grad_out, Hkv)
        l_rows = _rows(lse.unsqueeze(-1), Hkv).squeeze(-1)
        k_blocks, v_blocks = _blocks(k, block), _blocks(v, block)
        for rows, blocks in ctx.entries.chunks(G * W):
            kb, vb = k_blocks.index_select(0, blocks).unsqueeze(1), v_blocks.index_select(0, blocks).unsqueeze(1)
            gq, gk, gv = _op_backward(
                _take(g_rows, rows),
                _take(q_rows, rows),
                kb,
                vb,
                _take(o_rows, rows),
                _take(l_rows.unsqueeze(-1), rows).squeeze(-1),
                0.0,
                False,
                scale=ctx.scale,
            )
            dq_rows.index_add_(0, rows.reshape(-1), gq.reshape(-1, G, W).to(dq_rows.dtype))
            dk_blocks.index_add_(0, blocks, gk.squeeze(1).to(dk_blocks.dtype))
            dv_blocks.index_add_(0, blocks, gv.squeeze(1).to(dv_blocks.dtype))
        dq = _unrows(dq_rows, B, Hkv)
        dk = dk_blocks.view(B, Hkv, -1, W)[:, :, : k.shape[2]]
        dv = dv_blocks.view(B, Hkv, -1, W)[:, :, : k.shape[2]]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _rows(x: Tensor, kv_heads: int) -> Tensor:
    """(B, Hq, Nq, W) -> (B * Hkv * Nq + 1, G, W): one row per (batch, kv head, query)
    with the G query heads of the group, and a zero dummy row at the end."""
    B, Hq, Nq, W = x.shape
    G = Hq // kv_heads
    rows = x.reshape(B, kv_heads, G, Nq, W).transpose(2, 3).reshape(B * kv_heads * Nq, G, W)
    return torch.cat([rows, rows.new_zeros(1, G, W)])


def _unrows(rows: Tensor, B: int, kv_heads: int) -> Tensor:
    G, W = rows.shape[1:]
    return rows[:-1].reshape(B, kv_heads, -1, G, W).transpose(2, 3).reshape(B, kv_heads * G, -1, W)


def _take(rows: Tensor, index: Tensor) -> Tensor:
    """Rows (R + 1, G, W) picked by index (E, C) -> (E, 1, C * G, W): the G heads of a
    group share the entry's keys, so they run as one head of C * G queries (row-major, no
    transpose either way), and the op takes its large query tiles from 768 queries on."""
    E, C = index.shape
    G, W = rows.shape[1:]
    return rows.index_select(0, index.reshape(-1)).view(E, 1, C * G, W)


def _blocks(x: Tensor, block: int) -> Tensor:
    """(B, Hkv, Nk, W) -> (B * Hkv * n_blocks, block, W), the last block zero-padded."""
    B, H, Nk, W = x.shape
    n = -(-Nk // block)
    return _pad_rows(x, 0, n * block - Nk).reshape(B * H * n, block, W)


def _pad_rows(x: Tensor, before: int, after: int) -> Tensor:
    """Zero rows before and after dim 2 of (B, H, L, W); x itself when there are none
    (F.pad would copy it: at long lengths a fresh buffer whose page faults cost time)."""
    return x if before == after == 0 else F.pad(x, (0, 0, before, after))


class _Entries:
    """The (row, block) pairs of a selection other than each query's own block, grouped by
    (batch, kv head, block) and cut into entries of rows of one block: ``ROWS`` rows while
    a block has that many left, then entries of ``TAIL_ROWS`` for the rest, so a block's
    last entry pads at most TAIL_ROWS - 1 dummy rows (one size for all would pad ~14% of
    the work at N=16384, and small entries alone run slower in the fused op)."""

    ROWS, TAIL_ROWS = 256, 64

    def __init__(self, selection: Tensor, own: Tensor, n_blocks: int):
        B, Hkv, Nq, n = selection.shape
        n_keys = B * Hkv * n_blocks
        # Every (row, slot) pair gets its block's id among the B * Hkv * n_blocks; own blocks
        # and empty slots get n_keys and sort last. One stable sort of int32 keys groups the
        # rows by block in query order (cheaper than nonzero, gathers and an int64 sort).
        skip = (selection < 0) | (selection == own.view(1, 1, Nq, 1))
        base = torch.arange(B * Hkv, dtype=torch.int32).view(B, Hkv, 1, 1) * n_blocks
        key = (selection.to(torch.int32) + base).masked_fill_(skip, n_keys).reshape(-1)
        key, order = torch.sort(key, stable=True)
        kept = key.numel() - int(skip.sum())
        row = order[:kept] // n  # row (batch, kv head, query), as _rows numbers them
        counts = torch.bincount(key[:kept], minlength=n_keys)
        full = counts // self.ROWS  # whole entries of ROWS rows per block, then tail entries
        tail = -(-(counts - full * self.ROWS) // self.TAIL_ROWS)
        in_full = int(full.sum()) * self.ROWS
        # Pair i (the i-th in block order) goes to place i + shift in one flat table of full
        # entries, then tail entries. The shift is constant along a block's full rows and along
        # its tail rows: a cumulative sum of its jumps at those runs' first pairs (cheaper than
        # spreading per-block values over the 2M pairs with gathers).
        start = torch.cumsum(counts, 0) - counts
        full_shift = (torch.cumsum(full, 0) - full) * self.ROWS - start
        tail_shift = in_full + (torch.cumsum(tail, 0) - tail) * self.TAIL_ROWS - start - full * self.ROWS
        runs = torch.stack([start, start + full * self.ROWS], 1).reshape(-1)  # run starts, in order
        shift = torch.stack([full_shift, tail_shift], 1).reshape(-1)
        jumps = torch.zeros(kept + 1, dtype=torch.long).index_add_(0, runs, torch.diff(shift, prepend=shift.new_zeros(1)))
        place = torch.arange(kept) + torch.cumsum(jumps[:kept], 0)
        table = torch.full((in_full + int(tail.sum()) * self.TAIL_ROWS,), B * Hkv * Nq, dtype=torch.long)  # dummy row
        table[place] = row
        blocks = torch.arange(n_keys)
        self.parts = [
            (table[:in_full].view(-1, self.ROWS), blocks.repeat_interleave(full)),
            (table[in_full:].view(-1, self.TAIL_ROWS), blocks.repeat_interleave(tail)),
        ]

    def chunks(self, row_width: int):
        """(rows (E, C), blocks (E,)) of at most ``CALL_ELEMENTS`` query elements each."""
        for rows, blocks in self.parts:
            step = max(1, CALL_ELEMENTS // (rows.shape[1] * row_width))
            for e0 in range(0, blocks.numel(), step):
                yield rows[e0 : e0 + step], blocks[e0 : e0 + step]


class _Diagonal:
    """Every query against its own selection block, causally: the positions are cut into
    blocks of ``block`` (zero-padded at both ends) and run as one square causal call."""

    def __init__(self, block: int, q_start: int, Nq: int, Nk: int):
        self.block, self.q_start, self.Nq, self.Nk = block, q_start, Nq, Nk
        self.first = q_start // block  # first position block holding a query
        self.n = (Nk - 1) // block - self.first + 1
        self.offset = q_start - self.first * block  # padding rows before the first query
        self.own = (torch.arange(Nq) + q_start) // block

    def _cut(self, x: Tensor, rows: bool) -> Tensor:
        """(B, H, L, W) -> (B * n, H, block, W) over positions [first * block, ...)."""
        B, H, _, W = x.shape
        span = self.n * self.block
        if rows:  # queries: pad before q_start and after Nk
            x = _pad_rows(x, self.offset, span - self.offset - x.shape[2])
        else:
            x = _pad_rows(x[:, :, self.first * self.block :], 0, span - (self.Nk - self.first * self.block))
        return x.reshape(B, H, self.n, self.block, W).transpose(1, 2).reshape(B * self.n, H, self.block, W)

    def _uncut(self, x: Tensor, rows: bool) -> Tensor:
        shape = x.shape
        x = x.view(-1, self.n, *shape[1:]).transpose(1, 2).reshape(-1, shape[1], self.n * self.block, *shape[3:])
        if rows:
            return x[:, :, self.offset : self.offset + self.Nq]
        return x[:, :, : self.Nk - self.first * self.block]

    def forward(self, q, k, v, scale):
        # Padded keys sit after every real query of their block: the causal cut hides them.
        o, l = _op(self._cut(q, True), self._cut(k, False), self._cut(v, False), 0.0, True, scale=scale)
        return self._uncut(o, True), self._uncut(l, True)

    def backward(self, grad_out, q, k, v, out, lse, scale):
        cut = lambda x: self._cut(x, True)
        lse_cut = self._cut(lse.unsqueeze(-1), True).squeeze(-1)
        gq, gk, gv = _op_backward(
            cut(grad_out), cut(q), self._cut(k, False), self._cut(v, False), cut(out), lse_cut, 0.0, True, scale=scale
        )
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dk = torch.zeros(k.shape, dtype=acc)
        dv = torch.zeros(v.shape, dtype=acc)
        dk[:, :, self.first * self.block :] = self._uncut(gk, False)
        dv[:, :, self.first * self.block :] = self._uncut(gv, False)
        return self._uncut(gq, True).to(acc), dk, dv


def _window_attention(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float, bw: int) -> tuple[Tensor, Tensor]:
    """Every query against its ``window`` most recent keys, itself included (the paper's
    sliding-window branch): queries in blocks of ``bw``, each against the ``window - 1 +
    bw`` keys ending at its last query. Those key windows are overlapping strided views of
    k and v (no gather), and the band rule is the same mask for every block: only the
    first blocks, whose window starts before key 0, need a mask each, and a zero-padded
    copy of their keys. Later blocks go in calls of ``CALL_ELEMENTS`` outputs."""
    B, Hq, Nq, D = q.shape
    Nk, Dv = k.shape[2], v.shape[-1]
    width = max(D, Dv)  # the op wants one head size: pad the smaller with zero columns
    q, k, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    q_start = Nk - Nq
    first = q_start // bw
    m = (Nk - 1) // bw - first + 1
    offset = q_start - first * bw
    span = window - 1 + bw
    qb = _pad_rows(q, offset, m * bw - offset - Nq).reshape(B, Hq, m, bw, width).transpose(1, 2)

    def windows(x: Tensor, j0: int, j1: int) -> Tensor:
        """Key windows (B, j1 - j0, Hkv, span, width) of blocks [j0, j1): views of x, or of a
        copy of their positions zero-padded before key 0 and past Nk (a full copy of k per
        call costs more in page faults than the blocks that need it)."""
        lo, hi = (first + j0) * bw - (window - 1), (first + j1) * bw  # row i is position lo + i
        part = _pad_rows(x[:, :, max(lo, 0) : min(hi, Nk)], max(0, -lo), max(0, hi - Nk))
        return part.unfold(2, span, bw).permute(0, 2, 1, 4, 3)

    r, s = torch.arange(bw).view(-1, 1), torch.arange(span).view(1, -1)
    band = (s >= r) & (s <= r + window - 1)  # key_pos in (q_pos - window, q_pos]
    head = max(0, min(m, -(-(window - 1) // bw) - first))  # blocks whose window starts before key 0
    step = max(1, CALL_ELEMENTS // (Hq * bw * width))  # later blocks per call
    runs = []  # (query blocks, their key windows, value windows, additive mask)
    if head:
        key_pos = (first + torch.arange(head)).view(-1, 1, 1) * bw - (window - 1) + s
        runs.append((slice(0, head), windows(k, 0, head), windows(v, 0, head), _additive(band & (key_pos >= 0), q.dtype)))
    if head < m:
        kw, vw, mask = windows(k, head, m), windows(v, head, m), _additive(band.unsqueeze(0), q.dtype)
        runs += [
            (slice(j, min(j + step, m)), kw[:, j - head : j - head + step], vw[:, j - head : j - head + step], mask)
            for j in range(head, m, step)
        ]
    outs, lses = [], []
    for b in range(B):
        for blocks, kw, vw, mask in runs:
            o, lse = FlashWithLse.apply(qb[b, blocks], kw[b], vw[b], mask, scale)
            outs.append(o.transpose(0, 1))  # (Hq, blocks, bw, width)
            lses.append(lse.transpose(0, 1))
    # One concatenation in (Hq, batch and block) order: the result is (B, Hq, m * bw) as a view.
    o = torch.cat(outs, 1).view(Hq, B, m * bw, width).transpose(0, 1)[:, :, offset : offset + Nq, :Dv]
    lse = torch.cat(lses, 1).view(Hq, B, m * bw).transpose(0, 1)[:, :, offset : offset + Nq]
    return o, lse


def _additive(visible: Tensor, dtype) -> Tensor:
    """Boolean (blocks, bw, span) -> the op's additive mask (blocks, 1, bw, span)."""
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, -math.inf).unsqueeze(1)


@register("nsa")
class NativeSparseAttention(Mechanism):
    """Native Sparse Attention (arXiv 2502.11089); see the module docstring.

    Args:
        compress_block, compress_stride: l and d of the compression (l % d == 0).
        select_block: l' of the selection blocks (a multiple of d).
        num_selected: n, blocks each query attends to (forced ones included).
        window: w, most recent tokens of the sliding-window branch.
        initial_blocks, local_blocks: blocks always selected at the start and at the end.
        compress: "mean" or "mlp" (learned phi; needs head_dim, and v_dim if different).
        num_heads: query heads, for a learnable per-head gate table ``gate_logits``.
    """

    paper = "arXiv:2502.11089"

    def __init__(
        self,
        compress_block: int = 32,
        compress_stride: int = 16,
        select_block: int = 64,
        num_selected: int = 16,
        window: int = 512,
        initial_blocks: int = 1,
        local_blocks: int = 2,
        compress: str = "mean",
        head_dim: int | None = None,
        v_dim: int | None = None,
        num_heads: int | None = None,
    ):
        super().__init__()
        for name, value, low in (
            ("compress_block", compress_block, 1),
            ("compress_stride", compress_stride, 1),
            ("select_block", select_block, 1),
            ("num_selected", num_selected, 1),
            ("window", window, 1),
            ("initial_blocks", initial_blocks, 0),
            ("local_blocks", local_blocks, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        if compress_block % compress_stride:
            raise ValueError(f"compress_block: must be a multiple of compress_stride={compress_stride}, got {compress_block}")
        if select_block % compress_stride:
            raise ValueError(f"select_block: must be a multiple of compress_stride={compress_stride}, got {select_block}")
        if initial_blocks + local_blocks > num_selected:
            raise ValueError(
                f"num_selected: must cover the forced blocks, initial_blocks + local_blocks = {initial_blocks + local_blocks}, got {num_selected}"
            )
        if compress not in ("mean", "mlp"):
            raise ValueError(f"compress: expected 'mean' or 'mlp', got {compress!r}")
        self.compress_block, self.compress_stride, self.select_block = compress_block, compress_stride, select_block
        self.num_selected, self.window = num_selected, window
        self.initial_blocks, self.local_blocks, self.compress_kind = initial_blocks, local_blocks, compress
        if compress == "mlp":
            if not isinstance(head_dim, int) or head_dim < 1:
                raise ValueError(f"head_dim: compress='mlp' needs the head dim (int >= 1), got {head_dim!r}")
            v_dim = head_dim if v_dim is None else v_dim
            self.compress_k = CompressMLP(compress_block, head_dim, head_dim)
            self.compress_v = CompressMLP(compress_block, v_dim, v_dim)
        if num_heads is not None:
            if not isinstance(num_heads, int) or num_heads < 1:
                raise ValueError(f"num_heads: expected an int >= 1, got {num_heads!r}")
            self.gate_logits: nn.Parameter | None = nn.Parameter(torch.zeros(num_heads, 3))
        else:
            self.gate_logits = None

    # ------------------------------------------------------------------ pieces

    def compress(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Compressed keys and values (B, Hkv, Ncmp, D), Ncmp = (Nk - l) // d + 1 blocks."""
        l, d = self.compress_block, self.compress_stride
        Nk = k.shape[2]
        if Nk < l:
            return k[:, :, :0], v[:, :, :0]
        kb, vb = k.unfold(2, l, d).transpose(-1, -2), v.unfold(2, l, d).transpose(-1, -2)  # (B, H, Ncmp, l, D)
        if self.compress_kind == "mean":
            return kb.mean(-2), vb.mean(-2)
        return self.compress_k(kb), self.compress_v(vb)

    def block_mass(self, p: Tensor, n_blocks: int) -> Tensor:
        """Importance (B, Hkv, rows, n_blocks) of the selection blocks from the compression
        probabilities p (B, Hkv, G, rows, Ncmp): block j sums, over the G heads of the group
        (eq. 10), the compressed blocks that share a token with it (eq. 9). With
        a = select_block / d and c = compress_block / d those are the a + c - 1 consecutive
        blocks from j * a - c + 1, so the group's summed p and a + c - 1 strided slice-adds
        replace a dense (Ncmp, n_blocks) matmul (the head sum first: one pass over p, not
        a + c - 1)."""
        a, c = self.select_block // self.compress_stride, self.compress_block // self.compress_stride
        B, Hkv, G, rows, n_cmp = p.shape
        p = p.sum(2) if G > 1 else p.squeeze(2)
        out = p.new_zeros(B, Hkv, rows, n_blocks)
        for t in range(1 - c, a):  # compressed block j * a + t, for every block j that has one
            lo = -(t // a)  # first j with j * a + t >= 0
            hi = min(n_blocks, (n_cmp - 1 - t) // a + 1)
            if lo < hi:
                out[..., lo:hi] += p[..., lo * a + t : (hi - 1) * a + t + 1 : a]
        return out

    def choose(self, importance: Tensor, own: Tensor, width: int) -> Tensor:
        """Block ids (..., width) from block importance (..., blocks), which is overwritten:
        forced blocks first, then the top-scoring earlier ones; -1 where fewer blocks exist."""
        j = torch.arange(importance.shape[-1])
        own = own.unsqueeze(-1)
        forced = ((j < self.initial_blocks) | (j > own - self.local_blocks)) & (j <= own)
        score = importance.masked_fill_(j >= own, -math.inf).masked_fill_(forced, math.inf)
        n = min(width, score.shape[-1])
        if n > 0 and cpu.usable(score):
            values, indices = cpu.topk_rows(score, n)  # a set: order unused; C, ~3x torch.topk
        else:
            values, indices = torch.topk(score, n, dim=-1, sorted=False)
        chosen = indices.masked_fill_(torch.isneginf(values), -1)
        return F.pad(chosen, (0, width - chosen.shape[-1]), value=-1)

    def select(self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor | None, scale: float, Nk: int):
        """Selected blocks (B, Hkv, Nq, n) from the compression branch's probabilities, and
        that branch's (out, lse) when ``v_cmp`` is given (no gradient: the same pass).
        Queries go in chunks of ``SELECT_Q_CHUNK``, each against the compressed blocks
        complete by its last position only, so the causal waste stays small."""
        B, Hq, Nq, _ = q.shape
        Hkv, n_cmp = k_cmp.shape[1], k_cmp.shape[2]
        G = Hq // Hkv
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        width = min(self.num_selected, -(-Nk // self.select_block))
        pos = torch.arange(Nq) + Nk - Nq
        own = pos // self.select_block
        Dv = 0 if v_cmp is None else v_cmp.shape[-1]
        chosen = torch.empty(B, Hkv, Nq, width, dtype=torch.long)
        o_cmp = torch.zeros(B, Hq, Nq, Dv, dtype=cd)
        lse_cmp = torch.full((B, Hq, Nq), -math.inf, dtype=cd)
        with torch.no_grad():
            qc = q.detach().to(cd)  # scaled chunk by chunk: a scaled copy of all q is a fresh 32 MiB at N=16384
            # (B, Hkv, D, Ncmp) in memory: matmul reads a column slice of it faster than a
            # transposed view of k_cmp.
            kt = k_cmp.detach().to(cd).transpose(-1, -2).contiguous()
            vc = None if v_cmp is None else v_cmp.detach().to(cd)
            for r0 in range(0, Nq, SELECT_Q_CHUNK):
                r1 = min(r0 + SELECT_Q_CHUNK, Nq)
                # positions as ints (pos[i] = i + Nk - Nq): sizes torch.compile knows while tracing
                cols = (r1 - 1 + Nk - Nq) // self.select_block + 1  # no block after the chunk's last own block matters
                seen = min(n_cmp, self._complete(r1 - 1 + Nk - Nq))
                if seen:
                    p, lse = self._compressed_probs(qc[:, :, r0:r1] * scale, kt[..., :seen], pos[r0:r1], r0 + Nk - Nq)
                    importance = self.block_mass(p, cols)
                    lse_cmp[:, :, r0:r1] = lse.view(B, Hq, r1 - r0)
                    if vc is not None:
                        o = torch.matmul(p.view(B, Hkv, G * (r1 - r0), seen), vc[:, :, :seen])
                        o_cmp[:, :, r0:r1] = o.view(B, Hq, r1 - r0, Dv)
                else:  # no compressed block is complete yet: nothing to score, p = 0
                    importance = torch.zeros(B, Hkv, r1 - r0, cols, dtype=cd)
                chosen[:, :, r0:r1] = self.choose(importance, own[r0:r1].view(1, 1, -1), width)
        return chosen, (o_cmp, lse_cmp)

    def _complete(self, position: int) -> int:
        """How many compressed blocks are complete at a token position (eq. 7's causal rule)."""
        return max(0, (position - self.compress_block + 1) // self.compress_stride + 1)

    def _compressed_probs(self, q: Tensor, k_t: Tensor, pos: Tensor, pos0: int) -> tuple[Tensor, Tensor]:
        """Softmax p (B, Hkv, G, rows, Ncmp) of the scaled queries at positions ``pos`` (the
        first, ``pos0``, also as an int) over
        the compressed keys k_t (B, Hkv, D, Ncmp) complete at each (eq. 7-8), and its lse
        (B, Hkv, G, rows, 1); a row that sees no block gets p = 0 and lse = -inf. In place on
        one scores buffer."""
        B, Hq, rows, D = q.shape
        Hkv, seen = k_t.shape[1], k_t.shape[3]
        G = Hq // Hkv
        s = torch.matmul(q.reshape(B, Hkv, G * rows, D), k_t).view(B, Hkv, G, rows, seen)
        first = self._complete(pos0)  # blocks before it are complete for every row
        if first < seen:
            hidden = torch.arange(first, seen) * self.compress_stride + self.compress_block - 1 > pos[:, None]
            s[..., first:].masked_fill_(hidden, -math.inf)
        top = s.amax(-1, keepdim=True)
        top = top.masked_fill_(torch.isneginf(top), 0.0)
        s.sub_(top).exp_()
        den = s.sum(-1, keepdim=True)
        # A live row's den is >= 1 (its top term is exp(0)); a dead row's is 0 and its p stays 0.
        return s.div_(den.clamp(min=1.0)), top + torch.log(den)

    def gates(self, gates: Tensor | None, B: int, Hq: int, Nq: int, dtype) -> Tensor:
        """Gates (B|1, Hq, Nq|1, 3) in [0, 1] for the compression, selection, window branches."""
        if gates is not None:
            if (
                not isinstance(gates, Tensor)
                or gates.dim() != 4
                or gates.shape[-1] != 3
                or gates.shape[1] != Hq
                or gates.shape[0] not in (1, B)
                or gates.shape[2] not in (1, Nq)
            ):
                raise ValueError(f"gates: expected shape (B|1, Hq={Hq}, Nq|1, 3), got {getattr(gates, 'shape', gates)!r}")
            return gates.to(dtype)
        if self.gate_logits is not None:
            if self.gate_logits.shape[0] != Hq:
                raise ValueError(f"gate_logits: table has {self.gate_logits.shape[0]} heads but the call has Hq={Hq}")
            return torch.sigmoid(self.gate_logits).to(dtype).view(1, Hq, 1, 3)
        return torch.full((1, 1, 1, 3), 0.5, dtype=dtype)

    def _check_call(self, q, k, v, mask, score, sinks, return_lse, scale, backend):
        req = make_request(q, k, v, scale=scale)
        rest, keep = split_key_masks(mask, req.batch, req.heads, req.q_len, req.k_len)
        if keep is not None and len(rest) == 1 and isinstance(rest[0], Causal):
            # Right padding sits after every real token, where the causal mask already
            # hides it from real queries: the call is the causal one. Left padding would
            # move the compression and selection blocks, which sit at absolute positions.
            if not is_right_padding(keep):
                raise padding_refused(
                    "NSA",
                    "its compression and selection blocks sit at absolute key positions, so left padding moves them.",
                    right_ok=True,
                )
            mask = rest[0]
        if not isinstance(mask, Causal):
            raise ValueError(
                f"mask: NSA is causal (arXiv 2502.11089); pass mask=attnkit.causal() (and-ed with right padding, if any), got {mask!r}"
            )
        for name, value in (("score", score), ("sinks", sinks)):
            if value is not None:
                raise ValueError(f"{name}: NSA takes no {name}, got {value!r}")
        if return_lse:
            raise ValueError("return_lse: NSA's output is a gated sum of three attentions and has no single logsumexp")
        if backend not in ("auto", "reference"):
            raise ValueError(f"backend: NSA runs 'auto' (its fast path) or 'reference', got {backend!r}")
        if req.q_len > req.k_len:
            raise ValueError(f"q, k: NSA needs Nq <= Nk (queries are the last Nq positions), got Nq={req.q_len}, Nk={req.k_len}")
        return req

    # ------------------------------------------------------------------ fast path

    # not the template: its own checks and messages (causal, right padding only, no score, sinks or lse) and gates
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
        gates=None,
    ):
        req = self._check_call(q, k, v, mask, score, sinks, return_lse, scale, backend)
        if backend == "reference" and observers:
            raise ValueError("observers: the dense reference (backend='reference') feeds no observers; use backend='auto'")
        if backend == "reference":
            out = self.reference(q, k, v, mask=mask, scale=scale, gates=gates)
        else:
            cd = torch.float64 if q.dtype == torch.float64 else torch.float32
            g = self.gates(gates, req.batch, req.heads, req.q_len, cd)
            qc, kc, vc = q.to(cd), k.to(cd), v.to(cd)
            differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *self.parameters()))
            if not differentiable:  # the C loops want contiguous rows
                qc, kc, vc = qc.contiguous(), kc.contiguous(), vc.contiguous()
            k_cmp, v_cmp = self.compress(kc, vc)
            gated = torch.is_grad_enabled() and g.requires_grad  # then the branches are kept apart for autograd
            if not differentiable and not gated and cpu.fused_usable(qc, kc, vc) and cpu.usable(k_cmp, v_cmp):
                out, selection, lse_cmp, lse_slc, lse_win = self._native_forward(qc, kc, vc, k_cmp, v_cmp, g, req)
            else:
                branches = self._torch_branches(qc, kc, vc, k_cmp, v_cmp, req, differentiable)
                selection, (o_cmp, lse_cmp), (o_slc, lse_slc), (o_win, lse_win) = branches
                # One buffer; without autograd, the scoring pass's fresh o_cmp itself (gates may
                # want gradients even where q, k, v do not).
                out = g[..., 0:1] * o_cmp if torch.is_grad_enabled() else o_cmp.mul_(g[..., 0:1])
                out = out.addcmul_(g[..., 1:2], o_slc).addcmul_(g[..., 2:3], o_win)
            out = out.to(q.dtype)
            if observers:
                call = CallInfo(req.batch, req.heads, req.q_len, req.k_len, req.q_start, layer, self.name)
                branches = (g.detach(), k_cmp.detach(), lse_cmp.detach(), selection, lse_slc, lse_win.detach())
                feed(observers, call, self._tiles(req, call, *branches))
        if check_finite and not all_finite(out):
            raise nonfinite_error(req)
        return out

    def _torch_branches(self, q, k, v, k_cmp, v_cmp, req, differentiable: bool):
        """selection, then (out, lse) of the compression, selection and window branches by
        PyTorch calls (with autograd where ``differentiable``)."""
        # Without gradients the selection pass also yields the compression branch.
        selection, (o_cmp, lse_cmp) = self.select(q, k_cmp, None if differentiable else v_cmp, req.scale, req.k_len)
        if differentiable:
            shift = req.k_len - k_cmp.shape[2]
            o_cmp, lse_cmp = softmax_attention(
                q,
                k_cmp,
                v_cmp,
                mask=CompressedCausal(self.compress_block, self.compress_stride, shift),
                scale=req.scale,
                return_lse=True,
                check_finite=False,
            )
        bw = WINDOW_BLOCK_GRAD if differentiable else WINDOW_BLOCK
        return (
            selection,
            (o_cmp, lse_cmp),
            self._selected(q, k, v, selection, req),
            _window_attention(q, k, v, self.window, req.scale, bw),
        )

    def _native_forward(self, q, k, v, k_cmp, v_cmp, g, req):
        """The gated output, selection and the three branches' lse by the C loops of
        kernels/cpu/loops_sparse.cpp (inference, float32): the scoring pass with the compression
        branch, the selection branch by key block, the window; each adds its gated share
        into one output (no full-size buffer per branch, no pass to sum them)."""
        width = min(self.num_selected, -(-req.k_len // self.select_block))
        gates = g.expand(req.batch, req.heads, req.q_len, 3).contiguous()
        return cpu.nsa_forward(
            q,
            k,
            v,
            k_cmp,
            v_cmp,
            gates,
            req.scale,
            compress_block=self.compress_block,
            compress_stride=self.compress_stride,
            select_block=self.select_block,
            width=width,
            initial=self.initial_blocks,
            local=self.local_blocks,
            window=self.window,
            rescale_above=RESCALE_ABOVE,
            select_chunk=SELECT_Q_CHUNK,
            tile_rows=SELECTED_TILE_ROWS,
            span_rows=SELECTED_SPAN_ROWS,
            window_block=WINDOW_BLOCK_NATIVE,
        )

    def _selected(self, q, k, v, selection, req) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling():
            return self._selected_gathered(q, k, v, selection, req)
        D, Dv = q.shape[-1], v.shape[-1]
        width = max(D, Dv)  # the op wants one head size: pad the smaller with zero columns
        q, k, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        out, lse = _SelectedAttention.apply(q, k, v, selection, req.scale, self.select_block, req.q_start)
        return out[..., :Dv], lse

    def _selected_gathered(self, q, k, v, selection, req) -> tuple[Tensor, Tensor]:
        """The selection branch for torch.compile, where shapes cannot depend on the data:
        how many queries chose each key block (the entries of ``_SelectedAttention``) is
        data. Each query gathers the raw tokens of its ``n`` slots instead, (B, Hkv, Nq,
        n * select_block) keys, masked where a slot is empty, a token lies after the query
        or past Nk; plain softmax with autograd. Memory grows as Nq * n * select_block."""
        B, Hq, Nq, D = q.shape
        Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
        G, bs, n = Hq // Hkv, self.select_block, selection.shape[-1]
        n_blocks = -(-Nk // bs)
        ids = selection.clamp(min=0)  # (B, Hkv, Nq, n)
        b_idx = torch.arange(B).view(B, 1, 1, 1)
        h_idx = torch.arange(Hkv).view(1, Hkv, 1, 1)
        kb = _pad_rows(k, 0, n_blocks * bs - Nk).view(B, Hkv, n_blocks, bs, D)[b_idx, h_idx, ids].view(B, Hkv, Nq, n * bs, D)
        vb = _pad_rows(v, 0, n_blocks * bs - Nk).view(B, Hkv, n_blocks, bs, Dv)[b_idx, h_idx, ids].view(B, Hkv, Nq, n * bs, Dv)
        key_pos = (ids.unsqueeze(-1) * bs + torch.arange(bs)).view(B, Hkv, Nq, n * bs)
        q_pos = (torch.arange(Nq) + req.q_start).view(1, 1, Nq, 1)
        visible = (selection >= 0).repeat_interleave(bs, dim=-1) & (key_pos <= q_pos)  # past Nk is after every query
        qg = q.view(B, Hkv, G, Nq, D).transpose(2, 3)  # (B, Hkv, Nq, G, D)
        s = torch.matmul(qg, kb.transpose(-1, -2)) * req.scale  # (B, Hkv, Nq, G, n * bs)
        s = s.masked_fill(~visible.unsqueeze(3), -math.inf)
        lse = torch.logsumexp(s, dim=-1)  # -inf for a row without keys (never: the own block holds the query)
        p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
        out = torch.matmul(p, vb)  # (B, Hkv, Nq, G, Dv)
        return out.transpose(2, 3).reshape(B, Hq, Nq, Dv), lse.transpose(2, 3).reshape(B, Hq, Nq)

    def _tiles(self, req, call, g, k_cmp, lse_cmp, selection, lse_slc, lse_win):
        """The weight each raw key gets in the output: g_slc * P_slc + g_win * P_win +
        g_cmp * P_cmp of every compressed block spread evenly over its tokens (with mean
        compression, exactly the weight of v_j in the output)."""
        cd = torch.float64 if req.q.dtype == torch.float64 else torch.float32
        B, H = req.batch, req.heads
        G = H // req.kv_heads
        l, d, block = self.compress_block, self.compress_stride, self.select_block
        n_cmp, n_blocks = k_cmp.shape[2], -(-req.k_len // block)
        g = g.expand(B, H, req.q_len, 3)
        inf_if_dead = lambda x: torch.where(torch.isneginf(x), math.inf, x).to(cd).unsqueeze(-1)
        with torch.no_grad():
            for r0 in range(0, req.q_len, OBSERVE_Q_BLOCK):
                r1 = min(r0 + OBSERVE_Q_BLOCK, req.q_len)
                pos = torch.arange(r0, r1) + req.q_start
                q = req.q[:, :, r0:r1].to(cd)
                p_cmp = torch.zeros(B, H, r1 - r0, n_cmp, dtype=cd)
                if n_cmp:
                    kc = k_cmp.to(cd).repeat_interleave(G, 1)
                    visible = torch.arange(n_cmp) * d + l - 1 <= pos[:, None]
                    p_cmp = torch.exp(
                        torch.matmul(q, kc.transpose(-1, -2)) * req.scale - inf_if_dead(lse_cmp[:, :, r0:r1])
                    ).masked_fill(~visible, 0.0)
                chosen = torch.zeros(B, req.kv_heads, r1 - r0, n_blocks + 1, dtype=torch.bool)
                chosen.scatter_(-1, selection[:, :, r0:r1] % (n_blocks + 1), True)  # -1 lands in the spare column
                chosen = chosen[..., :n_blocks].repeat_interleave(G, 1)
                for c0 in range(0, int(pos[-1]) + 1, OBSERVE_K_BLOCK):
                    c1 = min(c0 + OBSERVE_K_BLOCK, int(pos[-1]) + 1)
                    keys = torch.arange(c0, c1)
                    k = req.k[:, :, c0:c1].to(cd).repeat_interleave(G, 1)
                    s = torch.matmul(q, k.transpose(-1, -2)) * req.scale
                    causal = keys <= pos[:, None]
                    in_slc = chosen[..., keys // block] & causal
                    in_win = causal & (keys > pos[:, None] - self.window)
                    w = g[:, :, r0:r1, 1:2] * torch.exp(s - inf_if_dead(lse_slc[:, :, r0:r1])).masked_fill(~in_slc, 0.0)
                    w = w + g[:, :, r0:r1, 2:3] * torch.exp(s - inf_if_dead(lse_win[:, :, r0:r1])).masked_fill(~in_win, 0.0)
                    if n_cmp:
                        cover = ((keys >= torch.arange(n_cmp)[:, None] * d) & (keys < torch.arange(n_cmp)[:, None] * d + l)).to(
                            cd
                        ) / l
                        w = w + g[:, :, r0:r1, 0:1] * torch.matmul(p_cmp, cover)
                    if bool(w.any()):
                        yield AttentionTile(call, torch.arange(B), pos, keys, w, None)

    # ------------------------------------------------------------------ reference

    def reference(self, q, k, v, *, mask=None, scale=None, gates=None, **_):
        """The three branches written densely from the paper's equations (7-11), O(N^2)."""
        req = self._check_call(q, k, v, mask, None, None, False, scale, "auto")
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        B, H, Nq, Nk = req.batch, req.heads, req.q_len, req.k_len
        G = H // req.kv_heads
        q, k, v = q.to(cd), k.to(cd), v.to(cd)
        g = self.gates(gates, B, H, Nq, cd)
        pos = torch.arange(Nq).view(-1, 1) + Nk - Nq
        key = torch.arange(Nk).view(1, -1)

        def attend(keys, values, visible):  # masked softmax attention; no visible key -> 0
            s = torch.matmul(q, keys.repeat_interleave(G, 1).transpose(-1, -2)) * req.scale
            s = s.masked_fill(~visible, -math.inf)
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)
            return torch.matmul(p, values.repeat_interleave(G, 1)), p

        # compression (eq. 7): complete blocks only
        k_cmp, v_cmp = self.compress(k, v)
        n_cmp = k_cmp.shape[2]
        o_cmp, p_cmp = attend(
            k_cmp, v_cmp, torch.arange(n_cmp).view(1, -1) * self.compress_stride + self.compress_block - 1 <= pos
        )
        # selection (eq. 8-11): block importance from p_cmp, shared by a GQA group, top-n
        n_blocks = -(-Nk // self.select_block)
        tokens = torch.arange(Nk)
        cmp_covers = (tokens >= torch.arange(n_cmp).view(-1, 1) * self.compress_stride) & (
            tokens < torch.arange(n_cmp).view(-1, 1) * self.compress_stride + self.compress_block
        )
        block_has = tokens // self.select_block == torch.arange(n_blocks).view(-1, 1)
        overlap = (cmp_covers.to(cd) @ block_has.to(cd).T > 0).to(cd)
        importance = torch.matmul(p_cmp, overlap).view(B, req.kv_heads, G, Nq, n_blocks).sum(2)
        own = (pos // self.select_block).view(1, 1, Nq, 1)
        j = torch.arange(n_blocks)
        forced = ((j < self.initial_blocks) | (j > own - self.local_blocks)) & (j <= own)
        ranked = torch.where(forced, math.inf, torch.where(j < own, importance, -math.inf))
        order = torch.sort(ranked, dim=-1, descending=True, stable=True)
        keep = (torch.arange(n_blocks) < self.num_selected) & ~torch.isneginf(order.values)
        chosen = torch.zeros_like(keep).scatter(-1, order.indices, keep)  # (B, Hkv, Nq, n_blocks)
        in_selected = chosen.repeat_interleave(G, 1)[..., tokens // self.select_block] & (key <= pos)
        o_slc, _ = attend(k, v, in_selected)
        # sliding window: the last `window` tokens
        o_win, _ = attend(k, v, (key <= pos) & (key > pos - self.window))
        return (g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win).to(req.q.dtype)
