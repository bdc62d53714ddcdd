"""Attention sinks: mass on the first keys, on chosen positions, and the sink score.

The sink score of a head is the mean attention the first key receives from the queries
that see it, alpha = 1/|Q_0| sum_{i in Q_0} A[i, 0]; Gu et al. 2024, "When Attention Sink
Emerges in Language Models: An Empirical View" (arXiv 2410.10781), call a head a sink
head when alpha > epsilon (their epsilon = 0.3) and measure a model by the fraction of
such heads. StreamingLLM (Xiao et al. 2023, arXiv 2309.17453) keeps the first 4 keys.
"""

from __future__ import annotations

import torch

from .base import CallInfo
from .meter import Meter, TileView


class SinkMass(Meter):
    """Per head: mean mass on the first ``first`` keys (``sink.first<k>``), on each key
    position of ``positions`` (``sink.pos<p>``, negative positions count from the end),
    and the sink score ``sink.score`` of Gu et al. (key 0)."""

    name = "sink"

    def __init__(self, first: int = 4, positions=(), epsilon: float = 0.3, **restrict):
        super().__init__(**restrict)
        if isinstance(first, bool) or not isinstance(first, int) or first < 1:
            raise ValueError(f"first: expected an int >= 1 (number of leading keys), got {first!r}")
        if isinstance(positions, int):
            positions = (positions,)
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in positions):
            raise ValueError(f"positions: expected a list of key positions (ints), got {positions!r}")
        if not 0.0 < float(epsilon) < 1.0:
            raise ValueError(f"epsilon: expected a threshold in (0, 1), got {epsilon!r}")
        self.first, self.positions, self.epsilon = first, tuple(positions), float(epsilon)
        self._state: dict = {}

    def begin_call(self, call: CallInfo, n_heads: int, row_lo: int, row_hi: int) -> None:
        for p in self.positions:
            if not -call.k_len <= p < call.k_len:
                raise ValueError(f"positions: key position {p} is outside a call with {call.k_len} keys")
        self._resolved = [p % call.k_len for p in self.positions]
        if call.layer not in self._state:
            z = lambda: torch.zeros(n_heads, dtype=torch.float64)  # noqa: E731
            self._state[call.layer] = {"first": z(), "pos": [z() for _ in self.positions], "key0": z(), "key0_seen": z()}

    def update_view(self, call: CallInfo, view: TileView) -> None:
        st = self._state[call.layer]
        k0, span = view.k0, view.w.shape[3]
        if k0 < self.first:
            st["first"] += view.w[..., : min(self.first - k0, span)].sum((0, 2, 3)).double()
        for i, p in enumerate(self._resolved):
            if k0 <= p < k0 + span:
                st["pos"][i] += view.w[..., p - k0].sum((0, 2)).double()
        if k0 == 0:
            st["key0"] += view.w[..., 0].sum((0, 2)).double()
            if view.all_visible:
                st["key0_seen"] += view.w.shape[0] * view.w.shape[2]
            else:
                visible = view.visible()
                assert visible is not None  # not all visible, so visible() says which
                vis = visible[..., 0]
                st["key0_seen"] += vis.expand(view.w.shape[:3]).sum((0, 2)).double()

    def rows(self):
        out = []
        for layer, heads, n_rows in self.measured():
            st = {k: (v.tolist() if torch.is_tensor(v) else [m.tolist() for m in v]) for k, v in self._state[layer].items()}
            for j, h in enumerate(heads):
                out.append((layer, h, f"sink.first{self.first}", st["first"][j] / n_rows))
                for p, mass in zip(self.positions, st["pos"]):
                    out.append((layer, h, f"sink.pos{p}", mass[j] / n_rows))
                seen = st["key0_seen"][j]
                if seen:  # undefined when no observed query sees key 0 (e.g. a window mask)
                    out.append((layer, h, "sink.score", st["key0"][j] / seen))
        return out

    def meta(self) -> dict:
        return {"first": self.first, "positions": list(self.positions), "epsilon": self.epsilon}
