"""Per-head interventions: output ablation (zero or mean), output scaling, logit
temperature and dispersion.

- ``ablate(heads, mode="zero")`` sets the chosen heads' outputs to zero; ``mode="mean"``
  to their mean output over a reference batch (mean ablation, the usual control in
  retrieval-head studies, Wu et al. 2024, arXiv 2404.15574).
- ``scale(heads, factor)``: outputs times ``factor``.
- ``temperature(heads, t)``: logits divided by ``t`` (``t`` > 1 flattens, < 1 sharpens).
- ``disperse(heads, strength)``: logits times ``1 - strength``, so attention flattens
  towards uniform over the keys the row may see, and is exactly uniform at strength 1:
  the dispersion HICD applies to its inducing heads (see ``contrastive.py``).

Identity settings (factor 1, t 1, strength 0) add nothing at all, so outputs stay
bitwise those of the unsteered run.
"""

from __future__ import annotations

import torch

from .. import validate
from .base import Intervention, query_keep, softmax_rows
from .mods import HeadFactor
from .registry import number, register_intervention

Tensor = torch.Tensor
MODES = ("zero", "mean")


class Ablate(Intervention):
    name = "ablate"

    def __init__(self, heads, mode: str = "zero", reference=None):
        super().__init__(heads)
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        if mode == "mean" and reference is None:
            raise ValueError(
                "reference: mode='mean' needs a reference batch (input_ids, or a dict of model inputs) to average over"
            )
        if mode == "zero" and reference is not None:
            raise ValueError("reference: only mode='mean' takes a reference batch")
        self.mode, self.reference_inputs = mode, reference
        self.means: dict[int, Tensor] = {}  # layer -> (Hq, Dv) mean output, from ``prepare``

    def prepare(self, model) -> None:
        if self.mode == "mean":
            self.means = _mean_outputs(model, self.reference_inputs, set(self.bound_heads()))

    def output_for(self, layer, out, keep):
        flags = self.selected(layer, out.shape[1], out.device)
        if flags is None:
            return out
        sel = flags.view(1, -1, 1, 1)
        if self.mode == "zero":
            return torch.where(sel, torch.zeros((), dtype=out.dtype, device=out.device), out)
        mean = self.means[layer].to(device=out.device, dtype=out.dtype)
        return torch.where(sel, mean.view(1, mean.shape[0], 1, mean.shape[1]), out)

    def reference(self, logits, values, layer):
        out = softmax_rows(logits) @ values
        for h in self.heads.get(layer, ()):
            out[:, h] = 0.0 if self.mode == "zero" else self.means[layer][h].to(out.dtype)
        return out

    def __repr__(self):
        return f"ablate({self.heads_spec!r}, mode={self.mode!r})"


class Scale(Intervention):
    name = "scale"

    def __init__(self, heads, factor: float):
        super().__init__(heads)
        self.factor = validate.number(factor, "factor")

    def output_for(self, layer, out, keep):
        flags = self.selected(layer, out.shape[1], out.device)
        if flags is None or self.factor == 1.0:
            return out
        return torch.where(flags.view(1, -1, 1, 1), out * self.factor, out)

    def reference(self, logits, values, layer):
        out = softmax_rows(logits) @ values
        for h in self.heads.get(layer, ()):
            out[:, h] = out[:, h] * self.factor
        return out

    def __repr__(self):
        return f"scale({self.heads_spec!r}, factor={self.factor:g})"


class _LogitFactor(Intervention):
    """Chosen heads' logits times one factor (the model's scaling, soft-cap and position
    bias included: the change sits after them)."""

    multiplier = 1.0

    def scores_for(self, layer, query, key, keep):
        flags = self.selected(layer, query.shape[1], query.device)
        if flags is None or self.multiplier == 1.0:
            return []
        one = torch.ones(flags.shape, dtype=torch.float64, device=query.device)
        return [HeadFactor(torch.where(flags, one * self.multiplier, one))]

    def reference(self, logits, values, layer):
        logits = logits.clone()
        for h in self.heads.get(layer, ()):
            row = logits[:, h]
            logits[:, h] = torch.where(torch.isinf(row), row, row * self.multiplier)
        return softmax_rows(logits) @ values


class Temperature(_LogitFactor):
    name = "temperature"

    def __init__(self, heads, t: float):
        super().__init__(heads)
        self.t = validate.number(t, "t", low=0.0, open_low=True)
        self.multiplier = 1.0 / self.t

    def __repr__(self):
        return f"temperature({self.heads_spec!r}, t={self.t:g})"


class Disperse(_LogitFactor):
    name = "disperse"

    def __init__(self, heads, strength: float = 1.0):
        super().__init__(heads)
        self.strength = validate.number(strength, "strength", low=0.0, high=1.0)
        self.multiplier = 1.0 - self.strength

    def __repr__(self):
        return f"disperse({self.heads_spec!r}, strength={self.strength:g})"


def ablate(heads, mode: str = "zero", reference=None) -> Ablate:
    """Zero the chosen heads' outputs, or (``mode="mean"``) replace them by their mean
    output over ``reference`` (input_ids, or a dict of model inputs; real tokens only)."""
    return Ablate(heads, mode, reference)


def scale(heads, factor: float) -> Scale:
    """Multiply the chosen heads' outputs by ``factor``."""
    return Scale(heads, factor)


def temperature(heads, t: float) -> Temperature:
    """Divide the chosen heads' attention logits by ``t`` > 0."""
    return Temperature(heads, t)


def disperse(heads, strength: float = 1.0) -> Disperse:
    """Flatten the chosen heads' attention towards uniform: logits times 1 - strength
    (strength in [0, 1]; 1 gives uniform weights over the visible keys)."""
    return Disperse(heads, strength)


register_intervention("ablate", lambda heads: ablate(heads))  # the command line zeroes; mode="mean" needs a reference batch
register_intervention("scale", scale, params={"factor": number}, required=("factor",), example="scale:heads=all:factor=0.5")
register_intervention("temperature", temperature, params={"t": number}, required=("t",), example="temperature:heads=0.1:t=2")
register_intervention("disperse", disperse, params={"strength": number}, defaults={"strength": "1"})


# -- mean ablation's reference run ---------------------------------------------------------


class _Recorder:
    """An edit that records, per layer, the sum and count of each head's output over
    real query rows, and changes nothing."""

    def __init__(self, layers: set):
        self.layers = layers
        self.sums: dict[int, Tensor] = {}
        self.counts: dict[int, float] = {}

    def scores(self, layer, query, key, keep):
        return []

    def output(self, layer, out, keep):
        if layer in self.layers:
            rows = query_keep(keep, out)
            w = torch.ones(out.shape[0], out.shape[2], dtype=torch.float64) if rows is None else rows.double()
            total = torch.einsum("bhnd,bn->hd", out.detach().double(), w.to(out.device))
            self.sums[layer] = self.sums.get(layer, 0) + total
            self.counts[layer] = self.counts.get(layer, 0) + float(w.sum())
        return out


def _mean_outputs(model, inputs, layers: set) -> dict[int, Tensor]:
    from ..hf.attention import EDITS

    if isinstance(inputs, Tensor):
        inputs = {"input_ids": inputs}
    if not isinstance(inputs, dict) or not inputs:
        raise ValueError(f"reference: expected input_ids (a tensor) or a dict of model inputs, got {type(inputs).__name__}")
    recorder = _Recorder(layers)
    modules = list(model.modules())
    saved = {m: EDITS.get(m) for m in modules}
    try:
        for m in modules:
            EDITS[m] = recorder
        with torch.no_grad():
            model(**inputs)
    finally:
        for m, prev in saved.items():
            if prev is None:
                EDITS.pop(m, None)
            else:
                EDITS[m] = prev
    missing = sorted(layers - set(recorder.sums))
    if missing:
        raise ValueError(f"reference: the reference run never reached layer(s) {missing}")
    return {layer: recorder.sums[layer] / max(recorder.counts[layer], 1.0) for layer in recorder.sums}
