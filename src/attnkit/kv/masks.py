"""The attention masks of a policy cache's layers.

transformers builds one mask for a full cache; a policy cache replaces it per layer with
the entries each head keeps: causal over token positions (not slots: a decoding step's
token may fill an evicted slot), the model's sliding window, padding, and, for a policy
that reads part of the cache per query, the part it reads (``read``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .model_parts import sliding_window

Tensor = torch.Tensor


def layer_mask(module, layer, hidden: Tensor, n_new: int, real: Tensor, read: Callable[[], Tensor] | None = None) -> Tensor:
    """The layer's mask for this call, cached entries then the call's own tokens, in the
    form the module's attention takes: (B, Hq, n_new, L + n_new). ``real`` (B, n_new)
    marks the call's tokens that are not padding; ``read`` gives (B, Hq, n_new, L), the
    cached entries each query reads (a policy's sparse reads), or None for all."""
    dev = hidden.device
    B, Hkv, L = layer.valid.shape
    Hq = module.config.num_attention_heads
    g = Hq // Hkv
    window = sliding_window(module)
    if n_new == 1 and window is None and read is None:
        return as_impl(module, hidden, step_mask(layer, g))
    q_pos = layer.seen + torch.arange(n_new, device=dev)
    old = layer.valid[:, :, None, :].expand(B, Hkv, n_new, L)
    if window is not None:
        old = old & (q_pos[None, None, :, None] - layer.pos[:, :, None, :] < window)
    old = old.repeat_interleave(g, 1)
    if read is not None:
        old = old & read()
    j = torch.arange(n_new, device=dev)
    new = (j[None, :] <= j[:, None])[None, None]
    if window is not None:
        new = new & (j[:, None] - j[None, :] < window)
    new = (new & real[:, None, None, :]) | torch.eye(n_new, dtype=torch.bool, device=dev)  # a padded query sees itself
    return as_impl(module, hidden, torch.cat([old, new.expand(B, Hq, n_new, n_new)], dim=-1))


def as_impl(module, hidden: Tensor, mask: Tensor) -> Tensor:
    """A boolean mask in the form the module's attention implementation takes."""
    impl = module.config._attn_implementation
    if impl == "eager":
        dtype = hidden.dtype
        return torch.where(mask, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)
    if impl in ("sdpa", "attnkit"):
        return mask
    raise ValueError(
        f"model: attn_implementation {impl!r} cannot take a policy cache's per-head masks; use 'sdpa', 'eager' or attnkit"
    )


def step_mask(layer, g: int) -> Tensor:
    """A one-token step's mask, (B, Hq, 1, L + 1): each query head sees its KV head's kept
    entries, and the token itself. Kept in ``layer.memo`` (emptied whenever existing slots
    change) and extended by the slots appended since, so that a step writes a column or
    two instead of building the mask again."""
    B, Hkv, L = layer.valid.shape
    storage, done = layer.memo.get("step_mask", (None, 0))
    if storage is None or storage.shape[-1] < L + 1:
        grown = torch.empty(B, Hkv * g, 1, L + 1 + max(1, (L + 1) // 16), dtype=torch.bool, device=layer.valid.device)
        if storage is not None:
            grown[..., :done] = storage[..., :done]
        storage = grown
    storage[..., done:L] = layer.valid[:, :, None, done:L].repeat_interleave(g, 1)
    storage[..., L] = True  # a query sees itself, padded or not
    layer.memo["step_mask"] = (storage, L)  # its own column is rewritten from ``valid`` next time
    return storage[..., : L + 1]
