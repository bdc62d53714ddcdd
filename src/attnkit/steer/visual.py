"""Interventions on the attention a vision-language model's decoder pays to image tokens.

Each takes the image keys — a (B, N0) bool mask over the prompt, or an object with a
``mask`` attribute such as ``attnkit.vision.image_spans(...)`` — and the heads to change
(``(layer, head)`` pairs, ``{layer: [heads]}``, ``"all"``; layers and heads of the
decoder). Keys past N0 (generated tokens) are text. All run inside the kernels as score
mods; none materialises a weight matrix. With I the image keys of a row and w its
weights:

- ``amplify_visual(keys, heads, alpha)``: ``w_j · α`` on I, rows renormalised (α > 1
  pays more attention to the image); an additive ``log α`` on I's logits. With
  ``mode="logits"``, PAI's own form (Liu et al. 2024, "Paying More Attention to Image",
  arXiv 2407.21771): image logits ``s + α |s|``, α >= 0.
- ``calibrate_visual(keys, blind, heads, beta, boost=1)``: mass off the blind
  (over-attended) image tokens, ``w_j · β`` on ``blind`` and ``w_j · boost`` on the
  other image tokens, renormalised: the attention-calibration idea of AVC (Woo et al.
  2024, arXiv 2405.17820) and VAR (Kang et al. 2025, arXiv 2503.03321) as a weight
  edit; ``attnkit.vision.blind_tokens`` picks ``blind`` from a meter. (VAR keeps each
  row's visual budget exactly by handing the removed mass to the other image tokens;
  that needs each row's own sums, so here ``boost`` sets the hand-over for all rows.)
- ``hold_visual(keys, heads, curve, strength=1)``: drift correction during generation.
  ``curve[l, h, t]`` is a reference visual share at generated step t (a
  ``VisualAttention`` meter's ``visual_share`` arrays, averaged); the query that
  predicts step t gets ``strength · (logit c[0] − logit c[t])`` on its image logits, so
  a row that drifts like the reference keeps the visual share of step 0 ("text
  inertia": the drift from visual evidence of the reading lists' CG-VLM abstract).
- ``ablate_visual(keys, heads="all")``: image keys hidden (their logits −inf): the
  visually-ablated "amateur" of ``contrastive_visual_generate``.

Identity settings (α = 1, or 0 for logits; β = boost = 1; strength 0) add no mod, so
logits stay bitwise the unsteered ones. Each intervention refuses a model with no image
placeholder in its config (``model``), and keys whose batch does not match a call.
"""

from __future__ import annotations

import math

import torch

from ..mods.scores import AbsBoost, Bias
from .base import Intervention, softmax_rows
from .mods import KeyBias

Tensor = torch.Tensor


def _keys(keys, name: str = "keys") -> Tensor:
    mask = getattr(keys, "mask", keys)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[1] == 0:
        raise ValueError(
            f"{name}: expected a (batch, tokens) bool mask of image keys or attnkit.vision.image_spans(...), got {type(keys).__name__}"
        )
    if not bool(mask.any()):
        raise ValueError(f"{name}: marks no image key")
    return mask.detach().cpu()


def _positive(value, name: str, low: float = 0.0, open_low: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    if value < low or (open_low and value == low):
        raise ValueError(f"{name}: expected a number {'>' if open_low else '>='} {low:g}, got {value!r}")
    return float(value)


def image_keys_for(mask: Tensor, batch: int, k_len: int, device=None) -> Tensor:
    """(B, Nk) bool image keys of a call: the mask's prompt, text past it."""
    if mask.shape[0] not in (1, batch):
        raise ValueError(f"keys: a mask for {mask.shape[0]} batch rows, but the call has a batch of {batch}")
    mask = mask.expand(batch, -1)
    if k_len <= mask.shape[1]:
        out = mask[:, :k_len]
    else:
        out = torch.cat([mask, mask.new_zeros(batch, k_len - mask.shape[1])], 1)
    return out.to(device)


class _Visual(Intervention):
    """Shared: the image keys, and the refusal of a text-only model."""

    def __init__(self, keys, heads):
        super().__init__(heads)
        self.keys = _keys(keys)
        self._tables: dict = {}  # (layer, B, Hq, device) -> the widest table built, or None

    def bind(self, model) -> Intervention:
        bound = super().bind(model)
        assert isinstance(bound, _Visual)  # a copy of self
        bound._tables = {}  # its own: the tables follow the heads bound here
        return bound

    def check(self, model) -> None:
        config = model.config
        if not any(isinstance(getattr(config, n, None), int) for n in ("image_token_id", "image_token_index")):
            raise ValueError(
                f"model: {type(config).__name__} has no image placeholder (config.image_token_id); "
                f"{self.name} needs a vision-language model"
            )

    def table(self, layer, batch: int, heads: int, k_len: int, device) -> Tensor | None:
        """The (B, Hq, Nk) table this intervention adds (or feeds its score mod) on a call
        of ``layer``; None when the layer has no chosen head. Keys past the prompt are
        text, whose entries must not depend on ``k_len`` (``call_table`` slices wider ones)."""
        raise NotImplementedError  # the interventions made of one table per call override it

    def call_table(self, layer, query: Tensor, key: Tensor) -> Tensor | None:
        """``table`` for this call, built once per layer and batch shape at a width that
        doubles as the keys grow: the layers of every forward, and each decoding step,
        slice it instead of rebuilding it from some ten small ops."""
        B, H, Nk = query.shape[0], query.shape[1], key.shape[2]
        slot = (layer, B, H, query.device)
        held = self._tables.get(slot, False)
        if held is False or (held is not None and held.shape[2] < Nk):
            width = max(Nk, 2 * held.shape[2]) if isinstance(held, Tensor) else Nk
            held = self._tables[slot] = self.table(layer, B, H, width, query.device)
        return None if held is None else held[:, :, :Nk]

    def bias_table(self, layer, batch: int, heads: int, k_len: int, device, on_image, off_image=None) -> Tensor | None:
        """(B, Hq, Nk) additive table: ``on_image`` (per key (B, Nk) or scalar) on image keys
        of the chosen heads, ``off_image`` elsewhere (default 0)."""
        flags = self.selected(layer, heads, device)
        if flags is None:
            return None
        img = image_keys_for(self.keys, batch, k_len, device)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        per_key = torch.where(
            img,
            torch.as_tensor(on_image, dtype=torch.float64, device=device),
            zero if off_image is None else torch.as_tensor(off_image, dtype=torch.float64, device=device),
        )
        return torch.where(flags.view(1, heads, 1), per_key.view(batch, 1, k_len), zero)

    def weight_factors(self, B: int, Nk: int) -> Tensor:
        """(B, Nk) float64 factor on each key's weight (the literal form of the edit)."""
        raise NotImplementedError

    def reference(self, logits, values, layer):
        weights = softmax_rows(logits)
        B, _, _, Nk = weights.shape
        factors = self.weight_factors(B, Nk)
        for h in self.heads.get(layer, ()):
            w = weights[:, h] * factors.view(B, 1, Nk).to(weights.dtype)
            weights[:, h] = w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny)
        return weights @ values


class AmplifyVisual(_Visual):
    name = "amplify_visual"

    def __init__(self, keys, heads, alpha: float, mode: str = "weights"):
        super().__init__(keys, heads)
        if mode not in ("weights", "logits"):
            raise ValueError(f"mode: expected 'weights' or 'logits', got {mode!r}")
        self.mode = mode
        self.alpha = _positive(alpha, "alpha", 0.0, open_low=(mode == "weights"))

    @property
    def identity(self) -> bool:
        return self.alpha == (1.0 if self.mode == "weights" else 0.0)

    def table(self, layer, batch, heads, k_len, device):
        on_image = math.log(self.alpha) if self.mode == "weights" else self.alpha
        return self.bias_table(layer, batch, heads, k_len, device, on_image)

    def scores_for(self, layer, query, key, keep):
        if self.identity:
            return []
        table = self.call_table(layer, query, key)
        if table is None:
            return []
        return [KeyBias(table) if self.mode == "weights" else AbsBoost(table)]

    def weight_factors(self, B, Nk):
        img = image_keys_for(self.keys, B, Nk)
        return torch.where(img, torch.tensor(self.alpha, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))

    def reference(self, logits, values, layer):
        if self.mode == "weights":
            return super().reference(logits, values, layer)
        logits = logits.clone()
        B, _, _, Nk = logits.shape
        img = image_keys_for(self.keys, B, Nk).view(B, 1, Nk)
        for h in self.heads.get(layer, ()):
            row = logits[:, h]
            logits[:, h] = torch.where(img & torch.isfinite(row), row + self.alpha * row.abs(), row)
        return softmax_rows(logits) @ values

    def __repr__(self):
        return f"amplify_visual({self.heads_spec!r}, alpha={self.alpha:g}, mode={self.mode!r})"


class CalibrateVisual(_Visual):
    name = "calibrate_visual"

    def __init__(self, keys, blind, heads, beta: float = 0.5, boost: float = 1.0):
        super().__init__(keys, heads)
        self.blind = _keys(blind, "blind")
        if self.blind.shape[1] > self.keys.shape[1] or bool(
            (self.blind & ~self.keys[:, : self.blind.shape[1]].expand_as(self.blind)).any()
        ):
            raise ValueError("blind: marks keys that are not image keys")
        self.beta = _positive(beta, "beta")
        self.boost = _positive(boost, "boost")

    def _factors(self, B, Nk, device=None) -> tuple[Tensor, Tensor]:
        img = image_keys_for(self.keys, B, Nk, device)
        blind = image_keys_for(self.blind, B, Nk, device)
        return img, blind

    def table(self, layer, batch, heads, k_len, device):
        _, blind = self._factors(batch, k_len, device)
        f64 = dict(dtype=torch.float64, device=device)
        on = torch.where(blind, torch.tensor(math.log(self.beta), **f64), torch.tensor(math.log(self.boost), **f64))
        return self.bias_table(layer, batch, heads, k_len, device, on)

    def scores_for(self, layer, query, key, keep):
        if self.beta == 1.0 and self.boost == 1.0:
            return []
        table = self.call_table(layer, query, key)
        return [] if table is None else [KeyBias(table)]

    def weight_factors(self, B, Nk):
        img, blind = self._factors(B, Nk)
        one = torch.tensor(1.0, dtype=torch.float64)
        return torch.where(
            blind,
            torch.tensor(self.beta, dtype=torch.float64),
            torch.where(img, torch.tensor(self.boost, dtype=torch.float64), one),
        )

    def __repr__(self):
        return f"calibrate_visual({self.heads_spec!r}, beta={self.beta:g}, boost={self.boost:g})"


class HoldVisual(_Visual):
    name = "hold_visual"

    def __init__(self, keys, heads, curve: Tensor, strength: float = 1.0):
        super().__init__(keys, heads)
        curve = torch.as_tensor(curve, dtype=torch.float64)
        if curve.dim() != 3 or curve.shape[2] < 1:
            raise ValueError(f"curve: expected (layers, heads, steps) reference visual shares, got shape {tuple(curve.shape)}")
        if not bool(((curve > 0) & (curve < 1)).all()):
            raise ValueError("curve: visual shares must lie strictly between 0 and 1")
        self.curve = curve
        self.strength = _positive(strength, "strength", 0.0, open_low=False)

    def check(self, model):
        super().check(model)
        if self.curve.shape[:2] != (self.num_layers, self.num_heads):
            raise ValueError(
                f"curve: measured for {tuple(self.curve.shape[:2])} (layers, heads); the model has ({self.num_layers}, {self.num_heads})"
            )

    def step_bias(self, layer) -> Tensor:
        """(Hq, T) logit offset at each step: strength · (logit c[0] − logit c[t])."""
        c = self.curve[layer]
        logit = torch.log(c) - torch.log1p(-c)
        return self.strength * (logit[:, :1] - logit)

    def scores_for(self, layer, query, key, keep):
        flags = self.selected(layer, query.shape[1], query.device)
        if flags is None or self.strength == 0.0:
            return []
        B, H, Nq, Nk = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        first = self.keys.shape[1] - 1  # query position of step 0
        t = torch.arange(Nk - Nq, Nk) - first  # each query's step (negative: a prompt row)
        if int(t[-1]) <= 0:
            return []  # no query past step 0: the offset is 0 everywhere
        sb = self.step_bias(layer)
        per_q = torch.where(t.view(1, Nq) > 0, sb[:, t.clamp(0, sb.shape[1] - 1)], 0.0)  # (H, Nq)
        per_q = torch.where(flags.view(H, 1).cpu(), per_q, 0.0)
        img = image_keys_for(self.keys, B, Nk, query.device)
        return [StepBias(per_q.to(query.device), img, Nk - Nq)]

    def reference(self, logits, values, layer):
        logits = logits.clone()
        B, _, Nq, Nk = logits.shape
        img = image_keys_for(self.keys, B, Nk)
        sb = self.step_bias(layer)
        first = self.keys.shape[1] - 1
        for h in self.heads.get(layer, ()):
            for i in range(Nq):
                t = Nk - Nq + i - first
                if t > 0:
                    off = float(sb[h, min(t, sb.shape[1] - 1)])
                    row = logits[:, h, i]
                    logits[:, h, i] = torch.where(img & torch.isfinite(row), row + off, row)
        return softmax_rows(logits) @ values

    def __repr__(self):
        return f"hold_visual({self.heads_spec!r}, steps={self.curve.shape[2]}, strength={self.strength:g})"


class StepBias(Bias):
    """``s + per_q[h, q − q0] · img[b, kv]``: one offset per head and query row on the image keys."""

    def __init__(self, per_q: Tensor, img: Tensor, q0: int):
        self.per_q, self.img, self.q0 = per_q, img, q0

    def bias(self, b, h, q_idx, kv_idx):
        return self.per_q[h, q_idx - self.q0] * self.img[b, kv_idx].to(self.per_q.dtype)

    def check(self, batch, heads, q_len, k_len):
        if self.per_q.shape != (heads, q_len) or self.img.shape != (batch, k_len):
            raise ValueError(
                f"step bias: tables {tuple(self.per_q.shape)}, {tuple(self.img.shape)} do not fit a call of ({batch}, {heads}, {q_len}, {k_len})"
            )

    def __repr__(self):
        return f"step_bias({'x'.join(map(str, self.per_q.shape))})"


class AblateVisual(_Visual):
    name = "ablate_visual"

    def table(self, layer, batch, heads, k_len, device):
        return self.bias_table(layer, batch, heads, k_len, device, -math.inf)

    def scores_for(self, layer, query, key, keep):
        table = self.call_table(layer, query, key)
        return [] if table is None else [KeyBias(table)]

    def weight_factors(self, B, Nk):
        img = image_keys_for(self.keys, B, Nk)
        return torch.where(img, torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))

    def __repr__(self):
        return f"ablate_visual({self.heads_spec!r})"


def amplify_visual(keys, heads, alpha: float, mode: str = "weights") -> AmplifyVisual:
    """Image-key weights times ``alpha`` on ``heads``, rows renormalised; ``mode="logits"``:
    PAI's ``s + alpha |s|`` on image logits."""
    return AmplifyVisual(keys, heads, alpha, mode)


def calibrate_visual(keys, blind, heads, beta: float = 0.5, boost: float = 1.0) -> CalibrateVisual:
    """Weights of ``blind`` image keys times ``beta``, of the other image keys times
    ``boost``, rows renormalised, on ``heads``."""
    return CalibrateVisual(keys, blind, heads, beta, boost)


def hold_visual(keys, heads, curve, strength: float = 1.0) -> HoldVisual:
    """Drift-corrected visual attention: image logits of step t's query shifted by
    ``strength · (logit curve[l, h, 0] − logit curve[l, h, t])``."""
    return HoldVisual(keys, heads, curve, strength)


def ablate_visual(keys, heads="all") -> AblateVisual:
    """Image keys hidden from ``heads``."""
    return AblateVisual(keys, heads)
