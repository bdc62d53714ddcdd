"""High-norm tokens in vision transformers, the attention they draw, and the neurons that
make them.

Vision transformers (CLIP, DINOv2, ...) grow a few tokens whose hidden states have norms
far above the rest, in background patches; attention concentrates on them and attention
maps turn noisy (Darcet et al. 2023, "Vision Transformers Need Registers", arXiv
2309.16588). A sparse set of MLP neurons writes those activations ("register neurons",
the test-time-registers abstract in the reading lists, Jiang et al. 2025, arXiv
2506.08010).

``high_norm(model, pixel_values)`` runs the tower once with hooks on its encoder layers
and a ``VisualAttention`` meter over every key (O(B·H·N) per layer):

- a token is an outlier of layer l when the norm of its hidden state entering layer l
  exceeds ``factor`` × the median norm of its image's tokens there;
- ``highnorm.count`` (per layer, head -1): outliers per image; ``highnorm.mass`` (per
  layer and head): the share of all attention of layer l that goes to layer l's outliers,
  next to ``highnorm.uniform``, their share of the keys.

``register_neurons(...)`` ranks, in each layer, the MLP's hidden units by their mean
activation on the next layer's outliers, minus their mean elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

Tensor = torch.Tensor


def vit_parts(model) -> tuple[nn.Module, list[nn.Module], list[nn.Linear]]:
    """(embeddings, encoder layers, each layer's MLP output projection) of a ViT-like
    tower (CLIP/SigLIP vision, ViT, DINOv2); a ValueError naming ``model`` otherwise."""
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    emb = getattr(model, "embeddings", None) or getattr(getattr(model, "vision_model", None), "embeddings", None)
    layers = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and isinstance(n, int) and len(m) == n), None)
    if emb is None or layers is None or not isinstance(hidden, int) or getattr(config, "image_token_id", None) is not None:
        raise ValueError(
            f"model: {type(model).__name__} is not a vision transformer tower (embeddings and {n} encoder layers); "
            "pass a CLIPVisionModel, SiglipVisionModel, ViTModel, Dinov2Model or a VLM's vision_tower"
        )
    outs = []
    for layer in layers:
        lin = [m for m in layer.modules() if isinstance(m, nn.Linear) and m.out_features == hidden and m.in_features != hidden]
        if not lin:
            raise ValueError(
                f"model: a {type(layer).__name__} has no MLP output projection (Linear from the MLP width to {hidden})"
            )
        outs.append(lin[-1])
    return emb, list(layers), outs


@dataclass
class HighNorm:
    """What ``high_norm`` measured: ``norms[l]`` (B, N) hidden-state norms entering layer
    l, ``outliers[l]`` (B, N) bool, and tidy ``rows`` (layer, head, metric, value)."""

    norms: list[Tensor]
    outliers: list[Tensor]
    rows: list[tuple]
    factor: float


def _hidden(args, kwargs) -> Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def high_norm(model, pixel_values: Tensor, factor: float = 3.0) -> HighNorm:
    """Outlier tokens per layer of ``model`` (a ViT tower) on ``pixel_values`` and the
    attention they draw (see the module docstring)."""
    from .. import hf
    from ..observe.visual import VisualAttention

    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ValueError(f"factor: expected a number > 1 (times the median norm), got {factor!r}")
    _, layers, _ = vit_parts(model)
    norms: list = [None] * len(layers)
    handles = [
        layer.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: norms.__setitem__(i, _hidden(args, kwargs).detach().norm(dim=-1)), with_kwargs=True
        )
        for i, layer in enumerate(layers)
    ]
    meter = None
    try:
        with torch.no_grad():
            n_tokens = _sequence_length(model, pixel_values)
            meter = VisualAttention(torch.ones(pixel_values.shape[0], n_tokens, dtype=torch.bool), top_k=1)
            with hf.use(model, observers=[meter]):
                model(pixel_values=pixel_values)
    finally:
        for h in handles:
            h.remove()
    outliers = [n > factor * n.median(dim=-1, keepdim=True).values for n in norms]
    received = meter.arrays()["visual_received"]
    rows = []
    for layer, out in enumerate(outliers):
        rows.append((layer, -1, "highnorm.count", float(out.sum(-1).double().mean())))
        for (lay, head), mass in sorted(received.items()):
            if lay != layer:
                continue
            total = float(mass.sum())
            rows.append((layer, head, "highnorm.mass", float((mass.double() * out).sum()) / total if total else 0.0))
            rows.append((layer, head, "highnorm.uniform", float(out.double().mean())))
    return HighNorm(norms, outliers, rows, float(factor))


def _sequence_length(model, pixel_values: Tensor) -> int:
    emb, _, _ = vit_parts(model)
    seen: dict[str, int] = {}
    handle = emb.register_forward_hook(
        lambda mod, args, out: seen.__setitem__("n", (out[0] if isinstance(out, tuple) else out).shape[1])
    )
    try:
        with torch.no_grad():
            emb(pixel_values)
    finally:
        handle.remove()
    return seen["n"]


def register_neurons(model, pixel_values: Tensor, top: int = 2, factor: float = 3.0, layers=None) -> dict[int, list[int]]:
    """{layer: [hidden units]}: in each layer (default: every layer whose output has
    outliers), the ``top`` MLP units whose mean activation on the outlier tokens of the
    layer's output most exceeds their mean on the other tokens."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top: expected an int >= 1, got {top!r}")
    measured = high_norm(model, pixel_values, factor)
    _, enc, outs = vit_parts(model)
    acts: list = [None] * len(enc)
    handles = [
        o.register_forward_pre_hook(lambda mod, args, i=i: acts.__setitem__(i, args[0].detach())) for i, o in enumerate(outs)
    ]
    try:
        with torch.no_grad():
            model(pixel_values=pixel_values)
    finally:
        for h in handles:
            h.remove()
    chosen = {}
    for layer in range(len(enc) - 1):
        out = measured.outliers[layer + 1]  # the tokens this layer's output makes high-norm
        if (layers is not None and layer not in layers) or not bool(out.any()) or bool(out.all()):
            continue
        a = acts[layer].double()  # (B, N, hidden units)
        on = (a * out.unsqueeze(-1)).sum((0, 1)) / out.sum()
        off = (a * (~out).unsqueeze(-1)).sum((0, 1)) / (~out).sum()
        chosen[layer] = (on - off).topk(min(top, a.shape[-1])).indices.tolist()
    return chosen
