"""The attention layers of a diffusers model: their names, kinds and token layout.

diffusers routes attention two ways today: ``Attention`` modules whose processors call
``torch.nn.functional.scaled_dot_product_attention`` (UNet2DConditionModel, DiT, PixArt,
SD3's joint processor), and ``AttentionModuleMixin`` modules whose processors call
diffusers' attention dispatcher (Flux), whose native backend ends in the same SDPA call.
Both are found here by class; a layer is named by its module path and is one of

- ``"self"``: image tokens attend to image tokens;
- ``"cross"``: image queries attend to text keys (``encoder_hidden_states``);
- ``"joint"``: one softmax over image and text tokens together (SD3 and Flux
  double-stream blocks, which project the text with their own ``add_*`` weights, and
  Flux single-stream blocks, which run on the concatenated [text; image] sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

Tensor = torch.Tensor
KINDS = ("self", "cross", "joint")


@dataclass(frozen=True)
class AttentionLayer:
    """One attention module: ``index`` (its rank among the model's attention modules,
    the layer number observers see), ``name`` (its module path), ``kind``."""

    index: int
    name: str
    module: nn.Module
    kind: str
    #: True when the module puts text before image in its joint sequence (Flux), False
    #: when after (SD3), None for self- and cross-attention
    text_first: bool | None = None


@dataclass(frozen=True)
class CallLayout:
    """Where image queries and text keys sit in one attention call (positions counted
    from 0 in the call's own query and key sequences)."""

    layer: int
    name: str
    kind: str
    step: int
    image_queries: tuple[int, int]
    text_keys: tuple[int, int] | None
    grid: tuple[int, int] | None  # (h, w) of the image tokens, when known


def _attention_classes() -> tuple[type[Attention], type[AttentionModuleMixin]]:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return (Attention, AttentionModuleMixin)


def _kind(module: nn.Module) -> tuple[str, bool | None]:
    from diffusers.models.attention_processor import Attention

    if isinstance(module, Attention):
        if getattr(module, "add_k_proj", None) is not None:
            return "joint", False  # SD3's JointAttnProcessor2_0: [image; text]
        return ("cross" if module.is_cross_attention else "self"), None
    # AttentionModuleMixin (Flux): double-stream blocks project text with added_kv_proj,
    # single-stream blocks receive [text; image] already concatenated.
    return "joint", True


def attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """Every attention module of ``model`` (a diffusers model), in module order."""
    classes = _attention_classes()
    out: list[AttentionLayer] = []
    for name, module in model.named_modules():
        if isinstance(module, classes) and hasattr(module, "processor"):
            layer = cast(nn.Module, module)  # named_modules yields modules: AttentionModuleMixin is mixed into one
            kind, text_first = _kind(layer)
            out.append(AttentionLayer(len(out), name, layer, kind, text_first))
    return out


def layer_names(model, kind: str | None = None) -> list[str]:
    """The module paths of the attention layers of ``model`` (or a pipeline's denoiser),
    optionally only those of ``kind`` ("self", "cross" or "joint")."""
    from .switch import denoiser

    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS} or None, got {kind!r}")
    return [layer.name for layer in attention_layers(denoiser(model)) if kind is None or layer.kind == kind]


def grid_for(tokens: int, latent: tuple[int, int] | None) -> tuple[int, int] | None:
    """(h, w) of ``tokens`` image tokens: the model input's latent (H, W) downsampled by
    the factor that gives that many tokens (UNet levels, DiT patches, rounding up as a
    stride-2 convolution does), or a square grid when the latent size is unknown."""
    if latent is not None:
        height, width = latent
        for f in range(1, max(height, width) + 1):
            h, w = -(-height // f), -(-width // f)
            if h * w == tokens:
                return h, w
            if h * w < tokens:
                break
    side = int(round(tokens**0.5))
    return (side, side) if side * side == tokens else None


def call_layout(
    layer: AttentionLayer,
    step: int,
    image_len: int,
    text_len: int | None,
    in_sequence_text: int | None,
    latent: tuple[int, int] | None,
) -> CallLayout:
    """The layout of one call of ``layer``: ``image_len`` tokens of hidden states,
    ``text_len`` tokens of ``encoder_hidden_states`` passed to the module (None when none
    was), ``in_sequence_text`` the text length of the model's call (for single-stream
    blocks whose hidden states already hold [text; image])."""
    if text_len is None:
        if layer.kind == "joint" and layer.text_first and in_sequence_text is not None and in_sequence_text < image_len:
            n_img = image_len - in_sequence_text
            return CallLayout(
                layer.index,
                layer.name,
                layer.kind,
                step,
                (in_sequence_text, image_len),
                (0, in_sequence_text),
                grid_for(n_img, latent),
            )
        return CallLayout(
            layer.index,
            layer.name,
            layer.kind if layer.kind != "cross" else "self",
            step,
            (0, image_len),
            None,
            grid_for(image_len, latent),
        )
    if layer.kind == "cross" or layer.kind == "self":
        return CallLayout(layer.index, layer.name, "cross", step, (0, image_len), (0, text_len), grid_for(image_len, latent))
    if layer.text_first:
        return CallLayout(
            layer.index, layer.name, "joint", step, (text_len, text_len + image_len), (0, text_len), grid_for(image_len, latent)
        )
    return CallLayout(
        layer.index, layer.name, "joint", step, (0, image_len), (image_len, image_len + text_len), grid_for(image_len, latent)
    )


def select_layers(model: nn.Module, layers, kinds: tuple[str, ...] = KINDS, argument: str = "layers") -> list[AttentionLayer]:
    """The attention layers of ``model`` named in ``layers`` (a module path or a list of
    them), in model order, or every layer of ``kinds`` when ``layers`` is None.

    Paths match exactly: ``"blocks.1"`` never selects ``blocks.10`` (diffusers' own PAG
    layer regex does). A path that names no attention module, one of a kind not in
    ``kinds`` or an empty list is a ValueError naming ``argument``."""
    available = attention_layers(model)
    joined = " or ".join(kinds)
    if layers is None:
        chosen = [layer for layer in available if layer.kind in kinds]
        if not chosen:
            raise ValueError(f"{argument}: the model has no {joined} attention layers")
        return chosen
    if isinstance(layers, str):
        layers = [layers]
    by_name = {layer.name: layer for layer in available}
    chosen = []
    for path in layers:
        if not isinstance(path, str):
            raise ValueError(f"{argument}: expected module paths (str), got {path!r}")
        if path not in by_name:
            sample = ", ".join(repr(n) for n in list(by_name)[:4])
            raise ValueError(
                f"{argument}: {path!r} is not an attention module of the model (names are exact module paths, e.g. {sample})"
            )
        layer = by_name[path]
        if layer.kind not in kinds:
            raise ValueError(f"{argument}: {path!r} is {layer.kind}-attention, not {joined}")
        if layer not in chosen:
            chosen.append(layer)
    if not chosen:
        raise ValueError(f"{argument}: expected at least one module path, got an empty selection")
    return sorted(chosen, key=lambda layer: layer.index)


def index_tuple(value, argument: str) -> tuple[int, ...] | None:
    """None, or an index (int >= 0) or a non-empty list of them as a sorted tuple without
    repeats; anything else is a ValueError naming ``argument``."""
    if value is None:
        return None
    try:
        items = [value] if isinstance(value, int) else list(value)
    except TypeError:  # a float, an object: reported below, not as a TypeError from list()
        items = []
    if not items or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in items):
        raise ValueError(f"{argument}: expected None or a non-empty list of indices >= 0, got {value!r}")
    return tuple(sorted(set(items)))


__all__ = ["KINDS", "AttentionLayer", "CallLayout", "attention_layers", "layer_names"]
