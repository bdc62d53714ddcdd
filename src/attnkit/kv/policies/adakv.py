"""AdaKV (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation for Efficient LLM Inference", arXiv 2407.11550): a layer's budget is shared
by its KV heads — ``budget x Hkv`` entries per layer and row, taken as the top-scoring
entries over all heads together, so heads that concentrate their attention give entries
to heads that spread it. Scores are SnapKV's pooled observation-window votes (the
window is always kept); the paper's safeguard first gives every head its own top
``floor x budget`` entries. Heads end with different lengths, stored compactly."""

from __future__ import annotations

import math

import torch

from ..select import top
from .base import Step, check_fraction
from .snapkv import SnapKV, snap_reference, snap_scores


class AdaKV(SnapKV):
    name = "adakv"
    paper = "arXiv:2407.11550"
    params = {"window": 32, "kernel": 5, "pooling": "max", "floor": 0.2}
    floor: float

    def check(self) -> None:
        super().check()
        check_fraction(self.floor, "floor")

    def _guaranteed(self, capacity):
        return torch.floor(capacity.to(torch.float64) * self.floor).to(torch.long)

    def select(self, step: Step) -> torch.Tensor:
        window, pooled, earlier = snap_scores(self, step.mass, step.valid, step.capacity, step.keys.shape[1])
        score = torch.where(window, math.inf, pooled)
        candidates = window | earlier
        own = top(score, candidates, self._guaranteed(step.capacity))
        B, H, L = score.shape
        left = step.capacity.sum(-1) - own.sum((-1, -2))  # the layer's entries still to give, per row
        shared = top(score.reshape(B, H * L), (candidates & ~own).reshape(B, H * L), left)
        return own | shared.view(B, H, L)

    def reference(self, weights, keys, held, capacity, state, phase):
        window, pooled, earlier = snap_reference(self, weights, held, capacity)
        score = torch.where(window, math.inf, pooled)
        candidates = window | earlier
        keep = torch.zeros_like(held)
        B, H, _ = held.shape
        for b in range(B):
            for h in range(H):
                idx = candidates[b, h].nonzero().flatten().tolist()
                idx.sort(key=lambda j: (-float(score[b, h, j]), j))
                keep[b, h, idx[: int(self._guaranteed(capacity[b, h]))]] = True
            pool_ = [(h, j) for h in range(H) for j in candidates[b, h].nonzero().flatten().tolist() if not keep[b, h, j]]
            pool_.sort(key=lambda hj: (-float(score[b, hj[0], hj[1]]), hj[0], hj[1]))
            left = int(capacity[b].sum()) - int(keep[b].sum())
            for h, j in pool_[: max(left, 0)]:
                keep[b, h, j] = True
        return keep
