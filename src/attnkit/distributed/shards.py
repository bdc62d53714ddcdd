"""Cutting whole tensors into this rank's shard and gathering shards back."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import all_gather_ints, exchange, resolve_group
from .layout import layout_for

Tensor = torch.Tensor


def positions(n: int, group=None, layout: str = "zigzag") -> Tensor:
    """Global positions (long, ascending within each chunk) of this rank's tokens when N = n
    tokens are cut by ``layout``: the ``position_ids`` of this rank's shard."""
    g = resolve_group(group)
    return layout_for(n, g.world, layout).positions(g.rank)


def shard(x: Tensor, dim: int = 2, group=None, layout: str = "zigzag") -> Tensor:
    """This rank's shard of the whole tensor ``x`` along ``dim`` (every rank passes all of x)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    dim = _dim(x, dim)
    idx = positions(x.shape[dim], group, layout).to(x.device)
    return x.index_select(dim, idx)


def unshard(x: Tensor, dim: int = 2, group=None, layout: str = "zigzag") -> Tensor:
    """The whole tensor from every rank's shard ``x`` along ``dim`` (an all-gather; the
    result is the same on every rank). Not differentiable."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    g = resolve_group(group)
    dim = _dim(x, dim)
    lengths = [t[0] for t in all_gather_ints([x.shape[dim]], g, "unshard's length exchange")]
    n = sum(lengths)
    lay = layout_for(n, g.world, layout)
    if lengths != [lay.local_length(r) for r in range(g.world)]:
        raise ValueError(f"x: shard lengths {lengths} along dim {dim} are not the {layout!r} layout of N={n}")
    # all_gather needs equal sizes: pad every shard to the longest
    longest = max(lengths)
    moved = x.detach().movedim(dim, 0).contiguous()
    pad = moved.new_zeros(longest, *moved.shape[1:])
    pad[: moved.shape[0]] = moved
    parts = [torch.empty_like(pad) for _ in range(g.world)]
    with exchange("unshard's all-gather", g):
        dist.all_gather(parts, pad, group=g.handle)
    whole = moved.new_empty(n, *moved.shape[1:])
    for r, part in enumerate(parts):
        whole[lay.positions(r).to(x.device)] = part[: lengths[r]]
    return whole.movedim(0, dim)


def _dim(x: Tensor, dim: int) -> int:
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: expected an int in [{-x.dim()}, {x.dim()}) for a {x.dim()}-D tensor, got {dim!r}")
    return dim % x.dim()
