"""Exact softmax attention from tensors to (out, lse): the runner behind ``attnkit.attention``.

Mechanisms call these functions (never ``attnkit.attention``): ``api.py`` sits above the
mechanisms and dispatches named ones to them, so a mechanism that needs exact softmax
attention on a piece of its call (HyperAttention's exact blocks, NSA's compression
branch) finds it here, one layer down.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..mods.masks import Causal
from .dense_rows import dense_rows_attention, dense_rows_serve, observed_rows
from .dispatch import choose_backend
from .finite import nonfinite_reaches_output, rows_finite_and_nonzero, without_hidden_nonfinite
from .key_offsets import key_offset_terms, key_offsets_attention
from .observe_pass import observe_softmax
from .request import FLOAT_DTYPES, Request, all_finite, empty_result, make_request, nonfinite_error
from .tiled import c_loop_forward

Tensor = torch.Tensor

BACKEND_NAMES = ("auto", "reference", "chunked", "sdpa", "flex")


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask=None,
    score=None,
    scale: float | None = None,
    sinks: Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    check_finite: bool = True,
    observers=None,
    layer: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact softmax attention; the arguments are those of ``attnkit.attention`` (which
    documents them) without ``mechanism``."""
    if mask is None or type(mask) is Causal:
        if observers and score is None and sinks is None and not return_lse and backend == "auto":
            out = observed_rows(q, k, v, mask, scale, observers, layer)  # an observed decoding step
        else:
            out = _plain_sdpa(q, k, v, mask, score, scale, sinks, return_lse, backend, check_finite, observers)
        if out is not None:
            return out
    want_lse = return_lse or bool(observers)
    req = make_request(q, k, v, mask=mask, score=score, scale=scale, sinks=sinks, return_lse=want_lse)
    lse: Tensor | None  # None only where the call asked for none (want_lse)
    offset_terms = key_offset_terms(req) if backend == "auto" and not observers else None
    if offset_terms is not None:
        out, lse = key_offsets_attention(req, offset_terms), None  # a steered prefill or decoding step
    elif (c_loop := _few_queries_c_loop(req, backend, observers)) is not None:
        out, lse = c_loop  # a decoding step with a mod the C++ loop runs (PAI's boost, softcap)
    elif backend == "auto" and (observers or score is not None) and dense_rows_serve(req):
        out, lse = dense_rows_attention(req, observers, layer, need_lse=return_lse)  # a decoding step observed or steered
    elif observers:
        out, lse = run_request(req, backend)
        assert lse is not None  # asked for: observers want it
        # the weights of hidden keys are 0 whatever the keys hold (NaN in padding too)
        observe_softmax(without_hidden_nonfinite(req) or req, lse, observers, layer)
    else:
        out, lse = run_request(req, backend)
    # Checked on the output (a NaN in a key the mask hides is harmless: run_request keeps
    # it out), on q, and on k when an output row is exactly zero: torch's flash kernel
    # returns zeros, not NaN, for a row whose every logit is NaN (kernels/finite.py).
    if check_finite and nonfinite_reaches_output(req, out):
        raise nonfinite_error(req)
    if not return_lse:
        return out
    assert lse is not None  # asked for (want_lse)
    return out, lse


def _few_queries_c_loop(req: Request, backend: str, observers) -> tuple[Tensor, Tensor] | None:
    """(out, lse) of an unobserved few-query inference call with a score mod from the C++
    softmax loop, which takes it whole in one operator call (the dense path below is some
    fifteen small ops); None when that loop does not run it."""
    if backend != "auto" or observers or req.score is None or req.sinks is not None or req.needs_grad:
        return None
    if not dense_rows_serve(req):
        return None
    return c_loop_forward(req.q, req.k, req.v, req.scale, req.mask, req.score, req.q_start)


def _plain_sdpa(q, k, v, mask, score, scale, sinks, return_lse, backend, check_finite, observers) -> Tensor | None:
    """The commonest small call (a decoding step: no mods, no mask or plain causal,
    inference) straight to torch SDPA, its inputs checked by what SDPA itself would need;
    None when the call is anything else, or when its output is not clean (finite, no row
    exactly zero), so the full path validates it, decides and explains."""
    if score is not None or sinks is not None or return_lse or observers or backend != "auto":
        return None
    if not (type(q) is type(k) is type(v) is Tensor) or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in FLOAT_DTYPES or not (q.device == k.device == v.device):
        return None
    (B, Hq, Nq, D), (Bk, Hkv, Nk, Dk), (Bv, Hv, Nv, Dv) = q.shape, k.shape, v.shape
    if not (B == Bk == Bv and Hkv == Hv and Nk == Nv and D == Dk == Dv) or Hkv == 0 or Hq % Hkv or not (Nq and Nk and D):
        return None
    if mask is not None and Nq != Nk and Nq != 1:  # SDPA's is_causal is top-left aligned
        return None
    if scale is not None and (type(scale) not in (int, float) or not math.isfinite(scale)):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    out = F.scaled_dot_product_attention(q, k, v, is_causal=mask is not None and Nq == Nk, scale=scale, enable_gqa=Hq != Hkv)
    if check_finite and not rows_finite_and_nonzero(out):
        return None
    return out


def run_request(req: Request, backend: str = "auto") -> tuple[Tensor, Tensor | None]:
    """(out, lse) of a validated request on the chosen backend; lse may be None when not asked."""
    if req.q_len == 0 or req.k_len == 0:
        if backend not in BACKEND_NAMES:
            choose_backend(req, backend)  # raises the unknown-backend error
        return empty_result(req)
    chosen, _ = choose_backend(req, backend)
    # NaN/inf in keys or values that no query sees (padding) must not reach the output or
    # the gradients, though a kernel's 0 * NaN spreads them (kernels/finite.py). Training
    # calls are cleaned first; the others only when their output comes back non-finite.
    if req.needs_grad:
        req = without_hidden_nonfinite(req) or req
    out, lse = chosen.run(req)
    if not req.needs_grad and req.mask is not None and not all_finite(out):  # no mask: nothing is hidden
        clean = without_hidden_nonfinite(req)
        if clean is not None:
            out, lse = chosen.run(clean)
    return out, lse
