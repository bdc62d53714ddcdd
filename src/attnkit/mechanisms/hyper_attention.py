"""HyperAttention (Han et al. 2023, arXiv 2310.05869): near-linear approximate attention.

For a long non-causal call, queries and keys are each sorted by an angular LSH whose
buckets are ordered so that neighbouring buckets differ in one bit (sortLSH). Cutting
both sorted orders into ``n_blocks = ceil(Nk / block_size)`` blocks, every query attends
exactly to the keys of its own block (the heavy entries LSH brings together), and the
rest of the row is estimated from ``sample_size`` keys drawn uniformly with replacement,
each weighted ``Nk / sample_size``, sampled keys of the query's own block left out.
Both parts are merged by their log-sum-exps. The weight of key j in row i is therefore

    W_ij = 1                               if j is in i's block,
           count_j * Nk / sample_size      otherwise   (count_j: times j was drawn),

and the output is ``(exp(S) * W) V / rowsum(exp(S) * W)`` — the paper's D~^-1 A~ V.
Causal attention splits the square recursively in halves: two causal halves on the
diagonal and the off-diagonal rectangle as a non-causal call (the paper's recursion);
any piece with fewer than ``min_seq_len`` queries is computed exactly, so a call shorter
than ``min_seq_len`` is exact softmax attention.

Randomness (the LSH projections and the samples) comes from a generator seeded with
``seed`` on every call: the same inputs always give the same output. The bucket order
is the rank in the reflected Gray code (adjacent buckets one bit apart, as the paper
says); the authors' code indexes the Gray sequence by the bucket instead of inverting it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import make_request
from ..kernels.request import all_finite, nonfinite_error
from ..kernels.run import softmax_attention
from ..mods.masks import Causal
from ..observe import AttentionTile, CallInfo, feed
from .base import Mechanism, register
from .key_masks import and_parts, is_key_mask, padding_refused

Tensor = torch.Tensor

from ..kernels.flash import FlashWithLse, merge_partial

OBSERVE_Q_BLOCK = 128
OBSERVE_K_BLOCK = 512


def _memo(fn):
    """``functools.cached_property`` without the lock that Python 3.11 takes in it (which
    torch.compile cannot enter): cached on eager calls, recomputed while tracing."""
    name = fn.__name__

    @functools.wraps(fn)
    def get(self):
        if torch.compiler.is_compiling():
            return fn(self)
        if name not in self.__dict__:
            self.__dict__[name] = fn(self)  # the instance dict: a frozen dataclass allows it
        return self.__dict__[name]

    return property(get)


@dataclass(frozen=True)
class ExactPart:
    """Queries [q0, q1) against keys [k0, k1), computed exactly (causal: a square
    diagonal block, lower triangle)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool

    def weights(self, B: int, H: int, dtype, rows: slice, cols: slice) -> Tensor:
        """W on rows x cols of the part (part-relative): 1, or the lower triangle."""
        i = torch.arange(self.q1 - self.q0)[rows].view(-1, 1)
        j = torch.arange(self.k1 - self.k0)[cols].view(1, -1)
        w = (j <= i) if self.causal else torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
        return w.to(dtype).expand(B, H, -1, -1)


@dataclass(frozen=True)
class HyperPart:
    """Queries [q0, q1) against keys [k0, k1) by sortLSH blocks plus uniform samples.

    Keys are sorted and sampled once per key/value head; the query heads of a GQA group
    share them (their keys are the same)."""

    q0: int
    q1: int
    k0: int
    k1: int
    q_order: Tensor  # (B, Hq, nq): query indices (from q0) in sorted order
    k_order: Tensor  # (B, Hkv, nk)
    n_blocks: int
    block_size: int  # keys per block; queries per block is ceil(nq / n_blocks)
    samples: Tensor | None  # (B, Hkv, m) key indices (from k0), drawn with replacement

    @property
    def q_block_size(self) -> int:
        return -(-(self.q1 - self.q0) // self.n_blocks)

    @_memo
    def q_block(self) -> Tensor:
        """Block id of every query, in original order (B, Hq, nq)."""
        return _ranks(self.q_order) // self.q_block_size

    @_memo
    def k_block(self) -> Tensor:
        """Block id of every key, in original order (B, Hkv, nk)."""
        return _ranks(self.k_order) // self.block_size

    @_memo
    def counts(self) -> Tensor:
        """How many times each key was drawn, (B, Hkv, nk)."""
        samples = self.samples
        assert samples is not None  # asked of sampled parts only
        out = torch.zeros(self.k_order.shape, dtype=torch.long)
        return out.scatter_add_(2, samples, torch.ones_like(samples))

    def weights(self, B: int, H: int, dtype, rows: slice, cols: slice) -> Tensor:
        """W on rows x cols of the part (part-relative): 1 in the query's block,
        count * nk / m for sampled keys elsewhere."""
        groups = H // self.k_block.shape[1]
        k_block = self.k_block.repeat_interleave(groups, 1)[..., cols]
        same = self.q_block[..., rows, None] == k_block[..., None, :]
        w = same.to(dtype)
        if self.samples is not None:
            weight = (self.k1 - self.k0) / self.samples.shape[-1]
            w = w + (~same) * self.counts.repeat_interleave(groups, 1)[..., None, cols].to(dtype) * weight
        return w


def _ranks(order: Tensor) -> Tensor:
    """Inverse permutation along the last dim: rank of every index in ``order``."""
    ranks = torch.empty_like(order)
    return ranks.scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order).contiguous())


def _draws(
    seed: int, dim: int, projs: int, sample_shape: tuple[int, int, int], highs: tuple[int, ...]
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The random choices of a call, from one generator seeded with ``seed``: the LSH
    hyperplanes (dim, projs), then for each sampled piece in order key indices below its
    ``high`` of shape ``sample_shape``. A generator cannot be created inside a
    torch.compile graph: compiled calls draw them through an op the graph keeps opaque."""
    if torch.compiler.is_compiling():
        proj, *samples = _draws_op(seed, dim, projs, list(sample_shape), list(highs))
        return proj, tuple(samples)
    return _draw(seed, dim, projs, sample_shape, highs)


def _draw(seed, dim, projs, sample_shape, highs) -> tuple[Tensor, tuple[Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(dim, projs, generator=gen, dtype=torch.float64)
    return proj, tuple(torch.randint(high, tuple(sample_shape), generator=gen) for high in highs)


@torch.library.custom_op("attnkit_mechanisms::hyper_attention_draws", mutates_args=())
def _draws_op(seed: int, dim: int, projs: int, sample_shape: list[int], highs: list[int]) -> list[Tensor]:
    proj, samples = _draw(seed, dim, projs, sample_shape, highs)
    return [proj, *samples]


@_draws_op.register_fake
def _(seed, dim, projs, sample_shape, highs):
    return [torch.empty(dim, projs, dtype=torch.float64), *(torch.empty(sample_shape, dtype=torch.long) for _ in highs)]


def gray_rank(codes: Tensor, bits: int) -> Tensor:
    """Position of each code in the reflected Gray sequence of ``bits`` bits (the
    inverse Gray code): consecutive positions hold codes one bit apart."""
    out = codes.clone()
    shift = 1
    while shift < bits:
        out = out ^ (out >> shift)
        shift *= 2
    return out


@register("hyper_attention")
class HyperAttention(Mechanism):
    """HyperAttention (arXiv 2310.05869); see the module docstring.

    Args:
        block_size: keys per sortLSH block.
        sample_size: keys drawn uniformly for the residual (0: blocks only).
        min_seq_len: calls (and causal pieces) with fewer queries are computed exactly.
        lsh_num_projs: random hyperplanes of the angular LSH (2^p buckets).
        seed: seeds the projections and the samples of every call.
    """

    paper = "arXiv:2310.05869"
    # The LSH blocks and the samples are drawn over the queries and keys of the whole
    # call, so a query's row depends on the rest of the call.
    decodes = False
    decode_note = (
        "HyperAttention's LSH blocks and samples are drawn over the whole call, so a query's row depends on the other "
        "queries and keys of the call and a call against a KV cache would compute another model."
    )

    def __init__(
        self, block_size: int = 256, sample_size: int = 256, min_seq_len: int = 4096, lsh_num_projs: int = 7, seed: int = 0
    ):
        super().__init__()
        for name, value, low in (
            ("block_size", block_size, 1),
            ("sample_size", sample_size, 0),
            ("min_seq_len", min_seq_len, 2),
            ("lsh_num_projs", lsh_num_projs, 1),
            ("seed", seed, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        if lsh_num_projs > 30:
            raise ValueError(f"lsh_num_projs: expected at most 30 (2^p buckets), got {lsh_num_projs}")
        self.block_size, self.sample_size, self.min_seq_len = block_size, sample_size, min_seq_len
        self.lsh_num_projs, self.seed = lsh_num_projs, seed

    # ------------------------------------------------------------------ the plan

    def plan(self, q: Tensor, k: Tensor, causal: bool) -> list[ExactPart | HyperPart]:
        """The pieces of a call with their random choices, drawn from ``seed``. Pieces
        cover every visible (query, key) pair exactly once."""
        B, Hq, Nq, D = q.shape
        Nk = k.shape[2]
        pieces: list[tuple[int, int, int, int, bool | None]] = []  # (q0, q1, k0, k1, causal), None: a HyperPart

        def rect(q0, q1, k0, k1):
            pieces.append((q0, q1, k0, k1, False if q1 - q0 < self.min_seq_len else None))

        def square(q0, k0, n):
            if n < self.min_seq_len:
                pieces.append((q0, q0 + n, k0, k0 + n, True))
                return
            half = n // 2
            square(q0, k0, half)
            square(q0 + half, k0 + half, n - half)
            rect(q0 + half, q0 + n, k0, k0 + half)

        if not causal:
            rect(0, Nq, 0, Nk)
        elif Nq <= Nk:
            if Nk > Nq:  # keys before the first query: visible to every query
                rect(0, Nq, 0, Nk - Nq)
            square(0, Nk - Nq, Nq)
        else:  # the first Nq - Nk queries see no key (bottom-right alignment)
            square(Nq - Nk, 0, Nk)

        def sampled(q0, q1, k0, k1):
            return self.sample_size > 0 and -(-(k1 - k0) // self.block_size) > 1

        highs = tuple(k1 - k0 for q0, q1, k0, k1, c in pieces if c is None and sampled(q0, q1, k0, k1))
        proj, draws = _draws(self.seed, D, self.lsh_num_projs, (B, k.shape[1], self.sample_size), highs)
        next_draws = iter(draws)
        parts: list[ExactPart | HyperPart] = []
        for q0, q1, k0, k1, c in pieces:
            if c is not None:
                parts.append(ExactPart(q0, q1, k0, k1, c))
                continue
            samples = next(next_draws) if sampled(q0, q1, k0, k1) else None
            parts.append(
                HyperPart(
                    q0,
                    q1,
                    k0,
                    k1,
                    self._sort(q[:, :, q0:q1], proj),
                    self._sort(k[:, :, k0:k1], proj),
                    -(-(k1 - k0) // self.block_size),
                    self.block_size,
                    samples,
                )
            )
        return parts

    def _sort(self, x: Tensor, proj: Tensor) -> Tensor:
        """Indices sorting x (B, H, n, D) by angular-LSH bucket, in Gray-code order."""
        bits = torch.matmul(x.detach().to(torch.float64), proj) > 0
        codes = (bits.long() << torch.arange(self.lsh_num_projs)).sum(-1)
        return torch.sort(gray_rank(codes, self.lsh_num_projs), dim=-1, stable=True).indices

    # ------------------------------------------------------------------ fast path

    # not the template: its own checks and messages (no mask or causal, no score or sinks, 'auto' or 'reference')
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
        req, causal = self._check_call(q, k, v, mask, score, sinks, scale, backend)
        if backend == "reference" and observers:
            raise ValueError("observers: the dense reference (backend='reference') feeds no observers; use backend='auto'")
        if backend == "reference":
            out, lse = self.reference(q, k, v, mask=mask, scale=scale, return_lse=True)
        else:
            parts = self.plan(q, k, causal)
            out, lse = self._run(req, parts)
            if observers:
                call = CallInfo(req.batch, req.heads, req.q_len, req.k_len, req.q_start, layer, self.name)
                feed(observers, call, self._tiles(req, parts, lse, call))
        if check_finite and not all_finite(out):
            raise nonfinite_error(req)
        return (out, lse) if return_lse else out

    def _check_call(self, q, k, v, mask, score, sinks, scale, backend):
        req = make_request(q, k, v, scale=scale)
        if any(is_key_mask(p) for p in and_parts(mask)):
            raise padding_refused(
                "HyperAttention",
                "its LSH blocks and samples are drawn over every query and key of the call, padded ones included.",
            )
        if mask is not None and not isinstance(mask, Causal):
            raise ValueError(
                f"mask: HyperAttention supports no mask or attnkit.causal() (causal by recursive halving), got {mask!r}"
            )
        for name, value in (("score", score), ("sinks", sinks)):
            if value is not None:
                raise ValueError(
                    f"{name}: HyperAttention approximates plain softmax attention and takes no {name}, got {value!r}"
                )
        if backend not in ("auto", "reference"):
            raise ValueError(f"backend: HyperAttention runs 'auto' (its fast path) or 'reference', got {backend!r}")
        return req, mask is not None

    def _run(self, req, parts) -> tuple[Tensor, Tensor]:
        cd = torch.float64 if req.q.dtype == torch.float64 else torch.float32
        B, H, Nq, Dv = req.batch, req.heads, req.q_len, req.v_dim
        out = torch.zeros(B, H, Nq, Dv, dtype=cd)
        lse = torch.full((B, H, Nq), -math.inf, dtype=cd)
        for part in parts:
            q = req.q[:, :, part.q0 : part.q1]
            k, v = req.k[:, :, part.k0 : part.k1], req.v[:, :, part.k0 : part.k1]
            if isinstance(part, ExactPart):
                o, l = softmax_attention(
                    q, k, v, mask=Causal() if part.causal else None, scale=req.scale, return_lse=True, check_finite=False
                )
            else:
                o, l = self._hyper_part(part, q.to(cd), k.to(cd), v.to(cd), req.scale)
            o_new, l_new = merge_partial(out[:, :, part.q0 : part.q1], lse[:, :, part.q0 : part.q1], o.to(cd), l.to(cd))
            out = torch.slice_scatter(out, o_new, dim=2, start=part.q0, end=part.q1)
            lse = torch.slice_scatter(lse, l_new, dim=2, start=part.q0, end=part.q1)
        lse_dtype = torch.float64 if req.q.dtype == torch.float64 else torch.float32
        return out.to(req.q.dtype), lse.to(lse_dtype)

    def _hyper_part(self, part: HyperPart, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """Block-diagonal attention on the sorted orders plus the sampled residual.

        Rows are laid out (batch, kv head, block, query head of the group, row) by one
        index_select per tensor, so the whole part is two fused-op calls with a single
        "head": the G query heads of a group read the same key blocks and samples."""
        B, Hq, nq, D = q.shape
        Hkv, nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
        G = Hq // Hkv
        nb, bk, bq = part.n_blocks, part.block_size, part.q_block_size
        width = max(D, Dv)  # the op wants one head size: pad the smaller with zero columns
        q, k, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        # Flat rows with a zero row appended, which padding slots point at.
        q_rows, k_rows, v_rows = (torch.cat([t.reshape(-1, width), t.new_zeros(1, width)]) for t in (q, k, v))

        def base(heads, n):  # first flat row of every (batch row, head)
            return (torch.arange(B).view(B, 1, 1) * heads + torch.arange(heads).view(1, heads, 1)) * n

        def flat(order, heads, n, size):  # flat row of every sorted slot, padded to nb * size
            padded = F.pad(order, (0, nb * size - n), value=-1)
            return torch.where(padded >= 0, padded + base(heads, n), B * heads * n)

        q_src = flat(part.q_order, Hq, nq, bq).view(B, Hkv, G, nb, bq).transpose(2, 3).reshape(-1)
        k_src = flat(part.k_order, Hkv, nk, bk).reshape(-1)
        qb = q_rows.index_select(0, q_src).view(B * Hkv * nb, 1, G * bq, width)
        kb = k_rows.index_select(0, k_src).view(B * Hkv * nb, 1, bk, width)
        vb = v_rows.index_select(0, k_src).view(B * Hkv * nb, 1, bk, width)
        pad_mask = None
        if nb * bk > nk:  # padding keys at the end of the last block
            pad_mask = torch.zeros(nb, bk, dtype=q.dtype)
            pad_mask[-1, bk - (nb * bk - nk) :] = -math.inf
            pad_mask = pad_mask.repeat(B * Hkv, 1).view(B * Hkv * nb, 1, 1, bk)
        o, l = FlashWithLse.apply(qb, kb, vb, pad_mask, scale)
        if part.samples is not None:
            m = part.samples.shape[-1]
            s_src = (part.samples + base(Hkv, nk)).unsqueeze(2).expand(B, Hkv, nb, m).reshape(-1)
            kr = k_rows.index_select(0, s_src).view(B * Hkv * nb, 1, m, width)
            vr = v_rows.index_select(0, s_src).view(B * Hkv * nb, 1, m, width)
            # A sampled key of the query's own block is already counted exactly: leave it out.
            sample_block = part.k_block.gather(2, part.samples)
            own = sample_block.unsqueeze(2) == torch.arange(nb).view(1, 1, nb, 1)
            res_mask = torch.zeros(own.shape, dtype=q.dtype).masked_fill(own, -math.inf).view(B * Hkv * nb, 1, 1, m)
            o_res, l_res = FlashWithLse.apply(qb, kr, vr, res_mask, scale)
            o, l = merge_partial(o, l, o_res, l_res + math.log(nk / m))
        # Back to (B, Hq, nq): the slot of query (b, h = g*G + t, i) of sorted rank j*bq + r.
        rank = _ranks(part.q_order)
        head = torch.arange(Hq).view(1, Hq, 1)
        dest = ((torch.arange(B).view(B, 1, 1) * Hkv + head // G) * nb + rank // bq) * (G * bq) + (head % G) * bq + rank % bq
        dest = dest.reshape(-1)
        out = o.reshape(-1, width).index_select(0, dest).view(B, Hq, nq, width)[..., :Dv]
        return out, l.reshape(-1).index_select(0, dest).view(B, Hq, nq)

    # ------------------------------------------------------------------ reference

    def weights(self, parts, B: int, H: int, Nq: int, Nk: int, dtype, rows=None, cols=None) -> Tensor:
        """The multiplier W of exp(S) (B, H, rows, cols) that the pieces define: 1 on
        exact pairs and same-block pairs, count * Nk/m on sampled ones, 0 elsewhere."""
        r0, r1 = rows or (0, Nq)
        c0, c1 = cols or (0, Nk)
        w = torch.zeros(B, H, r1 - r0, c1 - c0, dtype=dtype)
        for part in parts:
            a0, a1, b0, b1 = max(part.q0, r0), min(part.q1, r1), max(part.k0, c0), min(part.k1, c1)
            if a0 < a1 and b0 < b1:
                w[:, :, a0 - r0 : a1 - r0, b0 - c0 : b1 - c0] = part.weights(
                    B, H, dtype, slice(a0 - part.q0, a1 - part.q0), slice(b0 - part.k0, b1 - part.k0)
                )
        return w

    def reference(self, q, k, v, *, mask=None, scale=None, return_lse=False, **_):
        """The paper's estimator written densely: out = (exp(S) * W) V / rowsum(exp(S) * W),
        W from the same seeded pieces as the fast path. O(N^2) memory."""
        req, causal = self._check_call(q, k, v, mask, None, None, scale, "auto")
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        G = req.heads // req.kv_heads
        parts = self.plan(q, k, causal)
        s = torch.matmul(q.to(cd), k.to(cd).repeat_interleave(G, 1).transpose(-1, -2)) * req.scale
        w = self.weights(parts, req.batch, req.heads, req.q_len, req.k_len, cd)
        s = s.masked_fill(w == 0, -math.inf)
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        a = torch.exp(s - m) * w
        total = a.sum(-1, keepdim=True)
        dead = total == 0  # rows that see no key: zeros and lse = -inf, finite gradients
        total = torch.where(dead, torch.ones_like(total), total)
        out = torch.matmul(a, v.to(cd).repeat_interleave(G, 1)) / total
        lse = torch.where(dead, -math.inf, m + torch.log(total)).squeeze(-1)
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out

    def _tiles(self, req, parts, lse: Tensor, call: CallInfo):
        """The weights the estimator gives every pair, exp(S - lse) * W, tile by tile."""
        cd = torch.float64 if req.q.dtype == torch.float64 else torch.float32
        B, H, G = req.batch, req.heads, req.heads // req.kv_heads
        with torch.no_grad():
            lse = lse.detach().to(cd)
            lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)  # dead rows: weight 0, not NaN
            for r0 in range(0, req.q_len, OBSERVE_Q_BLOCK):
                r1 = min(r0 + OBSERVE_Q_BLOCK, req.q_len)
                q = req.q[:, :, r0:r1].to(cd)
                for c0 in range(0, req.k_len, OBSERVE_K_BLOCK):
                    c1 = min(c0 + OBSERVE_K_BLOCK, req.k_len)
                    w = self.weights(parts, B, H, req.q_len, req.k_len, cd, (r0, r1), (c0, c1))
                    if not bool(w.any()):
                        continue
                    k = req.k[:, :, c0:c1].to(cd).repeat_interleave(G, 1)
                    s = (torch.matmul(q, k.transpose(-1, -2)) * req.scale).masked_fill(w == 0, -math.inf)
                    p = torch.exp(s - lse[:, :, r0:r1, None]) * w
                    yield AttentionTile(call, torch.arange(B), torch.arange(r0, r1) + req.q_start, torch.arange(c0, c1), p, s)
