"""Selection helpers shared by the policies: top-k per head with a fixed tie rule,
first and last entries, grouping query heads onto KV heads, 1-D pooling.

Ties go to the earlier position (a stable sort), in the fast paths and the references
alike, so that kept sets are reproducible."""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def top(scores: Tensor, candidates: Tensor, count: Tensor, pos: Tensor | None = None) -> Tensor:
    """The ``count`` (broadcastable to scores.shape[:-1]) candidates with the highest
    scores along the last dim, as a bool mask; ties to the earlier position. ``pos``:
    the entries' positions when the layout is not in position order (None: it is, so
    the index is the order)."""
    count = torch.as_tensor(count, device=scores.device)
    excess = candidates.sum(-1) - count
    most = int(excess.max()) if excess.numel() else 0
    if most <= 0:
        return candidates.clone()  # room for every candidate
    if most == 1:
        # a decoding step adds one entry to a full layer: drop each over-full row's lowest
        # candidate, the latest one among equal lowest (the earlier position wins a tie)
        s = torch.where(candidates, scores.to(torch.float64), math.inf)
        if pos is None:
            flipped = s.flip(-1)
            latest = s.shape[-1] - 1 - flipped.argmin(-1, keepdim=True)  # argmin takes the first, i.e. the latest slot
        else:
            lowest = s == s.min(-1, keepdim=True).values
            latest = torch.where(lowest, pos, -1).argmax(-1, keepdim=True)
        out = candidates.clone()
        out.scatter_(-1, latest, False)
        return torch.where((excess > 0)[..., None], out, candidates)
    s = torch.where(candidates, scores.to(torch.float64), -math.inf)
    k = int(count.max())
    if 0 < k < s.shape[-1] and bool((count == k).all()):
        # one count for all: when the k-th highest score is strictly above the next, the
        # top k are those at or above it, whatever the tie rule (a top-k, not a sort)
        ranked = torch.topk(s, k + 1, dim=-1).values
        nth = ranked[..., k - 1 : k]
        if bool((nth > ranked[..., k:]).all()):
            return (s >= nth) & candidates
    if pos is None:
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    else:  # in position order first, so that the stable sort breaks ties by position
        by_pos = torch.sort(pos, dim=-1, stable=True).indices
        order = by_pos.gather(-1, torch.sort(s.gather(-1, by_pos), dim=-1, descending=True, stable=True).indices)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(s.shape[-1], device=s.device).expand_as(order))
    return (rank < count[..., None]) & candidates


def first(valid: Tensor, count, pos: Tensor | None = None) -> Tensor:
    """The first ``count`` valid entries along the last dim (by ``pos`` when given: the
    layout is then not in position order)."""
    count = torch.as_tensor(count, device=valid.device)
    if pos is not None:
        return _by_position(valid, count, pos, earliest=True)
    return valid & (valid.cumsum(-1) <= count[..., None])


def last(valid: Tensor, count, pos: Tensor | None = None) -> Tensor:
    """The last ``count`` valid entries along the last dim (by ``pos`` when given)."""
    count = torch.as_tensor(count, device=valid.device)
    if pos is not None:
        return _by_position(valid, count, pos, earliest=False)
    ones = valid.to(torch.int32)
    after = ones.sum(-1, keepdim=True) - ones.cumsum(-1) + ones  # valid entries at or after each slot
    return valid & (after <= count[..., None])


def _by_position(valid: Tensor, count: Tensor, pos: Tensor, earliest: bool) -> Tensor:
    """The ``count`` earliest (or latest) valid entries by position (distinct among valid
    entries). Found from whichever side is shorter: a decoding step keeps all but one
    entry, so the entries left out are the few to rank (a top-k of a handful, not a sort)."""
    held = valid.sum(-1)
    count = torch.minimum(count.expand_as(held), held)
    fewest, most = (int(c) for c in count.aminmax())
    if fewest == most:
        # one count for every row and head (a decoding step's usual case): the k-th position
        if most == 0:
            return torch.zeros_like(valid)
        key = torch.where(valid, pos, torch.iinfo(pos.dtype).max if earliest else -1)
        nth = torch.kthvalue(key, most if earliest else key.shape[-1] - most + 1, dim=-1, keepdim=True).values
        return valid & (key <= nth if earliest else key >= nth)
    rest = held - count
    if most <= int(rest.max()):
        return _extreme(valid, count, pos, earliest)
    return valid & ~_extreme(valid, rest, pos, not earliest)


def _extreme(valid: Tensor, count: Tensor, pos: Tensor, earliest: bool) -> Tensor:
    k = int(count.max())
    if k == 0:
        return torch.zeros_like(valid)
    key = torch.where(valid, pos, torch.iinfo(pos.dtype).max if earliest else -1)
    ranked = torch.topk(key, k, dim=-1, largest=not earliest, sorted=True).values
    nth = ranked.gather(-1, (count - 1).clamp(min=0)[..., None])
    return valid & (key <= nth if earliest else key >= nth) & (count > 0)[..., None]


def group_mean(mass: Tensor, kv_heads: int) -> Tensor:
    """(B, Hq, L) -> (B, Hkv, L): the mean over each KV head's group of query heads (the
    aggregation kvpress and SnapKV's GQA variant use)."""
    B, Hq, L = mass.shape
    return mass.view(B, kv_heads, Hq // kv_heads, L).mean(2)


def pool(x: Tensor, kernel: int, how: str) -> Tensor:
    """SnapKV's clustering of scores along the last dim: stride 1, centred, same length
    (max pooling pads with -inf, average pooling with zeros counted in the mean)."""
    if kernel <= 1:
        return x
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1]).to(torch.float64)
    if how == "max":
        out = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        out = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    return out[..., : shape[-1]].reshape(shape)
