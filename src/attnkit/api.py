"""The public call: ``attnkit.attention`` and ``attnkit.explain``, a thin facade: named
mechanisms go to ``attnkit.mechanisms``, exact softmax attention to ``kernels/run.py``."""

from __future__ import annotations

from typing import Literal, overload

import torch

from .kernels import explain_request, make_request
from .kernels.run import softmax_attention

Tensor = torch.Tensor


@overload
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask=None,
    score=None,
    scale: float | None = None,
    sinks: Tensor | None = None,
    return_lse: Literal[False] = ...,
    backend: str = "auto",
    check_finite: bool = True,
    mechanism=None,
    observers=None,
    layer: int | None = None,
) -> Tensor: ...


@overload
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask=None,
    score=None,
    scale: float | None = None,
    sinks: Tensor | None = None,
    return_lse: Literal[True],
    backend: str = "auto",
    check_finite: bool = True,
    mechanism=None,
    observers=None,
    layer: int | None = None,
) -> tuple[Tensor, Tensor]: ...


@overload
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask=None,
    score=None,
    scale: float | None = None,
    sinks: Tensor | None = None,
    return_lse: bool = ...,
    backend: str = "auto",
    check_finite: bool = True,
    mechanism=None,
    observers=None,
    layer: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]: ...


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask=None,
    score=None,
    scale: float | None = None,
    sinks: Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    check_finite: bool = True,
    mechanism=None,
    observers=None,
    layer: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact softmax attention with any mask and score modification.

    Args:
        q: (B, Hq, Nq, D) queries. k: (B, Hkv, Nk, D) keys. v: (B, Hkv, Nk, Dv) values.
            Hq must be a multiple of Hkv (GQA / MQA: query head h reads key head
            h // (Hq / Hkv)). float16, bfloat16, float32 or float64.
        mask: an attnkit mask (``causal()``, ``window(256)``, ``document(ids)``, ...,
            composed with ``&``, ``|``, ``~``) or a callable ``(b, h, q_idx, kv_idx) -> bool``.
            Query indices are positions among the keys: query i sits at Nk - Nq + i.
        score: a score mod (``alibi(8)``, ``softcap(30)``, ...), a callable
            ``(s, b, h, q_idx, kv_idx) -> s``, or a list applied in order.
        scale: logit scale; 1/sqrt(D) by default.
        sinks: (Hq,) learnable logits of an extra key with value zero (attention sinks /
            off-by-one softmax); differentiable.
        return_lse: also return the logsumexp (B, Hq, Nq) of every row (float32; float64
            for float64 inputs); differentiable.
        backend: "auto", "chunked", "sdpa", "flex" or "reference"; see ``explain``.
        check_finite: raise ValueError (naming the input) when NaN/inf in q, k, v or sinks
            reaches the output, instead of returning it.
        mechanism: None or "softmax" for exact softmax attention; another registered name
            (``attnkit.mechanisms.available()``) or a Mechanism instance runs that
            mechanism with the same arguments.
        observers: meters (``attnkit.observe``) that receive the attention weights tile
            by tile in a second pass, O(N) memory; ``layer`` tags the tiles they see.

    A row that sees no key returns zeros with lse = -inf and zero gradients, never NaN.
    """
    if mechanism is not None and mechanism != "softmax":
        from .mechanisms import get_mechanism

        mech = get_mechanism(mechanism)
        if mech.name != "softmax":
            extra = {} if observers is None else {"observers": observers, "layer": layer}
            return mech(
                q,
                k,
                v,
                mask=mask,
                score=score,
                scale=scale,
                sinks=sinks,
                return_lse=return_lse,
                backend=backend,
                check_finite=check_finite,
                **extra,
            )
    return softmax_attention(
        q,
        k,
        v,
        mask=mask,
        score=score,
        scale=scale,
        sinks=sinks,
        return_lse=return_lse,
        backend=backend,
        check_finite=check_finite,
        observers=observers,
        layer=layer,
    )


def explain(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask=None,
    score=None,
    scale=None,
    sinks=None,
    return_lse=False,
    backend="auto",
    check_finite=True,
) -> str:
    """Which backend runs this call, why, and (for the chunked backend) its tile plan."""
    req = make_request(q, k, v, mask=mask, score=score, scale=scale, sinks=sinks, return_lse=return_lse)
    if req.q_len == 0 or req.k_len == 0:
        return f"call: {req.shapes()}\nempty sequence: zeros (and lse = -inf), no backend runs"
    return explain_request(req, backend)
