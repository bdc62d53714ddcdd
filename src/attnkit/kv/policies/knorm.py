"""Key-norm eviction (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy
for KV Cache Compression", arXiv 2406.11430): keys with a low L2 norm draw high
attention, so each KV head keeps the ``budget`` keys of lowest norm, at prefill. It reads
no attention weights (it also works under transformers' own sdpa). The norm of a key is
the same before and after RoPE (a rotation)."""

from __future__ import annotations

import torch

from ..select import top
from .base import Policy, Step


class KNorm(Policy):
    name = "knorm"
    paper = "arXiv:2406.11430"
    params = {}

    def select(self, step: Step) -> torch.Tensor:
        norm = step.keys.to(torch.float64).norm(dim=-1)
        return top(-norm, step.valid, step.capacity)

    def reference(self, weights, keys, held, capacity, state, phase):
        keep = torch.zeros_like(held)
        norms = keys.to(torch.float64).norm(dim=-1)
        B, H, _ = held.shape
        for b in range(B):
            for h in range(H):
                idx = held[b, h].nonzero().flatten().tolist()
                idx.sort(key=lambda j: (float(norms[b, h, j]), j))
                keep[b, h, idx[: int(capacity[b, h])]] = True
        return keep
