"""One dispatcher for every backend: which one runs a call, and why.

Each backend declares what it cannot do (``unsupported(req) -> reason | None``); an
explicit ``backend=`` that cannot run the call raises an error naming the backend and
the missing feature, never a silent fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..mods import band_of
from ..mods.scores import AbsBoost, Softcap
from . import cpu
from .chunked import choose_engine, chunked_attention, make_chunked_plan
from .few_queries import SMALL_QUERIES
from .flex import flex_attention_call, flex_reroute, flex_unsupported
from .reference import reference_attention
from .request import Request
from .sdpa import is_plain_causal, sdpa_attention, sdpa_unsupported

Tensor = torch.Tensor


@dataclass(frozen=True)
class Backend:
    name: str
    summary: str
    unsupported: Callable[[Request], str | None]
    run: Callable[[Request], tuple[Tensor, Tensor | None]]


def _never(req: Request) -> None:
    return None


BACKENDS: dict[str, Backend] = {
    "reference": Backend("reference", "dense literal formula (O(N^2) memory)", _never, reference_attention),
    "chunked": Backend("chunked", "tiled exact attention, O(N) memory, custom backward", _never, chunked_attention),
    "sdpa": Backend("sdpa", "torch scaled_dot_product_attention", sdpa_unsupported, sdpa_attention),
    "flex": Backend("flex", "compiled FlexAttention (inference on CPU)", flex_unsupported, flex_attention_call),
}


def choose_backend(req: Request, backend: str = "auto") -> tuple[Backend, list[str]]:
    """The backend for this call and the reasons, most important first."""
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
        chosen = BACKENDS[backend]
        why = chosen.unsupported(req)
        if why is not None:
            raise ValueError(f"backend={backend!r} cannot run this call: {why}")
        return chosen, [f"requested explicitly (backend={backend!r})"]

    reasons = []
    why_not_sdpa = sdpa_unsupported(req)
    if why_not_sdpa is None:
        if req.mask is not None and not is_plain_causal(req):
            return BACKENDS["sdpa"], [
                f"{req.q_len} queries (at most {SMALL_QUERIES}): the mask goes to torch SDPA as an Nq x Nk boolean tensor"
            ]
        return BACKENDS["sdpa"], ["the call reduces to torch SDPA (no mods beyond causal and a scalar temperature)"]
    reasons.append(f"not sdpa: {why_not_sdpa}")
    if req.q.device.type == "cuda" and flex_unsupported(req) is None:
        reasons.insert(0, "on CUDA, compiled FlexAttention fuses mods and masks into one kernel")
        return BACKENDS["flex"], reasons
    engine, why = choose_engine(req)
    reasons.insert(0, f"chunked/{engine}: {why}")
    return BACKENDS["chunked"], reasons


def explain_request(req: Request, backend: str = "auto") -> str:
    chosen, reasons = choose_backend(req, backend)
    lines = [f"backend: {chosen.name} — {chosen.summary}", f"call: {req.shapes()}"]
    if req.mask is not None:
        lines.append(f"mask: {req.mask!r}")
    if req.score is not None:
        lines.append(f"score: {req.score!r}")
    if req.sinks is not None:
        lines.append("sinks: one learned logit per head")
    lines += [f"why: {r}" for r in reasons]
    if chosen.name == "flex" and flex_reroute(req) is not None:
        lines.append(f"runs on the chunked backend instead: {flex_reroute(req)}")
    if chosen.name == "chunked":
        engine, _ = choose_engine(req)
        lines.append(f"engine: {engine_description(req, engine)}")
        plan = make_chunked_plan(req, engine)
        lines.append(
            f"plan: {plan.grid.n_q} query blocks x {plan.grid.n_k} key blocks of {plan.grid.q_block}x{plan.grid.k_block}; "
            f"{plan.tiles_skipped} of {plan.tiles_total} tiles skipped ({100 * (1 - plan.visited_fraction):.1f}%), "
            f"{plan.tiles_partial} evaluate the mask{'' if plan.shared else ' (planned per batch row)'}"
        )
    lines.append(cpu.status().describe() + ("" if cpu.status().available else "; C++ paths run as PyTorch tiles"))
    return "\n".join(lines)


def engine_description(req: Request, engine: str) -> str:
    """What computes the tiles of a chunked call: torch's flash kernel per tile segment,
    the whole call as a C++ operator, or PyTorch tiles (with C++ tile steps or without)."""
    if engine == "fused":
        return "torch's fused flash kernel per tile segment (masks and biases as small tiles)"
    float32_cpu = req.q.dtype == torch.float32 and req.q.device.type == "cpu"
    if not float32_cpu:
        return f"PyTorch tiles ({req.q.dtype} on {req.q.device.type}; the C++ operators take float32 CPU tensors)"
    status = cpu.status()
    if not status.available:
        return f"PyTorch tiles ({status.describe()})"
    if band_of(req.mask) is not None and (req.score is None or type(req.score) in (Softcap, AbsBoost)):
        return "C++ operator attnkit::softmax_attention for the whole forward; backward in PyTorch tiles"
    return "PyTorch tiles with C++ tile steps (online softmax, softcap)"
