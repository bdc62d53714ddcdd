"""The k keys every query attends to most, O(N k) memory.

The token view of the report is drawn from these; they are also how retrieval heads are
found (Wu et al. 2024, arXiv 2404.15574: a head whose top key is the token being
copied). Each tile's top k merge into the running top k of its rows.
"""

from __future__ import annotations

import math

import torch

from .base import CallInfo
from .meter import Meter, TileView


class TopKeys(Meter):
    """Per query and head, the ``k`` keys of largest positive weight (positions and
    weights, latest call of each layer: ``arrays()["top_keys"]``), and per head the means
    ``topkeys.top1`` (largest weight of a row) and ``topkeys.top<k>`` (mass of its top k).
    Masked keys have weight 0 and never appear; a row with fewer than k attended keys
    keeps index -1 (weight 0) in the rest."""

    name = "topkeys"

    def __init__(self, k: int = 8, **restrict):
        super().__init__(**restrict)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k: expected an int >= 1 (keys kept per query), got {k!r}")
        self.k = k
        self._state: dict = {}
        self._latest: dict = {}

    def begin_call(self, call: CallInfo, n_heads: int, row_lo: int, row_hi: int) -> None:
        shape = (call.batch, n_heads, row_hi - row_lo, self.k)
        self._val = torch.full(shape, -math.inf, dtype=torch.float64)
        self._idx = torch.full(shape, -1, dtype=torch.int32)
        self._seen = torch.zeros(call.batch, row_hi - row_lo, dtype=torch.bool)  # rows with keys merged in
        self._q0 = call.q_start + row_lo
        if call.layer not in self._state:
            self._state[call.layer] = {
                "top1": torch.zeros(n_heads, dtype=torch.float64),
                "topk": torch.zeros(n_heads, dtype=torch.float64),
            }

    def update_view(self, call: CallInfo, view: TileView) -> None:
        tv, ti = view.w.topk(min(self.k, view.w.shape[3]), dim=-1)
        # Masked keys have weight 0: only positive weights count as attended, so the tile
        # needs no masking, and a row with fewer than k of them keeps -1 entries.
        attended = tv > 0
        at = (view.batch, slice(None), view.rows)
        tv = torch.where(attended, tv.double(), -math.inf)
        ti = torch.where(attended, ti + view.k0, -1).int()
        seen = self._seen[view.batch, view.rows]
        if not bool(seen.any()):  # these rows' first keys: nothing to merge with
            self._val[at][..., : tv.shape[-1]] = tv
            self._idx[at][..., : ti.shape[-1]] = ti
        else:
            vals = torch.cat([self._val[at], tv], dim=-1)
            best, where = vals.topk(self.k, dim=-1)
            self._val[at] = best
            self._idx[at] = torch.cat([self._idx[at], ti], dim=-1).gather(-1, where)
        seen.fill_(True)

    def end_call(self, call: CallInfo) -> None:
        found = self._idx >= 0
        val = torch.where(found, self._val, 0.0)
        st = self._state[call.layer]
        st["top1"] += val[..., 0].sum((0, 2)).double()
        st["topk"] += val.sum((0, 2, 3)).double()
        self._latest[call.layer] = (self._q0, self._idx, val)
        del self._val, self._idx, self._seen

    def rows(self):
        out = []
        for layer, heads, n_rows in self.measured():
            top1, topk = self._state[layer]["top1"].tolist(), self._state[layer]["topk"].tolist()
            for j, h in enumerate(heads):
                out.append((layer, h, "topkeys.top1", top1[j] / n_rows))
                if self.k > 1:
                    out.append((layer, h, f"topkeys.top{self.k}", topk[j] / n_rows))
        return out

    def arrays(self) -> dict:
        """{"top_keys": {(layer, head): {"q_start", "index" (B, R, k) int32, -1 where a row
        has fewer than k visible keys, "weight" (B, R, k)}}}"""
        out = {}
        for layer, (q0, idx, val) in self._latest.items():
            for j, h in enumerate(self._head_ids[layer]):
                out[(layer, h)] = {"q_start": q0, "index": idx[:, j], "weight": val[:, j]}
        return {"top_keys": out}

    def meta(self) -> dict:
        return {"k": self.k}
