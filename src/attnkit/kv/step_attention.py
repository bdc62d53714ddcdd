"""A one-token decoding step's attention computed where the policy cache can see its
weights: for the policies that score every decoded token (H2O, TOVA), the cache routes
that step's attention call here instead of the model's sdpa/eager function. The query
arrives rotated, as the model computed it, and the softmax that makes the output is the
step's weights, so nothing is computed twice (no second query projection, no second
product with the keys).

The model's attention module looks its function up by ``config._attn_implementation``;
the cache names this one (``NAME``) for the length of that call and restores the name
right after (and at the end of the forward, whatever happens in between).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.cpu import kv as native_kv

Tensor = torch.Tensor
NAME = "attnkit_kv_step"
#: a C++ step's attention over the cache's own storage: (query, key, value, scaling) -> output
Attend = Callable[[Tensor, Tensor, Tensor, float], Tensor]
_registered = False


def register() -> None:
    """Register ``step_attention`` in transformers' AttentionInterface (once)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, step_attention)
        _registered = True


class StepCall:
    """What the cache and the attention call exchange for one layer's step."""

    __slots__ = ("attend", "hide", "mass")

    def __init__(self) -> None:
        self.hide: Tensor | None = None  # (B, Hkv, L) slots the query must not see, set by the cache's update
        self.mass: Tensor | None = None  # (B, Hq, L) the step's softmax weights, set here
        #: set by the cache's update when the call runs one of kernels.cpu.kv's C++ steps (packed
        #: heads, Quest's pages, a prefill with its mass): (query, key, value, scaling) -> output
        self.attend: Attend | None = None


def step_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    attnkit_kv_step: StepCall | None = None,
    **kwargs,
):
    """softmax(q k^T * scaling | visible) v for one query per head, GQA without copying
    the keys per query head: (B, 1, Hq, Dv) as transformers' attention functions return,
    and the weights left in ``attnkit_kv_step.mass``."""
    call = attnkit_kv_step
    assert call is not None  # the cache names this function only for a call it gave a StepCall
    if call.attend is not None:  # the key and value the module passes are the cache's own storage
        return call.attend(query, key, value, query.shape[-1] ** -0.5 if scaling is None else scaling), None
    B, Hq, _, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    scaling = D**-0.5 if scaling is None else scaling
    if (
        query.dtype in (torch.float32, torch.float64)
        and key.dtype == value.dtype == query.dtype
        and not (query.requires_grad or key.requires_grad or value.requires_grad)
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and native_kv.available()
    ):
        out, call.mass = native_kv.step_attention(query, key, value, call.hide, scaling)  # one pass, same softmax
        return out, None
    cd = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query.to(cd).view(B, Hkv, Hq // Hkv, D) * scaling
    logits = torch.matmul(q, key.to(cd).transpose(-1, -2))  # (B, Hkv, g, L)
    if call.hide is not None:
        logits.masked_fill_(call.hide[:, :, None, :], float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    call.mass = weights.view(B, Hq, L)
    out = torch.matmul(weights, value.to(cd)).to(query.dtype)  # (B, Hkv, g, Dv)
    return out.view(B, Hq, 1, -1).transpose(1, 2), None
