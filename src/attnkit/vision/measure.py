"""What a ``VisualAttention`` meter measured, turned into the inputs of the visual
interventions: the blind tokens to calibrate, and the reference curve to hold."""

from __future__ import annotations

import torch

from ..observe.visual import VisualAttention

Tensor = torch.Tensor


def _check(meter) -> None:
    if not isinstance(meter, VisualAttention):
        raise ValueError(f"meter: expected an attnkit.observe.VisualAttention that has run, got {type(meter).__name__}")
    if not meter.arrays()["visual_received"]:
        raise ValueError(
            "meter: has observed no attention call yet (run the model inside attnkit.hf.use(model, observers=[meter]))"
        )


def blind_tokens(meter: VisualAttention, factor: float = 3.0, layers=None) -> Tensor:
    """(B, N0) bool: image keys that receive more than ``factor`` times the mean received
    mass of their row's image keys, averaged over the measured heads of ``layers``
    (default: every measured layer). AVC (arXiv 2405.17820) calls such over-attended
    tokens "blind"; VAR (arXiv 2503.03321) the visual attention sink."""
    _check(meter)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ValueError(f"factor: expected a number > 1, got {factor!r}")
    received = meter.arrays()["visual_received"]
    picked = [v for (layer, _), v in received.items() if layers is None or layer in set(layers)]
    if not picked:
        raise ValueError(f"layers: the meter measured none of {list(layers)}")
    mass = torch.stack(picked).double().mean(0)  # (B, N0)
    keys = meter.keys.expand(mass.shape[0], -1)
    n = keys.sum(-1, keepdim=True).clamp_min(1)
    mean = torch.where(keys, mass, 0.0).sum(-1, keepdim=True) / n
    return keys & (mass > factor * mean)


def share_curve(meter: VisualAttention, num_layers: int, num_heads: int, floor: float = 1e-6) -> Tensor:
    """(layers, heads, T) visual share per generated step, averaged over batch rows,
    clamped into [floor, 1 - floor]: the ``curve`` of ``steer.hold_visual``. Heads or
    layers the meter did not measure get their step-0 value held (no correction)."""
    _check(meter)
    shares = meter.arrays()["visual_share"]
    if not shares:
        raise ValueError("meter: recorded no generated step (its prompt_len is past every query it saw)")
    T = max(v["values"].shape[1] for v in shares.values())
    out = torch.full((num_layers, num_heads, T), 0.5, dtype=torch.float64)
    for (layer, head), v in shares.items():
        if layer is None or layer >= num_layers or head >= num_heads:
            continue
        vals = v["values"].double()
        ok = torch.isfinite(vals)
        mean = torch.where(ok, vals, 0.0).sum(0) / ok.sum(0).clamp_min(1)
        mean = torch.where(ok.any(0), mean, float("nan"))
        curve = torch.full((T,), float("nan"), dtype=torch.float64)
        curve[: mean.shape[0]] = mean
        # steps never seen hold the last one seen
        last = float(curve[0]) if torch.isfinite(curve[0]) else 0.5
        for t in range(T):
            if torch.isfinite(curve[t]):
                last = float(curve[t])
            else:
                curve[t] = last
        out[layer, head] = curve
    return out.clamp(floor, 1 - floor)
