"""What every mechanism call shares: option checks, the finiteness check, dense logits.

Mechanisms accept the keyword arguments of ``attnkit.attention``; the ones that make no
sense for a mechanism (an lse where nothing is normalised, sinks, an unknown backend)
are refused with a ValueError that names the argument and the mechanism.
"""

from __future__ import annotations

import torch

from ..observe.base import feed, interested
from .observe_pass import call_info, softmax_tiles
from .reference import reference_scores
from .request import Request, all_finite, make_request, nonfinite_error

Tensor = torch.Tensor


def check_options(
    name: str,
    *,
    sinks=None,
    return_lse: bool = False,
    backend: str = "auto",
    backends: tuple[str, ...] = ("auto", "chunked", "reference"),
    lse: bool = True,
    allow_sinks: bool = False,
) -> None:
    if backend not in backends:
        raise ValueError(f"backend: mechanism {name!r} runs on {', '.join(repr(b) for b in backends)}, got {backend!r}")
    if return_lse and not lse:
        raise ValueError(f"return_lse: mechanism {name!r} has no softmax normaliser, so there is no logsumexp to return")
    if sinks is not None and not allow_sinks:
        raise ValueError(f"sinks: mechanism {name!r} does not support attention sinks")


def request(q, k, v, *, mask=None, score=None, scale=None, sinks=None, return_lse=False) -> Request:
    return make_request(q, k, v, mask=mask, score=score, scale=scale, sinks=sinks, return_lse=return_lse)


def finish(req: Request, out: Tensor, check_finite: bool) -> Tensor:
    if check_finite and not all_finite(out):
        raise nonfinite_error(req)
    return out


def observe_softmax_as(req: Request, lse: Tensor, observers, layer: int | None, mechanism: str) -> None:
    """Feed observers the softmax weights of ``req`` (given its lse), tagged as ``mechanism``."""
    call = call_info(req, layer, mechanism)
    _, union = interested(observers, call)
    feed(observers, call, softmax_tiles(req, lse, call, union))


def dense_logits(req: Request) -> Tensor:
    """Modified logits (B, Hq, Nq, Nk) with -inf where masked, in float32 (float64 for
    float64 inputs): the starting point of every mechanism's reference."""
    cd = torch.float64 if req.q.dtype == torch.float64 else torch.float32
    s, _ = reference_scores(req, cd)
    return s


def dense_values(req: Request) -> Tensor:
    """v (B, Hq, Nk, Dv) in the compute dtype, each query head given its key/value head."""
    cd = torch.float64 if req.q.dtype == torch.float64 else torch.float32
    return req.v.to(cd).repeat_interleave(req.heads // req.kv_heads, dim=1)
