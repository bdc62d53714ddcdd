"""Heavy-Hitter Oracle (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models", arXiv 2306.14048): each entry's score is
the attention it has received, accumulated over every query so far (all prompt queries,
then each decoded token); a layer keeps the ``recent`` share of its budget as the most
recent tokens and fills the rest with the highest-scoring older ones ("heavy hitters").
Eviction runs at prefill and after every decoding step (one entry out per new token,
Sec. 4's greedy rule). Query heads of a KV group share the group's mean score."""

from __future__ import annotations

import torch

from ...kernels.cpu.kv import H2O as LOWEST_ACCUMULATED
from ..select import group_mean, last, top
from .base import Policy, Step, check_fraction


class H2O(Policy):
    name = "h2o"
    paper = "arXiv:2306.14048"
    params = {"recent": 0.5}
    recent: float
    needs_weights = True
    decodes = True
    keeps_score = True

    def check(self) -> None:
        check_fraction(self.recent, "recent")

    def rows(self, phase, q_len):
        return (0, q_len)

    @property
    def lowest_rule(self):
        return (LOWEST_ACCUMULATED, float(self.recent))

    def _recent(self, capacity: torch.Tensor) -> torch.Tensor:
        return torch.floor(capacity.to(torch.float64) * self.recent).to(torch.long)

    def select(self, step: Step) -> torch.Tensor:
        assert step.mass is not None  # needs_weights: the cache hands over the call's weights
        step.score += group_mean(step.mass, step.keys.shape[1]).to(torch.float64)
        r = self._recent(step.capacity)
        recent = last(step.valid, r, step.order)
        return recent | top(step.score, step.valid & ~recent, step.capacity - r, step.order)

    def reference(self, weights, keys, held, capacity, state, phase):
        B, H, N = held.shape
        g = weights.shape[1] // H
        received = weights.to(torch.float64).sum(2).view(B, H, g, N).mean(2)
        before = state.get("acc", torch.zeros(B, H, 0, dtype=torch.float64))
        state["acc"] = torch.nn.functional.pad(before, (0, N - before.shape[-1])) + received  # new tokens start at 0
        acc = state["acc"]
        keep = torch.zeros_like(held)
        for b in range(B):
            for h in range(H):
                idx = held[b, h].nonzero().flatten().tolist()
                c = int(capacity[b, h])
                r = int(self._recent(capacity[b, h]))
                recent = idx[len(idx) - r :] if r else []
                older = [j for j in idx if j not in recent]
                older.sort(key=lambda j: (-float(acc[b, h, j]), j))
                keep[b, h, recent + older[: max(c - r, 0)]] = True
        return keep
