"""Score modifications: ``score(s, b, h, q_idx, kv_idx) -> s`` (the FlexAttention convention).

A score mod changes a pre-softmax logit ``s`` (already multiplied by ``scale``). Mods
chain with ``>>`` (``alibi(8) >> softcap(30)`` applies ALiBi first) or a list.

Each mod declares its algebraic kind so kernels can run it without evaluating it on
every element:

- ``row_scale``: ``s * f(b, h, q)`` — folded into the queries before the matmul;
- ``bias``: ``s + g(b, h, q, kv)`` — an additive mask tile; some biases are
  *separable* on one side of the diagonal (ALiBi: ``slope * kv - slope * q``), which
  kernels pass as a (H, 1, Nk) row of per-key offsets plus a per-query correction;
- ``general``: anything else (softcap, user callables), evaluated tile by tile.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .masks import index_tensors

Tensor = torch.Tensor


class ScoreMod:
    kind = "general"

    def __call__(self, s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def apply_(self, s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The mod's value, free to overwrite ``s``: for tile loops that own their logits."""
        return self(s, b, h, q_idx, kv_idx)

    def parameters(self) -> list[Tensor]:
        """Tensors this mod reads that may carry gradients (learnable tables, slopes...)."""
        return []

    @property
    def requires_grad(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def check(self, batch: int, heads: int, q_len: int, k_len: int) -> None:
        """Raise ValueError if this mod cannot apply to a call of these sizes."""

    def bind(self, batch: int, heads: int, q_len: int, k_len: int) -> ScoreMod:
        self.check(batch, heads, q_len, k_len)
        return self

    def atoms(self) -> tuple[ScoreMod, ...]:
        return (self,)

    def __rshift__(self, other) -> ScoreMod:
        return Chain(*self.atoms(), *as_score(other).atoms())


class RowScale(ScoreMod):
    """``s * factor(b, h, q)``; ``per_head`` when the factor does not depend on q."""

    kind = "row_scale"
    per_head = True

    def factor(self, b: Tensor | None, h: Tensor, q_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def __call__(self, s, b, h, q_idx, kv_idx):
        # Factors come in float64 (see ``_scalar_or_per_head``); rounded to the logits'
        # dtype here so a float32 tile stays float32 and a float64 one is exact.
        return s * self.factor(b, h, q_idx).to(s.dtype)

    def scale_masked(self, s, b, h, q_idx):
        """``s * factor`` where -inf (a bias used as a mask) stays -inf: a factor of 0
        (log_length_scale at n = 1) would make it NaN, and a learnable factor's gradient
        -inf * 0. Used after a bias in a chain, where s can hold -inf."""
        return _scale_keeping_neg_inf(s, self.factor(b, h, q_idx).to(s.dtype))


def _scale_keeping_neg_inf(s: Tensor, factor: Tensor) -> Tensor:
    hidden = torch.isneginf(s)
    # both branches finite where the other is taken, so neither value nor gradient is NaN
    return torch.where(hidden, s, s.masked_fill(hidden, 0.0) * factor)


class Bias(ScoreMod):
    """``s + bias(b, h, q, kv)``."""

    kind = "bias"
    #: True when the bias depends on (b, h, kv) only, never on the query: ``separable``
    #: then returns a zero row on any side of the diagonal, and fused kernels add it as a
    #: row of per-key offsets even on tiles the causal mask cuts
    key_only = False

    def bias(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def separable(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor, side: str) -> tuple[Tensor, Tensor] | None:
        """(row, col) with bias == row[..., :, None] + col[..., None, :] for every pair in
        the tile of batch rows ``b``, when every key is on ``side`` ("left": kv <= q,
        "right": kv >= q) of every query; None when the bias has no such form. Shapes:
        row (H|1, BQ), col (H|1, span) or (Bt, H|1, span) for a bias that differs by row."""
        return None

    def key_row(self, batch: int, heads: int, q_len: int, k_len: int) -> Tensor:
        """A key-only bias over a whole call, (B | 1, H | 1, 1, Nk): the same for every query."""
        assert self.key_only, f"{self!r}: not key-only"
        b, h, q_first, kv = index_tensors(batch, heads, k_len - q_len, 1, 0, k_len)
        return self.bias(b, h, q_first, kv)

    def __call__(self, s, b, h, q_idx, kv_idx):
        return s + self.bias(b, h, q_idx, kv_idx).to(s.dtype)


class Chain(ScoreMod):
    """Mods applied left to right."""

    def __init__(self, *mods: ScoreMod):
        self.mods = tuple(mods)
        kinds = {m.kind for m in self.mods}
        self.kind = "general" if "general" in kinds else "affine"

    def __call__(self, s, b, h, q_idx, kv_idx):
        after_bias = False
        for m in self.mods:
            # a bias's -inf is a mask: later row scales keep it -inf (RowScale.scale_masked)
            s = m.scale_masked(s, b, h, q_idx) if after_bias and m.kind == "row_scale" else m(s, b, h, q_idx, kv_idx)
            after_bias = after_bias or m.kind == "bias"
        return s

    def apply_(self, s, b, h, q_idx, kv_idx):
        after_bias = False
        for m in self.mods:
            s = m.scale_masked(s, b, h, q_idx) if after_bias and m.kind == "row_scale" else m.apply_(s, b, h, q_idx, kv_idx)
            after_bias = after_bias or m.kind == "bias"
        return s

    def parameters(self):
        return [p for m in self.mods for p in m.parameters()]

    def bind(self, *shape):
        return Chain(*(m.bind(*shape) for m in self.mods))

    def atoms(self):
        return self.mods

    def __repr__(self):
        return " >> ".join(repr(m) for m in self.mods)


class FnScore(ScoreMod):
    """A user callable; always evaluated tile by tile."""

    def __init__(self, fn: Callable, params: Sequence[Tensor] = ()):
        self.fn = fn
        self.params = list(params)

    def __call__(self, s, b, h, q_idx, kv_idx):
        return self.fn(s, b, h, q_idx, kv_idx)

    def parameters(self):
        return self.params

    def __repr__(self):
        return f"score({getattr(self.fn, '__name__', type(self.fn).__name__)})"


def as_score(obj, name: str = "score") -> ScoreMod:
    """A ScoreMod from a mod, a callable ``(s, b, h, q_idx, kv_idx) -> s`` or a list of them."""
    if isinstance(obj, ScoreMod):
        return obj
    if isinstance(obj, (list, tuple)):
        if not obj:
            raise ValueError(f"{name}: empty list of score mods")
        return Chain(*(a for o in obj for a in as_score(o, name).atoms()))
    if callable(obj):
        return FnScore(obj)
    raise TypeError(
        f"{name}: expected an attnkit score mod, a callable (s, b, h, q_idx, kv_idx) -> s, or a list, got {type(obj).__name__}"
    )


# --------------------------------------------------------------------------- mods


class Temperature(RowScale):
    """Logits divided by a temperature ``t`` (scalar or one per head)."""

    def __init__(self, t):
        self.t = _scalar_or_per_head(t, "temperature(t)")
        if (self.t.detach() <= 0).any():
            raise ValueError(f"temperature(t): must be > 0, got {t!r}")

    def factor(self, b, h, q_idx):
        t = self.t[h] if self.t.dim() else self.t
        return 1.0 / t.to(torch.float64)  # exact for float64 calls; callers round it to theirs

    def parameters(self):
        return [self.t]

    def check(self, batch, heads, q_len, k_len):
        _check_heads(self.t, heads, "temperature(t)")

    def __repr__(self):
        return f"temperature({_fmt(self.t)})"


class LogLengthScale(RowScale):
    """Scalable-Softmax: logits times ``scale * log n`` (Nakanishi 2025, arXiv 2501.19399).

    ``n`` is the number of keys the query can see: ``q + 1`` for causal attention, Nk
    otherwise. Keeps attention from flattening as the context grows. ``scale`` may be a
    learnable tensor of one value per head.
    """

    def __init__(self, scale=1.0, causal: bool = True):
        self.scale = _scalar_or_per_head(scale, "log_length_scale(scale)")
        self.causal = causal
        self.per_head = not causal
        self.k_len: int | None = None

    def factor(self, b, h, q_idx):
        scale = self.scale[h] if self.scale.dim() else self.scale
        if self.causal:
            n = (q_idx + 1).clamp(min=1)
        else:
            if self.k_len is None:
                raise RuntimeError("log_length_scale(causal=False) must be bound to a call first")
            n = torch.tensor(max(self.k_len, 1))
        # float64 whatever the parameter's dtype: callers round it to the logits' dtype
        return scale.to(torch.float64) * torch.log(n.to(torch.float64))

    def parameters(self):
        return [self.scale]

    def bind(self, batch, heads, q_len, k_len):
        _check_heads(self.scale, heads, "log_length_scale(scale)")
        out = LogLengthScale(self.scale, self.causal)
        out.k_len = k_len
        return out

    def __repr__(self):
        return f"log_length_scale({_fmt(self.scale)}{', causal=False' if not self.causal else ''})"


class ALiBi(Bias):
    """ALiBi: ``-slope_h * |q - kv|`` (Press et al. 2021, arXiv 2108.12409)."""

    def __init__(self, num_heads: int | None = None, slopes=None):
        if slopes is None:
            if not isinstance(num_heads, int) or num_heads < 1:
                raise ValueError(f"alibi: give num_heads (int >= 1) or slopes, got num_heads={num_heads!r}")
            slopes = alibi_slopes(num_heads)
        self.slopes = torch.as_tensor(slopes)
        if self.slopes.dim() != 1 or not self.slopes.is_floating_point():
            raise ValueError(f"alibi(slopes): expected a 1-D float tensor, one slope per head, got {slopes!r}")

    # Distances reach 10^5: biases are formed in float64 and rounded once by the caller.
    def bias(self, b, h, q_idx, kv_idx):
        return -self.slopes[h].double() * (q_idx - kv_idx).abs().double()

    def separable(self, b, h, q_idx, kv_idx, side):
        # Measured from the first query of the tile so that terms stay small and the
        # sum keeps full float precision near the diagonal.
        origin = q_idx[0]
        slope = self.slopes[h].double().view(-1, 1)
        sign = 1.0 if side == "left" else -1.0
        row = -sign * slope * (q_idx - origin).double()
        col = sign * slope * (kv_idx - origin).double()
        return row, col

    def parameters(self):
        return [self.slopes]

    def check(self, batch, heads, q_len, k_len):
        _check_heads(self.slopes, heads, "alibi(slopes)")

    def __repr__(self):
        return f"alibi({self.slopes.numel()} heads)"


class Softcap(ScoreMod):
    """``cap * tanh(s / cap)`` (Gemma 2; FlashAttention's ``softcap``)."""

    def __init__(self, cap: float):
        if not isinstance(cap, (int, float)) or not cap > 0 or math.isinf(cap):
            raise ValueError(f"softcap(cap): expected a finite number > 0, got {cap!r}")
        self.cap = float(cap)

    def __call__(self, s, b, h, q_idx, kv_idx):
        return self.cap * torch.tanh(s / self.cap)

    def __repr__(self):
        return f"softcap({self.cap:g})"


class AbsBoost(ScoreMod):
    """``s + table[b, h, kv] · |s|``, table (B, H, Nk) >= 0: PAI's amplification of image
    logits (Liu et al. 2024, arXiv 2407.21771; table: α on the image keys of the chosen
    heads, 0 elsewhere). A hidden key (s = -inf) stays hidden. Not affine in s, so no
    fused flash op takes it; kernels run it in their C++ loops (kernels/tiled.py)."""

    def __init__(self, table: Tensor):
        if not isinstance(table, Tensor) or table.dim() != 3 or not table.is_floating_point():
            raise ValueError(
                f"abs_boost(table): expected a float tensor of shape (B, H, Nk), got {getattr(table, 'shape', table)!r}"
            )
        self.table = table

    def __call__(self, s, b, h, q_idx, kv_idx):
        boosted = torch.addcmul(s, self.table[b, h, kv_idx].to(s.dtype), s.abs())
        # -inf + t·inf is NaN: the guard, two full passes over the tile, only where needed
        if torch.compiler.is_compiling() or bool(torch.isneginf(s).any()):
            boosted = torch.where(torch.isneginf(s), s, boosted)
        return boosted

    def check(self, batch, heads, q_len, k_len):
        if tuple(self.table.shape) != (batch, heads, k_len):
            raise ValueError(
                f"abs boost: table of shape {tuple(self.table.shape)} but the call needs ({batch}, {heads}, {k_len})"
            )

    def __repr__(self):
        return f"abs_boost({'x'.join(map(str, self.table.shape))})"


class RelativeBias(Bias):
    """T5 relative position bias: a learnable table over log-spaced distance buckets.

    Raffel et al. 2019 (arXiv 1910.10683): half the buckets are exact distances, the rest
    grow logarithmically up to ``max_distance``; bidirectional tables split the buckets
    between keys before and after the query. ``table`` has shape (num_buckets, H).
    """

    def __init__(self, table: Tensor, num_buckets: int | None = None, max_distance: int = 128, bidirectional: bool = True):
        if not isinstance(table, Tensor) or table.dim() != 2 or not table.is_floating_point():
            raise ValueError(
                f"relative_bias(table): expected a float tensor of shape (num_buckets, H), got {getattr(table, 'shape', table)!r}"
            )
        num_buckets = table.shape[0] if num_buckets is None else num_buckets
        if num_buckets != table.shape[0]:
            raise ValueError(f"relative_bias: table has {table.shape[0]} rows but num_buckets={num_buckets}")
        min_buckets = 4 if bidirectional else 2
        if num_buckets < min_buckets:
            raise ValueError(f"relative_bias(num_buckets): need at least {min_buckets}, got {num_buckets}")
        exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
        if not isinstance(max_distance, int) or max_distance <= exact:
            raise ValueError(f"relative_bias(max_distance): must be an int > {exact} (the exact buckets), got {max_distance!r}")
        self.table, self.num_buckets, self.max_distance, self.bidirectional = table, num_buckets, max_distance, bidirectional

    def bucket(self, relative: Tensor) -> Tensor:
        """Bucket of ``relative = kv - q``."""
        n = self.num_buckets
        out = torch.zeros_like(relative)
        if self.bidirectional:
            n //= 2
            out = out + (relative > 0).long() * n
            dist = relative.abs()
        else:
            dist = (-relative).clamp(min=0)
        exact = n // 2
        # log-spaced buckets from `exact` to `max_distance`, then saturated
        far = exact + (torch.log(dist.clamp(min=1).double() / exact) / math.log(self.max_distance / exact) * (n - exact)).long()
        far = far.clamp(max=n - 1)
        return out + torch.where(dist < exact, dist, far)

    def bias(self, b, h, q_idx, kv_idx):
        return self.table[self.bucket(kv_idx - q_idx), h]

    def parameters(self):
        return [self.table]

    def check(self, batch, heads, q_len, k_len):
        if self.table.shape[1] != heads:
            raise ValueError(f"relative_bias(table): has {self.table.shape[1]} heads (columns) but the call has Hq={heads}")

    def __repr__(self):
        return f"relative_bias({self.num_buckets} buckets, max_distance={self.max_distance}{', unidirectional' if not self.bidirectional else ''})"


class DenseBias(Bias):
    """A dense additive bias of shape (B|1, H|1, Nq, Nk), rows aligned with the queries."""

    def __init__(self, tensor: Tensor):
        if not isinstance(tensor, Tensor) or tensor.dim() != 4 or not tensor.is_floating_point():
            raise ValueError(
                f"bias(tensor): expected a float tensor of shape (B|1, H|1, Nq, Nk), got {getattr(tensor, 'shape', tensor)!r}"
            )
        self.tensor = tensor
        self.q_start = 0

    def bias(self, b, h, q_idx, kv_idx):
        t = self.tensor
        rows = q_idx - self.q_start
        bi = b if t.shape[0] > 1 else torch.zeros_like(b)
        hi = h if t.shape[1] > 1 else torch.zeros_like(h)
        return t[bi, hi, rows, kv_idx]

    def parameters(self):
        return [self.tensor]

    def bind(self, batch, heads, q_len, k_len):
        t = self.tensor
        if t.shape[0] not in (1, batch) or t.shape[1] not in (1, heads) or t.shape[2] != q_len or t.shape[3] != k_len:
            raise ValueError(
                f"bias(tensor): has shape {tuple(t.shape)} but the call needs (1 or B={batch}, 1 or Hq={heads}, Nq={q_len}, Nk={k_len})"
            )
        out = DenseBias(t)
        out.q_start = k_len - q_len
        return out

    def __repr__(self):
        return f"bias({'x'.join(map(str, self.tensor.shape))})"


# --------------------------------------------------------------------------- affine form


@dataclass
class AffineForm:
    """A chain of row scales and biases, ``s -> factor * s + bias``, for fused kernels."""

    scales: list[RowScale]
    terms: list[tuple[Bias, list[RowScale]]]  # each bias with the row scales applied after it

    @property
    def bias_requires_grad(self) -> bool:
        """True when a bias term carries a gradient: a learnable bias, or a learnable row
        scale applied after a bias (``(s + b) * f`` has d/df = s + b: the bias's share
        needs dS, which kernels that take biases as constant mask tiles never form)."""
        return any(b.requires_grad or any(s.requires_grad for s in later) for b, later in self.terms)

    @property
    def per_head_scales(self) -> bool:
        return all(s.per_head for s in self.scales)

    def factor(self, b, h, q_idx) -> Tensor | None:
        out = None
        for s in self.scales:
            f = s.factor(b, h, q_idx)
            out = f if out is None else out * f
        return out

    def dense_bias(self, b, h, q_idx, kv_idx) -> Tensor | None:
        out = None
        for bias, later in self.terms:
            t = bias.bias(b, h, q_idx, kv_idx)
            for s in later:
                t = _scale_keeping_neg_inf(t, s.factor(b, h, q_idx))
            out = t if out is None else out + t
        return out

    @property
    def key_only(self) -> bool:
        """Every bias term is key-only and every later row scale per head (no query term)."""
        return bool(self.terms) and all(b.key_only and all(s.per_head for s in later) for b, later in self.terms)

    def separable_bias(self, b, h, q_idx, kv_idx, side) -> tuple[Tensor, Tensor] | None:
        """(row (H|1, BQ), col (H|1, span) or (Bt, H|1, span)) or None; b, h, q_idx and
        kv_idx are 1-D."""
        row = col = None
        for bias, later in self.terms:
            parts = bias.separable(b, h, q_idx, kv_idx, side)
            if parts is None or not all(s.per_head for s in later):
                return None
            r, c = parts
            for s in later:
                f = s.factor(None, h, q_idx[:1]).reshape(-1, 1)
                r, c = r * f, c * f
            row = r if row is None else row + r
            col = c if col is None else col + c
        if row is None or col is None:  # no terms: nothing to separate
            return None
        return row, col


def affine_form(score: ScoreMod | None) -> AffineForm | None:
    """The affine form of a chain of row scales and biases; None if any mod is general."""
    if score is None:
        return AffineForm([], [])
    atoms = score.atoms()
    if any(a.kind not in ("row_scale", "bias") for a in atoms):
        return None
    # the kinds say which class each atom is: row scales are RowScale, biases are Bias
    scales = [a for a in atoms if isinstance(a, RowScale)]
    terms = [(a, [s for s in atoms[i + 1 :] if isinstance(s, RowScale)]) for i, a in enumerate(atoms) if isinstance(a, Bias)]
    return AffineForm(scales, terms)


# --------------------------------------------------------------------------- helpers


def alibi_slopes(num_heads: int) -> Tensor:
    """The ALiBi paper's geometric slopes; for a head count that is not a power of two,
    the slopes of the next lower power of two followed by every other slope of the next
    higher one."""

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    lower = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(lower)
    if lower < num_heads:
        slopes += geometric(2 * lower)[0::2][: num_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


def _scalar_or_per_head(value, name: str) -> Tensor:
    # A Python number is kept in float64: a float64 call must not see it rounded to float32
    # (temperature(0.3) in float32 is off by 1e-8 relative, 4e-6 in a float64 lse).
    t = value if isinstance(value, Tensor) else torch.tensor(float(value), dtype=torch.float64)
    if not t.is_floating_point() or t.dim() > 1:
        raise ValueError(f"{name}: expected a float or a 1-D float tensor (one per head), got {value!r}")
    if not torch.isfinite(t.detach()).all():
        raise ValueError(f"{name}: must be finite, got {value!r}")
    return t


def _check_heads(t: Tensor, heads: int, name: str) -> None:
    if t.dim() == 1 and t.shape[0] != heads:
        raise ValueError(f"{name}: has {t.shape[0]} values but the call has Hq={heads} heads")


def _fmt(t: Tensor) -> str:
    return f"{float(t):g}" if t.dim() == 0 else f"{t.numel()} heads"


# --------------------------------------------------------------------------- constructors


def alibi(num_heads: int | None = None, slopes=None) -> ScoreMod:
    """ALiBi linear distance bias; slopes from the head count or given (may be learnable)."""
    return ALiBi(num_heads, slopes)


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping ``cap * tanh(s / cap)``."""
    return Softcap(cap)


def abs_boost(table: Tensor) -> ScoreMod:
    """``s + table[b, h, kv] · |s|`` with ``table`` (B, H, Nk) >= 0: PAI's boost of the
    logits of chosen keys (arXiv 2407.21771)."""
    return AbsBoost(table)


def temperature(t) -> ScoreMod:
    """Divide logits by ``t`` (a float or one per head; may be learnable)."""
    return Temperature(t)


def log_length_scale(scale=1.0, causal: bool = True) -> ScoreMod:
    """Scalable-Softmax: multiply logits by ``scale * log(n)`` (n = keys the query sees)."""
    return LogLengthScale(scale, causal)


def relative_bias(table: Tensor, num_buckets: int | None = None, max_distance: int = 128, bidirectional: bool = True) -> ScoreMod:
    """T5-style bucketed relative position bias; ``table`` (num_buckets, H), learnable."""
    return RelativeBias(table, num_buckets, max_distance, bidirectional)


def bias(tensor: Tensor) -> ScoreMod:
    """Dense additive bias of shape (B|1, H|1, Nq, Nk)."""
    return DenseBias(tensor)
