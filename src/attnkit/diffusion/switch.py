"""``attnkit.diffusion.use``: run a diffusers model's attention on attnkit, and back.

Every selected attention module's ``forward`` is wrapped for the block: while it runs, a
``TorchFunctionMode`` hands its call of ``torch.nn.functional.scaled_dot_product_attention``
to attnkit, with the layer's mask, score mods, mechanism, heads and observers. The
processor itself (projections, QK norms, RoPE, output projection) is the model's own, so
both of diffusers' routings are covered without copying any of them: ``Attention``
processors call SDPA directly, and the attention dispatcher's native backend ends in the
same call. On exit, also after an exception, the modules' own ``forward`` comes back.

Interventions (perturbed-attention guidance, attend-and-excite, regulation, ...) plug in
like ``attnkit.steer`` does for transformers: a ``DiffusionEdit`` in ``EDITS[module]``
(the protocol is written in ``edits.py``); ``edit`` puts a registered one on by name.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..api import attention
from ..mechanisms import Mechanism, build_mechanism, get_mechanism
from ..mods import Mask, ScoreMod, as_mask, as_score, bias, causal
from .edits import EDITS, DiffusionEdit, StackedEdit, edit_type, edits_on  # noqa: F401  (re-exported)
from .layers import KINDS, AttentionLayer, CallLayout, attention_layers, call_layout, index_tuple, select_layers

Tensor = torch.Tensor

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def denoiser(model_or_pipeline) -> nn.Module:
    """The model to switch: ``model_or_pipeline`` itself when it is a module, else a
    pipeline's ``unet`` or ``transformer``."""
    if isinstance(model_or_pipeline, nn.Module):
        return model_or_pipeline
    for attr in ("unet", "transformer"):
        found = getattr(model_or_pipeline, attr, None)
        if isinstance(found, nn.Module):
            return found
    raise ValueError(
        f"model_or_pipeline: expected a diffusers model (torch.nn.Module) or a pipeline with a unet or transformer, "
        f"got {type(model_or_pipeline).__name__}"
    )


@dataclass
class DiffusionSwitch:
    """What ``use`` asked for; yielded by the context manager. ``layers`` are the
    selected attention layers; ``names`` maps the layer numbers observers see to module
    paths; ``step`` counts the denoiser's forward calls inside the block (0 first)."""

    model: nn.Module
    mechanism: str | Mechanism
    params: dict
    mask: Mask | None
    score: ScoreMod | None
    layers: list[AttentionLayer]
    heads: tuple[int, ...] | None
    observers: list | None
    plain: bool
    mechanisms: dict[int, Mechanism] = field(default_factory=dict)
    step: int = -1
    latent: tuple[int, int] | None = None
    text_len: int | None = None

    @property
    def names(self) -> dict[int, str]:
        return {layer.index: layer.name for layer in self.layers}

    def mechanism_for(self, layer: AttentionLayer, q: Tensor, k: Tensor, v: Tensor) -> Mechanism | None:
        if self.plain:
            return None
        if isinstance(self.mechanism, Mechanism):
            return self.mechanism
        if layer.index not in self.mechanisms:
            mech = build_mechanism(self.mechanism, self.params, q.shape[1], q.shape[-1], k.shape[1], v.shape[-1], None)
            self.mechanisms[layer.index] = mech.to(device=q.device, dtype=q.dtype)
        return self.mechanisms[layer.index]

    def attend(
        self,
        layer: AttentionLayer,
        layout: CallLayout,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ) -> Tensor:
        """One SDPA call of ``layer``, run by attnkit."""
        if dropout_p:
            raise ValueError(
                f"dropout: {layer.name} asked for attention dropout p={dropout_p}; attnkit has none, call model.eval()"
            )
        mask = causal() if is_causal else None
        swap = getattr(EDITS.get(layer.module), "inputs", None)
        if swap is not None:  # an edit that changes what attends (style injection's reference K, V)
            query, key, value = swap(layout, query, key, value)
        scores = [] if attn_mask is None else [_mask_as_bias(attn_mask, query, key, layer.name)]
        edit = EDITS.get(layer.module)
        if edit is not None:
            scores += list(edit.scores(layout, query, key))
        if self.observers:
            for o in self.observers:
                if hasattr(o, "note_call"):
                    o.note_call(layout)
        observe: dict[str, Any] = {"observers": self.observers, "layer": layer.index} if self.observers else {}
        scale = None if scale is None else float(scale)
        if self.heads is None:
            mine = scores + ([self.score] if self.score is not None else [])
            mech = self.mechanism_for(layer, query, key, value)
            out = attention(
                query, key, value, mask=_and(mask, self.mask), score=mine or None, scale=scale, mechanism=mech, **observe
            )
        else:
            out = self._heads(layer, query, key, value, mask, scores, scale, observe)
        if edit is not None:
            out = edit.output(layout, out)
        return out

    def _heads(self, layer, query, key, value, base, scores, scale, observe) -> Tensor:
        """The change on ``self.heads`` only; ``base`` is the call's own mask (or None)."""
        from ..hf.heads import HeadMask, HeadScore, merge_heads, split_heads

        assert self.heads is not None  # attend sends only head-restricted calls here
        num_heads = query.shape[1]
        if max(self.heads) >= num_heads:
            raise ValueError(f"heads: {list(self.heads)} names a head >= the {num_heads} heads of {layer.name}")
        selected = torch.zeros(num_heads, dtype=torch.bool, device=query.device)
        selected[list(self.heads)] = True
        if self.plain:
            gated = base if self.mask is None else _and(base, HeadMask(self.mask, selected))
            mine = scores + ([HeadScore(self.score, selected)] if self.score is not None else [])
            return attention(query, key, value, mask=gated, score=mine or None, scale=scale, **observe)
        idx, rest = selected.nonzero().view(-1), (~selected).nonzero().view(-1)
        q, k, v = split_heads(query, key, value, idx)
        mine = [_heads_of(s, idx) for s in scores] + ([self.score] if self.score is not None else [])
        changed = attention(
            q, k, v, mask=_and(base, self.mask), score=mine or None, scale=scale, mechanism=self.mechanism_for(layer, q, k, v)
        )
        parts = [(changed, idx)]
        if rest.numel():
            q, k, v = split_heads(query, key, value, rest)
            theirs = [_heads_of(s, rest) for s in scores]
            parts.append((attention(q, k, v, mask=base, score=theirs or None, scale=scale), rest))
        return merge_heads(parts, num_heads)


def _heads_of(score, idx: Tensor):
    """A dense bias restricted to some heads (other score mods are head-agnostic here)."""
    from ..mods.scores import DenseBias

    if isinstance(score, DenseBias) and score.tensor.shape[1] > 1:
        return bias(score.tensor[:, idx])
    return score


def _and(a, b):
    if a is None or b is None:
        return a if b is None else b
    return a & b


def _mask_as_bias(attn_mask: Tensor, query: Tensor, key: Tensor, name: str):
    """SDPA's ``attn_mask`` (bool: True = attend; float: added to the logits), as a
    dense bias of shape (B|1, H|1, Nq, Nk) with -inf where a bool mask hides a key."""
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.dim() != 4:
        raise ValueError(f"attention_mask: {name} passed a {attn_mask.dim()}-D mask; expected at most 4-D (B, H, Nq, Nk)")
    b, h = m.shape[0], m.shape[1]
    m = m.expand(b, h, query.shape[2], key.shape[2])
    if m.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=m.device)
        m = torch.where(m, zero, torch.full((), float("-inf"), dtype=query.dtype, device=m.device))
    elif not m.is_floating_point():
        raise ValueError(f"attention_mask: {name} passed a mask of dtype {attn_mask.dtype}; expected bool or float")
    return bias(m)


class _Route(TorchFunctionMode):
    """Inside one attention module's forward: its SDPA calls go to attnkit. Inside
    ``__torch_function__`` the mode is off, so attnkit's own kernels run untouched."""

    def __init__(self, switch: DiffusionSwitch, layer: AttentionLayer, layout: CallLayout):
        super().__init__()
        self.switch, self.layer, self.layout, self.calls = switch, layer, layout, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            bound = dict(zip(_SDPA_ARGS, args))
            bound.update(kwargs)
            return self.switch.attend(self.layer, self.layout, **bound)
        return func(*args, **kwargs)


def _wrap(switch: DiffusionSwitch, layer: AttentionLayer, forward):
    if getattr(forward, "_attnkit_routed", False):
        # A ``use`` inside another: the inner switch runs this layer for its block (a mode
        # pushed by the outer wrapper would otherwise sit on top and take the call).
        forward = forward.__wrapped__

    def routed(*args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        context = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
        image_len = hidden.shape[2] * hidden.shape[3] if hidden.dim() == 4 else hidden.shape[1]
        text_len = None if context is None else context.shape[1]
        layout = call_layout(layer, switch.step, image_len, text_len, switch.text_len, switch.latent)
        route = _Route(switch, layer, layout)
        with route:
            out = forward(*args, **kwargs)
        if route.calls == 0:
            processor = type(getattr(layer.module, "processor", None)).__name__
            raise ValueError(
                f"layers: {layer.name!r} computed attention without torch's scaled_dot_product_attention (processor "
                f"{processor}, or a non-native attention backend), so attnkit cannot run it; use the model's default "
                "processors (model.set_default_attn_processor()) and the native attention backend"
            )
        return out

    marked = cast(Any, routed)  # attributes set on a function: mypy knows only FunctionType's
    marked.__wrapped__ = forward
    marked._attnkit_routed = True
    return routed


def _observe_inputs(switch: DiffusionSwitch, model: nn.Module):
    """A pre-hook on the denoiser: counts steps and reads the latent grid and text length."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        signature = None

    def hook(module, args, kwargs):
        switch.step += 1
        named = dict(kwargs)
        if signature is not None:
            try:
                named = dict(signature.bind_partial(*args, **kwargs).arguments)
            except TypeError:
                pass
        sample = named.get("sample", named.get("hidden_states", args[0] if args else None))
        context = named.get("encoder_hidden_states")
        switch.text_len = context.shape[1] if isinstance(context, Tensor) and context.dim() == 3 else None
        switch.latent = None
        if isinstance(sample, Tensor) and sample.dim() == 4:
            switch.latent = (sample.shape[-2], sample.shape[-1])
        ids = named.get("img_ids")
        if isinstance(ids, Tensor) and ids.shape[-1] >= 3 and ids.numel():
            ids = ids.reshape(-1, ids.shape[-1])
            h, w = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
            if h * w == ids.shape[0]:
                switch.latent = (h, w)
        return None

    return model.register_forward_pre_hook(hook, with_kwargs=True)


@contextmanager
def use(
    model_or_pipeline,
    mechanism: str | Mechanism = "softmax",
    mask=None,
    score=None,
    layers: Iterable[str] | str | None = None,
    heads: Iterable[int] | None = None,
    observers=None,
    kind: str | None = None,
    **params,
):
    """Run a diffusers model's attention on attnkit inside the ``with`` block.

    Args:
        model_or_pipeline: a diffusers model (UNet2DConditionModel, DiT, PixArt, SD3,
            Flux, ...) or a pipeline (its ``unet`` or ``transformer`` is switched).
        mechanism: a registered mechanism name or a Mechanism instance; ``params`` build
            it (one instance per layer for a name).
        mask: an attnkit mask and-ed with the call's own.
        score: score mods applied after the model's own logits.
        layers: module paths of the attention layers to switch (``layer_names(model)``
            lists them), matched exactly; default: all (of ``kind``).
        heads: head indices to change (default: all); with softmax the change is gated
            per head inside one call.
        observers: attnkit meters; they see every call of the switched layers, tagged
            with the layer's number (``switch.names`` maps numbers to paths). Meters
            with ``note_call(layout)`` are told where image queries and text keys sit.
        kind: only layers of this kind: "self", "cross" or "joint".

    With nothing changed the outputs equal the model's own (attnkit's exact softmax).
    A ``use`` opened inside another takes over the layers it selects for its block.
    Yields the ``DiffusionSwitch``.
    """
    model = denoiser(model_or_pipeline)
    available = attention_layers(model)
    if not available:
        raise ValueError(f"model_or_pipeline: {type(model).__name__} has no diffusers attention modules to switch")
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS} or None, got {kind!r}")
    if layers is None and kind is not None and all(layer.kind != kind for layer in available):
        raise ValueError(f"kind: the model has no {kind} attention layers")
    selected = select_layers(model, layers, KINDS if kind is None else (kind,))
    plain = _plain(mechanism, params, selected[0])
    head_list = index_tuple(heads, "heads")
    if head_list is not None and not plain and observers:
        raise ValueError(
            "observers: with heads= and a mechanism other than softmax the selected heads run as a call of "
            "their own, so no observer could see the whole layer; observe without heads="
        )
    switch = DiffusionSwitch(
        model,
        mechanism,
        dict(params),
        None if mask is None else as_mask(mask, "mask"),
        None if score is None else as_score(score, "score"),
        selected,
        head_list,
        list(observers) if observers else None,
        plain,
    )
    saved = [(layer.module, layer.module.__dict__.get("forward")) for layer in selected]
    handles = []
    try:
        handles.append(_observe_inputs(switch, model))
        for layer in selected:
            layer.module.forward = _wrap(switch, layer, layer.module.forward)
        yield switch
    finally:
        for handle in handles:
            handle.remove()
        for module, previous in saved:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous


def _plain(mechanism, params, layer: AttentionLayer) -> bool:
    """Whether the mechanism is softmax; a named one is built once now, with the first
    selected layer's sizes, so a bad name or parameter fails at ``use``, not mid-step."""
    if isinstance(mechanism, Mechanism):
        return get_mechanism(mechanism, **params).name == "softmax"
    if not isinstance(mechanism, str):
        raise ValueError(f"mechanism: expected a mechanism name or a Mechanism, got {type(mechanism).__name__}")
    heads = int(getattr(layer.module, "heads", 1))
    head_dim = getattr(layer.module, "head_dim", None) or getattr(layer.module, "inner_dim", heads * 64) // heads
    return build_mechanism(mechanism, params, heads, int(head_dim), heads, int(head_dim), None).name == "softmax"


@contextmanager
def edit(model_or_pipeline, name: str, *, layers=None, kind: str | None = None, observers=None, **params):
    """The diffusion edit registered as ``name`` (``edits.register_edit``) on the chosen
    layers (module paths, exact; default every layer of ``kind``, or every layer) for
    the block, on top of any edit already there; yields the ``DiffusionSwitch``."""
    make = edit_type(name)
    with use(model_or_pipeline, layers=layers, kind=kind, observers=observers) as switch:
        with edits_on(switch.layers, lambda layer, previous: make(layer, previous, **params)):
            yield switch


__all__ = ["EDITS", "DiffusionSwitch", "denoiser", "edit", "use"]
