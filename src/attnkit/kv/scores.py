"""Attention received per key, from attnkit's observers (O(N) memory): the policy cache
asks, per layer and call, for the query rows a policy needs (SnapKV's observation
window, TOVA's current query, H2O's every query), and this observer sums their
normalised weights onto the keys, (B, Hq, Nk) float64 — never ``output_attentions``."""

from __future__ import annotations

import torch

from ..observe import AttentionTile, CallInfo, Observer, Selection

Tensor = torch.Tensor


class ReceivedMass(Observer):
    """Sum of the weights of the requested query rows on every key, per layer."""

    def __init__(self) -> None:
        # keyed by CallInfo.layer (None for a call no layer index names)
        self.wanted: dict[int | None, tuple[int, int]] = {}  # layer -> (lo, hi) query rows of its next call
        self.mass: dict[int | None, Tensor] = {}  # layer -> (B, Hq, Nk) of its last call
        self._acc: Tensor | None = None
        self._rows: tuple[int, int] | None = None

    def wants(self, call: CallInfo) -> Selection | None:
        rows = self.wanted.get(call.layer)
        if rows is None:
            return None
        return Selection(None, (call.q_start + rows[0], call.q_start + rows[1]))

    def begin(self, call: CallInfo) -> None:
        lo, hi = self.wanted.pop(call.layer)
        self._rows = (call.q_start + lo, call.q_start + hi)
        self._acc = None  # allocated on the first tile's device
        self._shape = (call.batch, call.heads, call.k_len)

    def update(self, tile: AttentionTile) -> None:
        q0, k0, b0 = tile.starts
        assert self._rows is not None  # begin ran for this call
        lo, hi = self._rows
        a, b = max(lo - q0, 0), min(hi - q0, len(tile.q_pos))
        if a >= b:
            return
        w = tile.weights[:, :, a:b].to(torch.float64).sum(2)  # (Bt, H', span)
        if self._acc is None:
            self._acc = torch.zeros(self._shape, dtype=torch.float64, device=w.device)
        heads = slice(None) if tile.heads is None else tile.heads.to(w.device)
        self._acc[b0 : b0 + len(tile.batch), heads, k0 : k0 + len(tile.k_pos)] += w

    def end(self, call: CallInfo) -> None:
        self.mass[call.layer] = torch.zeros(self._shape, dtype=torch.float64) if self._acc is None else self._acc
        self._acc = None
