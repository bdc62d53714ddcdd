"""Entropy-guided attention concentration: a logit scale per layer, from measured entropy.

A diffusion transformer or UNet sampled above its training resolution attends over more
image tokens than it was trained for, and its attention dilutes: each query's weights
spread thinner, its entropy grows (about log N for a spread-out head), and fine detail
washes out. UltraImage (the reading lists' abstract, "entropy-guided adaptive attention
concentration") counters this with per-layer focus factors on the attention logits,
chosen from the attention's entropy: larger for heads that were concentrated (local,
fine detail), smaller for those that attend globally. The abstract gives the principle,
not a formula; attnkit's definition, stated here, is entropy matching:

    choose lambda_l so that entropy_l(target, logits * lambda_l) = entropy_l(base)

for every layer l, where entropy_l is the mean entropy of l's attention rows (nats,
measured with attnkit's ``Entropy`` meter, O(N) memory) over a calibration run at the
base (training) resolution and one at the target resolution. Layers whose attention
diluted more get larger factors; a concentrated layer's base entropy is low, so its
factor grows most, as the paper asks. Entropy of softmax(lambda s) falls monotonically
as lambda grows; near uniform attention it is log N - lambda^2 Var(s) / 2, which gives
the update used, one calibration pass per round:

    lambda <- lambda * sqrt((log N_t - H_base) / (log N_t - H_target(lambda)))

whose fixed point is H_target(lambda) = H_base exactly; more rounds approach it when
layers interact (each layer's input depends on the earlier layers' factors).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch

from ..mods import temperature
from ..observe import Entropy
from .edits import DiffusionEdit, edits_on
from .switch import denoiser, use


@dataclass(frozen=True)
class LayerEntropy:
    """One layer's attention over a run: ``entropy`` (mean over batch rows, heads, query
    rows and calls; nats), ``keys`` (the keys each query saw) and ``heads`` (the mean
    entropy of each head)."""

    entropy: float
    keys: int
    heads: tuple[float, ...] = ()


class _KeyedEntropy(Entropy):
    """attnkit's Entropy meter that also notes each layer's key count."""

    def __init__(self):
        super().__init__()
        self.keys: dict[int, set[int]] = {}

    def begin_call(self, call, n_heads, row_lo, row_hi):
        super().begin_call(call, n_heads, row_lo, row_hi)
        self.keys.setdefault(call.layer, set()).add(call.k_len)


class _Scale(DiffusionEdit):
    """A ``DiffusionEdit``: the layer's logits times ``factor``, one number or one per head
    (nothing added where every factor is 1), on top of any edit already there."""

    def __init__(self, factor, previous=None):
        super().__init__(previous)
        if isinstance(factor, tuple):
            plain = all(f == 1.0 for f in factor)
            self.mods = [] if plain else [temperature(torch.tensor([1.0 / f for f in factor], dtype=torch.float64))]
        else:
            self.mods = [] if factor == 1.0 else [temperature(1.0 / factor)]

    def scores(self, layout, query, key):
        return super().scores(layout, query, key) + list(self.mods)


@contextmanager
def _scaled(model, scales: dict, layers: list[str] | None, kind: str | None, observers=None):
    with use(model, layers=layers, kind=kind, observers=observers) as switch:
        modules = {layer.name: layer.module for layer in switch.layers}
        for name, factor in scales.items():
            heads = getattr(modules[name], "heads", None)
            if isinstance(factor, tuple) and heads is not None and len(factor) != heads:
                raise ValueError(f"scales: {name!r} has {heads} heads, got {len(factor)} factors")
        scaled = [layer for layer in switch.layers if layer.name in scales]
        with edits_on(scaled, lambda layer, previous: _Scale(scales[layer.name], previous)):
            yield switch


def measure_entropy(
    model_or_pipeline,
    run: Callable[[], object],
    *,
    layers: Iterable[str] | None = None,
    kind: str | None = "self",
    scales: dict | None = None,
) -> dict[str, LayerEntropy]:
    """Call ``run()`` (which runs the model or pipeline) with attnkit's ``Entropy`` meter on
    the chosen layers (module paths, exact; default: every layer of ``kind``) and return
    each layer's ``LayerEntropy``, keyed by module path. ``scales`` (path -> factor, or
    one factor per head) multiplies those layers' logits while measuring."""
    if not callable(run):
        raise ValueError(f"run: expected a callable that runs the model, got {type(run).__name__}")
    model = denoiser(model_or_pipeline)
    scales = EntropyConcentration(scales).scales if scales else {}
    meter = _KeyedEntropy()
    layer_list = None if layers is None else ([layers] if isinstance(layers, str) else list(layers))
    with _scaled(model, scales, layer_list, kind, observers=[meter]) as switch:
        with torch.no_grad():
            run()
        names = switch.names
    per_layer: dict[int, list[float]] = {}
    for layer, _head, metric, value in meter.rows():  # rows come in head order
        if metric == "entropy.mean":
            per_layer.setdefault(layer, []).append(value)
    if not per_layer:
        raise ValueError(
            "run: the model made no attention call on the chosen layers; run(), called with no arguments, "
            "must run the model (or pipeline) passed"
        )
    out = {}
    for layer, values in sorted(per_layer.items()):
        keys = meter.keys[layer]
        if len(keys) != 1:
            raise ValueError(
                f"run: {names[layer]} saw calls with different key counts {sorted(keys)}; calibrate at one resolution per run"
            )
        out[names[layer]] = LayerEntropy(sum(values) / len(values), next(iter(keys)), tuple(values))
    return out


class EntropyConcentration:
    """Per-layer logit factors: ``scales`` maps module paths to factors > 0 (1 = the
    model's own attention), one number per layer or a sequence of one per head. Build them with ``calibrate`` (entropy matching, see the
    module docstring) or by hand; ``apply(model)`` runs the model with them.

    After ``calibrate``: ``base`` (the base run's ``LayerEntropy`` per layer) and
    ``history``: per round, the target run's entropies with that round's factors (the
    first with every factor 1), which shows how close the matching came."""

    def __init__(self, scales: dict):
        if not isinstance(scales, dict) or not scales:
            raise ValueError(f"scales: expected a non-empty dict of module path -> factor, got {scales!r}")
        self.scales = {}
        for name, factor in scales.items():
            if not isinstance(name, str):
                raise ValueError(f"scales: keys are module paths (str), got {name!r}")
            many = isinstance(factor, (list, tuple))
            values = list(factor) if many else [factor]
            if not values or any(
                isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0 for f in values
            ):
                raise ValueError(
                    f"scales: the factor of {name!r} must be a finite number > 0 or a non-empty list of them "
                    f"(one per head), got {factor!r}"
                )
            self.scales[name] = tuple(float(f) for f in values) if many else float(factor)
        self.base: dict[str, LayerEntropy] = {}
        self.history: list[dict[str, LayerEntropy]] = []

    @classmethod
    def calibrate(
        cls,
        model_or_pipeline,
        base_run: Callable[[], object],
        target_run: Callable[[], object],
        *,
        layers: Iterable[str] | None = None,
        kind: str | None = "self",
        rounds: int = 3,
        max_scale: float = 8.0,
        per_head: bool = False,
    ) -> EntropyConcentration:
        """Factors that bring each layer's entropy at the target resolution back to its
        entropy at the base resolution.

        Args:
            base_run, target_run: callables that run the model (or pipeline) once at the
                base (training) resolution and at the target resolution.
            layers, kind: the layers to concentrate (default: every self-attention layer,
                where image tokens attend to image tokens and dilute as they grow).
            rounds: calibration passes at the target resolution (each one forward of
                ``target_run``; the first gives the closed form, later ones refine it).
            max_scale: factors are clipped to [1 / max_scale, max_scale].
            per_head: one factor per head, each matching its head's entropy (heads of
                one layer dilute differently: local ones more than global ones).
        """
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds: expected an integer >= 1, got {rounds!r}")
        if isinstance(max_scale, bool) or not isinstance(max_scale, (int, float)) or not max_scale >= 1:
            raise ValueError(f"max_scale: expected a number >= 1, got {max_scale!r}")
        base = measure_entropy(model_or_pipeline, base_run, layers=layers, kind=kind)
        scales = {name: (1.0,) * len(b.heads) if per_head else 1.0 for name, b in base.items()}
        history, tried = [], []
        for _ in range(rounds):
            target = measure_entropy(model_or_pipeline, target_run, layers=list(base), kind=kind, scales=scales)
            history.append(target)
            tried.append(scales)
            scales = {}
            for name, b in base.items():
                seen = [h[name] for h in history]
                if per_head:  # every factor tried is a tuple, one per head
                    per_heads = [cast(tuple[float, ...], s[name]) for s in tried]
                    scales[name] = tuple(
                        _update([f[j] for f in per_heads], [e.heads[j] for e in seen], seen[-1].keys, b.heads[j], max_scale)
                        for j in range(len(b.heads))
                    )
                else:  # every factor tried is one float
                    scales[name] = _update(
                        [cast(float, s[name]) for s in tried], [e.entropy for e in seen], seen[-1].keys, b.entropy, max_scale
                    )
        out = cls(scales)
        out.base, out.history = base, history
        return out

    @contextmanager
    def apply(self, model_or_pipeline, observers=None):
        """Run the model with these factors on their layers inside the block (and
        ``observers`` on the same layers); restored on exit, also after an exception."""
        with _scaled(denoiser(model_or_pipeline), self.scales, list(self.scales), None, observers) as switch:
            yield switch

    def __repr__(self):
        def show(f):
            return "[" + ", ".join(f"{x:.4g}" for x in f) + "]" if isinstance(f, tuple) else f"{f:.4g}"

        inner = ", ".join(f"{name!r}: {show(f)}" for name, f in self.scales.items())
        return f"EntropyConcentration({{{inner}}})"


def _update(factors: list[float], measured: list[float], keys: int, base_entropy: float, max_scale: float) -> float:
    """The next factor of one layer (or head), from the factors tried and the target entropies they
    gave. The first step is the near-uniform closed form (module docstring); later steps
    are secant steps on entropy against log(factor), which reach the fixed point fast
    where the closed form, exact only near uniform attention, undershoots (peaked
    heads). A step that the measurements cannot inform keeps the closed form; a layer
    whose attention is exactly uniform carries no information and keeps its factor."""
    factor, now = factors[-1], measured[-1]
    log_n = math.log(keys) if keys > 1 else 0.0
    spread_now, spread_wanted = log_n - now, log_n - base_entropy
    if spread_now <= 1e-12:
        return factor
    new = factor * math.sqrt(max(spread_wanted, 0.0) / spread_now)
    if len(factors) >= 2 and factors[-2] != factor:
        slope = (now - measured[-2]) / (math.log(factor) - math.log(factors[-2]))
        if slope < 0:  # entropy falls as the factor grows, as it must for softmax
            new = factor * math.exp((base_entropy - now) / slope)
    return min(max(new, 1.0 / max_scale), max_scale)


__all__ = ["EntropyConcentration", "LayerEntropy", "measure_entropy"]
