"""Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", arXiv 2406.10774): nothing is evicted. The cache is cut into pages of
``page_size`` consecutive entries; each page keeps the channel-wise minimum and maximum
of its keys, which bound any query's logit on the page from above:

    q . k  <=  sum_d max(q_d * max_d, q_d * min_d)      for every key k of the page.

While decoding, each query head attends only to the pages with the highest bounds, as
many as the token budget allows (``ceil(budget / page_size)``), plus the new tokens; the
first ``dense_layers`` layers and the prefill stay dense, as in the paper. The selection
needs the queries, which the cache recomputes from the layer's inputs (Llama-style
``q_proj`` + RoPE), so Quest reads no attention weights and also runs under sdpa."""

from __future__ import annotations

import math

import torch

from ..select import top
from .base import Policy, Step, check_int

Tensor = torch.Tensor


def page_extremes(keys: Tensor, valid: Tensor, page_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per page (B, Hkv, P, D): channel-wise min and max over the page's valid keys, and
    (B, Hkv, P) whether the page holds any valid key."""
    B, H, L, D = keys.shape
    P = math.ceil(L / page_size)
    pad = P * page_size - L
    k = torch.nn.functional.pad(keys.to(torch.float64), (0, 0, 0, pad)).view(B, H, P, page_size, D)
    v = torch.nn.functional.pad(valid, (0, pad)).view(B, H, P, page_size, 1)
    kmin = torch.where(v, k, math.inf).amin(3)
    kmax = torch.where(v, k, -math.inf).amax(3)
    return kmin, kmax, v.any(3).squeeze(-1)


def page_bounds(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    """Quest's upper bound of q . k over each page: q (B, Hq, Nq, D), kmin/kmax
    (B, Hkv, P, D) -> (B, Hq, Nq, P), unscaled."""
    g = q.shape[1] // kmin.shape[1]
    lo = kmin.repeat_interleave(g, 1)[:, :, None]  # (B, Hq, 1, P, D)
    hi = kmax.repeat_interleave(g, 1)[:, :, None]
    qd = q.to(torch.float64)[:, :, :, None, :]
    return torch.maximum(qd * lo, qd * hi).sum(-1)


def layer_extremes(layer, page_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``page_extremes`` of a cache layer's slots, kept in ``layer.memo`` between
    decoding steps: appended tokens only touch the last pages, so only those are
    recomputed (the layer empties the memo whenever existing slots change)."""
    L = layer.length
    memo = layer.memo.get("quest_pages")
    if memo is None or memo[3] != page_size or memo[4] > L:
        kmin, kmax, has = page_extremes(layer.keys, layer.valid, page_size)
    else:
        kmin, kmax, has, _, upto = memo
        p0 = upto // page_size  # the first page that was not complete
        if upto < L:
            tail = page_extremes(layer.keys[:, :, p0 * page_size :], layer.valid[:, :, p0 * page_size :], page_size)
            kmin, kmax, has = (torch.cat([old[:, :, :p0], new], 2) for old, new in zip((kmin, kmax, has), tail))
    layer.memo["quest_pages"] = (kmin, kmax, has, page_size, L)
    return kmin, kmax, has


def page_mask(q: Tensor, keys: Tensor, valid: Tensor, tokens: Tensor, page_size: int,
              extremes: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """Cached entries each query head attends to, (B, Hq, Nq, L): the top
    ``ceil(tokens / page_size)`` pages (tokens (B,)) by their bound. ``extremes``: the
    pages' ``page_extremes``, when already known."""
    kmin, kmax, has = page_extremes(keys, valid, page_size) if extremes is None else extremes
    bound = page_bounds(q, torch.where(has[..., None], kmin, 0.0), torch.where(has[..., None], kmax, 0.0))
    B, Hq, Nq, P = bound.shape
    pages = torch.ceil(tokens.to(torch.float64) / page_size).to(torch.long).view(B, 1, 1)
    g = Hq // keys.shape[1]
    chosen = top(bound, has.repeat_interleave(g, 1)[:, :, None, :].expand_as(bound), pages)
    L = keys.shape[2]
    return chosen.repeat_interleave(page_size, -1)[..., :L] & valid.repeat_interleave(g, 1)[:, :, None, :]


class Quest(Policy):
    name = "quest"
    paper = "arXiv:2406.10774"
    params = {"page_size": 16, "dense_layers": 2}

    def check(self) -> None:
        check_int(self.page_size, "page_size", 1)
        check_int(self.dense_layers, "dense_layers", 0)

    def evicts(self, phase: str) -> bool:
        return phase == "prefill"  # only the padding goes; every real entry stays

    def select(self, step: Step) -> Tensor:
        return step.valid

    def reference(self, weights, keys, held, capacity, state, phase):
        return held.clone()

    def reference_pages(self, q: Tensor, keys: Tensor, valid: Tensor, tokens: Tensor) -> Tensor:
        """Page selection of one call, literally: for every (row, query head, query) the
        pages sorted by their bound (ties to the earlier page), the first ones kept."""
        B, Hq, Nq, D = q.shape
        H, L = keys.shape[1], keys.shape[2]
        g, ps = Hq // H, self.page_size
        out = torch.zeros(B, Hq, Nq, L, dtype=torch.bool)
        for b in range(B):
            n_pages = math.ceil(int(tokens[b]) / ps)
            for h in range(Hq):
                for i in range(Nq):
                    bounds = []
                    for p in range(math.ceil(L / ps)):
                        members = [j for j in range(p * ps, min((p + 1) * ps, L)) if valid[b, h // g, j]]
                        if not members:
                            continue
                        u = 0.0
                        for d in range(D):
                            qd = float(q[b, h, i, d])
                            u += max(qd * max(float(keys[b, h // g, j, d]) for j in members),
                                     qd * min(float(keys[b, h // g, j, d]) for j in members))
                        bounds.append((-u, p, members))
                    bounds.sort(key=lambda t: (t[0], t[1]))
                    for _, _, members in bounds[:n_pages]:
                        out[b, h, i, members] = True
        return out
