"""What the policy cache reads from a transformers model: its attention modules, the
RoPE module, and the queries of a layer recomputed from its inputs (Llama-style
``q_proj`` [+ ``q_norm``] + the modeling file's ``apply_rotary_pos_emb``), for the
policies whose selection depends on the query (Quest) without reading weights, or its
keys before RoPE (key-norm eviction)."""

from __future__ import annotations

import sys

import torch

Tensor = torch.Tensor


def attention_modules(model) -> list:
    """The modules that update the cache, in layer order."""
    found = [
        m for m in model.modules() if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)
    ]
    return sorted(found, key=lambda m: m.layer_idx)


def rotary_module(model):
    for m in model.modules():
        if "Rotary" in type(m).__name__ and isinstance(getattr(m, "inv_freq", None), Tensor):
            return m
    return None


def can_recompute_queries(module) -> bool:
    return hasattr(module, "q_proj") and hasattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb")


def recompute_queries(module, hidden: Tensor, position_embeddings) -> Tensor:
    """The layer's queries (B, Hq, N, D) after RoPE, as its forward computes them."""
    rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
    B, N = hidden.shape[:2]
    q = module.q_proj(hidden).view(B, N, -1, module.head_dim)
    if hasattr(module, "q_norm"):
        q = module.q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = position_embeddings
    q, _ = rope(q, q, cos, sin)
    return q


def can_recompute_keys(module) -> bool:
    return hasattr(module, "k_proj") and isinstance(getattr(module, "head_dim", None), int)


def recompute_keys(module, hidden: Tensor) -> Tensor:
    """The layer's keys (B, Hkv, N, D) before RoPE, as its forward projects them
    (``k_proj`` [+ ``k_norm``])."""
    B, N = hidden.shape[:2]
    k = module.k_proj(hidden).view(B, N, -1, module.head_dim)
    if hasattr(module, "k_norm"):
        k = module.k_norm(k)
    return k.transpose(1, 2)


def sliding_window(module) -> int | None:
    """The layer's sliding window (transformers' convention: a key is visible when
    ``q - kv < window``), or None."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) else None


def rotate(keys: Tensor, delta: Tensor, inv_freq: Tensor) -> Tensor:
    """Keys (B, H, L, D) rotated by ``delta`` (B, H, L) more positions under RoPE's
    rotate-half convention: R(p + d) k0 = R(d) R(p) k0, exact whatever the scaling of
    the cos/sin tables (it multiplies both sides)."""
    angle = delta.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    emb = torch.cat([angle, angle], dim=-1)
    k = keys.to(torch.float64)
    half = k.shape[-1] // 2
    rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return (k * emb.cos() + rotated * emb.sin()).to(keys.dtype)
