"""Budgets: how many KV entries a policy keeps.

``budget`` is a fraction of each row's prompt (a float in (0, 1]) or a token count (an
int >= 1). A fraction counts the row's real tokens only (left padding is never kept), so
rows of a padded batch keep ``floor(f * n_b)`` entries each (at least one); a count keeps
that many entries (all of a shorter prompt; a policy that evicts while decoding lets the
cache grow to the count, then holds it there). The budget is per layer and per KV head, unless the policy
distributes it (PyramidKV over depth, AdaKV over the heads of a layer).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def check_budget(budget) -> tuple[str, float]:
    """("fraction", f) or ("count", n); a ValueError naming ``budget`` otherwise."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget: expected a fraction of the prompt in (0, 1] or a token count >= 1, got {budget!r}")
    if isinstance(budget, int):
        if budget < 1:
            raise ValueError(f"budget: a token count must be >= 1, got {budget}")
        return "count", budget
    if not math.isfinite(budget) or budget <= 0 or budget > 1:
        raise ValueError(f"budget: a fraction of the prompt must be in (0, 1] (pass an int for a token count), got {budget!r}")
    return "fraction", float(budget)


def tokens(spec: tuple[str, float], real: Tensor) -> Tensor:
    """Entries each row keeps, (B,) long, from its real prompt length ``real`` (B,)."""
    kind, value = spec
    real = real.to(torch.long)
    if kind == "count":
        return torch.full_like(real, int(value))
    kept = torch.floor(real.to(torch.float64) * value).to(torch.long)
    return torch.clamp(kept, min=1)


def pyramid(mean: Tensor, layer: int, num_layers: int, beta: float) -> Tensor:
    """PyramidKV's per-layer budget (Cai et al. 2024, arXiv 2406.02069, Sec. 3): an
    arithmetic sequence from ``k_0 = 2k - k_min`` at the first layer to ``k_min = k / beta``
    at the last, so that the layers' mean is the requested ``k``."""
    k = mean.to(torch.float64)
    k_min = k / beta
    k_max = 2 * k - k_min
    step = 0.0 if num_layers == 1 else layer / (num_layers - 1)
    return torch.clamp(torch.floor(k_max - (k_max - k_min) * step).to(torch.long), min=1)
