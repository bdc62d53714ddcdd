"""Attention perturbation for guidance: PAG's identity map and SoftPAG's per-head blend.

Perturbed-attention guidance (Ahn et al. 2024, arXiv 2403.17377) builds a weak model by
replacing chosen self-attention maps ``A = softmax(Q K^T / sqrt(d))`` with the identity,
so every query returns its own value: the layer then computes ``to_out(to_v(x))``.
SoftPAG (arXiv 2506.10978) interpolates each chosen head toward the identity,
``(1 - u_h) A + u_h I``, which on the values is

    out_h = (1 - u_h) * softmax(Q_h K_h^T / sqrt(d)) V_h + u_h * V_h,    u_h in [0, 1]

(u = 1: PAG; u = 0: the model). ``perturb`` puts that on chosen layers (exact module
paths) and heads through ``attnkit.diffusion.use``: the model's own processor runs
(projections, q/k norms, RoPE, output projection), only the attention core's output is
blended, and no N x N map is formed.

Joint attention (SD3, Flux) runs one softmax over [image; text] (SD3) or [text; image]
(Flux). With ``text="identity"`` (default, as PAG's joint-attention processors do) every
query of the joint sequence, image or text, returns its own value, so the image part of
the layer is ``to_out(to_v(x))`` and the text part ``to_add_out(add_v_proj(c))`` (Flux
single-stream blocks: ``to_v`` of the concatenated sequence). With ``text="keep"`` only
image queries are perturbed: text queries keep their ordinary attention over all tokens.
Cross-attention cannot be perturbed this way (there is no identity between image queries
and text keys).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from .edits import DiffusionEdit, edits_on
from .layers import AttentionLayer, CallLayout, attention_layers
from .switch import denoiser, use

Tensor = torch.Tensor
TEXT_CHOICES = ("identity", "keep")


@dataclass
class PerturbState:
    """What ``perturb`` yields. ``rows``: None to perturb every batch row of each call,
    or a (B,) bool tensor flagging the rows to perturb (guidance sets it per call);
    ``strengths``: module path -> (H,) float64 u per head."""

    strengths: dict[str, Tensor]
    text: str
    rows: Tensor | None = None


class Perturbation(DiffusionEdit):
    """The edit ``perturb`` puts in ``EDITS[module]`` for one layer: it notes the call's
    values (``inputs``) and blends the attention output toward them (``output``). An edit
    already on the module (``previous``) keeps running: its ``inputs`` and ``scores``
    first, its ``output`` before the blend."""

    def __init__(self, name: str, strength: Tensor, state: PerturbState, previous=None):
        super().__init__(previous)
        self.name, self.strength, self.state = name, strength, state
        self._value: Tensor | None = None

    def inputs(self, layout: CallLayout, query: Tensor, key: Tensor, value: Tensor):
        query, key, value = super().inputs(layout, query, key, value)
        self._value = value
        return query, key, value

    def output(self, layout: CallLayout, out: Tensor) -> Tensor:
        out = super().output(layout, out)
        value, self._value = self._value, None
        if value is None:
            raise ValueError(f"layers: {self.name} ran attention without passing its values through the edit's inputs hook")
        return blend(out, value, self.strength, self.state.rows, _query_span(layout, self.state.text), self.name)

    def __repr__(self):
        return f"perturbation({self.name}, u={[round(float(u), 6) for u in self.strength]})"


def blend(
    out: Tensor,
    value: Tensor,
    strength: Tensor,
    rows: Tensor | None = None,
    span: tuple[int, int] | None = None,
    name: str = "layer",
) -> Tensor:
    """``(1 - u_h) * out + u_h * V`` on (B, H, Nq, Dv) attention outputs, for the flagged
    batch ``rows`` (all when None) and query positions ``span`` (all when None); the rest
    of ``out`` is returned untouched, bit for bit."""
    b, h, nq, dv = out.shape
    if value.shape[2] != nq:
        raise ValueError(
            f"layers: {name} has {nq} queries but {value.shape[2]} keys; the identity map needs self- or "
            "joint attention (as many keys as queries), not cross-attention"
        )
    if value.shape[1] != h:
        if h % value.shape[1]:
            raise ValueError(f"layers: {name} has {h} query heads and {value.shape[1]} value heads")
        value = value.repeat_interleave(h // value.shape[1], dim=1)
    if strength.shape != (h,):
        raise ValueError(f"strength: {name} has {h} heads but {strength.shape[0]} strengths were given")
    u = strength.to(device=out.device, dtype=out.dtype).view(1, h, 1, 1)
    mixed = (1 - u) * out + u * value.to(out.dtype)
    changed = torch.zeros(b, 1, nq, 1, dtype=torch.bool, device=out.device)
    lo, hi = span if span is not None else (0, nq)
    if rows is None:
        changed[:, :, lo:hi] = True
    else:
        if rows.shape != (b,):
            raise ValueError(
                f"rows: expected a (B,) bool flag per batch row of {name}'s call (B={b}), got shape {tuple(rows.shape)}"
            )
        changed[:, :, lo:hi] = rows.to(out.device).view(b, 1, 1, 1)
    return torch.where(changed, mixed, out)


def _query_span(layout: CallLayout, text: str) -> tuple[int, int] | None:
    """The query rows to perturb: all, or with text="keep" the image rows of joint calls."""
    if text == "identity" or layout.kind != "joint":
        return None
    return layout.image_queries


def resolve(model, layers, strength: float = 1.0) -> dict[str, tuple[AttentionLayer, Tensor]]:
    """The layers and per-head strengths a ``layers`` spec names (see ``perturb``)."""
    available = {layer.name: layer for layer in attention_layers(model)}
    if not available:
        raise ValueError(f"model_or_pipeline: {type(model).__name__} has no diffusers attention modules")
    _check_u(strength, "strength")
    if isinstance(layers, str):
        layers = [layers]
    if isinstance(layers, Mapping):
        items = list(layers.items())
    elif isinstance(layers, Iterable):
        items = []
        for entry in layers:
            if isinstance(entry, str):
                items.append((entry, None))
            elif isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str) and _is_index(entry[1]):
                items.append((entry[0], ("head", int(entry[1]))))
            else:
                raise ValueError(f"layers: expected module paths or (module path, head) pairs, got {entry!r}")
    else:
        raise ValueError(
            f"layers: expected a module path, a list of paths or (path, head) pairs, or a dict path -> u; got {layers!r}"
        )
    if not items:
        raise ValueError("layers: expected at least one layer to perturb, got an empty selection")
    plan: dict[str, tuple[AttentionLayer, Tensor]] = {}
    for name, spec in items:
        if not isinstance(name, str) or name not in available:
            sample = ", ".join(repr(n) for n in list(available)[:4])
            raise ValueError(
                f"layers: {name!r} is not an attention module of the model (names are exact module paths, e.g. {sample})"
            )
        layer = available[name]
        if layer.kind == "cross":
            raise ValueError(
                f"layers: {name!r} is cross-attention; perturbation replaces self- or joint attention maps by the identity"
            )
        heads = int(getattr(layer.module, "heads", 0))
        if heads < 1:
            raise ValueError(f"layers: {name!r} does not say how many heads it has")
        u = plan[name][1] if name in plan else torch.zeros(heads, dtype=torch.float64)
        if spec is None:
            u = torch.full((heads,), float(strength), dtype=torch.float64)
        elif isinstance(spec, tuple) and spec and spec[0] == "head":
            if spec[1] >= heads:
                raise ValueError(f"layers: head {spec[1]} of {name!r}, which has {heads} heads")
            u = u.clone()
            u[spec[1]] = float(strength)
        else:
            u = _per_head(spec, heads, name)
        plan[name] = (layer, u)
    return plan


def _is_index(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_u(u, what: str) -> float:
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not math.isfinite(u) or not 0.0 <= u <= 1.0:
        raise ValueError(f"{what}: expected a number in [0, 1], got {u!r}")
    return float(u)


def _per_head(spec, heads: int, name: str) -> Tensor:
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return torch.full((heads,), _check_u(spec, f"layers[{name!r}]"), dtype=torch.float64)
    values = spec.tolist() if isinstance(spec, Tensor) else list(spec) if isinstance(spec, Iterable) else None
    if values is None or len(values) != heads:
        raise ValueError(f"layers[{name!r}]: expected a number in [0, 1] or one per head ({heads}), got {spec!r}")
    return torch.tensor([_check_u(v, f"layers[{name!r}]") for v in values], dtype=torch.float64)


@contextmanager
def perturb(model_or_pipeline, layers, *, strength: float = 1.0, text: str = "identity"):
    """Perturb chosen attention layers (PAG's identity map, SoftPAG's blend) inside ``with``.

    Args:
        model_or_pipeline: a diffusers model or a pipeline (its ``unet``/``transformer``).
        layers: which maps to perturb, by exact module path (``layer_names(model)``):
            a path or list of paths (every head at ``strength``), a list of
            ``(path, head)`` pairs (those heads at ``strength``, the layer's others at 0:
            HeadHunter's selections), or a dict path -> u (a number, or one per head).
        strength: u in [0, 1] for the entries above (1: PAG's identity).
        text: on joint attention, "identity" (every query returns its value) or "keep"
            (text queries attend as usual; only image queries are perturbed).

    Layers already switched by an enclosing ``attnkit.diffusion.use`` stay on that
    switch (its observers keep seeing their softmax maps; the blend acts on the output);
    the others are switched for the block. Yields a ``PerturbState``; set its ``rows`` to
    perturb only some batch rows. On exit, also after an exception, the model and any
    edits already on it are as they were.
    """
    if text not in TEXT_CHOICES:
        raise ValueError(f"text: expected one of {TEXT_CHOICES}, got {text!r}")
    model = denoiser(model_or_pipeline)
    plan = resolve(model, layers, strength)
    state = PerturbState({name: u for name, (_, u) in plan.items()}, text)
    # Layers an enclosing ``use`` already routes keep its switch (its observers, its
    # mechanism): the edits reach them there. Only the others are switched here.
    unrouted = [
        name for name, (layer, _) in plan.items() if not getattr(layer.module.__dict__.get("forward"), "_attnkit_routed", False)
    ]
    with use(model, layers=unrouted) if unrouted else nullcontext():
        chosen = [layer for layer, _ in plan.values()]
        with edits_on(chosen, lambda layer, previous: Perturbation(layer.name, plan[layer.name][1], state, previous)):
            yield state


__all__ = ["PerturbState", "Perturbation", "blend", "perturb", "resolve"]
