"""transformers' masks, kept as descriptions and turned into attnkit masks.

transformers builds a mask once per forward through the function registered in
``AttentionMaskInterface`` under the model's attention implementation. Its own sdpa and
eager functions materialise a (B, 1, Nq, Nk) tensor; attnkit's returns a ``MaskSpec``
instead: the mask *function* (a FlexAttention-style ``mask(b, h, q, kv)``), the 2-D
padding mask and the offsets. ``to_attnkit`` then reads the function's structure —
causal, sliding window, bidirectional, and/or-compositions — into attnkit's structured
masks, so the kernels skip whole tiles and nothing N x N is ever held; a function it
does not recognise is kept exactly and evaluated tile by tile.

Index convention: transformers numbers queries ``q_offset + i`` and keys
``kv_offset + j``; attnkit puts query i at key position ``Nk - Nq + i``. ``shift`` below
is the difference between the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
from transformers import masking_utils as hf_masks

from ..mods import PARTIAL, Mask, TileGrid, causal, window
from ..mods.grid import classify_interval, states
from ..mods.masks import And, Causal

Tensor = torch.Tensor


@dataclass
class MaskSpec:
    """What transformers asked the mask function for, unevaluated."""

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    mask_function: object
    padding: Tensor | None  # (B, >= kv_offset + kv_length) bool, True = a real token
    use_vmap: bool = False


def mask_spec(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=hf_masks.causal_mask_function,
    attention_mask=None,
    use_vmap=False,
    **_,
) -> MaskSpec:
    """The function attnkit registers in ``AttentionMaskInterface`` (same signature as
    transformers' ``sdpa_mask``): it records the request instead of building a tensor."""
    return MaskSpec(
        int(batch_size),
        int(q_length),
        int(kv_length),
        int(q_offset),
        int(kv_offset),
        mask_function,
        attention_mask,
        bool(use_vmap),
    )


# --------------------------------------------------------------------------- attnkit masks


class Band(Mask):
    """``q + lo <= kv <= q + hi`` (None: unbounded), for offsets attnkit's ``window``
    does not take (a negative ``hi`` appears with static caches)."""

    def __init__(self, lo: int | None, hi: int | None):
        self.lo, self.hi = lo, hi

    def __call__(self, b, h, q_idx, kv_idx):
        out = torch.ones((), dtype=torch.bool)
        if self.lo is not None:
            out = out & (kv_idx >= q_idx + self.lo)
        if self.hi is not None:
            out = out & (kv_idx <= q_idx + self.hi)
        return out

    def classify(self, grid: TileGrid) -> Tensor:
        return classify_interval(grid, self.lo, self.hi)

    def __repr__(self):
        return f"band(lo={self.lo}, hi={self.hi})"


class KeyMask(Mask):
    """Key j of batch row b is visible iff ``keep[b, j]`` (any padding pattern, left or right)."""

    batch_dependent = True
    #: it depends on the key alone: mechanisms without a dense mask (linear attention's
    #: recurrence) read it as "this key does not exist", as they read attnkit.padding
    key_only = True

    def __init__(self, keep: Tensor):
        if keep.dim() != 2 or keep.dtype != torch.bool:
            raise ValueError(f"key mask: expected a (B, Nk) bool tensor, got {keep.dtype} of shape {tuple(keep.shape)}")
        self.keep = keep

    def __call__(self, b, h, q_idx, kv_idx):
        return self.keep[b, kv_idx]

    def classify(self, grid: TileGrid) -> Tensor:
        lo, hi = grid.block_min_max(self.keep.to(torch.int8), "k")  # (B, n_k) each
        full = (lo == 1)[:, None, :].expand(-1, grid.n_q, -1)
        empty = (hi == 0)[:, None, :].expand(-1, grid.n_q, -1)
        return states(full, empty)

    def check(self, batch, heads, q_len, k_len):
        if self.keep.shape != (batch, k_len):
            raise ValueError(f"key mask: has shape {tuple(self.keep.shape)} but the call needs (B, Nk) = ({batch}, {k_len})")

    def __repr__(self):
        return f"key_mask({int(self.keep.sum())} of {self.keep.numel()} keys)"


class DenseMask(Mask):
    """A boolean (B|1, H|1, Nq, Nk) tensor, rows aligned with the queries (a custom 4-D mask)."""

    def __init__(self, keep: Tensor):
        self.keep = keep
        self.batch_dependent = keep.shape[0] > 1
        self.q_start = 0

    def __call__(self, b, h, q_idx, kv_idx):
        t = self.keep
        bi = b if t.shape[0] > 1 else torch.zeros_like(b)
        hi = h if t.shape[1] > 1 else torch.zeros_like(h)
        return t[bi, hi, q_idx - self.q_start, kv_idx]

    def bind(self, batch, heads, q_len, k_len):
        t = self.keep
        if t.dim() != 4 or t.shape[0] not in (1, batch) or t.shape[1] not in (1, heads) or t.shape[2:] != (q_len, k_len):
            raise ValueError(
                f"attention_mask: a 4-D mask must have shape (1 or B={batch}, 1 or H={heads}, Nq={q_len}, Nk={k_len}), got {tuple(t.shape)}"
            )
        out = DenseMask(t)
        out.q_start = k_len - q_len
        return out

    def __repr__(self):
        return f"dense_mask({'x'.join(map(str, self.keep.shape))})"


class FunctionMask(Mask):
    """A transformers mask function evaluated exactly on every tile, in its own coordinates."""

    def __init__(self, fn, q_shift: int, kv_offset: int, use_vmap: bool):
        self.fn, self.q_shift, self.kv_offset, self.use_vmap = fn, q_shift, kv_offset, use_vmap
        # The function may close over per-row tensors (packed sequences, token types).
        self.batch_dependent = True

    def __call__(self, b, h, q_idx, kv_idx):
        q_hf, kv_hf = q_idx + self.q_shift, kv_idx + self.kv_offset
        if not self.use_vmap:
            return self.fn(b, h, q_hf, kv_hf)
        # Functions flagged for vmap may index tensors with scalars; evaluate them the way
        # transformers does (one vmap per dimension), on this tile only.
        fn = self.fn
        for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
            fn = torch.vmap(fn, in_dims=dims, out_dims=0)
        with TransformGetItemToIndex():
            return fn(b.reshape(-1), h.reshape(-1), q_hf.reshape(-1), kv_hf.reshape(-1))

    def classify(self, grid: TileGrid) -> Tensor:
        return torch.full((1, grid.n_q, grid.n_k), PARTIAL, dtype=torch.int8)

    def __repr__(self):
        return f"hf_mask({getattr(self.fn, '__name__', type(self.fn).__name__)})"


# --------------------------------------------------------------------------- translation


def _code(factory, *args):
    """The code object of the closure a transformers mask factory returns."""
    return factory(*args).__code__


_AND = _code(hf_masks.and_masks)
_OR = _code(hf_masks.or_masks)
_SLIDING = _code(hf_masks.sliding_window_overlay, 1)
_PADDING = _code(hf_masks.padding_mask_function, torch.ones(1, 1, dtype=torch.bool))


ALL = object()  # a mask function that keeps every pair


def _closure(fn) -> dict:
    """The variables a closure captured, by name."""
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())}


@dataclass(frozen=True)
class _Call:
    q_shift: int  # q_hf = q + q_shift
    kv_offset: int  # kv_hf = kv + kv_offset
    k_len: int
    use_vmap: bool

    @property
    def shift(self) -> int:
        """q_hf - kv_offset = q + shift: the query in key coordinates."""
        return self.q_shift - self.kv_offset


def _translate(fn, call: _Call):
    """An attnkit mask equal to ``fn`` on this call (ALL when it keeps every pair).

    Known pieces become structured masks; an unknown piece is kept as a FunctionMask,
    so an and-composition still skips the tiles its known parts rule out."""
    if fn is hf_masks.causal_mask_function:
        # kv_hf <= q_hf  <=>  kv <= q + shift
        return causal() if call.shift == 0 else Band(None, call.shift)
    if fn is hf_masks.bidirectional_mask_function:
        return ALL
    code = getattr(fn, "__code__", None)
    if code is _SLIDING:
        # kv_hf > q_hf - w  <=>  kv >= q + shift - w + 1
        return Band(call.shift - _closure(fn)["sliding_window"] + 1, None)
    if code is _PADDING:
        return KeyMask(_keys_held(_closure(fn)["padding_mask"], call.kv_offset, call.k_len))
    if code in (_AND, _OR):
        parts = [_translate(f, call) for f in _closure(fn)["mask_functions"]]
        if code is _AND:
            parts = [p for p in parts if p is not ALL]
            return ALL if not parts else _fold(parts, lambda a, b: a & b)
        if any(p is ALL for p in parts):
            return ALL
        return _fold(parts, lambda a, b: a | b)
    return FunctionMask(fn, call.q_shift, call.kv_offset, call.use_vmap)


def _keys_held(padding: Tensor, kv_offset: int, k_len: int) -> Tensor:
    """The (B, k_len) slice of a 2-D padding mask for the keys the layer holds; past its
    end, keys count as padding (transformers pads it with False the same way)."""
    keep = padding[:, kv_offset : kv_offset + k_len].to(torch.bool)
    if keep.shape[1] < k_len:
        keep = torch.nn.functional.pad(keep, (0, k_len - keep.shape[1]))
    return keep


def _fold(parts, op):
    out = parts[0]
    for p in parts[1:]:
        out = op(out, p)
    return _simplify(out)


def _simplify(mask: Mask) -> Mask:
    """``causal & band(lo, None)`` with lo <= 0 is attnkit's ``window(-lo)``: the form the
    dispatcher and planner recognise."""
    if isinstance(mask, And) and len(mask.parts) == 2:
        a, b = mask.parts
        if isinstance(b, Causal):
            a, b = b, a
        if isinstance(a, Causal) and isinstance(b, Band) and b.hi is None and b.lo is not None and b.lo <= 0:
            return window(-b.lo)
    return mask


def to_attnkit(spec: MaskSpec, q_len: int, k_len: int) -> Mask | None:
    """The attnkit mask for one attention call of ``q_len`` queries against ``k_len`` keys."""
    # attnkit query row i sits at position k_len - q_len + i; transformers at q_offset + i.
    call = _Call(spec.q_offset - (k_len - q_len), spec.kv_offset, k_len, spec.use_vmap)
    mask = _translate(spec.mask_function, call)
    if mask is ALL:
        mask = None
    if spec.padding is not None:
        keep = _keys_held(spec.padding, spec.kv_offset, k_len)
        if not bool(keep.all()):
            key_mask = KeyMask(keep)
            mask = key_mask if mask is None else mask & key_mask
    return mask


def tensor_to_attnkit(mask: Tensor) -> tuple[Mask | None, Tensor | None]:
    """A custom 4-D mask tensor as (attnkit mask, additive bias or None): bool is True =
    visible; float is additive, with the dtype's minimum (or -inf) meaning masked."""
    if mask.dim() != 4:
        raise ValueError(
            f"attention_mask: expected a 4-D tensor (B, 1|H, Nq, Nk) or a mask built by transformers, got shape {tuple(mask.shape)}"
        )
    if mask.dtype == torch.bool:
        return DenseMask(mask), None
    if not mask.is_floating_point():
        raise ValueError(f"attention_mask: expected a bool or float 4-D mask, got dtype {mask.dtype}")
    keep = mask > torch.finfo(mask.dtype).min / 2
    bias = torch.where(keep, mask, torch.zeros((), dtype=mask.dtype))
    return DenseMask(keep), (bias if bool((bias != 0).any()) else None)
