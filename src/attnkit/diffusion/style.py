"""Style injection: a style reference's keys and values in chosen self-attention layers.

StyleID (Chung et al. 2024, arXiv 2312.09008) transfers a style without training: in the
decoder's self-attention layers, while the stylised image is denoised, the keys and values
are those of the style image at the same timestep, the queries are blended with the
content image's ("query preservation") and the logits are sharpened by a temperature:

    q~ = gamma * q_content + (1 - gamma) * q_current
    out = softmax(T * q~ K_style^T * scale) V_style

Both references are recorded first, each by a pass of the model over it (the paper uses
the DDIM inversion of each image; any pass at the same timesteps works), and injected in
a third pass. Everything runs through ``attnkit.diffusion.use`` and its ``EDITS`` hook, so
the projections, QK norms and output projections stay the model's own, and every module
is restored on exit, also after an exception.

    style = StyleInjection(gamma=0.75, temperature=1.5)
    with style.record(unet, "style"):
        ...  # the style image's pass
    with style.record(unet, "content"):
        ...  # the content image's pass
    with style.inject(unet):
        ...  # the stylised pass, started e.g. from adain(content_noise, style_noise)
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from contextlib import contextmanager

import torch

from ..mods import temperature as temperature_mod
from .edits import DiffusionEdit, edits_on
from .layers import attention_layers
from .switch import denoiser, use

Tensor = torch.Tensor
ROLES = ("style", "content")


def adain(content: Tensor, style: Tensor, eps: float = 1e-5) -> Tensor:
    """Adaptive instance normalisation of ``content`` to ``style``'s channel statistics
    (Huang & Belongie 2017, arXiv 1703.06868), StyleID's initial latent:
    sigma(style) * (content - mu(content)) / sigma(content) + mu(style), with mean and
    standard deviation per (batch row, channel) over the spatial dimensions.
    ``content`` and ``style``: (B, C, H, W); the style's B is 1 or the content's."""
    if not isinstance(content, Tensor) or content.dim() != 4:
        raise ValueError(f"content: expected a (B, C, H, W) tensor, got {_shape(content)}")
    if (
        not isinstance(style, Tensor)
        or style.dim() != 4
        or style.shape[1] != content.shape[1]
        or style.shape[0] not in (1, content.shape[0])
    ):
        raise ValueError(f"style: expected a (1 or {content.shape[0]}, {content.shape[1]}, H, W) tensor, got {_shape(style)}")
    mu_c, sd_c = content.mean((2, 3), keepdim=True), content.std((2, 3), keepdim=True, unbiased=False)
    mu_s, sd_s = style.mean((2, 3), keepdim=True), style.std((2, 3), keepdim=True, unbiased=False)
    return sd_s * (content - mu_c) / (sd_c + eps) + mu_s


def _shape(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__


class _Clock:
    """The denoiser's current timestep, read by a forward pre-hook: references and the
    stylised pass are matched by timestep, not by call count, so a reference recorded by
    DDIM inversion (timesteps ascending) serves sampling (descending)."""

    def __init__(self, model):
        self.t: float | tuple | None = None
        try:
            signature = inspect.signature(model.forward)
        except (TypeError, ValueError):
            signature = None
        self.signature = signature

    def hook(self, module, args, kwargs):
        named = dict(kwargs)
        if self.signature is not None:
            try:
                named = dict(self.signature.bind_partial(*args, **kwargs).arguments)
            except TypeError:
                pass
        t = named.get("timestep", named.get("timesteps"))
        if t is None:
            raise ValueError(
                f"timestep: {type(module).__name__} was called without a timestep; style injection matches "
                "references to the stylised pass by timestep"
            )
        t = torch.as_tensor(t).detach().reshape(-1)
        if t.numel() == 0:
            raise ValueError("timestep: got an empty timestep tensor")
        # one value when the batch shares it (so a batch-1 reference serves a guided batch),
        # else the tuple of every row's
        values = [round(float(x), 6) for x in t.tolist()]
        self.t = values[0] if len(set(values)) == 1 else tuple(values)
        return None


class _Recorder(DiffusionEdit):
    def __init__(self, owner: StyleInjection, roles: tuple[str, ...], clock: _Clock, previous=None):
        super().__init__(previous)
        self.owner, self.roles, self.clock = owner, roles, clock

    def inputs(self, layout, query, key, value):
        query, key, value = super().inputs(layout, query, key, value)
        at = (self.clock.t, layout.name)
        if "style" in self.roles:
            self.owner.style[at] = (key.detach().clone(), value.detach().clone())
        if "content" in self.roles:
            self.owner.content[at] = query.detach().clone()
        return query, key, value


class _Injector(DiffusionEdit):
    def __init__(self, owner: StyleInjection, clock: _Clock, previous=None):
        super().__init__(previous)
        self.owner, self.clock = owner, clock
        t = owner.temperature
        # T * logits; T = 1 adds no score mod, so the call is the model's own
        self.mods = [] if t == 1.0 else [temperature_mod(1.0 / t)]

    def inputs(self, layout, query, key, value):
        query, key, value = super().inputs(layout, query, key, value)
        at = (self.clock.t, layout.name)
        if at not in self.owner.style:
            known = sorted({t for t, name in self.owner.style if name == layout.name}, key=str)
            raise ValueError(
                f"style: no reference keys and values recorded for {layout.name} at timestep {self.clock.t}; "
                f"record the style reference's pass at the same timesteps (recorded: {known[:8]})"
            )
        k_ref, v_ref = (_rows(x, query, "style", layout.name) for x in self.owner.style[at])
        if k_ref.shape[1] != key.shape[1] or k_ref.shape[3] != key.shape[3] or v_ref.shape[3] != value.shape[3]:
            raise ValueError(
                f"style: the reference's keys {tuple(k_ref.shape)} / values {tuple(v_ref.shape)} at {layout.name} "
                f"do not fit the call's {tuple(key.shape)} / {tuple(value.shape)} (heads and head sizes must match)"
            )
        gamma = self.owner.gamma
        if gamma != 0.0:
            if at not in self.owner.content:
                raise ValueError(
                    f"content: no content queries recorded for {layout.name} at timestep {self.clock.t}; record "
                    "the content's pass with record(model, 'content'), or use gamma=0"
                )
            q_content = _rows(self.owner.content[at], query, "content", layout.name)
            if q_content.shape != query.shape:
                raise ValueError(
                    f"content: the recorded queries {tuple(q_content.shape)} at {layout.name} do not match the "
                    f"call's {tuple(query.shape)}: the content must have the stylised image's size"
                )
            query = q_content if gamma == 1.0 else gamma * q_content + (1.0 - gamma) * query
        return query, k_ref, v_ref

    def scores(self, layout, query, key):
        return super().scores(layout, query, key) + list(self.mods)


def _rows(x: Tensor, like: Tensor, role: str, name: str) -> Tensor:
    """A recorded (B', H, N, D) tensor for a call of batch B: as is when B' = B, the one
    row for every row when B' = 1 (one reference for a guided batch), else an error."""
    x = x.to(device=like.device, dtype=like.dtype)
    if x.shape[0] == like.shape[0]:
        return x
    if x.shape[0] == 1:
        return x.expand(like.shape[0], *x.shape[1:])
    raise ValueError(
        f"{role}: recorded with batch {x.shape[0]} at {name}, but the call has batch {like.shape[0]}; "
        "record with batch 1 (shared by every row) or with the same batch"
    )


class StyleInjection:
    """StyleID's attention-level style transfer (arXiv 2312.09008).

    Args:
        layers: module paths of the self-attention layers to inject into (exact; see
            ``layer_names(model, "self")``). Default: every self-attention layer of a
            UNet's decoder (``up_blocks``), the layers the paper injects into.
        gamma: query preservation in [0, 1]: 1 keeps the content's queries, 0 the
            stylised pass's own (the paper uses 0.75).
        temperature: T > 0 multiplying the logits (the paper uses 1.5: the attention to
            the style's keys is sharpened, which the changed key statistics flatten).

    ``style`` and ``content`` hold what was recorded, keyed by (timestep, layer path):
    (keys, values) and queries, as (B, H, N, D) tensors after the model's projections
    (and QK norms). A reference recorded with batch 1 serves every row of a batch (a
    guided batch's unconditional and conditional rows alike). Memory: two (B, H, N, D)
    tensors per layer and timestep for the style, one for the content.
    """

    def __init__(self, layers: Iterable[str] | str | None = None, gamma: float = 0.75, temperature: float = 1.5):
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= float(gamma) <= 1.0:
            raise ValueError(f"gamma: expected a number in [0, 1], got {gamma!r}")
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature)
            or temperature <= 0
        ):
            raise ValueError(f"temperature: expected a finite number > 0, got {temperature!r}")
        self.layers = [layers] if isinstance(layers, str) else (None if layers is None else list(layers))
        self.gamma, self.temperature = float(gamma), float(temperature)
        self.style: dict[tuple, tuple[Tensor, Tensor]] = {}
        self.content: dict[tuple, Tensor] = {}

    def layer_paths(self, model_or_pipeline) -> list[str]:
        """The layers injected into, for this model."""
        if self.layers is not None:
            return list(self.layers)
        model = denoiser(model_or_pipeline)
        found = [layer.name for layer in attention_layers(model) if layer.kind == "self" and layer.name.startswith("up_blocks.")]
        if not found:
            raise ValueError(
                f"layers: {type(model).__name__} has no decoder (up_blocks) self-attention; name the layers to "
                "inject into (attnkit.diffusion.layer_names(model, 'self'))"
            )
        return found

    @contextmanager
    def record(self, model_or_pipeline, *roles: str):
        """Inside the block, every call of the chosen layers records the reference's
        features by timestep: ``"style"`` its keys and values, ``"content"`` its queries
        (both roles at once for one image serving as both). The model runs unchanged."""
        if not roles or any(r not in ROLES for r in roles):
            raise ValueError(f"roles: expected one or more of {ROLES}, got {roles!r}")
        with self._edited(model_or_pipeline, lambda clock, previous: _Recorder(self, tuple(roles), clock, previous)) as switch:
            yield switch

    @contextmanager
    def inject(self, model_or_pipeline, observers=None):
        """Inside the block, the chosen layers attend with the recorded style keys and
        values, blended queries and the temperature. ``observers`` (attnkit meters) see
        the injected attention."""
        if not self.style:
            raise ValueError("style: nothing recorded; run the style reference inside record(model, 'style') first")
        with self._edited(model_or_pipeline, lambda clock, previous: _Injector(self, clock, previous), observers) as switch:
            yield switch

    @contextmanager
    def _edited(self, model_or_pipeline, make_edit, observers=None):
        model = denoiser(model_or_pipeline)
        clock = _Clock(model)
        with use(model, layers=self.layer_paths(model), kind="self", observers=observers) as switch:
            handle = model.register_forward_pre_hook(clock.hook, with_kwargs=True)
            try:
                with edits_on(switch.layers, lambda layer, previous: make_edit(clock, previous)):
                    yield switch
            finally:
                handle.remove()


__all__ = ["StyleInjection", "adain"]
