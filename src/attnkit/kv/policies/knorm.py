"""Key-norm eviction (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy
for KV Cache Compression", arXiv 2406.11430): keys with a low L2 norm draw high
attention, so each KV head keeps the ``budget`` keys of lowest norm, at prefill. It reads
no attention weights (it also works under transformers' own sdpa).

The norm of a key is the same before and after RoPE (a rotation), but not once rounded:
equal keys rotated to different positions get norms that differ in their last bits, and
those bits would decide which of them stays. So the norms are taken before RoPE, from the
layer's input (Llama-style ``k_proj`` [+ ``k_norm``], in float64), where equal keys have
equal norms and ties go to the earlier position, as everywhere in ``select``. Modules
without ``k_proj`` are ranked by the norms of the keys held (exact for models without
RoPE, such as GPT-2)."""

from __future__ import annotations

import torch

from ..model_parts import can_recompute_keys, recompute_keys
from ..select import top
from .base import Policy, Step


class KNorm(Policy):
    name = "knorm"
    paper = "arXiv:2406.11430"
    params = {}
    packs_heads = True

    def before(self, module, layer, kwargs, phase):
        hidden = kwargs.get("hidden_states")
        if phase != "prefill" or hidden is None or not can_recompute_keys(module):
            return None
        return {"norms": recompute_keys(module, hidden).to(torch.float64).norm(dim=-1)}

    def select(self, step: Step) -> torch.Tensor:
        norms = (step.extra or {}).get("norms")
        if norms is None or norms.shape != step.valid.shape:  # no projection to recompute, or not the prefill's slots
            norms = step.keys.to(torch.float64).norm(dim=-1)
        return top(-norms, step.valid, step.capacity)

    def reference(self, weights, keys, held, capacity, state, phase):
        """``keys``: as projected (before RoPE) for exact ties; rotated keys give the same
        ranking up to rounding."""
        keep = torch.zeros_like(held)
        norms = keys.to(torch.float64).norm(dim=-1)
        B, H, _ = held.shape
        for b in range(B):
            for h in range(H):
                idx = held[b, h].nonzero().flatten().tolist()
                idx.sort(key=lambda j: (float(norms[b, h, j]), j))
                keep[b, h, idx[: int(capacity[b, h])]] = True
        return keep
