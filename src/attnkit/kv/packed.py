"""Keys and values of a layer whose heads keep different numbers of entries, stored
without padding.

After a prefill, a layer's (row, KV head) pairs may keep different numbers of entries
(AdaKV shares a layer's budget among its heads; every policy keeps fewer entries in a
row with more left padding). Padded to the longest, (B, Hkv, L, D) would hold
``B * Hkv * L`` slots; packed, it holds only the kept entries: one (T, D) block of rows
(T = the kept entries of every row and head, plus one row of zeros), and for each padded
slot the row it reads (int32; the zero row for an empty slot). Tokens appended while
decoding go to a dense tail, (B, Hkv, n, D), as every head receives them.

Attention still takes (B, Hkv, L + n, D): ``materialise`` builds it for the call (one
row gather and one concatenation, the copy a growing cache makes per step anyway), and
the layer drops it afterwards, so between calls only the packed rows are held.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


class PackedKV:
    def __init__(self, keys: Tensor, values: Tensor, valid: Tensor):
        B, H, L, D = keys.shape
        flat = valid.reshape(-1)
        rows = flat.nonzero().squeeze(1)
        T = rows.numel()
        self.shape = (B, H, L)
        self.k = torch.cat([keys.reshape(-1, D).index_select(0, rows), keys.new_zeros(1, D)])
        self.v = torch.cat([values.reshape(-1, values.shape[-1]).index_select(0, rows), values.new_zeros(1, values.shape[-1])])
        source = torch.full((flat.numel(),), T, dtype=torch.int32, device=keys.device)
        source[rows] = torch.arange(T, dtype=torch.int32, device=keys.device)
        self.source = source
        self.tail_k = keys[:, :, :0].contiguous()
        self.tail_v = values[:, :, :0].contiguous()

    def append(self, keys: Tensor, values: Tensor) -> None:
        self.tail_k = torch.cat([self.tail_k, keys], dim=-2)
        self.tail_v = torch.cat([self.tail_v, values], dim=-2)

    def materialise(self) -> tuple[Tensor, Tensor]:
        """(keys, values), (B, Hkv, L + n, D), zeros in the empty slots."""
        return self.padded(self.k, self.tail_k), self.padded(self.v, self.tail_v)

    def padded(self, rows: Tensor, tail: Tensor) -> Tensor:
        """One side (``k`` with ``tail_k``, or ``v`` with ``tail_v``) as (B, Hkv, L + n, D):
        reading the keys alone need not gather the values too."""
        B, H, L = self.shape
        out = rows.index_select(0, self.source).view(B, H, L, -1)
        return torch.cat([out, tail], dim=-2) if tail.shape[-2] else out

    @property
    def length(self) -> int:
        return self.shape[2] + self.tail_k.shape[-2]

    def kv_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.tail_k, self.tail_v))

    def nbytes(self) -> int:
        return self.kv_nbytes() + self.source.numel() * self.source.element_size()
