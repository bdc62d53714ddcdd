"""Keys and values of a layer whose heads keep different numbers of entries, stored
without padding.

After a prefill, a layer's (row, KV head) pairs may keep different numbers of entries
(AdaKV shares a layer's budget among its heads; every policy keeps fewer entries in a
row with more left padding). Padded to the longest, (B, Hkv, L, D) would hold
``B * Hkv * L`` slots; packed, it holds only the kept entries: one block of rows (the
kept entries of every row and head, one row of zeros, then the tokens appended while
decoding), and for each slot of the padded layout the row it reads (the zero row for an
empty slot).

Attention still takes (B, Hkv, L + n, D): ``materialise`` builds it for the call with one
row gather per side (the copy a growing cache makes per step anyway), and the layer drops
it afterwards, so between calls only the packed rows are held.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


class PackedKV:
    def __init__(self, keys: Tensor, values: Tensor, valid: Tensor):
        B, H, L, D = keys.shape
        flat = valid.reshape(-1)
        kept = flat.nonzero().squeeze(1)
        T = kept.numel()
        self.k = torch.cat([keys.reshape(-1, D).index_select(0, kept), keys.new_zeros(1, D)])
        self.v = torch.cat([values.reshape(-1, values.shape[-1]).index_select(0, kept), values.new_zeros(1, values.shape[-1])])
        self.rows = T + 1  # rows in use; ``k`` and ``v`` may hold more, for the tokens to come
        self.empty_row = T  # the row of zeros an empty slot reads
        source = torch.full((flat.numel(),), T, dtype=torch.int32, device=keys.device)
        source[kept] = torch.arange(T, dtype=torch.int32, device=keys.device)
        self.source = source.view(B, H, L)  # the row each slot reads (int32: half the bytes)

    def append(self, keys: Tensor, values: Tensor) -> None:
        """Tokens every head receives, (B, Hkv, N, D): new rows, and new slots reading them."""
        B, H, N = keys.shape[:3]
        first, count = self.rows, B * H * N
        if first + count > self.k.shape[0]:
            grow = first + count + max(count, first // 16)
            self.k = torch.cat([self.k[:first], self.k.new_empty(grow - first, self.k.shape[1])])
            self.v = torch.cat([self.v[:first], self.v.new_empty(grow - first, self.v.shape[1])])
        self.k[first : first + count] = keys.reshape(count, -1)
        self.v[first : first + count] = values.reshape(count, -1)
        self.rows += count
        slots = torch.arange(first, first + count, dtype=torch.int32, device=keys.device).view(B, H, N)
        self.source = torch.cat([self.source, slots], dim=-1)

    def materialise(self) -> tuple[Tensor, Tensor]:
        """(keys, values), (B, Hkv, L + n, D), zeros in the empty slots."""
        return self.padded(self.k), self.padded(self.v)

    def padded(self, rows: Tensor) -> Tensor:
        """One side (``k`` or ``v``) as (B, Hkv, L + n, D): reading the keys alone need not
        gather the values too."""
        B, H, L = self.source.shape
        return rows.index_select(0, self.source.view(-1)).view(B, H, L, -1)

    @property
    def length(self) -> int:
        return self.source.shape[2]

    def kv_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))

    def nbytes(self) -> int:
        return self.kv_nbytes() + self.source.numel() * self.source.element_size()
