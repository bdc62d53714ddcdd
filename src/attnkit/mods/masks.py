"""Attention masks: ``mask(b, h, q_idx, kv_idx) -> bool`` (the FlexAttention convention).

Every mask is a small object that (1) evaluates on broadcastable index tensors,
(2) classifies whole tiles as EMPTY / PARTIAL / FULL from its structure so kernels can
skip work without evaluating it, (3) checks itself against the shapes of a call, and
(4) prints a readable ``repr``. Masks compose with ``&``, ``|`` and ``~``.

Query indices are *positions in key coordinates*: with Nq queries against Nk keys,
query i sits at position ``Nk - Nq + i`` (bottom-right alignment, as FlashAttention
>= 2.1), so decoding against a KV cache needs no special case.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

from .grid import FULL, PARTIAL, TileGrid, classify_interval, states

Tensor = torch.Tensor


class Mask:
    """Base class. Subclasses implement ``__call__`` and usually ``classify``."""

    #: True when the mask differs between batch rows (classify returns B grids).
    batch_dependent: bool = False

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def classify(self, grid: TileGrid) -> Tensor:
        """int8 grid (Bm, n_q, n_k) of EMPTY / PARTIAL / FULL; the default knows nothing."""
        return torch.full((1, grid.n_q, grid.n_k), PARTIAL, dtype=torch.int8)

    def check(self, batch: int, heads: int, q_len: int, k_len: int) -> None:
        """Raise ValueError if this mask cannot apply to a call of these sizes."""

    def bind(self, batch: int, heads: int, q_len: int, k_len: int) -> Mask:
        """This mask resolved for a call of these sizes (checked; call-dependent parts fixed)."""
        self.check(batch, heads, q_len, k_len)
        return self

    def children(self) -> tuple[Mask, ...]:
        return ()

    def band(self) -> tuple[int | None, int | None] | None:
        """(lo, hi) when the mask is exactly ``lo <= kv - q <= hi`` (None: unbounded side),
        so fused kernels can take it as a key range per query; None for any other mask."""
        return None

    def walk(self):
        """This mask and every mask it is built from."""
        yield self
        for child in self.children():
            yield from child.walk()

    def __and__(self, other: Mask) -> Mask:
        return And(self, as_mask(other, "mask"))

    def __or__(self, other: Mask) -> Mask:
        return Or(self, as_mask(other, "mask"))

    def __invert__(self) -> Mask:
        return Not(self)

    def dense(self, batch: int, heads: int, q_len: int, k_len: int) -> Tensor:
        """The mask as a boolean tensor broadcastable to (B, H, Nq, Nk) (for tests and SDPA)."""
        mask = self.bind(batch, heads, q_len, k_len)
        b, h, qi, ki = index_tensors(batch, heads, k_len - q_len, q_len, 0, k_len)
        return torch.as_tensor(mask(b, h, qi, ki), dtype=torch.bool)


def index_tensors(
    batch: int | Tensor, heads: int, q_start: int, q_len: int, k_start: int, k_len: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcastable (b, h, q_idx, kv_idx) index tensors for a tile (read-only: cached)."""
    b = batch.view(-1, 1, 1, 1) if isinstance(batch, Tensor) else _arange(0, batch, 0)
    return b, _arange(0, heads, 1), _arange(q_start, q_len, 2), _arange(k_start, k_len, 3)


@functools.lru_cache(maxsize=512)
def _arange(start: int, length: int, dim: int) -> Tensor:
    shape = [1, 1, 1, 1]
    shape[dim] = length
    return torch.arange(start, start + length).view(shape)


def as_mask(obj, name: str = "mask") -> Mask:
    """A Mask from a Mask or a plain callable ``(b, h, q_idx, kv_idx) -> bool``."""
    if isinstance(obj, Mask):
        return obj
    if callable(obj):
        return FnMask(obj)
    raise TypeError(f"{name}: expected an attnkit mask or a callable (b, h, q_idx, kv_idx) -> bool, got {type(obj).__name__}")


def band_of(mask: Mask | None) -> tuple[int | None, int | None] | None:
    """``mask.band()``, with no mask being the unbounded band (None, None)."""
    return (None, None) if mask is None else mask.band()


class FnMask(Mask):
    """A user callable; always evaluated (kernels cannot see inside it)."""

    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]):
        self.fn = fn

    def __call__(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, q_idx, kv_idx)

    def __repr__(self):
        return f"mask({getattr(self.fn, '__name__', type(self.fn).__name__)})"


class And(Mask):
    def __init__(self, *parts: Mask):
        self.parts = tuple(parts)
        self.batch_dependent = any(p.batch_dependent for p in parts)

    def __call__(self, b, h, q_idx, kv_idx):
        out = self.parts[0](b, h, q_idx, kv_idx)
        for p in self.parts[1:]:
            out = out & p(b, h, q_idx, kv_idx)
        return out

    def classify(self, grid):
        return _combine([p.classify(grid) for p in self.parts], torch.minimum)

    def check(self, *shape):
        for p in self.parts:
            p.check(*shape)

    def bind(self, *shape):
        parts = [p.bind(*shape) for p in self.parts]
        return self if all(a is b for a, b in zip(parts, self.parts)) else And(*parts)

    def children(self):
        return self.parts

    def band(self):
        bands = [p.band() for p in self.parts]
        if any(b is None for b in bands):
            return None
        los = [lo for lo, _ in bands if lo is not None]
        his = [hi for _, hi in bands if hi is not None]
        return (max(los) if los else None, min(his) if his else None)

    def __repr__(self):
        return " & ".join(_paren(p) for p in self.parts)


class Or(Mask):
    def __init__(self, *parts: Mask):
        self.parts = tuple(parts)
        self.batch_dependent = any(p.batch_dependent for p in parts)

    def __call__(self, b, h, q_idx, kv_idx):
        out = self.parts[0](b, h, q_idx, kv_idx)
        for p in self.parts[1:]:
            out = out | p(b, h, q_idx, kv_idx)
        return out

    def classify(self, grid):
        return _combine([p.classify(grid) for p in self.parts], torch.maximum)

    def check(self, *shape):
        for p in self.parts:
            p.check(*shape)

    def bind(self, *shape):
        parts = [p.bind(*shape) for p in self.parts]
        return self if all(a is b for a, b in zip(parts, self.parts)) else Or(*parts)

    def children(self):
        return self.parts

    def __repr__(self):
        return " | ".join(_paren(p) for p in self.parts)


class Not(Mask):
    def __init__(self, part: Mask):
        self.part = part
        self.batch_dependent = part.batch_dependent

    def __call__(self, b, h, q_idx, kv_idx):
        return ~torch.as_tensor(self.part(b, h, q_idx, kv_idx), dtype=torch.bool)

    def classify(self, grid):
        return FULL - self.part.classify(grid)

    def check(self, *shape):
        self.part.check(*shape)

    def bind(self, *shape):
        inner = self.part.bind(*shape)
        return self if inner is self.part else Not(inner)

    def children(self):
        return (self.part,)

    def __repr__(self):
        return f"~{_paren(self.part)}"


def _paren(m: Mask) -> str:
    return f"({m!r})" if type(m) in (And, Or) else repr(m)


def _combine(grids: list[Tensor], op) -> Tensor:
    out = grids[0]
    for g in grids[1:]:
        out = op(out, g)
    return out


# --------------------------------------------------------------------------- structured


class Causal(Mask):
    """Key position <= query position (bottom-right aligned when Nq != Nk)."""

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def classify(self, grid):
        return classify_interval(grid, None, 0)

    def band(self):
        return (None, 0)

    def __repr__(self):
        return "causal()"


class Window(Mask):
    """``q - left <= kv <= q + right`` (FlashAttention's ``window_size=(left, right)``).

    ``window(left)`` alone is the causal sliding window of Mistral / Longformer's local
    attention: each query sees itself and ``left`` keys before it.
    """

    def __init__(self, left: int | None, right: int | None = 0):
        for name, value in (("left", left), ("right", right)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"window: {name} must be a non-negative int or None, got {value!r}")
        self.left, self.right = left, right

    def __call__(self, b, h, q_idx, kv_idx):
        diff = kv_idx - q_idx
        if self.left is None:
            return diff <= self.right if self.right is not None else torch.ones_like(diff, dtype=torch.bool)
        if self.right is None:
            return diff >= -self.left
        return (diff >= -self.left) & (diff <= self.right)

    def classify(self, grid):
        return classify_interval(grid, None if self.left is None else -self.left, self.right)

    def band(self):
        return (None if self.left is None else -self.left, self.right)

    def __repr__(self):
        return f"window(left={self.left}, right={self.right})"


class KeyPrefix(Mask):
    """Key position < prefix length (per batch row when given a tensor)."""

    def __init__(self, prefix_len):
        self.prefix = _per_batch_lengths(prefix_len, "prefix_lm(prefix_len)")
        self.batch_dependent = self.prefix.dim() == 1

    def __call__(self, b, h, q_idx, kv_idx):
        prefix = self.prefix[b] if self.batch_dependent else self.prefix
        return kv_idx < prefix

    def classify(self, grid):
        k_lo, k_hi = grid.k_bounds()
        prefix = self.prefix.view(-1, 1, 1)
        return states((k_hi <= prefix).expand(-1, grid.n_q, -1), (k_lo >= prefix).expand(-1, grid.n_q, -1))

    def check(self, batch, heads, q_len, k_len):
        _check_per_batch(self.prefix, batch, "prefix_lm(prefix_len)")

    def __repr__(self):
        return f"key_prefix({_short(self.prefix)})"


class PrefixLM(Or):
    """Prefix-LM: bidirectional over the first ``prefix_len`` keys, causal after."""

    def __init__(self, prefix_len):
        super().__init__(Causal(), KeyPrefix(prefix_len))

    def __repr__(self):
        return f"prefix_lm({_short(self.parts[1].prefix)})"


class Padding(Mask):
    """Key position < length of its batch row (right-padded batches)."""

    batch_dependent = True

    def __init__(self, lengths):
        self.lengths = _per_batch_lengths(lengths, "padding(lengths)")
        if self.lengths.dim() != 1:
            raise ValueError(f"padding(lengths): expected a 1-D tensor or list of lengths per batch row, got {lengths!r}")

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx < self.lengths[b]

    def classify(self, grid):
        k_lo, k_hi = grid.k_bounds()
        lengths = self.lengths.view(-1, 1, 1)
        return states((k_hi <= lengths).expand(-1, grid.n_q, -1), (k_lo >= lengths).expand(-1, grid.n_q, -1))

    def check(self, batch, heads, q_len, k_len):
        _check_per_batch(self.lengths, batch, "padding(lengths)")
        if int(self.lengths.max()) > k_len:
            raise ValueError(f"padding(lengths): a length exceeds the key length Nk={k_len}: {self.lengths.tolist()}")

    def __repr__(self):
        return f"padding({_short(self.lengths)})"


class Document(Mask):
    """Packed sequences: a query sees only keys of its own document.

    ``ids`` holds a document id per position, shape (Nk,) or (B, Nk). Not causal by
    itself: use ``causal() & document(ids)`` for packed causal LM training.
    """

    def __init__(self, ids):
        ids = torch.as_tensor(ids)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() not in (1, 2):
            raise ValueError(
                f"document(ids): expected an integer tensor of shape (N,) or (B, N), got dtype {ids.dtype} shape {tuple(ids.shape)}"
            )
        self.ids = ids.long()
        self.batch_dependent = ids.dim() == 2

    def __call__(self, b, h, q_idx, kv_idx):
        if self.batch_dependent:
            return self.ids[b, q_idx] == self.ids[b, kv_idx]
        return self.ids[q_idx] == self.ids[kv_idx]

    def classify(self, grid):
        ids = self.ids if self.batch_dependent else self.ids[None]
        q_min, q_max = grid.block_min_max(ids, "q")
        k_min, k_max = grid.block_min_max(ids, "k")
        q_min, q_max = q_min[:, :, None], q_max[:, :, None]
        k_min, k_max = k_min[:, None, :], k_max[:, None, :]
        full = (q_min == q_max) & (k_min == k_max) & (q_min == k_min)
        empty = (q_max < k_min) | (k_max < q_min)
        return states(full, empty)

    def check(self, batch, heads, q_len, k_len):
        if self.ids.shape[-1] != k_len:
            raise ValueError(
                f"document(ids): ids has {self.ids.shape[-1]} positions but the keys have Nk={k_len}; expected shape (Nk,) or (B, Nk)"
            )
        if self.batch_dependent:
            _check_per_batch(self.ids, batch, "document(ids)")
        if q_len > k_len:
            raise ValueError(f"document(ids): Nq={q_len} > Nk={k_len}: queries must be positions among the keys")

    def __repr__(self):
        n = int(self.ids.max()) + 1 if self.ids.numel() else 0
        return f"document({n} ids over {self.ids.shape[-1]} positions{', per batch row' if self.batch_dependent else ''})"


class Dilated(Mask):
    """Dilated sliding window: ``|q - kv| <= window`` and ``(q - kv) % dilation == 0``.

    The dilated window of Longformer (Beltagy et al. 2020, arXiv 2004.05150); ``window``
    is a distance in positions. ``causal=True`` keeps only ``kv <= q``.
    """

    def __init__(self, window: int, dilation: int, causal: bool = False):
        _positive_int(window, "dilated(window)", allow_zero=True)
        _positive_int(dilation, "dilated(dilation)")
        self.window, self.dilation, self.causal = window, dilation, causal

    def __call__(self, b, h, q_idx, kv_idx):
        diff = q_idx - kv_idx
        out = (diff.abs() <= self.window) & (diff % self.dilation == 0)
        return out & (diff >= 0) if self.causal else out

    def classify(self, grid):
        band = classify_interval(grid, -self.window, 0 if self.causal else self.window)
        return band if self.dilation == 1 else torch.minimum(band, torch.tensor(PARTIAL, dtype=torch.int8))

    def __repr__(self):
        return f"dilated(window={self.window}, dilation={self.dilation}{', causal=True' if self.causal else ''})"


class Neighborhood(Mask):
    """Neighborhood attention over a flattened N-D grid (NATTEN semantics).

    Every query sees a ``kernel``-sized neighbourhood along each axis, shifted inward at
    the borders so that it always holds ``kernel`` keys (Hassani et al. 2022, arXiv
    2204.07143); with ``dilation`` d, positions with the same residue mod d form their own
    sub-grid (DiNAT, arXiv 2209.15001); ``causal`` keeps keys at or before the query on
    that axis; with ``stride`` s, each group of s consecutive queries (of a sub-grid)
    shares the neighbourhood of its leader, the group's centre (its last query when
    causal), as NATTEN's strided / generalized NA (arXiv 2504.16922). Positions are
    row-major over ``grid``.
    """

    def __init__(self, grid: Sequence[int], kernel, dilation=1, causal=False, stride=1):
        self.grid = tuple(int(g) for g in grid)
        n = len(self.grid)
        self.kernel = _per_axis(kernel, n, "kernel")
        self.dilation = _per_axis(dilation, n, "dilation")
        self.causal = _per_axis(causal, n, "causal", kind=bool)
        self.stride = _per_axis(stride, n, "stride")
        for axis, (g, k, d, s) in enumerate(zip(self.grid, self.kernel, self.dilation, self.stride)):
            _positive_int(g, f"neighborhood: grid[{axis}]")
            _positive_int(k, f"neighborhood: kernel[{axis}]")
            _positive_int(d, f"neighborhood: dilation[{axis}]")
            _positive_int(s, f"neighborhood: stride[{axis}]")
            if k * d > g:
                raise ValueError(f"neighborhood: kernel[{axis}] * dilation[{axis}] = {k * d} exceeds grid[{axis}] = {g}")
            if s > k:
                raise ValueError(f"neighborhood: stride[{axis}] = {s} exceeds kernel[{axis}] = {k} (queries would go unattended)")

    @property
    def size(self) -> int:
        return math.prod(self.grid)

    def coords(self, pos: Tensor) -> list[Tensor]:
        out = []
        for g in reversed(self.grid):
            out.append(pos % g)
            pos = pos // g
        return out[::-1]

    def axis_window(self, x: Tensor, axis: int) -> tuple[Tensor, Tensor]:
        """First and last (inclusive) coordinate of the neighbourhood of coordinate x."""
        g, k, d, s = self.grid[axis], self.kernel[axis], self.dilation[axis], self.stride[axis]
        r, i = x % d, x // d
        group_len = (g - r + d - 1) // d
        if self.causal[axis]:
            leader = torch.minimum((i // s) * s + s - 1, group_len - 1)
            start = torch.clamp(leader - (k - 1), min=0)
            end = i
        else:
            leader = torch.minimum((i // s) * s + s // 2, group_len - 1)
            start = torch.minimum(torch.clamp(leader - k // 2, min=0), group_len - k)
            end = start + k - 1
        return r + d * start, r + d * end

    def __call__(self, b, h, q_idx, kv_idx):
        out = torch.ones((), dtype=torch.bool)
        qc, kc = self.coords(q_idx), self.coords(kv_idx)
        for axis in range(len(self.grid)):
            lo, hi = self.axis_window(qc[axis], axis)
            d = self.dilation[axis]
            out = out & (kc[axis] >= lo) & (kc[axis] <= hi) & ((kc[axis] - qc[axis]) % d == 0)
        return out

    def classify(self, grid):
        # Along the slowest axis a tile of flattened positions covers a contiguous range
        # of coordinates, so windows of that axis bound the keys any query can see.
        q_pos = torch.arange(grid.q_start + grid.q_len)
        stride = self.size // self.grid[0]
        lo, hi = self.axis_window(q_pos // stride, 0)
        lo_min, _ = grid.block_min_max(lo[None] * stride, "q")
        _, hi_max = grid.block_min_max(hi[None] * stride + stride - 1, "q")
        k_lo, k_hi = grid.k_bounds()
        empty = (k_hi - 1 < lo_min[0, :, None]) | (k_lo > hi_max[0, :, None])
        if len(self.grid) == 1 and self.dilation[0] == 1:
            lo_max, _ = grid.block_min_max(-lo[None], "q")
            hi_min, _ = grid.block_min_max(hi[None], "q")
            full = (k_lo >= -lo_max[0, :, None]) & (k_hi - 1 <= hi_min[0, :, None])
        else:
            full = torch.zeros_like(empty)
        return states(full, empty)

    def check(self, batch, heads, q_len, k_len):
        if k_len != self.size or q_len != k_len:
            raise ValueError(
                f"neighborhood over grid {self.grid}: expected Nq == Nk == {self.size} (self-attention over the flattened grid), got Nq={q_len}, Nk={k_len}"
            )

    def __repr__(self):
        name = f"neighborhood_{len(self.grid)}d"
        parts = [f"grid={self.grid}" if len(self.grid) > 1 else f"length={self.grid[0]}", f"kernel={_unwrap(self.kernel)}"]
        if any(d != 1 for d in self.dilation):
            parts.append(f"dilation={_unwrap(self.dilation)}")
        if any(self.causal):
            parts.append(f"causal={_unwrap(self.causal)}")
        if any(s != 1 for s in self.stride):
            parts.append(f"stride={_unwrap(self.stride)}")
        return f"{name}({', '.join(parts)})"


class _Lazy1D(Mask):
    """``neighborhood_1d`` without a length: bound to Nk at call time."""

    def __init__(self, kernel, dilation, causal, stride=1):
        self.kernel, self.dilation, self.causal, self.stride = kernel, dilation, causal, stride

    def bind(self, batch, heads, q_len, k_len):
        return Neighborhood((k_len,), self.kernel, self.dilation, self.causal, self.stride).bind(batch, heads, q_len, k_len)

    def __call__(self, b, h, q_idx, kv_idx):
        raise RuntimeError("neighborhood_1d without length= must be bound to a call first (pass it to attnkit.attention)")

    def __repr__(self):
        stride = f", stride={self.stride}" if self.stride != 1 else ""
        return f"neighborhood_1d(kernel={self.kernel}, dilation={self.dilation}, causal={self.causal}{stride})"


# --------------------------------------------------------------------------- helpers


def _per_batch_lengths(value, name: str) -> Tensor:
    t = torch.as_tensor(value)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() > 1:
        raise ValueError(f"{name}: expected an int or a 1-D integer tensor (one per batch row), got {value!r}")
    if (t < 0).any():
        raise ValueError(f"{name}: must be >= 0, got {value!r}")
    return t.long()


def _check_per_batch(t: Tensor, batch: int, name: str) -> None:
    if t.dim() >= 1 and t.shape[0] != batch:
        raise ValueError(f"{name}: has {t.shape[0]} batch rows but the call has B={batch}")


def _positive_int(value, name: str, allow_zero: bool = False) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value >= 1)
    if not ok:
        raise ValueError(f"{name}: expected an int {'>= 0' if allow_zero else '>= 1'}, got {value!r}")


def _per_axis(value, n: int, name: str, kind=int) -> tuple:
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * n
    if len(values) != n:
        raise ValueError(f"neighborhood: {name} has {len(values)} entries but the grid has {n} axes")
    if kind is bool and not all(isinstance(v, bool) for v in values):
        raise ValueError(f"neighborhood: {name} expects bools, got {value!r}")
    return values


def _unwrap(t: tuple):
    return t[0] if len(set(t)) == 1 else t


def _short(t: Tensor) -> str:
    return str(int(t)) if t.dim() == 0 else str(t.tolist()) if t.numel() <= 8 else f"tensor of {t.numel()}"


# --------------------------------------------------------------------------- constructors


def causal() -> Mask:
    """Causal mask, bottom-right aligned when Nq != Nk."""
    return Causal()


def window(left: int | None, right: int | None = 0) -> Mask:
    """Sliding window: key within ``left`` before and ``right`` after the query."""
    return Window(left, right)


def prefix_lm(prefix_len) -> Mask:
    """Bidirectional over the first ``prefix_len`` keys (int or one per batch row), causal after."""
    return PrefixLM(prefix_len)


def document(ids) -> Mask:
    """Packed sequences: same document id only; ``ids`` of shape (Nk,) or (B, Nk)."""
    return Document(ids)


def dilated(window: int, dilation: int, causal: bool = False) -> Mask:
    """Dilated sliding window (Longformer): distance <= window and a multiple of dilation."""
    return Dilated(window, dilation, causal)


def neighborhood_1d(kernel: int, dilation: int = 1, causal: bool = False, length: int | None = None, stride: int = 1) -> Mask:
    """1-D neighborhood attention (NATTEN semantics); ``length`` defaults to Nk."""
    if length is None:
        _positive_int(kernel, "neighborhood_1d(kernel)")
        _positive_int(dilation, "neighborhood_1d(dilation)")
        _positive_int(stride, "neighborhood_1d(stride)")
        if stride > kernel:
            raise ValueError(f"neighborhood_1d: stride = {stride} exceeds kernel = {kernel} (queries would go unattended)")
        return _Lazy1D(kernel, dilation, bool(causal), stride)
    return Neighborhood((length,), kernel, dilation, causal, stride)


def neighborhood_2d(grid: Sequence[int], kernel, dilation=1, causal=False, stride=1) -> Mask:
    """2-D neighborhood attention over a row-major flattened ``grid=(height, width)``."""
    if len(tuple(grid)) != 2:
        raise ValueError(f"neighborhood_2d: grid must be (height, width), got {grid!r}")
    return Neighborhood(grid, kernel, dilation, causal, stride)


def neighborhood_3d(grid: Sequence[int], kernel, dilation=1, causal=False, stride=1) -> Mask:
    """3-D neighborhood attention over a row-major flattened ``grid=(depth, height, width)``."""
    if len(tuple(grid)) != 3:
        raise ValueError(f"neighborhood_3d: grid must be (depth, height, width), got {grid!r}")
    return Neighborhood(grid, kernel, dilation, causal, stride)


def padding(lengths) -> Mask:
    """Key padding: batch row b sees only its first ``lengths[b]`` keys."""
    return Padding(lengths)
