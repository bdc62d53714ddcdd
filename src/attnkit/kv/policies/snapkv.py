"""SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before
Generation", arXiv 2404.14469): the last ``window`` prompt queries (the observation
window) vote for the earlier keys with their attention weights, summed over the window;
the votes are pooled along the sequence (``kernel``, ``pooling``) so that neighbours of
an important token stay with it; each KV head keeps the top ``budget - window`` earlier
keys plus the window itself. Runs once, at prefill. Query heads of a KV group vote
together (the mean of their votes)."""

from __future__ import annotations

import torch

from ..select import group_mean, last, pool, top
from .base import Policy, Step, check_int


def check_snap(policy) -> None:
    check_int(policy.window, "window", 1)
    check_int(policy.kernel, "kernel", 1)
    if policy.pooling not in ("max", "avg"):
        raise ValueError(f"pooling: expected 'max' or 'avg', got {policy.pooling!r}")


def snap_scores(policy, mass, valid, capacity, kv_heads):
    """(window entries kept, pooled votes of the earlier entries, those entries)."""
    vote = group_mean(mass, kv_heads).to(torch.float64)
    observed = last(valid, policy.window)
    earlier = valid & ~observed
    pooled = pool(torch.where(earlier, vote, 0.0), policy.kernel, policy.pooling)
    window = last(valid, torch.clamp(capacity, max=policy.window))
    return window, pooled, earlier


def snap_reference(policy, weights, held, capacity):
    """The same scores from dense eager weights (B, Hq, Nq, N), literally."""
    B, H, N = held.shape
    g = weights.shape[1] // H
    rows = weights[:, :, -policy.window :].to(torch.float64)  # the observation window's queries
    vote = rows.sum(2).view(B, H, g, N).mean(2)
    window = torch.zeros_like(held)
    earlier = torch.zeros_like(held)
    for b in range(B):
        for h in range(H):
            idx = held[b, h].nonzero().flatten().tolist()
            window[b, h, idx[max(len(idx) - min(policy.window, int(capacity[b, h])), 0) :]] = True
            earlier[b, h, idx[: max(len(idx) - policy.window, 0)]] = True
    vote = torch.where(earlier, vote, 0.0)
    half = policy.kernel // 2
    pooled = torch.zeros_like(vote)
    for j in range(N):
        lo, hi = j - half, j - half + policy.kernel  # the pooling window centred on j
        inside = vote[..., max(lo, 0) : min(hi, N)]
        if policy.pooling == "max":
            pooled[..., j] = inside.max(-1).values
        else:
            pooled[..., j] = inside.sum(-1) / policy.kernel
    return window, pooled, earlier


def ranked(scores, candidates, count):
    """Literal top-``count`` of one head: sort by (-score, position)."""
    idx = candidates.nonzero().flatten().tolist()
    idx.sort(key=lambda j: (-float(scores[j]), j))
    return idx[: max(int(count), 0)]


class SnapKV(Policy):
    name = "snapkv"
    paper = "arXiv:2404.14469"
    params = {"window": 32, "kernel": 5, "pooling": "max"}
    window: int
    kernel: int
    pooling: str
    needs_weights = True
    packs_heads = True

    def check(self) -> None:
        check_snap(self)

    def rows(self, phase, q_len):
        return (max(q_len - self.window, 0), q_len) if phase == "prefill" else None

    def select(self, step: Step) -> torch.Tensor:
        window, pooled, earlier = snap_scores(self, step.mass, step.valid, step.capacity, step.keys.shape[1])
        return window | top(pooled, earlier, step.capacity - window.sum(-1))

    def reference(self, weights, keys, held, capacity, state, phase):
        window, pooled, earlier = snap_reference(self, weights, held, capacity)
        keep = window.clone()
        B, H, _ = held.shape
        for b in range(B):
            for h in range(H):
                keep[b, h, ranked(pooled[b, h], earlier[b, h], int(capacity[b, h]) - int(window[b, h].sum()))] = True
        return keep
