"""Max and spread of attention logits per head: instability diagnostics.

Attention logits that grow without bound collapse the softmax to one-hot rows and stall
training ("attention logit growth": Dehghani et al. 2023, arXiv 2302.05442; Wortsman et
al. 2023, arXiv 2309.14322). The meter keeps the max, min, mean and standard deviation
of the modified logits over visible (query, key) pairs, merging tiles with Chan et al.'s
pairwise update of (count, mean, M2) so the spread stays accurate at any length.
"""

from __future__ import annotations

import math

import torch

from .base import CallInfo
from .meter import Meter, TileView


class LogitStats(Meter):
    """Per head: ``logit.max``, ``logit.min``, ``logit.mean``, ``logit.std`` (population)
    over every visible (query, key) pair observed. Mechanisms that hand no logits
    (``AttentionTile.scores is None``) leave the meter without rows for those layers."""

    name = "logit"

    def __init__(self, **restrict):
        super().__init__(**restrict)
        self._state: dict = {}

    def begin_call(self, call: CallInfo, n_heads: int, row_lo: int, row_hi: int) -> None:
        if call.layer not in self._state:
            z = lambda: torch.zeros(n_heads, dtype=torch.float64)  # noqa: E731
            self._state[call.layer] = {
                "n": z(),
                "mean": z(),
                "m2": z(),
                "max": torch.full((n_heads,), -math.inf, dtype=torch.float64),
                "min": torch.full((n_heads,), math.inf, dtype=torch.float64),
            }

    def update_view(self, call: CallInfo, view: TileView) -> None:
        s = view.s
        if s is None:
            return
        dims = (0, 2, 3)
        vis = view.visible()
        if vis is None:
            n = torch.full((s.shape[1],), float(s.shape[0] * s.shape[2] * s.shape[3]), dtype=torch.float64)
            mean = s.sum(dims, keepdim=True) / (s.shape[0] * s.shape[2] * s.shape[3])
            m2 = torch.linalg.vector_norm(s - mean, 2, dims).double().square()
            lo = s.amin(dims)
        else:
            # Masked pairs carry s = -inf: nan_to_num maps them out of each reduction (far
            # cheaper than masked_fill), and they are counted on the mask's own, often head-
            # and batch-free, shape.
            n = (vis.sum(dims).double() * (s.shape[0] // vis.shape[0])).expand(s.shape[1])
            if not bool((n > 0).any()):
                return
            mean = torch.nan_to_num(s, neginf=0.0).sum(dims, keepdim=True) / n.clamp_min(1).view(1, -1, 1, 1).to(s.dtype)
            m2 = torch.linalg.vector_norm(torch.nan_to_num(s - mean, neginf=0.0), 2, dims).double().square()
            lo = torch.nan_to_num(s, neginf=math.inf).amin(dims)
        hi = s.amax(dims)
        st = self._state[call.layer]
        mean = mean.view(-1).to(torch.float64)
        total = st["n"] + n
        delta = mean - st["mean"]
        frac = torch.where(total > 0, n / total.clamp_min(1), 0.0)
        st["m2"] += m2 + delta.square() * st["n"] * frac
        st["mean"] += delta * frac
        st["n"] = total
        st["max"] = torch.maximum(st["max"], hi.to(torch.float64))
        st["min"] = torch.minimum(st["min"], lo.to(torch.float64))

    def rows(self):
        out = []
        for layer, heads, _ in self.measured():
            st = {k: v.tolist() for k, v in self._state[layer].items()}
            for j, h in enumerate(heads):
                n = st["n"][j]
                if not n:
                    continue
                out += [
                    (layer, h, "logit.max", st["max"][j]),
                    (layer, h, "logit.min", st["min"][j]),
                    (layer, h, "logit.mean", st["mean"][j]),
                    (layer, h, "logit.std", math.sqrt(max(st["m2"][j] / n, 0.0))),
                ]
        return out
