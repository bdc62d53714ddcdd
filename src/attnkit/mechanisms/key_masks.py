"""Reading padding out of a call's mask, for mechanisms without a dense mask path.

A key mask (``attnkit.padding(lengths)``, or any mask with ``key_only = True`` such as
the padding ``attnkit.hf`` reads from transformers) says which keys exist. Mechanisms
that cannot take arbitrary masks still need to know it: linear attention skips the
keys, selective attention starts each row at its first real key, a sliding window
hides padded keys, and causal sparse methods accept right padding, which a causal
mask already keeps away from every real query.
"""

from __future__ import annotations

import torch

from ..mods.masks import And, Padding

Tensor = torch.Tensor


def and_parts(mask) -> list:
    """The and-ed pieces of ``mask`` (nested And flattened); [] for None."""
    if mask is None:
        return []
    if isinstance(mask, And):
        return [p for part in mask.parts for p in and_parts(part)]
    return [mask]


def is_key_mask(part) -> bool:
    return isinstance(part, Padding) or bool(getattr(part, "key_only", False))


def split_key_masks(mask, batch: int, heads: int, q_len: int, k_len: int) -> tuple[list, Tensor | None]:
    """(the other and-ed parts, keep (B, Nk) bool of the key masks or None)."""
    rest, keep = [], None
    for part in and_parts(mask):
        if not is_key_mask(part):
            rest.append(part)
            continue
        part.check(batch, heads, q_len, k_len)
        b = torch.arange(batch).view(-1, 1, 1, 1)
        kv = torch.arange(k_len).view(1, 1, 1, -1)
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        kept = torch.as_tensor(part(b, zero, zero + k_len - 1, kv), dtype=torch.bool)
        kept = torch.broadcast_to(kept, (batch, 1, 1, k_len)).reshape(batch, k_len)
        keep = kept if keep is None else keep & kept
    return rest, keep


def is_right_padding(keep: Tensor) -> bool:
    """Every row keeps a prefix of its keys (padding only at the end)."""
    return bool((keep[:, 1:] <= keep[:, :-1]).all())


def padding_refused(mechanism: str, why: str, right_ok: bool = False) -> ValueError:
    """The error for padding a mechanism cannot honour (``right_ok``: it takes right padding)."""
    instead = "pad on the right (a causal mask keeps it away from every real token), or " if right_ok else ""
    return ValueError(
        f"mask: {mechanism} cannot take this padding: {why} A padded row would not compute what the same row computes "
        f"alone; {instead}run rows of different lengths as separate calls"
    )
