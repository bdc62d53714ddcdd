"""One layer of a policy cache: keys and values with per-(row, head) lengths.

Each layer holds keys and values as (B, Hkv, L, D), where L is the longest kept length
of any (row, KV head), and beside them a validity mask ``valid`` (B, Hkv, L), each
entry's token position ``pos`` (its index in the padded sequence, as transformers counts
``cache_position``) and the RoPE position its key is rotated at (``rope``). Heads keep
different numbers of entries, so a head shorter than L has invalid slots at the end of
its kept entries, which the attention mask hides; eviction gathers the kept entries into
new, smaller tensors, so the bytes held fall with the budget (``nbytes``). While
decoding, an evicted entry first becomes an invalid slot in place (a hole), and the layer
is gathered once enough holes have gathered (``drop``).

New tokens are appended after the L slots, in place into storage with room for more
(``Room``), so a decoding step copies its new entries only, not the layer, as a growing
``torch.cat`` cache would. A policy that evicts one entry per decoding step leaves one
hole per head, and the next token takes that slot instead (``fill``): the layer stays the
same size, with no hole to mask. The layout is then no longer in position order
(``ordered``); ``pos`` orders it, and gathering (``compact``) restores position order.
"""

from __future__ import annotations

import itertools

import torch
from transformers.cache_utils import CacheLayerMixin

from ..kernels.cpu import kv as native_kv
from .packed import PackedKV

Tensor = torch.Tensor


class Room:
    """Storage for a tensor that grows along dim 2 (the slots): ``held`` is a view of the
    first slots of a larger allocation, and appending writes after it in place. When the
    allocation is full, or ``held`` was replaced by a tensor of its own (eviction gathers
    new tensors), the next append moves to a fresh allocation with ``headroom`` more slots:
    one copy per that many appended slots."""

    __slots__ = ("storage",)

    def __init__(self) -> None:
        self.storage: Tensor | None = None

    def append(self, held: Tensor, new: Tensor) -> Tensor:
        """``held`` followed by ``new`` along dim 2, written after ``held`` in its room."""
        L, N = held.shape[2], new.shape[2]
        if held.requires_grad or new.requires_grad:
            # autograd keeps the earlier slots for backward: writing into their storage
            # would invalidate them, so a differentiable forward copies instead
            self.storage = None
            return torch.cat([held, new], 2)
        room = self.storage
        reusable = (
            room is not None
            and room.shape[2] >= L + N
            and held.data_ptr() == room.data_ptr()
            and held.shape[:2] == room.shape[:2]
            and held.shape[3:] == room.shape[3:]
            and held.stride() == room.stride()
            and held.dtype == room.dtype
        )
        if not reusable:
            if L == 0:  # a prefill: no room yet, most of it is usually evicted at once
                self.storage = None
                return new.contiguous()
            room = held.new_empty(*held.shape[:2], L + N + headroom(L + N), *held.shape[3:])
            room[:, :, :L] = held
            self.storage = room
        assert room is not None  # reusable, or just allocated
        room[:, :, L : L + N] = new
        return room[:, :, : L + N]

    def base(self, held: Tensor) -> Tensor:
        """The allocation ``held`` lives in: its room, or itself."""
        room = self.storage
        return room if room is not None and held.data_ptr() == room.data_ptr() else held

    def nbytes(self, held: Tensor) -> int:
        """Bytes allocated for ``held``."""
        t = self.base(held)
        return t.numel() * t.element_size()

    def gather(self, held: Tensor, slots: Tensor) -> Tensor:
        """``held`` (B, H, L, D) at the slots (B, H', n), H' a multiple of H (head h' reads
        head h' // (H' / H): per query head of a KV group): one row copy per slot (torch's
        ``gather`` on the 4-D tensor copies element by element, ~10x slower)."""
        base = self.base(held).contiguous()
        B, H, cap, D = base.shape
        heads = torch.arange(slots.shape[1], device=slots.device) // (slots.shape[1] // H)
        rows = slots + ((torch.arange(B, device=slots.device)[:, None] * H + heads[None]) * cap)[..., None]
        return base.view(-1, D).index_select(0, rows.view(-1)).view(B, slots.shape[1], -1, D)


def headroom(slots: int) -> int:
    return max(1, slots // 16)


SLOT_TENSORS = ("keys", "values", "valid", "pos", "rope", "score")
_LAYOUTS = itertools.count()  # a fresh token for every layout of every layer


class PolicyLayer(CacheLayerMixin):
    """A ``transformers`` cache layer whose entries a policy may evict per head."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    _packed: PackedKV | None = None
    _keys: Tensor | None
    _values: Tensor | None

    def __init__(self) -> None:
        self._packed = None
        super().__init__()
        self.valid: Tensor | None = None
        self.pos: Tensor | None = None
        self.rope: Tensor | None = None
        #: which of ``rope`` and ``score`` the layer keeps (the cache drops what its policy
        #: never reads: two fewer writes per token); the others stay None
        self.optional: tuple[str, ...] = ("rope", "score")
        #: a per-entry score a policy accumulates across calls, aligned with the layout
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
        #: the slots are in position order (False once a token filled an evicted slot)
        self.ordered = True
        self._kept_range: tuple[Tensor, int, tuple[int, int]] | None = None
        #: a token naming the arrangement of the slots: a new one whenever entries are
        #: appended, gathered, cropped or reordered (not when a token fills a hole or an
        #: entry is evicted in place), so that state kept about the arrangement (a rolling
        #: window's ``ring.Ring``) knows when it no longer holds
        self.layout = next(_LAYOUTS)
        #: what a policy derives from the slots held and extends as tokens are appended
        #: (e.g. a sparse read's page extremes); emptied whenever existing slots change
        self.memo: dict = {}
        self.rooms = {name: Room() for name in SLOT_TENSORS}

    # ------------------------------------------------------------------ storage

    @property
    def keys(self) -> Tensor | None:
        packed = self._packed
        return packed.padded(packed.k) if packed is not None else self._keys

    @keys.setter
    def keys(self, value: Tensor | None) -> None:
        self.unpack()
        self._keys = value

    @property
    def values(self) -> Tensor | None:
        packed = self._packed
        return packed.padded(packed.v) if packed is not None else self._values

    @values.setter
    def values(self, value: Tensor | None) -> None:
        self.unpack()
        self._values = value

    def pack(self) -> bool:
        """Hold the keys and values without padding (``PackedKV``) when some slots are
        empty; returns whether the layer is packed. Reading ``keys``/``values`` then
        builds the padded tensors; assigning them unpacks the layer."""
        if self._packed is None and self.is_initialized:
            assert self._keys is not None and self._values is not None and self.valid is not None  # initialised, unpacked
            if not bool(self.valid.all()):
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
        if "rope" in self.optional:
            self.rope = torch.zeros(B, H, 0, dtype=torch.long, device=self.device)
        if "score" in self.optional:
            self.score = torch.zeros(B, H, 0, dtype=torch.float64, device=self.device)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        raise RuntimeError("a PolicyLayer is updated through its PolicyCache (append), which knows the padding")

    def fill(self, key_states: Tensor, value_states: Tensor, rope: Tensor, slot: int | None = None) -> tuple[Tensor, Tensor]:
        """Put one new real token per row into each (row, head)'s single hole (the entry
        the previous step evicted); the layer is then full. ``slot``: the hole, when it is
        the same known slot in every (row, head) (a rolling window's ring). Returns every
        slot."""
        keys, values = self._keys, self._values
        # a layer with one hole per head: initialised, unpacked (one_hole_each)
        assert keys is not None and values is not None and self.valid is not None and self.pos is not None
        B, H = self.valid.shape[:2]
        rope = rope.to(self.device, torch.long)[:, None, :].expand(B, H, 1)
        if slot is not None:
            h = slot
            keys[:, :, h : h + 1] = key_states
            values[:, :, h : h + 1] = value_states
            self.valid[:, :, h] = True
            self.pos[:, :, h] = self.seen
            if self.rope is not None:
                self.rope[:, :, h : h + 1] = rope
            if self.score is not None:
                self.score[:, :, h] = 0.0
        elif native_kv.available() and key_states.stride(-1) == 1 and value_states.stride(-1) == 1:
            native_kv.fill_hole(
                keys, values, self.valid, self.pos, self.rope, self.score, key_states, value_states, rope[:, 0, 0], self.seen
            )
        else:
            hole = (~self.valid).to(torch.uint8).argmax(-1, keepdim=True)  # (B, H, 1): the hole
            keys.scatter_(2, hole[..., None].expand(B, H, 1, keys.shape[-1]), key_states)
            values.scatter_(2, hole[..., None].expand(B, H, 1, values.shape[-1]), value_states)
            self.valid.scatter_(2, hole, True)
            self.pos.scatter_(2, hole, self.seen)
            if self.rope is not None:
                self.rope.scatter_(2, hole, rope)
            if self.score is not None:
                self.score.scatter_(2, hole, 0.0)
        self.seen += 1
        self.full = True
        self.ordered = False
        self.memo = {}
        L = self.length
        self._kept_range = (self.valid, self.valid._version, (L, L))
        return keys, values

    def evict_slot(self, h: int) -> None:
        """Evict slot ``h`` of every (row, head), in place, from a full layer: each then
        holds one hole (``fill`` takes it next)."""
        assert self.valid is not None  # a full layer is initialised
        self.valid[:, :, h] = False
        self.full = False
        self.memo = {}
        L = self.length
        self._kept_range = (self.valid, self.valid._version, (L - 1, L - 1))

    def one_hole_each(self) -> bool:
        """Every (row, head) has exactly one empty slot (``fill`` can take it)."""
        fewest, most = self.kept_range()
        return self._packed is None and fewest == most == self.length - 1

    def kept_range(self) -> tuple[int, int]:
        """(fewest, most) entries kept by any (row, head); remembered for the ``valid``
        tensor it was counted on (a decoding step asks twice between two changes)."""
        valid = self.valid
        assert valid is not None  # asked of an initialised layer
        seen = self._kept_range
        if seen is not None and seen[0] is valid and seen[1] == valid._version:
            return seen[2]
        if valid.numel() == 0:
            found = (0, 0)
        else:
            low, high = valid.sum(-1).aminmax()
            found = (int(low), int(high))
        self._kept_range = (valid, valid._version, found)
        return found

    def append(
        self,
        key_states: Tensor,
        value_states: Tensor,
        real: Tensor,
        rope: Tensor,
        kept_only: bool = False,
        slots: Tensor | None = None,
        materialise: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """Add ``Nq`` new tokens after the kept entries; ``real`` (B, Nq) marks the tokens
        that are not padding, ``rope`` (B, Nq) the positions their keys were rotated at.
        Returns the keys and values for this call's attention: every slot, or with
        ``kept_only`` (every row and head then keeps as many entries) the kept entries
        alone, gathered, so that the call needs no mask; or the ``slots`` (B, Hq, n)
        of each query head (a sparse read's pages), gathered per query head. A packed layer returns
        its padded keys and values, or without ``materialise`` its packed rows (for an
        attention that reads them where they lie)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.valid is not None and self.pos is not None  # initialised
        B, H, N = key_states.shape[:3]
        dev = self.device
        pos = torch.arange(self.seen, self.seen + N, device=dev).expand(B, H, N)
        rooms = self.rooms
        self.layout = next(_LAYOUTS)
        counted = self._kept_range
        known = counted[2] if counted is not None and counted[0] is self.valid and counted[1] == self.valid._version else None
        if self._packed is not None:
            packed = self._packed
            packed.append(key_states, value_states)
            # the padded layout for this call's attention only
            keys, values = packed.materialise() if materialise else (packed.k, packed.v)
        else:
            assert self._keys is not None and self._values is not None  # initialised, unpacked
            self._keys = keys = rooms["keys"].append(self._keys, key_states)
            self._values = values = rooms["values"].append(self._values, value_states)
        self.valid = rooms["valid"].append(self.valid, real.to(dev, torch.bool)[:, None, :].expand(B, H, N))
        self.pos = rooms["pos"].append(self.pos, pos)
        if self.rope is not None:
            self.rope = rooms["rope"].append(self.rope, rope.to(dev, torch.long)[:, None, :].expand(B, H, N))
        if self.score is not None:
            self.score = rooms["score"].append(self.score, torch.zeros(B, H, N, dtype=torch.float64, device=dev))
        self.seen += N
        all_real = bool(real.all())
        self.full = self.full and all_real
        if known is not None and all_real:  # every head gained N entries: no need to count them again
            self._kept_range = (self.valid, self.valid._version, (known[0] + N, known[1] + N))
        if slots is not None:
            return rooms["keys"].gather(keys, slots), rooms["values"].gather(values, slots)
        if kept_only and not self.full:
            slots = self.valid.nonzero()[:, 2].view(B, H, -1)
            keys, values = rooms["keys"].gather(keys, slots), rooms["values"].gather(values, slots)
        return keys, values

    def even(self) -> bool:
        """Every row and head keeps as many entries."""
        fewest, most = self.kept_range()
        return fewest == most

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask transformers builds is replaced per layer by the policy cache's hook;
        # these sizes keep its own construction consistent with the padding mask.
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        optional = self.optional
        type(self).__init__(self)
        self.optional = optional

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
        assert self.valid is not None and self.pos is not None  # initialised
        self.memo = {}
        self.layout = next(_LAYOUTS)
        packed = self._packed is not None
        removed = min(-tokens_to_remove, self.seen)
        self.seen -= removed
        L = self.length
        gone = self.pos >= self.seen  # the removed tokens' slots (kept entries and holes alike)
        tail = min(removed, L)
        if bool(gone[..., L - tail :].all()) and not bool(gone[..., : L - tail].any()):
            # the usual case: they are the layout's last slots (appended after everything else)
            for name in ("keys", "values", "valid", "pos", *self.optional):
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
        self.layout = next(_LAYOUTS)
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
        self.layout = next(_LAYOUTS)
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
        assert self.valid is not None  # asked of an initialised layer
        return self.valid.sum(-1)

    def compact(self, keep: Tensor) -> Tensor:
        """Keep the entries ``keep`` (B, Hkv, L) marks (never an invalid one) and gather
        them, in position order, into new tensors just long enough for the longest head.
        Returns the gather indices (B, Hkv, L'), for state kept beside the cache."""
        assert self.valid is not None and self.pos is not None  # compacts an initialised layer
        keep = keep & self.valid
        counts = keep.sum(-1)
        new_len = int(counts.max()) if counts.numel() else 0
        # kept entries first, in position order (distinct among kept entries)
        order = torch.sort(torch.where(keep, self.pos, torch.iinfo(self.pos.dtype).max), dim=-1).indices[..., :new_len]
        keys = self.keys
        assert keys is not None  # an initialised layer
        idx4 = order[..., None].expand(*order.shape, keys.shape[-1])
        self.memo = {}
        self.keys = keys.gather(2, idx4).contiguous()
        values = self.values
        assert values is not None  # an initialised layer
        self.values = values.gather(2, order[..., None].expand(*order.shape, values.shape[-1])).contiguous()
        self.valid = torch.arange(new_len, device=self.device)[None, None, :] < counts[..., None]
        self.full = bool((counts == new_len).all())
        self.ordered = True
        self.layout = next(_LAYOUTS)
        zero = torch.zeros((), device=self.device)
        slots = self.valid[..., None]
        self.keys = torch.where(slots, self.keys, zero.to(self.keys.dtype))  # padded slots hold zeros, never stale keys
        self.values = torch.where(slots, self.values, zero.to(self.values.dtype))
        self.pos = torch.where(self.valid, self.pos.gather(2, order), -1)
        if self.rope is not None:
            self.rope = torch.where(self.valid, self.rope.gather(2, order), -1)
        if self.score is not None:
            self.score = torch.where(self.valid, self.score.gather(2, order), 0.0)
        return order

    def drop(self, keep: Tensor, slack: int) -> Tensor | None:
        """Evict while decoding: entries outside ``keep`` stop being valid at once (the
        attention mask hides them), and the layer is gathered (``compact``) only when
        more than ``slack`` slots of its longest head are such holes. A decoding step
        evicts about one entry per head, so gathering every step would copy the whole
        layer per token; this copies it once per ``slack`` tokens. Returns the gather
        indices when it compacted, else None (the layout is unchanged)."""
        assert self.valid is not None  # drops from an initialised layer
        self.valid = self.valid & keep
        return self.settle(slack)

    def settle(self, slack: int, kept: tuple[int, int] | None = None) -> Tensor | None:
        """After entries stopped being valid (``drop``, or in place by the C++ step, which
        counts the ``kept`` (fewest, most) entries): gather the layer if more than ``slack``
        slots of its longest head are holes. Returns the gather indices, or None."""
        assert self.valid is not None  # settles an initialised layer
        self.memo = {}
        if kept is not None:
            self._kept_range = (self.valid, self.valid._version, kept)
        fewest, longest = self.kept_range()
        if self.length - longest > slack:
            return self.compact(self.valid)
        self.full = self.full and fewest == self.length
        return None

    def nbytes(self) -> int:
        """Bytes the layer's tensors occupy (keys, values and the bookkeeping)."""
        if not self.is_initialized:
            return 0
        names = ["valid", "pos", *self.optional] + (["keys", "values"] if self._packed is None else [])
        held = 0 if self._packed is None else self._packed.nbytes()
        held += sum(self.rooms[n].nbytes(getattr(self, "_" + n if n in ("keys", "values") else n)) for n in names)
        return held + (0 if self.capacity is None else self.capacity.numel() * self.capacity.element_size())

    def kv_nbytes(self) -> int:
        """Bytes of the keys and values alone."""
        if not self.is_initialized:
            return 0
        if self._packed is not None:
            return self._packed.kv_nbytes()
        assert self._keys is not None and self._values is not None  # initialised, unpacked
        return self.rooms["keys"].nbytes(self._keys) + self.rooms["values"].nbytes(self._values)
