"""``attnkit.diffusion.pag``: perturbed-attention guidance for any diffusers pipeline.

PAG (Ahn et al. 2024, arXiv 2403.17377) guides each denoising step away from a weak
model whose chosen self-attention maps are the identity (``perturb``):

    eps = eps_u + g (eps_c - eps_u) + s (eps_c - eps_ptb)

with ``g`` the classifier-free guidance scale (the pipeline's own) and ``s`` the PAG
scale; without CFG (g = 1, or a pipeline that runs no unconditional branch)
``eps = eps_c + s (eps_c - eps_ptb)``.

The wrapper sits on the denoiser, not in a pipeline: each call runs the conditional rows
a second time as extra batch entries with the perturbation on those entries only, and
returns the ordinary prediction plus ``delta = s (eps_c - eps_ptb)`` on every row. A
pipeline that then forms ``eps_u + g (eps_c - eps_u)`` from [unconditional;
conditional] halves gets exactly the formula above whatever ``g`` is, so no pipeline
code is copied or replaced, and SoftPAG (``strength`` < 1, per-head selections) comes
for free.
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager

import torch

from .perturb import TEXT_CHOICES, perturb
from .switch import denoiser

Tensor = torch.Tensor

#: denoiser arguments that are tensors without a batch dimension (Flux's position ids)
UNBATCHED = frozenset({"img_ids", "txt_ids"})


@contextmanager
def pag(
    pipeline_or_model,
    layers,
    scale: float = 3.0,
    *,
    strength: float = 1.0,
    text: str = "identity",
    cfg: bool | None = None,
    conditional: str = "second",
):
    """Perturbed-attention guidance (and SoftPAG) on ``pipeline_or_model`` inside ``with``.

    Args:
        pipeline_or_model: a diffusers pipeline (its ``unet``/``transformer`` is
            wrapped) or a denoiser model.
        layers: the perturbed layers and heads, as for ``perturb`` (exact module paths,
            ``(path, head)`` pairs, or a dict path -> u).
        scale: the PAG scale ``s`` (0 leaves the prediction unchanged).
        strength: SoftPAG's u in [0, 1] (1: the identity map of PAG).
        text: joint attention: "identity" (text queries also return their values) or
            "keep" (only image queries perturbed).
        cfg: whether each denoiser call holds [unconditional; conditional] halves, as
            diffusers batches classifier-free guidance; None reads the pipeline's
            ``do_classifier_free_guidance`` at every call (a bare model, or a pipeline
            without that property such as PixArt's or DiT's, needs it said).
        conditional: which half holds the conditional rows with ``cfg``: "second"
            (diffusers' usual [unconditional; conditional]) or "first" (DiTPipeline's
            [conditional; unconditional]).

    A pipeline that runs its unconditional branch as a separate denoiser call (Flux's
    ``true_cfg_scale``) is outside the formula: with ``cfg=False`` each call is guided
    on its own rows.

    Yields the ``PerturbState``. The denoiser's ``forward`` and the attention layers
    come back on exit, also after an exception.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number (the PAG scale s), got {scale!r}")
    if cfg is not None and not isinstance(cfg, bool):
        raise ValueError(f"cfg: expected True, False or None, got {cfg!r}")
    if text not in TEXT_CHOICES:
        raise ValueError(f"text: expected one of {TEXT_CHOICES}, got {text!r}")
    if conditional not in ("first", "second"):
        raise ValueError(
            f"conditional: expected 'first' or 'second' (the half holding the conditional rows), got {conditional!r}"
        )
    model = denoiser(pipeline_or_model)
    # on the class: the pipelines' property reads state that exists only inside __call__
    if cfg is None and not hasattr(type(pipeline_or_model), "do_classifier_free_guidance"):
        raise ValueError(
            f"cfg: {type(pipeline_or_model).__name__} does not say whether it batches classifier-free "
            "guidance; pass cfg=True ([unconditional; conditional] halves) or cfg=False"
        )
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        signature = None
    own = model.__dict__.get("forward")
    forward = model.forward
    with perturb(model, layers, strength=strength, text=text) as state:

        def guided(*args, **kwargs):
            halves = cfg if cfg is not None else bool(pipeline_or_model.do_classifier_free_guidance)
            named = _named(signature, args, kwargs)
            batch = _batch_size(named)
            if halves and batch % 2:
                raise ValueError(f"cfg: a denoiser call of {batch} rows cannot hold [unconditional; conditional] halves")
            if not halves:
                cond = torch.arange(batch)
            else:
                cond = torch.arange(batch // 2, batch) if conditional == "second" else torch.arange(batch // 2)
            extended = {k: _extend(k, v, batch, cond) for k, v in named.items()}
            rows = torch.zeros(batch + len(cond), dtype=torch.bool)
            rows[batch:] = True
            state.rows = rows
            try:
                out = forward(**extended)
            finally:
                state.rows = None
            sample = _sample(out)
            if sample.shape[0] != len(rows):
                raise ValueError(
                    f"pipeline_or_model: the denoiser returned {sample.shape[0]} rows for a call of {len(rows)}; "
                    "pag needs one prediction per batch row"
                )
            eps, eps_ptb = sample[:batch], sample[batch:]
            delta = float(scale) * (eps[cond.to(eps.device)] - eps_ptb)
            guided_eps = eps + (torch.cat([delta, delta]) if halves else delta)
            return _with_sample(out, guided_eps)

        model.forward = guided
        try:
            yield state
        finally:
            if own is None:
                model.__dict__.pop("forward", None)
            else:
                model.forward = own


def _named(signature, args, kwargs) -> dict:
    if signature is None:
        if args:
            raise ValueError("pipeline_or_model: cannot read the denoiser's signature to batch positional arguments")
        return dict(kwargs)
    bound = signature.bind(*args, **kwargs)
    named = dict(bound.arguments)
    for name, param in signature.parameters.items():  # **kwargs of the forward travel as such
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in named:
            named.update(named.pop(name))
        elif param.kind is inspect.Parameter.VAR_POSITIONAL and name in named:
            raise ValueError("pipeline_or_model: the denoiser takes *args; pag cannot tell which carry the batch")
    return named


def _batch_size(named: dict) -> int:
    for key in ("sample", "hidden_states", "x"):
        value = named.get(key)
        if isinstance(value, Tensor) and value.dim() >= 2:
            return value.shape[0]
    first = next((v for v in named.values() if isinstance(v, Tensor) and v.dim() >= 2), None)
    if first is None:
        raise ValueError("pipeline_or_model: found no batched tensor (sample / hidden_states) in the denoiser call")
    return first.shape[0]


def _extend(name: str, value, batch: int, cond: Tensor):
    """``value`` with its conditional rows appended again (the perturbed entries)."""
    if isinstance(value, dict):
        return {k: _extend(k, v, batch, cond) for k, v in value.items()}
    if isinstance(value, (tuple, list)) and any(isinstance(v, Tensor) for v in value):  # e.g. ControlNet residuals
        return type(value)(_extend(name, v, batch, cond) for v in value)
    if isinstance(value, Tensor) and name not in UNBATCHED and value.dim() >= 1 and value.shape[0] == batch:
        return torch.cat([value, value[cond.to(value.device)]])
    return value


def _sample(out) -> Tensor:
    sample = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", None)
    if not isinstance(sample, Tensor):
        raise ValueError(
            f"pipeline_or_model: the denoiser returned {type(out).__name__}; expected a tuple or an output with .sample"
        )
    return sample


def _with_sample(out, sample: Tensor):
    if isinstance(out, (tuple, list)):
        return type(out)([sample, *out[1:]])
    out.sample = sample
    return out


__all__ = ["pag"]
