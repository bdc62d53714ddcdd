"""Compiled FlexAttention: attnkit's masks and score mods fused into one generated kernel.

Guards against the traps measured with torch 2.13 on CPU (shared/notes/measured.md; the
README's Limits has the table):
- the generated CPU kernel can return wrong numbers, NaN included, with no error: on an
  AVX2 build (``ATEN_CPU_CAPABILITY=avx2`` or an AVX2-only CPU) at head sizes 8 and 16
  with 40 tokens, right at most other shapes, and on an AVX-512 host whose inductor cache
  holds AVX2-built kernels. No shape rule covers every case seen, so each compiled kernel
  is checked once, on its first call, against the chunked backend; a kernel that
  disagrees is never trusted again and its calls run on the chunked backend;
- CPU kernels are inference-only and return no lse: such calls are refused here;
- each distinct shape is a compile (``dynamic=False``: the document mask fails to compile
  with dynamic shapes), so lengths are padded up to buckets (Nq to a power of two, Nk to
  128 times a power of two) with the padded keys masked out: a long-running process with
  varying lengths reuses a few kernels. Past torch.compile's recompile limit flex would
  silently run an unfused O(N^2) path; the limit is raised to ``MAX_KERNELS`` for these
  calls and made an error, after which the chunked backend runs them;
- without a block mask it materialises N^2 scores: a BlockMask is always built (and
  cached per mask object and shape).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .request import Request
from .tiles import add_sinks

Tensor = torch.Tensor

MAX_KERNELS = 64  # compiled flex kernels kept per process (each is a few hundred kB)
_BLOCK = 128
# Agreement a kernel must show with the chunked backend on its first call: rounding of
# the dtype over a softmax row (float32's errors were below 2e-6; wrong kernels were off by 0.2 or more).
_CHECK_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}

_compiled = None
_block_masks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class _Verdicts:
    """What each kernel signature showed on its first call: None (trusted) or why not."""

    seen: dict
    out_of_kernels: bool = False


_verdicts = _Verdicts(seen={})


def bucket(n: int, floor: int = 1) -> int:
    """The padded length a call of ``n`` tokens compiles for: ``floor`` times a power of two."""
    size = floor
    while size < n:
        size *= 2
    return size


def _signature(req: Request) -> tuple:
    mods: tuple[str, ...] = ()
    if req.mask is not None:
        mods += tuple(type(m).__name__ for m in req.mask.walk())
    if req.score is not None:
        mods += tuple(type(a).__name__ for a in req.score.atoms())
    shape_q = (req.batch, req.heads, bucket(req.q_len), req.head_dim)
    shape_kv = (req.batch, req.kv_heads, bucket(req.k_len, _BLOCK), req.head_dim)
    return (shape_q, shape_kv, req.q.dtype, req.q.device.type, mods)


def flex_unsupported(req: Request) -> str | None:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return "this torch has no FlexAttention"
    if req.q.device.type == "cpu":
        if req.needs_grad:
            return "FlexAttention has no backward on CPU (use the chunked backend to train)"
        if req.return_lse or req.sinks is not None:
            return "compiled FlexAttention returns no lse on CPU (needed for return_lse and sinks)"
    elif req.sinks is not None and req.needs_grad:
        return "sinks through FlexAttention need the lse gradient; use the chunked backend"
    if req.q.device.type == "cpu" and req.q.dtype == torch.float64:
        return "FlexAttention on CPU compiles float32, float16 and bfloat16 only (got float64)"
    if req.v_dim != req.head_dim and req.q.device.type == "cpu":
        return "FlexAttention on CPU needs Dv == D"
    return None


def flex_reroute(req: Request) -> str | None:
    """Why a call that flex accepts runs on the chunked backend instead, or None."""
    signature = _signature(req)
    why = _verdicts.seen.get(signature)
    if why is not None:
        return why
    if _verdicts.out_of_kernels and signature not in _verdicts.seen:
        return (
            f"{MAX_KERNELS} compiled flex kernels already: one more would pass the recompile limit and run an unfused O(N^2) path"
        )
    return None


def _padded(t: Tensor, length: int) -> Tensor:
    return t if t.shape[2] == length else torch.nn.functional.pad(t, (0, 0, 0, length - t.shape[2]))


def _block_mask(req: Request, q_len: int, k_len: int, positions):
    from torch.nn.attention.flex_attention import create_block_mask

    mask = req.mask
    key = (req.batch, req.heads, req.q_len, req.k_len, q_len, k_len, req.q.device)
    cache = _block_masks.setdefault(mask, {}) if mask is not None else None
    if cache is not None and key in cache:
        return cache[key]
    real_q, real_k, real_len = positions

    if mask is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx < real_len

        batch = heads = None
    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < real_len) & mask(b, h, real_q(q_idx), real_k(kv_idx))

        batch = req.batch if mask.batch_dependent else None
        heads = req.heads if any(type(m).__name__ == "FnMask" for m in mask.walk()) else None
    block_mask = create_block_mask(mask_mod, batch, heads, q_len, k_len, device=req.q.device, BLOCK_SIZE=_BLOCK)
    if cache is not None:
        cache[key] = block_mask
    return block_mask


def _positions(req: Request):
    """Maps from padded indices to the call's positions, with the lengths as tensors (so a
    kernel serves every length of its bucket): query i sits at Nk - Nq + i; padded queries
    and keys read the last real position (mods may index tables by position)."""
    device = req.q.device
    q_len = torch.tensor(req.q_len, device=device)
    k_len = torch.tensor(req.k_len, device=device)

    def real_q(q_idx):
        return torch.where(q_idx < q_len, q_idx + (k_len - q_len), k_len - 1)

    def real_k(kv_idx):
        return torch.minimum(kv_idx, k_len - 1)

    return real_q, real_k, k_len


def _run_compiled(req: Request) -> tuple[Tensor, Tensor | None]:
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    q_len, k_len = bucket(req.q_len), bucket(req.k_len, _BLOCK)
    positions = _positions(req)
    score_mod = None
    if req.score is not None:
        score, real_q, real_k = req.score, positions[0], positions[1]

        def score_mod(s, b, h, q_idx, kv_idx):
            return score(s, b, h, real_q(q_idx), real_k(kv_idx))

    block_mask = _block_mask(req, q_len, k_len, positions)
    q, k, v = _padded(req.q, q_len), _padded(req.k, k_len), _padded(req.v, k_len)
    gqa = req.heads != req.kv_heads
    want_lse = req.return_lse or req.sinks is not None
    with torch._dynamo.config.patch(recompile_limit=MAX_KERNELS, fail_on_recompile_limit_hit=True):
        result = _compiled(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=req.scale,
            enable_gqa=gqa,
            return_lse=want_lse,  # type: ignore[arg-type]  # torch's overloads take only a literal True or False here
        )
    if not want_lse:
        return result[:, :, : req.q_len], None
    out, lse = result[0][:, :, : req.q_len], result[1][:, :, : req.q_len]
    return add_sinks(out, lse, req.sinks) if req.sinks is not None else (out, lse)


def _first_call_agrees(req: Request, out: Tensor, exact: Tensor) -> str | None:
    tol = _CHECK_TOL.get(req.q.dtype, 1e-4)
    got, want = out.float(), exact.float()
    if not all(bool(torch.isfinite(t).all()) for t in (req.q, req.k, req.v)):
        # NaN in a hidden key reaches a kernel's output through 0 * NaN (run_request cleans
        # and reruns such calls): compare where both are finite
        both = torch.isfinite(got) & torch.isfinite(want)
        got, want = got[both], want[both]
    if torch.allclose(got, want, rtol=tol, atol=tol, equal_nan=True):
        return None
    error = (got - want).abs().nan_to_num(float("inf")).max().item()
    return (
        f"torch's compiled FlexAttention gave wrong numbers for this kernel on this CPU "
        f"({req.shapes()}: {error:.3g} off the chunked backend on its first call)"
    )


def flex_attention_call(req: Request) -> tuple[Tensor, Tensor | None]:
    from .chunked import chunked_attention

    signature = _signature(req)
    if flex_reroute(req) is not None:
        return chunked_attention(req)
    try:
        out, lse = _run_compiled(req)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        _verdicts.out_of_kernels = True
        return chunked_attention(req)
    except torch._dynamo.exc.BackendCompilerFailed as err:  # e.g. inductor's C++ under ATEN_CPU_CAPABILITY=default
        first = str(err).strip().splitlines()[0][:200]
        _verdicts.seen[signature] = f"torch could not compile FlexAttention for this call on this CPU setting ({first})"
        return chunked_attention(req)
    if signature not in _verdicts.seen:
        exact = chunked_attention(req)
        _verdicts.seen[signature] = _first_call_agrees(req, out, exact[0])
        if _verdicts.seen[signature] is not None:
            return exact
    return out, lse
