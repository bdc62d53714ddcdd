"""Attention regulation (Zhang et al. 2024, arXiv 2403.06381).

Cross-attention often lets a few tokens dominate the image, so some subjects of the
prompt never appear. Attention regulation adds, at inference time, an optimised and
spatially smooth bias to the pre-softmax cross-attention logits of the target tokens:

    s[b, h, i, t] <- s[b, h, i, t] + beta[b, h, i, t]      (t a target token, i an image query)

with beta a weighted sum of Gaussian bumps over the latent grid (centres every 2 sigma,
sigma = max(1, grid // 16) cells, as the authors' code places them), so it is smooth by
construction. Per denoiser call of each chosen layer, the weights w minimise (the
objective of the authors' code)

    gamma * mean_t (q90(A_t) - 0.9)^2  +  delta * mean_t (mean(A_t) - tau / K)^2  +  eps * mean(w^2)

where A_t is target token t's attention map after the bias, q90 its 0.9-quantile over
image positions (each target holds a region of high attention), tau = min(1, 0.2 K) the
share of attention the K targets should take together, evenly; the last term keeps the
edit small. Plain gradient descent, a fixed number of iterations, the best iterate kept;
applied at the first denoising steps. The bias runs inside attnkit's kernels as a score
mod (``TokenBias``), so the model's processors, QK norms and RoPE stay its own.

Simplifications, stated: the weights start at zero (the authors draw them at random);
a step that would raise the objective is retried at half the rate (the authors keep the
best iterate of plain steps; at their sizes the two agree, on tiny grids plain steps of
lr 100 diverge);
the authors' moving average of the edit across steps, its decay over steps and their
restoring of the start/end tokens' weights after the edit are left out.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..mods.scores import Bias
from .edits import DiffusionEdit, edits_on
from .gradmaps import check_scale
from .layers import CallLayout, index_tuple, select_layers
from .switch import denoiser, use

Tensor = torch.Tensor


class TokenBias(Bias):
    """A score mod adding ``table`` (B|1, H|1, N_image, K) to the logits from the image
    queries ``image`` = (start, end) of a call to its keys ``keys`` (K positions); zero
    everywhere else."""

    def __init__(self, table: Tensor, keys, image: tuple[int, int]):
        if not isinstance(table, Tensor) or table.dim() != 4 or not table.is_floating_point():
            raise ValueError(f"table: expected a float tensor (B|1, H|1, N_image, K), got {getattr(table, 'shape', table)!r}")
        self.keys = [int(k) for k in keys]
        if table.shape[3] != len(self.keys):
            raise ValueError(f"table: its last dimension {table.shape[3]} differs from the {len(self.keys)} keys")
        if image[1] - image[0] != table.shape[2]:
            raise ValueError(f"table: {table.shape[2]} rows but the image queries span {image}")
        self.table, self.image, self.q_start, self.k_len = table, tuple(image), 0, None

    def bind(self, batch, heads, q_len, k_len):
        t = self.table
        if t.shape[0] not in (1, batch) or t.shape[1] not in (1, heads) or self.image[1] > q_len or max(self.keys) >= k_len:
            raise ValueError(
                f"table: shape {tuple(t.shape)} with image queries {self.image} and keys {self.keys} does not fit a "
                f"call of batch {batch}, {heads} heads, {q_len} queries, {k_len} keys"
            )
        out = TokenBias(t, self.keys, self.image)
        out.q_start, out.k_len = k_len - q_len, k_len
        out._column = out._columns()
        return out

    def _columns(self) -> Tensor:
        """(Nk,) the target's number of each key, -1 for the other keys."""
        column = torch.full((self.k_len or (max(self.keys) + 1),), -1, dtype=torch.long, device=self.table.device)
        column[self.keys] = torch.arange(len(self.keys), device=self.table.device)
        return column

    def bias(self, b, h, q_idx, kv_idx):
        t = self.table
        column = getattr(self, "_column", None)
        if column is None:
            column = self._columns()
        rows = q_idx - self.q_start - self.image[0]
        cols = column[kv_idx.clamp(0, column.shape[0] - 1)]
        inside = (rows >= 0) & (rows < t.shape[2]) & (cols >= 0) & (kv_idx < column.shape[0])
        bi = b if t.shape[0] > 1 else torch.zeros_like(b)
        hi = h if t.shape[1] > 1 else torch.zeros_like(h)
        value = t[bi, hi, rows.clamp(0, t.shape[2] - 1), cols.clamp_min(0)]
        return torch.where(inside, value, torch.zeros((), dtype=t.dtype, device=t.device))

    def parameters(self):
        return [self.table]

    def __repr__(self):
        return f"token_bias(keys={self.keys}, image={self.image})"


def gaussian_basis(grid: tuple[int, int], sigma: float | None = None, device=None) -> Tensor:
    """(C, h*w) Gaussian bumps of peak 1 over the grid, centres every 2 sigma from 2 sigma
    (sigma = max(1, max(h, w) // 16) cells unless given); one central bump when the grid
    is too small to hold a lattice."""
    h, w = grid
    s = float(max(1, max(h, w) // 16)) if sigma is None else float(sigma)
    if not s > 0:
        raise ValueError(f"sigma: expected > 0, got {sigma}")
    step = 2 * s
    ys = [y for y in _lattice(step, h)] or [(h - 1) / 2]
    xs = [x for x in _lattice(step, w)] or [(w - 1) / 2]
    yy, xx = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij")
    bumps = [torch.exp(-((yy - y0) ** 2 + (xx - x0) ** 2) / (2 * s * s)).reshape(-1) for y0 in ys for x0 in xs]
    return torch.stack(bumps).to(device)


def _lattice(step: float, size: int) -> list[float]:
    out, c = [], step
    while c < size:
        out.append(c)
        c += step
    return out


def regulation_objective(
    maps: Tensor,
    weights: Tensor,
    *,
    gamma: float = 1.0,
    delta: float = 80.0,
    epsilon: float = 0.09,
    quantile: float = 0.9,
    share: float | None = None,
) -> Tensor:
    """(B, H) the objective per batch row and head, from the targets' maps after the bias
    ``maps`` (B, H, N_image, K) and the bump weights (B, H, C, K)."""
    k = maps.shape[-1]
    tau = min(1.0, 0.2 * k) if share is None else share
    high = (torch.quantile(maps, quantile, dim=2) - quantile) ** 2  # (B, H, K)
    even = (maps.mean(dim=2) - tau / k) ** 2
    return gamma * high.mean(-1) + delta * even.mean(-1) + epsilon * (weights**2).mean((-2, -1))


@dataclass
class RegulationCall:
    """One regulated call: ``layer`` path, ``step``, the objective (summed over batch rows
    and heads) before and after the optimisation."""

    layer: str
    step: int
    before: float
    after: float


@dataclass
class AttentionRegulation:
    """The settings of ``regulate`` and what it did (``calls``)."""

    tokens: tuple[int, ...]
    steps: frozenset | None
    iterations: int = 20
    lr: float = 100.0
    gamma: float = 1.0
    delta: float = 80.0
    epsilon: float = 0.09
    quantile: float = 0.9
    share: float | None = None
    sigma: float | None = None
    conditional_only: bool = False
    calls: list[RegulationCall] = field(default_factory=list)

    def bias_for(self, layout: CallLayout, query: Tensor, key: Tensor, mods) -> TokenBias | None:
        """The optimised bias of one call (None outside the regulated steps, or when the
        optimisation leaves it at zero)."""
        if layout.text_keys is None or (self.steps is not None and layout.step not in self.steps) or self.iterations == 0:
            return None
        if layout.grid is None:
            raise ValueError(f"grid: cannot tell the latent grid of {layout.name}; pass a model input of shape (B, C, H, W)")
        t_lo, t_hi = layout.text_keys
        if max(self.tokens) >= t_hi - t_lo:
            raise ValueError(f"tokens: {max(self.tokens)} is outside the {t_hi - t_lo} text tokens of {layout.name}")
        with torch.enable_grad():
            table = self._optimise(layout, query.detach(), key.detach(), mods)
        if table is None:
            return None
        return TokenBias(table.to(query.dtype), [t_lo + t for t in self.tokens], layout.image_queries)

    def _optimise(self, layout: CallLayout, query: Tensor, key: Tensor, mods) -> Tensor | None:
        from ..mods import as_score
        from .gradmaps import block_logits

        b, h, nq, nk = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        scale = 1.0 / math.sqrt(query.shape[-1])
        bound = None if not mods else as_score(list(mods)).bind(b, h, nq, nk)
        assert layout.text_keys is not None and layout.grid is not None  # bias_for checked both
        (i_lo, i_hi), (t_lo, t_hi) = layout.image_queries, layout.text_keys
        dev = query.device
        rows = torch.arange(i_lo, i_hi, device=dev)
        s_text = block_logits(query, key, rows, torch.arange(t_lo, t_hi, device=dev), bound, scale).detach()
        if (t_lo, t_hi) == (0, nk):
            rest = None
        else:  # the image keys' share of each row's normaliser: constant while the bias moves
            text = (t_lo, t_hi)

            def not_text(bb, hh, qq, kv):
                return (kv < text[0]) | (kv >= text[1])

            value = query.new_zeros(b, key.shape[1], nk, 1)
            from ..api import attention

            _, lse = attention(query, key, value, mask=not_text, score=bound, scale=scale, return_lse=True)
            rest = lse[:, :, i_lo:i_hi].to(s_text.dtype).detach()
        basis = gaussian_basis(layout.grid, self.sigma, dev).to(s_text.dtype)  # (C, N)
        idx = list(self.tokens)
        weights = torch.zeros(b, h, basis.shape[0], len(idx), dtype=s_text.dtype, device=dev, requires_grad=True)
        row_on = torch.ones(b, dtype=s_text.dtype, device=dev)
        if self.conditional_only:
            if b % 2:
                raise ValueError(f"conditional_only: the call's batch {b} is odd; expected [unconditional; conditional] halves")
            row_on[: b // 2] = 0

        def objective(w):
            beta = torch.einsum("cn,bhck->bhnk", basis, w) * row_on.view(-1, 1, 1, 1)
            logits = s_text.clone()
            logits[..., idx] = logits[..., idx] + beta
            norm = torch.logsumexp(logits, dim=-1)
            if rest is not None:
                norm = torch.logaddexp(norm, rest)
            maps = torch.exp(logits[..., idx] - norm.unsqueeze(-1))
            per = regulation_objective(
                maps, w, gamma=self.gamma, delta=self.delta, epsilon=self.epsilon, quantile=self.quantile, share=self.share
            )
            return (per * row_on.view(-1, 1)).sum(), beta

        # Gradient descent with the step halved whenever it would not lower the objective
        # (only descents are kept). The first step is capped at half the stability limit
        # of the weight penalty, whose curvature 2 eps / (C K) per weight grows on small
        # grids with few bumps; on the authors' lattices (49 bumps at 16 x 16) lr = 100 is
        # well under it.
        count = basis.shape[0] * len(idx)
        lr = min(self.lr, 0.5 * count / self.epsilon) if self.epsilon > 0 else self.lr
        w = weights
        value, beta = objective(w)
        first = float(value.detach())
        for _ in range(self.iterations):
            (grad,) = torch.autograd.grad(value, w, retain_graph=True)
            step = (w - lr * grad).detach().requires_grad_(True)
            new_value, new_beta = objective(step)
            if float(new_value.detach()) < float(value.detach()):
                w, value, beta = step, new_value, new_beta
            else:
                lr /= 2
        best, best_beta = float(value.detach()), beta.detach()
        self.calls.append(RegulationCall(layout.name, layout.step, first, best))
        if not bool(best_beta.ne(0).any()):
            return None
        return best_beta


class _RegulationEdit(DiffusionEdit):
    def __init__(self, reg: AttentionRegulation, layer, previous):
        super().__init__(previous)
        self.reg, self.layer = reg, layer

    def scores(self, layout, query, key):
        mods = super().scores(layout, query, key)
        check_scale(self.layer, query.shape[-1])
        bias = self.reg.bias_for(layout, query, key, mods)
        return mods + ([bias] if bias is not None else [])


@contextmanager
def regulate(
    model_or_pipeline,
    tokens,
    *,
    layers=None,
    steps=range(25),
    iterations: int = 20,
    lr: float = 100.0,
    gamma: float = 1.0,
    delta: float = 80.0,
    epsilon: float = 0.09,
    quantile: float = 0.9,
    share: float | None = None,
    sigma: float | None = None,
    conditional_only: bool = False,
):
    """Attention regulation on the chosen cross- (or joint-) attention layers inside the
    block; the model is restored on exit, also after an exception.

    Args:
        model_or_pipeline: a diffusers model or pipeline.
        tokens: indices of the target tokens among the text tokens.
        layers: module paths (exact) of the cross/joint layers to regulate (default: all).
        steps: denoiser calls (0 = the first inside the block) to regulate; None: all.
            The paper regulates the first half of sampling (25 of 50 steps).
        iterations, lr: gradient descent on the bump weights per call (20, 100).
        gamma, delta, epsilon, quantile, share: the objective's weights (see
            ``regulation_objective``); share defaults to min(1, 0.2 K).
        sigma: width of the Gaussian bumps in grid cells (default max(1, grid // 16)).
        conditional_only: with classifier-free guidance in one batch, leave the first
            (unconditional) half of the rows unbiased, as the authors do.

    Yields the ``AttentionRegulation`` (``calls`` lists each regulated call).
    """
    idx = index_tuple(tokens, "tokens")
    if idx is None:
        raise ValueError("tokens: expected a non-empty list of text token indices, got None")
    if iterations < 0 or lr <= 0:
        raise ValueError(f"iterations, lr: expected iterations >= 0 and lr > 0, got {iterations}, {lr}")
    if not 0 < quantile < 1:
        raise ValueError(f"quantile: expected a value in (0, 1), got {quantile}")
    step_set = None if steps is None else frozenset(index_tuple(list(steps), "steps") or ())
    reg = AttentionRegulation(idx, step_set, iterations, lr, gamma, delta, epsilon, quantile, share, sigma, conditional_only)
    model = denoiser(model_or_pipeline)
    chosen = select_layers(model, layers, ("cross", "joint"))
    with use(model, layers=[layer.name for layer in chosen]):
        with edits_on(chosen, lambda layer, previous: _RegulationEdit(reg, layer, previous)):
            yield reg


__all__ = ["AttentionRegulation", "RegulationCall", "TokenBias", "gaussian_basis", "regulate", "regulation_objective"]
