"""Non-finite inputs: which ones reach the output, and keeping hidden ones out of it.

By the definition of attention, a key the mask hides from every query (padding, a
document no query belongs to) has no influence on the output whatever it holds. Fused
kernels do not see it that way: ``q . k`` of a NaN key is NaN before the mask's -inf is
added, and a weight of exactly 0 times a NaN value is NaN, so one NaN in padding turns
whole rows into NaN; in a backward, ``dQ = dS K`` multiplies the zero gradient of a hidden
pair by the NaN key. Calls that need gradients are cleaned before they run
(``without_hidden_nonfinite``: hidden keys and values zeroed, O(N D) next to an O(N^2 D)
training step); for the others the repair is lazy, since checking every input on every
call would cost as much as a decoding step: only an output that came back non-finite is
looked at again, and the call re-run cleaned.

The converse: torch's flash kernel returns a row of zeros, not NaN, when every logit of
the row is NaN (a NaN query row below ~16 rows, or a row whose only visible key is NaN),
so a finite output does not prove that no NaN reached it (``nonfinite_reaches_output``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from ..mods import index_tensors
from .request import Request, all_finite

Tensor = torch.Tensor


def _limit(dtype: torch.dtype) -> float:
    """Magnitudes above sqrt(max) overflow once multiplied together (q . k, dO . v), and
    0 * inf is NaN: such entries count as non-finite where they are hidden."""
    return torch.finfo(dtype).max ** 0.5


def _tame(t: Tensor) -> bool:
    """True when every entry is finite and below ``_limit`` (one reduction; NaN fails)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.detach())
    limit = _limit(t.dtype)
    return bool(hi <= limit) and bool(lo >= -limit)


def _wild_rows(t: Tensor) -> Tensor:
    """(..., N) bool: rows of t holding NaN, inf or a magnitude above ``_limit``."""
    t = t.detach()
    return ~(torch.isfinite(t) & (t.abs() <= _limit(t.dtype))).all(dim=-1)


#: query rows per slice when evaluating the mask against a few keys (bounds the memory)
_PAIRS_PER_SLICE = 1 << 22


def _seen_by_some_query(req: Request, keys: Tensor) -> Tensor:
    """(B, Hkv, len(keys)) bool: whether any query of the batch row reading that key head
    sees each key position of ``keys`` (1-D), by the mask."""
    assert req.mask is not None  # asked of masked calls only
    B, H, Hkv, Nq = req.batch, req.heads, req.kv_heads, req.q_len
    seen = torch.zeros(B, H, keys.numel(), dtype=torch.bool)
    rows = max(1, _PAIRS_PER_SLICE // max(1, B * H * keys.numel()))
    kv = keys.view(1, 1, 1, -1)
    for r0 in range(0, Nq, rows):
        n = min(rows, Nq - r0)
        b, h, qi, _ = index_tensors(B, H, req.q_start + r0, n, 0, 1)
        vis = torch.as_tensor(req.mask(b, h, qi, kv), dtype=torch.bool)
        seen |= torch.broadcast_to(vis, (B, H, n, keys.numel())).any(dim=-2)
    return seen.view(B, Hkv, H // Hkv, -1).any(dim=2)


def without_hidden_nonfinite(req: Request) -> Request | None:
    """The request with every key/value row that holds NaN/inf (or a magnitude that
    overflows in a product) and that no query sees, and every such query row that sees no
    key, replaced by zeros (differentiably:
    those entries get zero gradients); None when there is none (then a non-finite output
    is the inputs' own doing). Query rows matter for gradients only: dK = dS^T Q multiplies
    their zero dS by their NaN."""
    if req.mask is None or torch.compiler.is_compiling():  # a compiled graph cannot branch on the data
        return None
    k, v, q = req.k, req.v, req.q
    changed = False
    if not (_tame(k) and _tame(v)):
        bad = _wild_rows(k) | _wild_rows(v)  # (B, Hkv, Nk)
        keys = bad.any(dim=1).any(dim=0).nonzero().flatten()
        hidden = bad[:, :, keys] & ~_seen_by_some_query(req, keys)
        if bool(hidden.any()):
            drop = torch.zeros(req.batch, req.kv_heads, req.k_len, 1, dtype=torch.bool)
            drop[:, :, keys] = hidden.unsqueeze(-1)
            k, v, changed = k.masked_fill(drop, 0.0), v.masked_fill(drop, 0.0), True
    if not _tame(q):
        bad = _wild_rows(q)  # (B, Hq, Nq)
        rows = bad.any(dim=1).any(dim=0).nonzero().flatten()
        blind = bad[:, :, rows] & ~_rows_see_some_key(req, rows)
        if bool(blind.any()):
            drop = torch.zeros(req.batch, req.heads, req.q_len, 1, dtype=torch.bool)
            drop[:, :, rows] = blind.unsqueeze(-1)
            q, changed = q.masked_fill(drop, 0.0), True
    return replace(req, q=q, k=k, v=v) if changed else None


def _rows_see_some_key(req: Request, rows: Tensor) -> Tensor:
    """(B, Hq, len(rows)) bool: whether each query row of ``rows`` (1-D) sees any key."""
    assert req.mask is not None  # asked of masked calls only
    b, h, _, ki = index_tensors(req.batch, req.heads, 0, 1, 0, req.k_len)
    step = max(1, _PAIRS_PER_SLICE // max(1, req.batch * req.heads * req.k_len))
    parts = []
    for r0 in range(0, rows.numel(), step):
        some = rows[r0 : r0 + step]
        qi = (some + req.q_start).view(1, 1, -1, 1)
        vis = torch.as_tensor(req.mask(b, h, qi, ki), dtype=torch.bool)
        parts.append(torch.broadcast_to(vis, (req.batch, req.heads, some.numel(), req.k_len)).any(dim=-1))
    return torch.cat(parts, dim=-1) if parts else torch.zeros(req.batch, req.heads, 0, dtype=torch.bool)


def live_nonfinite_query(req: Request) -> bool:
    """True when a query row holding NaN/inf sees at least one key (by the mask), so that
    by definition its output is not finite, whatever a kernel returned for it."""
    if all_finite(req.q):
        return False
    bad = ~torch.isfinite(req.q.detach()).all(dim=-1)  # (B, Hq, Nq)
    if req.mask is None:
        return bool(bad.any())
    rows = bad.any(dim=1).any(dim=0).nonzero().flatten()
    return bool((bad[:, :, rows] & _rows_see_some_key(req, rows)).any())


def seen_nonfinite_key(req: Request) -> bool:
    """True when a key holding NaN/inf is seen by some query (by the mask)."""
    if all_finite(req.k):
        return False
    bad = ~torch.isfinite(req.k.detach()).all(dim=-1)  # (B, Hkv, Nk)
    if req.mask is None:
        return bool(bad.any())
    keys = bad.any(dim=1).any(dim=0).nonzero().flatten()
    return bool((bad[:, :, keys] & _seen_by_some_query(req, keys)).any())


def nonfinite_reaches_output(req: Request, out: Tensor) -> bool:
    """Whether NaN/inf in the inputs reaches the output by the definition of attention,
    whatever the kernel returned: a non-finite output; a non-finite query row that sees a
    key; or a NaN key that some query sees, which torch's flash kernel turns into a row of
    zeros when it is all the row sees. The common case costs one reduction over the output:
    when every row is finite and none is exactly zero, no NaN/inf reached it (a non-finite
    query or a seen non-finite key makes its row NaN, or zero under that kernel); otherwise
    each check is one reduction over a tensor no larger than the output (keys larger than
    the output, as in decoding, are only looked at when some output row is exactly zero)."""
    if rows_finite_and_nonzero(out):
        return False
    if not all_finite(out):
        return True
    if live_nonfinite_query(req):
        return True
    if req.k.numel() <= out.numel():  # checking k itself (one reduction) is then the cheaper
        return seen_nonfinite_key(req)
    return _has_zero_row(out) and seen_nonfinite_key(req)


def rows_finite_and_nonzero(out: Tensor) -> bool:
    """Whether every row of ``out`` is finite and not exactly zero (one reduction)."""
    if out.numel() == 0 or torch.compiler.is_compiling():
        return out.numel() != 0
    half = out.dtype in (torch.float16, torch.bfloat16)  # a half-precision row sum could overflow
    if out.numel() <= _TINY:  # one decoding step of a small model: |x| summed in one op
        rows = torch.linalg.vector_norm(out.detach(), 1, -1, dtype=torch.float32 if half else None)
    else:
        flat = out.detach().abs()
        flat = flat.float() if half else flat
        if flat.numel() <= _SMALL:  # a decoding step: fewer ops win
            rows = flat.sum(-1)
        else:
            rows = flat.reshape(-1, flat.shape[-1]) @ _ones(flat.shape[-1], flat.dtype, flat.device)
    low, high = torch.aminmax(rows)
    return math.isfinite(high.item()) and low.item() > 0


_SMALL = 1 << 14
#: up to here vector_norm's one op wins; above, its reduction is slower than abs and sum
_TINY = 256


@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Row sums by a product with ones (BLAS): ~20x faster than a reduction along the last
    dimension."""
    return torch.ones(n, dtype=dtype, device=device)


def _has_zero_row(out: Tensor) -> bool:
    """Whether some row of out (finite) is exactly zero. A product with a vector of ones
    (BLAS) rather than a reduction along the last dimension, which torch runs ~20x slower."""
    if out.numel() == 0:
        return False
    flat = out.detach().reshape(-1, out.shape[-1])
    return bool(((flat.abs() @ torch.ones(out.shape[-1], dtype=flat.dtype, device=flat.device)) == 0).any())
