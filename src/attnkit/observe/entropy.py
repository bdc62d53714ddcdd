"""Entropy of every query's attention row, summarised per head.

A row's weights w over its visible keys (|w| for mechanisms with signed weights),
normalised p = w / S1, have Shannon entropy H = log S1 - S2 / S1 with S1 = sum w and
S2 = sum w log w. Both are running sums, so a row cut across many key tiles needs two
numbers of state. For softmax S1 = 1 and H = -sum p log p exactly. Low entropy: a head
that focuses on few keys; entropy near log(visible keys): a head that spreads evenly
(Vig & Belinkov 2019, arXiv 1906.04284; Clark et al. 2019, arXiv 1906.04341).
"""

from __future__ import annotations

import torch

from .base import CallInfo
from .meter import Meter, TileView


class Entropy(Meter):
    """``entropy.mean`` (nats), ``entropy.min``, ``entropy.max`` over query rows, and
    ``entropy.norm``: the mean of H / log(n) over rows with n >= 2 visible keys (1 for a
    uniform row, 0 for a row on one key). Rows with no weight at all are left out.
    ``per_query=True`` also keeps every row's entropy of the latest call of each layer
    (``arrays()["entropy"]``; 0 for a row with no weight)."""

    name = "entropy"

    def __init__(self, per_query: bool = False, **restrict):
        super().__init__(**restrict)
        self.per_query = bool(per_query)
        self._state: dict = {}
        self._per_query: dict = {}

    def begin_call(self, call: CallInfo, n_heads: int, row_lo: int, row_hi: int) -> None:
        shape = (call.batch, n_heads, row_hi - row_lo)
        self._s1, self._s2, self._n = (torch.zeros(shape, dtype=torch.float64) for _ in range(3))
        self._q0 = call.q_start + row_lo
        if call.layer not in self._state:
            z = lambda: torch.zeros(n_heads, dtype=torch.float64)  # noqa: E731
            self._state[call.layer] = {
                "sum": z(),
                "count": z(),
                "norm_sum": z(),
                "norm_count": z(),
                "min": torch.full((n_heads,), float("inf"), dtype=torch.float64),
                "max": torch.full((n_heads,), float("-inf"), dtype=torch.float64),
            }

    def update_view(self, call: CallInfo, view: TileView) -> None:
        at = (view.batch, slice(None), view.rows)
        self._n[at] += view.visible_per_row()
        if view.log_norm is not None and view.s is not None:
            # softmax: log w = s - log_norm, so sum w log w = sum w s - log_norm sum w,
            # a product instead of a logarithm per weight
            w, s = view.w, view.s
            s1 = w.sum(-1)
            # masked pairs have w = 0 and s = -inf: clamping s keeps 0 * s at 0, not NaN
            ws = (w * (s if view.all_visible else s.clamp_min(torch.finfo(s.dtype).min))).sum(-1)
            log_norm = view.log_norm.masked_fill(torch.isinf(view.log_norm), 0.0)  # rows with no key: w = 0
            self._s1[at] += s1
            self._s2[at] += ws - log_norm * s1
            return
        w = view.w if call.mechanism == "softmax" else view.w.abs()
        self._s1[at] += w.sum(-1)
        self._s2[at] -= torch.special.entr(w).sum(-1)  # entr(x) = -x log x, 0 at x = 0

    def end_call(self, call: CallInfo) -> None:
        s1, s2, n = self._s1, self._s2, self._n
        live = s1 > 0
        h = torch.where(live, torch.log(torch.where(live, s1, 1.0)) - s2 / torch.where(live, s1, 1.0), 0.0)
        # A row of n equal weights has H = log n up to rounding: clamp rounding below 0.
        h = h.clamp_min(0.0)
        multi = live & (n >= 2)
        norm = torch.where(multi, h / torch.log(torch.where(multi, n, 2.0)), 0.0)
        st = self._state[call.layer]
        st["sum"] += (h * live).sum((0, 2))
        st["count"] += live.sum((0, 2))
        st["norm_sum"] += norm.sum((0, 2))
        st["norm_count"] += multi.sum((0, 2))
        st["min"] = torch.minimum(st["min"], torch.where(live, h, float("inf")).amin((0, 2)))
        st["max"] = torch.maximum(st["max"], torch.where(live, h, float("-inf")).amax((0, 2)))
        if self.per_query:
            self._per_query[call.layer] = (self._q0, h.float())
        del self._s1, self._s2, self._n

    def rows(self):
        out = []
        for layer, heads, _ in self.measured():
            st = {k: v.tolist() for k, v in self._state[layer].items()}
            for j, hd in enumerate(heads):
                count = st["count"][j]
                if not count:
                    continue
                out.append((layer, hd, "entropy.mean", st["sum"][j] / count))
                if st["norm_count"][j]:
                    out.append((layer, hd, "entropy.norm", st["norm_sum"][j] / st["norm_count"][j]))
                out.append((layer, hd, "entropy.min", st["min"][j]))
                out.append((layer, hd, "entropy.max", st["max"][j]))
        return out

    def arrays(self) -> dict:
        """{"entropy": {(layer, head): {"q_start": position of the first row, "values": (B, R)}}}"""
        if not self.per_query:
            return {}
        out = {}
        for layer, (q0, h) in self._per_query.items():
            for j, hd in enumerate(self._head_ids[layer]):
                out[(layer, hd)] = {"q_start": q0, "values": h[:, j]}
        return {"entropy": out}
