"""Mass from chosen queries onto named spans: the documents of a RAG prompt, an
instruction, a question.

The measurement behind attention-based re-ranking (ICR, Chen et al. 2024, arXiv
2410.02642: attention of the query tokens onto each document) and the "lost in the
middle" attention bias (Hsieh et al. 2024, arXiv 2406.16008). Each span also gets the
mass a uniform head would put there (its share of the visible keys), so a span that
takes much more than its share stands out whatever its length.
"""

from __future__ import annotations

import torch

from .base import CallInfo
from .meter import Meter, TileView


def check_spans(spans) -> dict[str, tuple[int, int]]:
    if not isinstance(spans, dict) or not spans:
        raise ValueError(f"spans: expected a non-empty dict name -> (start, end) of key positions, got {spans!r}")
    out = {}
    for name, rng in spans.items():
        if not isinstance(name, str) or not name or any(c in name for c in ',\n"'):
            raise ValueError(f"spans: names must be non-empty strings without commas, quotes or newlines, got {name!r}")
        if (
            not isinstance(rng, (tuple, list))
            or len(rng) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in rng)
            or not 0 <= rng[0] < rng[1]
        ):
            raise ValueError(f"spans: {name!r} must be (start, end) with 0 <= start < end (end exclusive), got {rng!r}")
        out[name] = (int(rng[0]), int(rng[1]))
    return out


class SpanMass(Meter):
    """Per head and span: ``span.<name>``, the mean mass the observed queries put on the
    span's keys, and ``span.<name>.uniform``, the mean share of each query's visible keys
    that lie in the span (what a uniform head would give). Restrict the queries with
    ``queries=`` (e.g. ``queries=(-8, None)``: the last 8 tokens)."""

    name = "span"

    def __init__(self, spans: dict, **restrict):
        super().__init__(**restrict)
        self.spans = check_spans(spans)
        self._state: dict = {}

    def begin_call(self, call: CallInfo, n_heads: int, row_lo: int, row_hi: int) -> None:
        for name, (a, b) in self.spans.items():
            if b > call.k_len:
                raise ValueError(f"spans: {name!r} = ({a}, {b}) ends past the {call.k_len} keys of layer {call.layer}'s call")
        shape = (call.batch, n_heads, row_hi - row_lo)
        self._n_all = torch.zeros(shape, dtype=torch.float64)
        self._n_in = torch.zeros((len(self.spans),) + shape, dtype=torch.float64)
        if call.layer not in self._state:
            self._state[call.layer] = {
                "mass": torch.zeros(len(self.spans), n_heads, dtype=torch.float64),
                "uniform": torch.zeros(len(self.spans), n_heads, dtype=torch.float64),
            }

    def update_view(self, call: CallInfo, view: TileView) -> None:
        st = self._state[call.layer]
        at = (view.batch, slice(None), view.rows)
        k0, span = view.k0, view.w.shape[3]
        vis = view.visible()
        self._n_all[at] += view.visible_per_row()
        for i, (a, b) in enumerate(self.spans.values()):
            ia, ib = max(a - k0, 0), min(b - k0, span)
            if ia >= ib:
                continue
            st["mass"][i] += view.w[..., ia:ib].sum((0, 2, 3)).double()
            self._n_in[i][at] += (ib - ia) if vis is None else vis[..., ia:ib].sum(-1, dtype=torch.float64)

    def end_call(self, call: CallInfo) -> None:
        share = torch.where(self._n_all > 0, self._n_in / self._n_all.clamp_min(1), 0.0)
        self._state[call.layer]["uniform"] += share.sum((1, 3))
        del self._n_all, self._n_in

    def rows(self):
        out = []
        for layer, heads, n_rows in self.measured():
            mass, uniform = self._state[layer]["mass"].tolist(), self._state[layer]["uniform"].tolist()
            for j, h in enumerate(heads):
                for i, name in enumerate(self.spans):
                    out.append((layer, h, f"span.{name}", mass[i][j] / n_rows))
                    out.append((layer, h, f"span.{name}.uniform", uniform[i][j] / n_rows))
        return out

    def meta(self) -> dict:
        return {"spans": {k: list(v) for k, v in self.spans.items()}}
