"""Exact softmax attention from tensors to (out, lse): the runner behind ``attnkit.attention``.

Mechanisms call these functions (never ``attnkit.attention``): ``api.py`` sits above the
mechanisms and dispatches named ones to them, so a mechanism that needs exact softmax
attention on a piece of its call (HyperAttention's exact blocks, NSA's compression
branch) finds it here, one layer down.
"""

from __future__ import annotations

import torch

from .dispatch import choose_backend
from .finite import nonfinite_reaches_output, without_hidden_nonfinite
from .request import Request, all_finite, empty_result, make_request, nonfinite_error

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
    want_lse = return_lse or bool(observers)
    req = make_request(q, k, v, mask=mask, score=score, scale=scale, sinks=sinks, return_lse=want_lse)
    out, lse = run_request(req, backend)
    if observers:
        from .observe_pass import observe_softmax

        # the weights of hidden keys are 0 whatever the keys hold (NaN in padding too)
        observe_softmax(without_hidden_nonfinite(req) or req, lse, observers, layer)
    # Checked on the output (a NaN in a key the mask hides is harmless: run_request keeps
    # it out), on q, and on k when an output row is exactly zero: torch's flash kernel
    # returns zeros, not NaN, for a row whose every logit is NaN (kernels/finite.py).
    if check_finite and nonfinite_reaches_output(req, out):
        raise nonfinite_error(req)
    return (out, lse) if return_lse else out


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
