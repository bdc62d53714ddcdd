"""Python side of kv.cpp and kv_attention.cpp, the KV-cache policies' steps in one pass
each: evicting the lowest-scoring entry per (row, KV head) (TOVA, arXiv 2401.06104; H2O,
arXiv 2306.14048) and writing the next token into the slot it left; attention that reads
the cache where it lies and returns what the policy reads beside the output (a step's
weights, a causal prefill's mass per key), over heads stored packed (AdaKV) or over
Quest's pages (arXiv 2406.10774), chosen in the same pass; and a few query rows that see
every key with their logits and weights, for a meter's decoding step. Callers check
``available()`` first and run their PyTorch path otherwise."""

from __future__ import annotations

import torch
from torch.autograd.graph import increment_version

from .build import available

__all__ = [
    "H2O",
    "TOVA",
    "available",
    "evict_lowest",
    "fill_hole",
    "packed_attention",
    "prefill_attention",
    "quest_attention",
    "rows_attention",
    "step_attention",
]

Tensor = torch.Tensor

#: ``evict_lowest`` modes
TOVA, H2O = 0, 1


def evict_lowest(
    mass: Tensor, valid: Tensor, pos: Tensor, capacity: Tensor, score: Tensor | None, mode: int, recent: float = 0.0
) -> tuple[Tensor | None, int, int]:
    """Per (row, KV head) holding one entry more than ``capacity`` (B, H): drop the entry
    with the lowest score, the latest position among equal lowest, by clearing it in
    ``valid`` (B, H, L) in place. TOVA scores by ``mass`` (B, Hq, L) averaged over all
    query heads; H2O adds ``mass`` averaged over each head's group to ``score`` (B, H, L)
    float64 in place and exempts the floor(capacity * recent) latest positions. Returns
    (evicted slot per (row, head), -1 for none; fewest kept; most kept), or (None, -1, -1)
    without changing anything when some head would evict more than one entry."""
    slot, fewest, most = torch.ops.attnkit.kv_evict_lowest(mass, valid, pos, capacity, score, mode, float(recent))
    # the operator writes through data pointers: tell autograd (and ``_version`` readers)
    increment_version(valid if score is None else (valid, score))
    return slot, fewest, most  # an undefined tensor arrives as None


def fill_hole(
    keys: Tensor,
    values: Tensor,
    valid: Tensor,
    pos: Tensor,
    rope: Tensor | None,
    score: Tensor | None,
    key_new: Tensor,
    value_new: Tensor,
    rope_new: Tensor,
    seen: int,
) -> None:
    """Write one new token per (row, KV head) into its first empty slot, in place: key and
    value (B, H, 1, D), ``valid`` set, position ``seen``, RoPE position ``rope_new`` (B,),
    score 0."""
    torch.ops.attnkit.kv_fill_hole(keys, values, valid, pos, rope, score, key_new, value_new, rope_new, seen)
    increment_version([t for t in (keys, values, valid, pos, rope, score) if t is not None])


def step_attention(q: Tensor, keys: Tensor, values: Tensor, hide: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """softmax(q k^T * scale | not hidden) v for one query per head, q (B, Hq, 1, D), over
    keys and values (B, Hkv, L, D|Dv) without repeating them per query head; ``hide``
    (B, Hkv, L) bool or None. Returns (out (B, 1, Hq, Dv), weights (B, Hq, L))."""
    return torch.ops.attnkit.kv_step_attention(q, keys, values, hide, scale)


def rows_attention(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """softmax(q k^T * scale) v for a few query rows per head that see every key, q (B, Hq,
    Nq, D), over keys and values (B, Hkv, L, D|Dv) without repeating them per query head.
    Returns (out (B, Hq, Nq, Dv), logits q k^T * scale and weights (B, Hq, Nq, L),
    log-normalisers (B, Hq, Nq), whether every logit and every output is finite)."""
    return torch.ops.attnkit.rows_attention(q, keys, values, scale)


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, start: Tensor) -> tuple[Tensor, Tensor]:
    """Causal softmax attention over a fresh sequence, q (B, Hq, N, D), k and v (B, Hkv, N,
    D|Dv), with the weight each key receives summed over all real queries (H2O's score,
    arXiv 2306.14048) from the same pass. Row b is left-padded up to ``start[b]`` (B,)
    int64: its padding queries see themselves alone and give no mass. Returns (out (B, N,
    Hq, Dv), mass (B, Hq, N) float64)."""
    return torch.ops.attnkit.kv_prefill_attention(q, k, v, scale, start)


def packed_attention(q: Tensor, k_rows: Tensor, v_rows: Tensor, source: Tensor, empty_row: int, scale: float) -> Tensor:
    """softmax(q k^T * scale) v for one query per head, q (B, Hq, 1, D), over heads stored
    packed: ``source`` (B, Hkv, L) int32 names each slot's row of ``k_rows`` (T, D) and
    ``v_rows`` (T, Dv); slots naming ``empty_row`` are empty. Returns (B, 1, Hq, Dv)."""
    return torch.ops.attnkit.kv_packed_attention(q, k_rows, v_rows, source, empty_row, scale)


def quest_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    kmin: Tensor,
    kmax: Tensor,
    has: Tensor,
    budget: Tensor,
    page_size: int,
    cached: int,
    per_group: bool,
    scale: float,
    fold: bool,
) -> tuple[Tensor, Tensor]:
    """Quest's step for one query per head, q (B, Hq, 1, D): pages of the ``cached`` slots
    ranked by their key bound (``kmin``/``kmax`` (B, Hkv, >= P, D) float64, ``has``
    (B, Hkv, >= P)), ceil(budget[b] / page_size) chosen per query head (per KV head with
    ``per_group``; the incomplete last page first, ties to the earlier page), attention
    over their slots and the new token's (slot ``cached``) of ``keys``/``values``.
    ``fold``: the new key then joins its page's extremes, in place. Returns (out (B, 1,
    Hq, Dv), chosen pages (B, Hq or Hkv, P) bool).

    Pages are runs of ``page_size`` slots, so every slot must hold a kept entry: Quest's
    pages are cut over each row's entries (``attnkit.kv.policies.quest.entry_pages``), and
    only in such a layer are those runs of slots; a layer with empty slots (a left-padded
    batch's) takes the PyTorch path."""
    out = torch.ops.attnkit.kv_quest_attention(
        q, keys, values, kmin, kmax, has, budget, page_size, cached, per_group, scale, fold
    )
    if fold:
        increment_version((kmin, kmax, has))
    return out


def register() -> None:
    """Nothing to register: the operators mutate the cache in place and are not traced."""
