"""InitNO: initial noise optimisation (Guo et al. 2024, arXiv 2404.04650).

Not every initial noise gives an image faithful to the prompt; InitNO scores the noise
by the denoiser's attention at the first step and moves it towards the valid region:

- cross-attention response score: max over target tokens of (1 - the peak of the
  token's smoothed, re-normalised cross-attention map) — Attend-and-Excite's loss;
- self-attention conflict score: for every pair of target tokens, the overlap
  sum(min(S_i, S_j)) / sum(S_i + S_j) of the self-attention maps S_i of the image
  position where token i's cross-attention map peaks (smoothed), averaged over pairs.
  As in the authors' code it counts only once the response score is <= 0.5 (``self_gate``).

The noise is optimised as z = z_0 * exp(log_var / 2) + mu with Adam on (mu, log_var);
after each step on the scores, Adam steps on KL(N(mu, exp(log_var)) || N(0, 1)) (mean
per element) run until it is <= ``kl_limit``, which keeps z a sample of a distribution
close to the standard Gaussian the sampler expects. It stops when both scores are
under their thresholds (0.2 and 0.3 in the paper).

Simplifications, stated: the authors' extra "clean cross-attention" term (the maximum
of a token's map outside its Otsu foreground) is not included; their restarts from
fresh noise when optimisation fails are left to the caller (run ``initno`` on several
seeds and keep the lowest ``joint`` score); the maps are the mean over the chosen
layers resized to one grid unless ``grid`` picks one (the paper uses Stable
Diffusion's 16 x 16 layers only: ``grid=(16, 16)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attend_excite import PAPER_SIGMA, gaussian_smooth, token_maps_for_loss
from .gradmaps import denoise, record_maps
from .switch import denoiser

Tensor = torch.Tensor


@dataclass
class InitNOScores:
    """(B,) scores of each batch row: ``cross`` (response), ``self`` (conflict, 0 while
    gated), ``joint`` = cross + self; ``peaks`` (B, K) flat positions of the tokens' peaks."""

    cross: Tensor
    self: Tensor
    joint: Tensor
    peaks: Tensor

    def detach(self) -> InitNOScores:
        return InitNOScores(self.cross.detach(), self.self.detach(), self.joint.detach(), self.peaks)


def conflict_score(self_maps: Tensor) -> Tensor:
    """(B,) mean over pairs i < j of sum(min(S_i, S_j)) / (sum(S_i + S_j) + 1e-6), from
    self-attention maps (B, K, h, w); 0 with fewer than two tokens."""
    k = self_maps.shape[1]
    flat = self_maps.flatten(2)
    total, pairs = flat.new_zeros(flat.shape[0]), 0
    for i in range(k):
        for j in range(i + 1, k):
            overlap = torch.minimum(flat[:, i], flat[:, j]).sum(-1)
            total = total + overlap / ((flat[:, i] + flat[:, j]).sum(-1) + 1e-6)
            pairs += 1
    return total / pairs if pairs else total


def initno_scores(
    model,
    latents: Tensor,
    t,
    prompt_embeds: Tensor,
    tokens,
    *,
    layers=None,
    self_layers=None,
    heads=None,
    grid: tuple[int, int] | None = None,
    size: tuple[int, int] | None = None,
    span=(1, None),
    temperature: float | None = 100.0,
    sigma: float = PAPER_SIGMA,
    kernel_size: int = 3,
    self_gate: float = 0.5,
    model_kwargs: dict | None = None,
) -> InitNOScores:
    """InitNO's scores of ``latents`` at timestep ``t``, differentiable w.r.t. them.

    ``layers``: cross- or joint-attention layers of the maps (default: all);
    ``self_layers``: self- or joint-attention layers of the conflict score (default:
    all; only those at the maps' grid count). ``grid``: only calls at this latent grid
    make the maps (the paper: SD's 16 x 16 layers). Other options as in
    ``attend_and_excite_loss``.
    """
    model = denoiser(model)
    with record_maps(model, layers=layers, heads=heads, self_layers=self_layers, grid=grid) as rec:
        denoise(model, latents, t, prompt_embeds, model_kwargs)
        maps = rec.maps(size)
        at = tuple(maps.shape[-2:])
        chosen = gaussian_smooth(token_maps_for_loss(maps, tokens, span, temperature), sigma, kernel_size)  # (B, K, h, w)
        peak, where = chosen.flatten(2).max(dim=-1)  # (B, K)
        cross = (1.0 - peak).clamp_min(0.0).amax(dim=1)
        if chosen.shape[1] > 1:
            conflict = conflict_score(gaussian_smooth(rec.self_maps(where, at), sigma, kernel_size))
        else:
            conflict = cross.new_zeros(cross.shape)
    conflict = conflict * (cross.detach() <= self_gate).to(conflict.dtype)
    return InitNOScores(cross, conflict, cross + conflict, where)


def gaussian_kl(mu: Tensor, log_var: Tensor) -> Tensor:
    """(B,) KL(N(mu, exp(log_var)) || N(0, 1)), mean over each row's elements."""
    per = -0.5 * (1.0 + log_var - mu**2 - log_var.exp())
    return per.flatten(1).mean(1)


@dataclass
class InitNOResult:
    """``latents``: the optimised initial noise (per row, the iterate with the lowest
    joint score among those measured); ``scores``: its scores; ``start``: the scores of
    the noise given; ``mu``, ``log_var``: its parameters (z = z_0 * exp(log_var / 2) + mu);
    ``kl``: (B,) their KL per element; ``succeeded``: (B,) both scores under threshold;
    ``history``: the joint scores measured, one (B,) tensor per iteration."""

    latents: Tensor
    scores: InitNOScores
    start: InitNOScores
    mu: Tensor
    log_var: Tensor
    kl: Tensor
    succeeded: Tensor
    history: list


def initno(
    model,
    latents: Tensor,
    t,
    prompt_embeds: Tensor,
    tokens,
    *,
    steps: int = 50,
    lr: float = 1e-2,
    cross_threshold: float = 0.2,
    self_threshold: float = 0.3,
    kl_limit: float = 1e-3,
    kl_max_steps: int = 100,
    **options,
) -> InitNOResult:
    """Optimise the initial noise ``latents`` (B, C, H, W) for the prompt.

    Args:
        model: the denoiser (a diffusers model) or a pipeline.
        latents: the initial noise, as the sampler would start from it.
        t: the first timestep of sampling (the scores are measured there).
        prompt_embeds: (B, T, D) conditional text embeddings.
        tokens: indices of the target (subject) tokens.
        steps: the most optimisation steps (the paper: 50). lr: Adam's step (1e-2).
        cross_threshold, self_threshold: stop once both scores are under these.
        kl_limit: the KL per element (mean) allowed after each step; ``kl_max_steps``
            bounds the Adam steps spent getting back under it.
        options: see ``initno_scores``.
    """
    if not isinstance(latents, Tensor) or not latents.is_floating_point() or latents.dim() < 2:
        raise ValueError("latents: expected a floating-point tensor (B, ...)")
    if prompt_embeds.shape[0] != latents.shape[0]:
        raise ValueError(f"prompt_embeds: batch {prompt_embeds.shape[0]} differs from the latents' batch {latents.shape[0]}")
    if steps < 1 or kl_limit <= 0 or lr <= 0:
        raise ValueError(f"steps, lr, kl_limit: expected steps >= 1 and lr, kl_limit > 0, got {steps}, {lr}, {kl_limit}")
    known = {
        "layers",
        "self_layers",
        "heads",
        "grid",
        "size",
        "span",
        "temperature",
        "sigma",
        "kernel_size",
        "self_gate",
        "model_kwargs",
    }
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"options: unknown {unknown}; expected some of {sorted(known)}")
    model = denoiser(model)
    z0 = latents.detach()
    mu = torch.zeros_like(z0, requires_grad=True)
    log_var = torch.zeros_like(z0, requires_grad=True)
    optimizer = torch.optim.Adam([mu, log_var], lr=lr, eps=1e-3)
    rows = (-1,) + (1,) * (z0.dim() - 1)
    best_z, best_mu, best_lv, best = z0.clone(), mu.detach().clone(), log_var.detach().clone(), None
    start, history = None, []
    for _ in range(steps):
        with torch.enable_grad():
            z = z0 * torch.exp(0.5 * log_var) + mu
            scores = initno_scores(model, z, t, prompt_embeds, tokens, **options)
            now = scores.detach()
            history.append(now.joint)
            start = now if start is None else start
            better = torch.ones_like(now.joint, dtype=torch.bool) if best is None else now.joint < best.joint
            best = now if best is None else _merge(best, now, better)
            keep = better.view(rows)
            best_z = torch.where(keep, z.detach(), best_z)
            best_mu = torch.where(keep, mu.detach(), best_mu)
            best_lv = torch.where(keep, log_var.detach(), best_lv)
            done = (now.cross < cross_threshold) & (now.self < self_threshold)
            if bool(done.all()):
                break
            # rows already valid keep their noise: only the others' scores move it
            objective = (scores.joint * (~done).to(scores.joint.dtype)).sum()
            grads = torch.autograd.grad(objective, [mu, log_var], allow_unused=True)
        optimizer.zero_grad()
        for p, g in zip((mu, log_var), grads):
            p.grad = torch.zeros_like(p) if g is None else g
        optimizer.step()
        for _ in range(kl_max_steps):
            with torch.enable_grad():
                kl = gaussian_kl(mu, log_var)
                if bool((kl <= kl_limit).all()):
                    break
                optimizer.zero_grad()
                (kl * (kl > kl_limit).to(kl.dtype)).sum().backward()
            optimizer.step()
    assert best is not None and start is not None  # steps >= 1: the loop scored at least once
    succeeded = (best.cross < cross_threshold) & (best.self < self_threshold)
    return InitNOResult(best_z, best, start, best_mu, best_lv, gaussian_kl(best_mu, best_lv), succeeded, history)


def _merge(old: InitNOScores, new: InitNOScores, take: Tensor) -> InitNOScores:
    pick = lambda a, b: torch.where(take.view(-1, *([1] * (a.dim() - 1))), b, a)  # noqa: E731
    return InitNOScores(
        pick(old.cross, new.cross), pick(old.self, new.self), pick(old.joint, new.joint), pick(old.peaks, new.peaks)
    )


__all__ = ["InitNOResult", "InitNOScores", "conflict_score", "gaussian_kl", "initno", "initno_scores"]
