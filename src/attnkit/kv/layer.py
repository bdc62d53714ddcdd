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

from .packed import PackedKV

Tensor = torch.Tensor


class PolicyLayer(CacheLayerMixin):
    """A ``transformers`` cache layer whose entries a policy may evict per head."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    _packed: PackedKV | None = None

    def __init__(self):
        self._packed = None
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
        #: what a policy derives from the slots held and extends as tokens are appended
        #: (Quest's page extremes); emptied whenever existing slots change
        self.memo: dict = {}

    # ------------------------------------------------------------------ storage

    @property
    def keys(self) -> Tensor | None:
        packed = self._packed
        return packed.padded(packed.k, packed.tail_k) if packed is not None else self._keys

    @keys.setter
    def keys(self, value: Tensor | None) -> None:
        self.unpack()
        self._keys = value

    @property
    def values(self) -> Tensor | None:
        packed = self._packed
        return packed.padded(packed.v, packed.tail_v) if packed is not None else self._values

    @values.setter
    def values(self, value: Tensor | None) -> None:
        self.unpack()
        self._values = value

    def pack(self) -> bool:
        """Hold the keys and values without padding (``PackedKV``) when some slots are
        empty; returns whether the layer is packed. Reading ``keys``/``values`` then
        builds the padded tensors; assigning them unpacks the layer."""
        if self._packed is None and self.is_initialized and not bool(self.valid.all()):
            self._packed = PackedKV(self._keys, self._values, self.valid)
            self._keys = self._values = None
        return self._packed is not None

    def unpack(self) -> None:
        packed, self._packed = self._packed, None
        if packed is not None:
            self._keys, self._values = packed.materialise()

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
        if self._packed is not None:
            self._packed.append(key_states, value_states)
            keys, values = self._packed.materialise()  # for this call's attention only
        else:
            self.keys = keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = values = torch.cat([self.values, value_states], dim=-2)
        self.valid = torch.cat([self.valid, real.to(dev, torch.bool)[:, None, :].expand(B, H, N)], dim=-1)
        self.pos = torch.cat([self.pos, pos], dim=-1)
        self.rope = torch.cat([self.rope, rope.to(dev, torch.long)[:, None, :].expand(B, H, N)], dim=-1)
        self.score = torch.cat([self.score, torch.zeros(B, H, N, dtype=torch.float64, device=dev)], dim=-1)
        self.seen += N
        self.full = self.full and bool(real.all())
        return keys, values

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
        """Forget the last ``-tokens_to_remove`` tokens fed (transformers 5's convention, a
        count <= 0; assisted decoding rolls back rejected draft tokens this way): their
        entries go, ``seen`` steps back. Entries evicted earlier stay evicted, so this
        restores the layer exactly only when nothing was evicted since those tokens came
        (``is_croppable``, set by the cache for policies that evict at prefill only)."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise ValueError(
                f"cache: crop takes the number of tokens to remove as an int <= 0 (transformers 5's convention), got {tokens_to_remove!r}"
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.memo = {}
        packed = self._packed is not None
        removed = min(-tokens_to_remove, self.seen)
        self.seen -= removed
        L = self.length
        gone = self.pos >= self.seen  # the removed tokens' slots (kept entries and holes alike)
        tail = min(removed, L)
        if bool(gone[..., L - tail :].all()) and not bool(gone[..., : L - tail].any()):
            # the usual case: they are the layout's last slots (appended after everything else)
            for name in ("keys", "values", "valid", "pos", "rope", "score"):
                setattr(self, name, getattr(self, name)[:, :, : L - tail])
            counts = self.valid.sum(-1)
            self.full = bool((counts == self.length).all())
        else:
            self.compact(self.valid & ~gone)
        if packed:
            self.pack()

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.memo = {}
        packed = self._packed is not None
        if self.is_initialized:
            for name in ("keys", "values", "valid", "pos", "rope", "score", "capacity"):
                t = getattr(self, name)
                if t is not None:
                    setattr(self, name, t.repeat_interleave(repeats, dim=0))
        if packed:
            self.pack()

    def batch_select_indices(self, indices: Tensor) -> None:
        self.memo = {}
        packed = self._packed is not None
        if self.is_initialized:
            for name in ("keys", "values", "valid", "pos", "rope", "score", "capacity"):
                t = getattr(self, name)
                if t is not None:
                    setattr(self, name, t[indices.to(t.device)])
        if packed:
            self.pack()

    # ------------------------------------------------------------------ policy side

    @property
    def length(self) -> int:
        return 0 if self.valid is None else self.valid.shape[-1]

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
        self.memo = {}
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
        self.memo = {}
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
        tensors = [self.valid, self.pos, self.rope, self.score, self.capacity]
        if self._packed is None:
            tensors += [self._keys, self._values]
        held = 0 if self._packed is None else self._packed.nbytes()
        return held + sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def kv_nbytes(self) -> int:
        """Bytes of the keys and values alone."""
        if not self.is_initialized:
            return 0
        if self._packed is not None:
            return self._packed.kv_nbytes()
        return sum(t.numel() * t.element_size() for t in (self._keys, self._values))
