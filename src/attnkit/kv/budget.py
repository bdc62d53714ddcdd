"""Budgets: how many KV entries a policy keeps.

``budget`` is a fraction of each row's prompt (a float in (0, 1]) or a token count (an
int >= 1). A fraction counts the row's real tokens only (left padding is never kept), so
rows of a padded batch keep ``floor(f * n_b)`` entries each (at least one); a count keeps
that many entries (all of a shorter prompt; a policy that evicts while decoding lets the
cache grow to the count, then holds it there). The budget is per layer and per KV head, unless the policy
distributes it (PyramidKV over depth, AdaKV over the heads of a layer). Quest, which
evicts nothing, reads a fraction of the entries held at each decoding step.
"""

from __future__ import annotations

import functools
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


def pyramid(mean: Tensor, layer: int, num_layers: int, beta: float, held: Tensor | None = None) -> Tensor:
    """PyramidKV's per-layer budget (Cai et al. 2024, arXiv 2406.02069, Sec. 3), (B,): an
    arithmetic sequence from ``k_0 = 2k - k_min`` at the first layer to ``k_min = k / beta``
    at the last, so that the layers' mean is the requested ``k`` (``mean`` (B,)).

    A layer cannot keep more than the ``held`` (B,) prompt entries of its row (None: no
    limit): what that clipping removes is spread over the other layers (``pyramid_layers``),
    so that the mean stays ``k`` where the prompt allows it, and ``k >= held`` (budget 1.0)
    keeps every entry in every layer, the full cache."""
    if held is None:
        held = torch.full_like(mean, torch.iinfo(torch.long).max)
    out = [pyramid_layers(int(k), int(n), num_layers, beta)[layer] for k, n in zip(mean.tolist(), held.tolist())]
    return torch.tensor(out, dtype=torch.long, device=mean.device)


@functools.lru_cache(maxsize=4096)
def pyramid_layers(k: int, held: int, num_layers: int, beta: float) -> tuple[int, ...]:
    """Entries each of ``num_layers`` layers keeps for a mean budget ``k`` over a prompt of
    ``held`` entries. The paper's sequence, with every layer at most ``held``: the layers
    it would put above ``held`` are set to ``held`` and the others raised by one common
    amount (the slope between them unchanged) until the total is ``num_layers * k``; then
    rounded to integers of that total, at least one each (the largest fractional parts
    round up, ties to the lower layer; where raising a layer to one entry overshoots, the
    smallest round down)."""
    if k >= held:
        return (held,) * num_layers
    k_min = k / beta
    k_max = 2 * k - k_min
    want = [k_max - (k_max - k_min) * (i / (num_layers - 1) if num_layers > 1 else 0.0) for i in range(num_layers)]
    total = k * num_layers
    free = list(range(num_layers))  # the layers below the limit
    while True:
        raise_by = (total - held * (num_layers - len(free)) - sum(want[i] for i in free)) / len(free)
        over = [i for i in free if want[i] + raise_by > held]
        if not over:
            break
        free = [i for i in free if i not in over]
    # to 9 decimals: float sums must not decide which of equal fractional parts rounds up
    exact = [round(want[i] + raise_by, 9) if i in free else float(held) for i in range(num_layers)]
    kept = [max(1, min(math.floor(x), held)) for x in exact]
    short = total - sum(kept)  # > 0 from rounding down; < 0 when a layer was raised to one entry
    if short > 0:
        up = sorted((i for i in range(num_layers) if kept[i] < held), key=lambda i: (kept[i] - exact[i], i))
        for i in up[:short]:
            kept[i] += 1
    else:
        down = sorted((i for i in range(num_layers) if kept[i] > 1), key=lambda i: (exact[i] - kept[i], -i))
        for i in down[:-short]:
            kept[i] -= 1
    return tuple(kept)
