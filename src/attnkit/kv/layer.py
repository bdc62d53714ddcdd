"""One layer of a policy cache: keys and values with per-(row, head) lengths.

Each layer holds keys and values as (B, Hkv, L, D), where L is the longest kept length
of any (row, KV head), and beside them a validity mask ``valid`` (B, Hkv, L), each
entry's token position ``pos`` (its index in the padded sequence, as transformers counts
``cache_position``) and the RoPE position its key is rotated at (``rope``). Heads keep
different numbers of entries, so a head shorter than L has invalid slots at the end of
its kept entries, which the attention mask hides; eviction gathers the kept entries into
new, smaller tensors, so the bytes held fall with the budget (``nbytes``). While
decoding, an evicted entry first becomes an invalid slot in place (a hole the mask hides)
and the layer is gathered once enough holes have gathered (``drop``).

New tokens are appended after the L slots, so the layout stays in position order.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

Tensor = torch.Tensor


class PolicyLayer(CacheLayerMixin):
    """A ``transformers`` cache layer whose entries a policy may evict per head."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self):
        super().__init__()
        self.valid: Tensor | None = None
        self.pos: Tensor | None = None
        self.rope: Tensor | None = None
        #: a per-entry score a policy accumulates across calls (H2O), aligned with the layout
        self.score: Tensor | None = None
        #: entries each (row, KV head) may keep, fixed at prefill, (B, Hkv) long
        self.capacity: Tensor | None = None
        #: tokens fed so far (the padded sequence length)
        self.seen = 0
        #: calls that went through this layer (the first is the prefill)
        self.calls = 0
        #: every slot of every (row, head) is a kept entry (no holes, equal lengths): a
        #: one-token decoding step then needs no mask at all
        self.full = True

    # ------------------------------------------------------------------ transformers API

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        B, H = key_states.shape[:2]
        self.keys = key_states[:, :, :0].contiguous()
        self.values = value_states[:, :, :0].contiguous()
        self.valid = torch.zeros(B, H, 0, dtype=torch.bool, device=self.device)
        self.pos = torch.zeros(B, H, 0, dtype=torch.long, device=self.device)
        self.rope = torch.zeros(B, H, 0, dtype=torch.long, device=self.device)
        self.score = torch.zeros(B, H, 0, dtype=torch.float64, device=self.device)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        raise RuntimeError("a PolicyLayer is updated through its PolicyCache (append), which knows the padding")

    def append(self, key_states: Tensor, value_states: Tensor, real: Tensor, rope: Tensor) -> tuple[Tensor, Tensor]:
        """Add ``Nq`` new tokens after the kept entries; ``real`` (B, Nq) marks the tokens
        that are not padding, ``rope`` (B, Nq) the positions their keys were rotated at."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, N = key_states.shape[:3]
        dev = self.device
        pos = torch.arange(self.seen, self.seen + N, device=dev).expand(B, H, N)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.valid = torch.cat([self.valid, real.to(dev, torch.bool)[:, None, :].expand(B, H, N)], dim=-1)
        self.pos = torch.cat([self.pos, pos], dim=-1)
        self.rope = torch.cat([self.rope, rope.to(dev, torch.long)[:, None, :].expand(B, H, N)], dim=-1)
        self.score = torch.cat([self.score, torch.zeros(B, H, N, dtype=torch.float64, device=dev)], dim=-1)
        self.seen += N
        self.full = self.full and bool(real.all())
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask transformers builds is replaced per layer by the policy cache's hook;
        # these sizes keep its own construction consistent with the padding mask.
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__()

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("cache: a policy cache cannot be cropped (evicted entries are gone); use a fresh policy_cache")

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "valid", "pos", "rope", "score", "capacity"):
                t = getattr(self, name)
                if t is not None:
                    setattr(self, name, t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "valid", "pos", "rope", "score", "capacity"):
                t = getattr(self, name)
                if t is not None:
                    setattr(self, name, t[indices.to(t.device)])

    # ------------------------------------------------------------------ policy side

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def lengths(self) -> Tensor:
        """Entries kept per (row, KV head), (B, Hkv)."""
        return self.valid.sum(-1)

    def compact(self, keep: Tensor) -> Tensor:
        """Keep the entries ``keep`` (B, Hkv, L) marks (never an invalid one) and gather
        them, in position order, into new tensors just long enough for the longest head.
        Returns the gather indices (B, Hkv, L'), for state kept beside the cache."""
        keep = keep & self.valid
        counts = keep.sum(-1)
        new_len = int(counts.max()) if counts.numel() else 0
        # stable sort: kept entries first, each group in layout (= position) order
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :new_len]
        idx4 = order[..., None].expand(*order.shape, self.keys.shape[-1])
        self.keys = self.keys.gather(2, idx4).contiguous()
        self.values = self.values.gather(2, order[..., None].expand(*order.shape, self.values.shape[-1])).contiguous()
        self.valid = torch.arange(new_len, device=self.device)[None, None, :] < counts[..., None]
        self.full = bool((counts == new_len).all())
        zero = torch.zeros((), device=self.device)
        slots = self.valid[..., None]
        self.keys = torch.where(slots, self.keys, zero.to(self.keys.dtype))  # padded slots hold zeros, never stale keys
        self.values = torch.where(slots, self.values, zero.to(self.values.dtype))
        self.pos = torch.where(self.valid, self.pos.gather(2, order), -1)
        self.rope = torch.where(self.valid, self.rope.gather(2, order), -1)
        self.score = torch.where(self.valid, self.score.gather(2, order), 0.0)
        return order

    def drop(self, keep: Tensor, slack: int) -> Tensor | None:
        """Evict while decoding: entries outside ``keep`` stop being valid at once (the
        attention mask hides them), and the layer is gathered (``compact``) only when
        more than ``slack`` slots of its longest head are such holes. A decoding step
        evicts about one entry per head, so gathering every step would copy the whole
        layer per token; this copies it once per ``slack`` tokens. Returns the gather
        indices when it compacted, else None (the layout is unchanged)."""
        self.valid = self.valid & keep
        counts = self.valid.sum(-1)
        longest = int(counts.max()) if counts.numel() else 0
        if self.length - longest > slack:
            return self.compact(self.valid)
        self.full = self.full and bool((counts == self.length).all())
        return None

    def nbytes(self) -> int:
        """Bytes the layer's tensors occupy (keys, values and the bookkeeping)."""
        if not self.is_initialized:
            return 0
        tensors = [self.keys, self.values, self.valid, self.pos, self.rope, self.score, self.capacity]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def kv_nbytes(self) -> int:
        """Bytes of the keys and values alone."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))
