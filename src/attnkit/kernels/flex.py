"""Compiled FlexAttention: attnkit's masks and score mods fused into one generated kernel.

Guards against the traps measured with torch 2.13 on CPU (shared/notes/measured.md):
- CPU kernels are inference-only and return no lse: such calls are refused here;
- past torch.compile's recompile limit flex silently runs an unfused O(N^2) path: every
  distinct compiled signature is counted and calls beyond the limit are refused;
- the document mask fails to compile once dynamic shapes kick in: compiled with
  ``dynamic=False``;
- without a block mask it materialises N^2 scores: a BlockMask is always built (and
  cached per mask object and shape).
"""

from __future__ import annotations

import weakref

import torch

from .request import Request
from .tiles import add_sinks

Tensor = torch.Tensor

_compiled = None
_signatures: set[tuple] = set()
_block_masks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BLOCK = 128


def _recompile_limit() -> int:
    cfg = torch._dynamo.config
    return int(getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 8)))


def _signature(req: Request) -> tuple:
    mods = ()
    if req.mask is not None:
        mods += tuple(type(m).__name__ for m in req.mask.walk())
    if req.score is not None:
        mods += tuple(type(a).__name__ for a in req.score.atoms())
    return (tuple(req.q.shape), tuple(req.k.shape), tuple(req.v.shape), req.q.dtype, req.q.device.type, mods, req.sinks is not None)


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
    if _signature(req) not in _signatures and len(_signatures) >= _recompile_limit():
        return (
            f"{len(_signatures)} distinct compiled signatures already: one more would pass torch.compile's "
            f"recompile limit ({_recompile_limit()}) and silently run an unfused O(N^2) path"
        )
    return None


def _block_mask(req: Request):
    from torch.nn.attention.flex_attention import create_block_mask

    mask = req.mask
    key = (req.batch, req.heads, req.q_len, req.k_len, req.q.device)
    per_mask = _block_masks.get(mask) if mask is not None else None
    if per_mask is not None and key in per_mask:
        return per_mask[key]
    q_start = req.q_start
    if mask is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= 0
        batch = heads = None
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return mask(b, h, q_idx + q_start, kv_idx)
        batch = req.batch if mask.batch_dependent else None
        heads = req.heads if any(type(m).__name__ == "FnMask" for m in mask.walk()) else None
    block_mask = create_block_mask(mask_mod, batch, heads, req.q_len, req.k_len, device=req.q.device, BLOCK_SIZE=_BLOCK)
    if mask is not None:
        _block_masks.setdefault(mask, {})[key] = block_mask
    return block_mask


def flex_attention_call(req: Request) -> tuple[Tensor, Tensor | None]:
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    _signatures.add(_signature(req))
    score_mod = None
    if req.score is not None:
        score, q_start = req.score, req.q_start

        def score_mod(s, b, h, q_idx, kv_idx):
            return score(s, b, h, q_idx + q_start, kv_idx)

    want_lse = req.return_lse or req.sinks is not None
    gqa = req.heads != req.kv_heads
    result = _compiled(req.q, req.k, req.v, score_mod=score_mod, block_mask=_block_mask(req), scale=req.scale, enable_gqa=gqa, return_lse=want_lse)
    if not want_lse:
        return result, None
    out, lse = result
    if req.sinks is not None:
        out, lse = add_sinks(out, lse, req.sinks)
    return out, lse
