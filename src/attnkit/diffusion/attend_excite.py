"""Attend-and-Excite (Chefer et al. 2023, arXiv 2301.13826).

At the early denoising steps, the latents are moved along the gradient of

    L = max over target tokens s of (1 - max over positions of (G * A_s)),

where A_s is token s's cross-attention map (mean over the chosen layers and heads;
the paper's maps at 16 x 16 for Stable Diffusion), re-normalised over the prompt's
tokens with a softmax of 100 x the maps (the start token excluded), and G a 3 x 3
Gaussian smoothing: ``z_t <- z_t - alpha_t * dL/dz_t``. At a few steps the update is
repeated until L <= 1 - threshold (iterative refinement; the paper's thresholds are
0.05, 0.5 and 0.8 at steps 0, 10 and 20 of 50, with alpha_t = 20 * sqrt(linspace(1, 0.5))
and updates at the first 25 steps).

The maps come from ``record_maps``: the image-by-text block of the attention weights
from the q and k that the model's processors give to attnkit, differentiable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .gradmaps import denoise, record_maps
from .switch import denoiser

Tensor = torch.Tensor

#: the standard-Gaussian sigma of the authors' 3 x 3 kernel: their code writes
#: exp(-((x - mu) / (2 * 0.5))**2), which is exp(-x**2 / (2 * sigma**2)) for sigma = 0.5 * sqrt(2)
PAPER_SIGMA = 0.5 * math.sqrt(2.0)


def gaussian_smooth(maps: Tensor, sigma: float = PAPER_SIGMA, kernel_size: int = 3) -> Tensor:
    """Each (h, w) map of ``maps`` (..., h, w) convolved with a normalised
    ``kernel_size`` x ``kernel_size`` Gaussian (standard deviation ``sigma`` in grid
    cells), with reflected borders as in the paper's code."""
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size: expected an odd size >= 1, got {kernel_size}")
    if not sigma > 0:
        raise ValueError(f"sigma: expected > 0, got {sigma}")
    pad = kernel_size // 2
    h, w = maps.shape[-2:]
    if pad and (h <= pad or w <= pad):
        raise ValueError(
            f"maps: a {kernel_size}x{kernel_size} smoothing with reflected borders needs a grid larger than "
            f"{pad} on each side, got {h}x{w}"
        )
    x = torch.arange(kernel_size, dtype=maps.dtype, device=maps.device) - pad
    g = torch.exp(-(x**2) / (2 * sigma**2))
    kernel = (g[:, None] * g[None, :]) / (g.sum() ** 2)
    flat = maps.reshape(-1, 1, h, w)
    if pad:
        flat = F.pad(flat, (pad, pad, pad, pad), mode="reflect")
    return F.conv2d(flat, kernel.view(1, 1, kernel_size, kernel_size)).reshape(maps.shape)


def _token_list(tokens, count: int, name: str = "tokens") -> list[int]:
    items = [tokens] if isinstance(tokens, int) else list(tokens)
    if not items or any(not isinstance(t, int) or isinstance(t, bool) for t in items):
        raise ValueError(f"{name}: expected a non-empty list of text token indices, got {tokens!r}")
    bad = [t for t in items if not 0 <= t < count]
    if bad:
        raise ValueError(f"{name}: {bad} outside the {count} text tokens")
    return items


def token_maps_for_loss(maps: Tensor, tokens, span=(1, None), temperature: float | None = 100.0) -> Tensor:
    """(B, K, h, w): the maps of ``tokens`` after Attend-and-Excite's re-normalisation:
    a softmax over the tokens of ``span`` (start, end; default: all but the first, the
    start token) of ``temperature`` x the maps; ``temperature=None`` keeps the maps."""
    if maps.dim() != 4:
        raise ValueError(f"maps: expected (B, T, h, w), got shape {tuple(maps.shape)}")
    count = maps.shape[1]
    if temperature is None:
        return maps[:, _token_list(tokens, count)]
    lo, hi = span
    hi = count if hi is None else hi
    if not 0 <= lo < hi <= count:
        raise ValueError(f"span: expected 0 <= start < end <= {count} text tokens, got {span!r}")
    idx = _token_list(tokens, count)
    outside = [t for t in idx if not lo <= t < hi]
    if outside:
        raise ValueError(f"tokens: {outside} outside the span {(lo, hi)} that the maps are re-normalised over")
    renorm = torch.softmax(maps[:, lo:hi] * temperature, dim=1)
    return renorm[:, [t - lo for t in idx]]


def excite_loss(
    maps: Tensor, tokens, *, span=(1, None), temperature: float | None = 100.0, sigma: float = PAPER_SIGMA, kernel_size: int = 3
) -> Tensor:
    """(B,) Attend-and-Excite's loss of each batch row, from maps (B, T, h, w):
    max over ``tokens`` of max(0, 1 - max over positions of the smoothed map)."""
    chosen = token_maps_for_loss(maps, tokens, span, temperature)
    peak = gaussian_smooth(chosen, sigma, kernel_size).amax(dim=(-2, -1))  # (B, K)
    return (1.0 - peak).clamp_min(0.0).amax(dim=1)


@dataclass
class ExciteOptions:
    """Where the maps come from and how the loss reads them (see ``excite_loss``)."""

    layers: object = None
    heads: object = None
    #: only calls at this latent grid count (the paper: SD's 16 x 16 layers); None: all
    grid: tuple[int, int] | None = None
    size: tuple[int, int] | None = None
    span: tuple = (1, None)
    temperature: float | None = 100.0
    sigma: float = PAPER_SIGMA
    kernel_size: int = 3
    model_kwargs: dict = field(default_factory=dict)
    #: applied to the latents inside the graph before the denoiser (a scheduler's
    #: ``scale_model_input``), so the gradient is w.r.t. the unscaled latents
    scale_input: Callable[[Tensor], Tensor] | None = None

    def loss(self, model, latents, t, prompt_embeds, tokens) -> Tensor:
        with record_maps(model, layers=self.layers, heads=self.heads, grid=self.grid) as rec:
            x = latents if self.scale_input is None else self.scale_input(latents)
            denoise(model, x, t, prompt_embeds, self.model_kwargs)
            maps = rec.maps(self.size)
        return excite_loss(
            maps, tokens, span=self.span, temperature=self.temperature, sigma=self.sigma, kernel_size=self.kernel_size
        )


def excite_options(options: dict) -> ExciteOptions:
    """``ExciteOptions`` from keyword arguments; an unknown name is a ValueError naming it."""
    known = set(ExciteOptions.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"options: unknown {unknown}; expected some of {sorted(known)}")
    return ExciteOptions(**options)


def attend_and_excite_loss(model, latents: Tensor, t, prompt_embeds: Tensor, tokens, **options) -> Tensor:
    """(B,) Attend-and-Excite's loss of ``latents`` at timestep ``t``, differentiable
    w.r.t. the latents. ``options``: those of ``ExciteOptions`` (layers, heads, grid,
    size, span, temperature, sigma, kernel_size, model_kwargs, scale_input)."""
    model = denoiser(model)
    return excite_options(options).loss(model, latents, t, prompt_embeds, tokens)


@dataclass
class ExciteStep:
    """What ``attend_and_excite_step`` did: the new ``latents``; ``losses``: the (B,)
    loss measured before each update (the last one, when no row was above its target,
    stopped the loop); ``updates``: how many gradient steps were taken. The loss after
    the last update is not measured (one denoiser call less); ``attend_and_excite_loss``
    gives it."""

    latents: Tensor
    losses: list[Tensor]
    updates: int


def attend_and_excite_step(
    model,
    latents: Tensor,
    t,
    prompt_embeds: Tensor,
    tokens,
    *,
    step_size: float = 20.0,
    threshold: float | None = None,
    max_iterations: int = 1,
    **options,
) -> ExciteStep:
    """Gradient steps ``z <- z - step_size * dL/dz`` on the latents while the loss is
    above its target, at most ``max_iterations`` of them.

    Args:
        model: the denoiser (a diffusers model) or a pipeline.
        latents: (B, C, H, W) (or a transformer's packed latents), the input of the call.
        t: the timestep passed to the denoiser.
        prompt_embeds: (B, T, D) the conditional text embeddings.
        tokens: indices of the target (subject) tokens among the T.
        step_size: alpha_t.
        threshold: the target is L <= 1 - threshold (iterative refinement); None: L <= 0,
            i.e. one plain update whenever the loss is positive.
        max_iterations: the most updates (the paper: 1 per step, at most 20 when refining).
        options: see ``attend_and_excite_loss``.

    Rows of the batch already at their target are left exactly as they were.
    """
    if not isinstance(latents, Tensor) or not latents.is_floating_point():
        raise ValueError("latents: expected a floating-point tensor")
    if prompt_embeds.shape[0] != latents.shape[0]:
        raise ValueError(
            f"prompt_embeds: batch {prompt_embeds.shape[0]} differs from the latents' batch {latents.shape[0]} "
            "(pass the conditional embeddings only)"
        )
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold: expected a value in [0, 1] or None, got {threshold}")
    if max_iterations < 1:
        raise ValueError(f"max_iterations: expected >= 1, got {max_iterations}")
    model = denoiser(model)
    opts = excite_options(options)
    target = 0.0 if threshold is None else 1.0 - threshold
    z = latents.detach()
    losses, updates = [], 0
    for _ in range(max_iterations):
        with torch.enable_grad():
            current = z.clone().requires_grad_(True)
            loss = opts.loss(model, current, t, prompt_embeds, tokens)
            losses.append(loss.detach())
            active = loss.detach() > target
            if not bool(active.any()):
                break
            # the rows' losses depend on their own latents only, so one backward of the sum
            # gives each row its own gradient
            (grad,) = torch.autograd.grad(loss.sum(), current)
        keep = active.view(-1, *([1] * (z.dim() - 1))).to(z.dtype)
        z = (z - step_size * grad * keep).detach()
        updates += 1
    return ExciteStep(z, losses, updates)


class AttendAndExcite:
    """Attend-and-Excite for a diffusers pipeline, as ``callback_on_step_end``.

    After step i the callback applies the paper's procedure to the latents about to be
    denoised at step i + 1 (refinement at the steps in ``thresholds``, then one update,
    for steps < ``steps``), with alpha_i = ``scale_factor`` * sqrt(linspace(*scale_range)[i]).
    The first step's latents come before any callback: refine them with ``prepare``::

        aae = AttendAndExcite(tokens=[2, 5])
        latents = aae.prepare(pipe, latents, prompt_embeds, num_inference_steps=50)
        pipe(prompt_embeds=..., latents=latents, num_inference_steps=50,
             callback_on_step_end=aae, callback_on_step_end_tensor_inputs=aae.tensor_inputs)

    For pipelines whose denoiser takes (latents, t, encoder_hidden_states=...) plus the
    fixed ``model_kwargs``; with classifier-free guidance the conditional half of
    ``prompt_embeds`` is used, as the paper does.
    """

    tensor_inputs = ["latents", "prompt_embeds"]

    def __init__(
        self,
        tokens,
        *,
        steps: int = 25,
        scale_factor: float = 20.0,
        scale_range=(1.0, 0.5),
        thresholds: dict | None = None,
        max_refinement: int = 20,
        **options,
    ):
        self.tokens = tokens
        self.steps = steps
        self.scale_factor = scale_factor
        self.scale_range = scale_range
        self.thresholds = {0: 0.05, 10: 0.5, 20: 0.8} if thresholds is None else dict(thresholds)
        self.max_refinement = max_refinement
        self.options = options
        excite_options(options)  # bad option names fail here, not mid-sampling
        self.history: list[tuple[int, Tensor]] = []

    def step_size(self, i: int, num_steps: int) -> float:
        lo, hi = self.scale_range
        frac = lo + (hi - lo) * (i / (num_steps - 1) if num_steps > 1 else 0.0)
        return self.scale_factor * math.sqrt(frac)

    def refine(self, model, i: int, num_steps: int, t, latents: Tensor, prompt_embeds: Tensor, scale_input=None) -> Tensor:
        """The paper's procedure at step i on latents about to be denoised at ``t``."""
        if i >= self.steps:
            return latents
        alpha = self.step_size(i, num_steps)
        options = {**self.options, "scale_input": scale_input}
        z = latents
        if i in self.thresholds:
            r = attend_and_excite_step(
                model,
                z,
                t,
                prompt_embeds,
                self.tokens,
                step_size=alpha,
                threshold=self.thresholds[i],
                max_iterations=self.max_refinement,
                **options,
            )
            z = r.latents
        r = attend_and_excite_step(model, z, t, prompt_embeds, self.tokens, step_size=alpha, **options)
        self.history.append((i, r.losses[0]))
        return r.latents

    def _conditional(self, pipe, prompt_embeds: Tensor, batch: int) -> Tensor:
        if getattr(pipe, "do_classifier_free_guidance", False) and prompt_embeds.shape[0] == 2 * batch:
            return prompt_embeds[batch:]
        return prompt_embeds

    def prepare(self, pipe, latents: Tensor, prompt_embeds: Tensor, num_inference_steps: int) -> Tensor:
        """The initial latents (as passed to ``pipe(latents=...)``) after step 0's
        procedure, at the scheduler's first timestep."""
        scheduler = pipe.scheduler
        scheduler.set_timesteps(num_inference_steps, device=latents.device)
        sigma = float(getattr(scheduler, "init_noise_sigma", 1.0))
        t0 = scheduler.timesteps[0]
        z = self.refine(
            pipe, 0, len(scheduler.timesteps), t0, latents * sigma, prompt_embeds, lambda z: scheduler.scale_model_input(z, t0)
        )
        return z / sigma

    def __call__(self, pipe, step: int, timestep, callback_kwargs: dict) -> dict:
        timesteps = pipe.scheduler.timesteps
        nxt = step + 1
        if nxt >= len(timesteps) or nxt >= self.steps:
            return callback_kwargs
        latents = callback_kwargs["latents"]
        cond = self._conditional(pipe, callback_kwargs["prompt_embeds"], latents.shape[0])
        t = timesteps[nxt]
        z = self.refine(pipe, nxt, len(timesteps), t, latents, cond, lambda z: pipe.scheduler.scale_model_input(z, t))
        return {**callback_kwargs, "latents": z.to(latents.dtype)}


__all__ = [
    "AttendAndExcite",
    "ExciteStep",
    "attend_and_excite_loss",
    "attend_and_excite_step",
    "excite_loss",
    "gaussian_smooth",
    "token_maps_for_loss",
]
