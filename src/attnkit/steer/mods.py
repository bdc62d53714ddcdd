"""The two score mods interventions are made of, both of a kind kernels fold without
evaluating them element by element (see ``mods/scores.py``):

- ``HeadFactor``: ``s * f[h]``, a per-head row scale (temperature, dispersion);
- ``KeyBias``: ``s + table[b, h, kv]``, an additive bias per batch row, head and key
  (PASTA's log α outside the emphasised spans, position calibrations).
"""

from __future__ import annotations

import torch

from ..mods.scores import Bias, RowScale

Tensor = torch.Tensor


class HeadFactor(RowScale):
    """Logits of head h multiplied by ``factors[h]`` (float64, one per query head)."""

    per_head = True

    def __init__(self, factors: Tensor):
        self.factors = factors.to(torch.float64)

    def factor(self, b, h, q_idx):
        return self.factors.to(h.device)[h]

    def check(self, batch, heads, q_len, k_len):
        if self.factors.shape != (heads,):
            raise ValueError(f"heads: factors for {self.factors.shape[0]} heads but the call has Hq={heads}")

    def __repr__(self):
        return f"head_factor({[round(float(f), 6) for f in self.factors]})"


class KeyBias(Bias):
    """``s + table[b, h, kv]`` with ``table`` (B, Hq, Nk): one offset per row, head and key,
    the same for every query (O(B H N) memory, never N x N)."""

    key_only = True

    def __init__(self, table: Tensor):
        self.table = table

    def bias(self, b, h, q_idx, kv_idx):
        return self.table[b, h, kv_idx]

    def key_row(self, batch, heads, q_len, k_len):
        return self.table.unsqueeze(2)  # (B, Hq, 1, Nk), checked by check()

    def separable(self, b, h, q_idx, kv_idx, side):
        # No query term: the fused kernel adds the (Bt, H, 1, span) row of offsets for
        # free instead of a dense (Bt, H, BQ, span) tile.
        col = self.table[b][:, h][..., kv_idx].double()
        return torch.zeros(1, len(q_idx), dtype=torch.float64, device=col.device), col

    def check(self, batch, heads, q_len, k_len):
        if tuple(self.table.shape) != (batch, heads, k_len):
            raise ValueError(
                f"key bias: table of shape {tuple(self.table.shape)} but the call needs (B={batch}, Hq={heads}, Nk={k_len})"
            )

    def __repr__(self):
        return f"key_bias({'x'.join(map(str, self.table.shape))})"
