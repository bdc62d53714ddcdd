"""TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs", arXiv 2401.06104):
Token Omission Via Attention. Whenever the cache holds more than its budget, drop the
entries that the current query (the last prompt token at prefill, then each decoded
token) attends to least. The paper scores a token by its attention averaged over all
heads of the layer, so every head of a layer keeps the same tokens. Eviction runs at
prefill and after every decoding step."""

from __future__ import annotations

import torch

from ...kernels.cpu.kv import TOVA as LOWEST_MEAN
from ..select import top
from .base import Policy, Step


class TOVA(Policy):
    name = "tova"
    paper = "arXiv:2401.06104"
    params = {}
    needs_weights = True
    decodes = True
    lowest_rule = (LOWEST_MEAN, 0.0)

    def rows(self, phase, q_len):
        return (q_len - 1, q_len)

    def select(self, step: Step) -> torch.Tensor:
        assert step.mass is not None  # needs_weights: the cache hands over the call's weights
        score = step.mass.to(torch.float64).mean(1, keepdim=True).expand(-1, step.keys.shape[1], -1)
        return top(score, step.valid, step.capacity, step.order)

    def reference(self, weights, keys, held, capacity, state, phase):
        last_row = weights[:, :, -1].to(torch.float64).mean(1)  # (B, N): the current query, mean over heads
        keep = torch.zeros_like(held)
        B, H, _ = held.shape
        for b in range(B):
            for h in range(H):
                idx = held[b, h].nonzero().flatten().tolist()
                idx.sort(key=lambda j: (-float(last_row[b, j]), j))
                keep[b, h, idx[: int(capacity[b, h])]] = True
        return keep
