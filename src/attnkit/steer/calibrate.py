"""Position-bias calibration of attention, for causal LMs and for embedding encoders.

- Causal LMs, Found in the Middle (Hsieh et al. 2024, arXiv 2406.16008): attention to a
  document is relevance plus a positional bias, and the bias is what a content-free
  document receives at the same position: ``Attn_cal(doc, k) = Attn(doc, k) −
  Attn(dummy, k)``. Here the bias is measured on content-free prompts (``texts``): the
  attention the last real token puts on each relative-position bin of the prompt.
- Encoders, the embedding-model attention calibration of the reflection-bias study in
  the reading lists: pooled embeddings over-represent early segments because the rows
  an embedding is pooled from put front-loaded attention on early tokens; calibration
  "redistributes attention more evenly across positions". The bias is the attention
  the pooled rows (every real token, mean pooling) put on each relative-position bin,
  measured on reference ``texts``.

Both are applied the same way inside the kernels: the measured mass of bin j relative to
its share of the tokens, ``r[l, h, j]`` (1 for no bias), is divided out of the weights,
``A' ∝ A / r^strength`` — ``s + (−strength · log r[l, h, bin(key)])``, an additive bias
per head and key. Subtracting the bias in log space keeps every weight positive (FiM's
difference of weights can go negative), and a prompt like the content-free ones gets
weights in proportion to each bin's share of tokens at strength 1. A key's bin is its
rank among the call's real keys times ``bins`` over their number. With
``special="exclude"`` the special tokens the tokenizer adds at either end ([CLS], [SEP],
BOS; attention sinks rather than content) are left out of the bins and unchanged, and
the ratio is measured on the share of the content attention each bin takes. (Measured
on all-MiniLM-L6-v2: the default, which also moves mass off [CLS] in the first bin,
removes the position-bias probe's first-versus-last gap; "exclude" barely changes it,
so the front-loading the probe sees sits largely in the first bin's sink.) Each call
bins the keys it sees, so when decoding with a KV cache the bins follow the growing
sequence.
"""

from __future__ import annotations

import math
from typing import cast

import torch

from .base import Intervention, softmax_rows
from .mods import KeyBias

Tensor = torch.Tensor


def key_bins(keep: Tensor, bins: int, edges: tuple[int, int] = (0, 0)) -> Tensor:
    """(B, Nk) long: the relative-position bin of every real key, -1 on padding and on
    the ``edges`` = (first, last) real keys left out (the tokenizer's special tokens)."""
    lead, trail = edges
    rank = keep.long().cumsum(-1) - 1 - lead
    n = (keep.long().sum(-1, keepdim=True) - lead - trail).clamp(min=1)
    b = torch.div(rank * bins, n, rounding_mode="floor").clamp(max=bins - 1)
    content = keep & (rank >= 0) & (rank < n)
    return torch.where(content, b, torch.full_like(b, -1))


class PositionCalibration(Intervention):
    """Divides measured positional attention ``ratio`` (L, Hq, bins) out of the weights."""

    name = "calibrate_positions"

    def __init__(self, ratio: Tensor, heads="all", strength: float = 1.0, kind: str = "encoder", edges: tuple[int, int] = (0, 0)):
        super().__init__(heads)
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength) or strength < 0:
            raise ValueError(f"strength: expected a finite number >= 0, got {strength!r}")
        self.ratio, self.strength, self.kind = ratio.double(), float(strength), kind
        self.bins = ratio.shape[-1]
        self.edges = cast("tuple[int, int]", tuple(edges))  # a (lead, trail) pair, as given

    def check(self, model):
        if self.ratio.shape[:2] != (self.num_layers, self.num_heads):
            raise ValueError(
                f"ratio: measured for {tuple(self.ratio.shape[:2])} (layers, heads), the model has "
                f"({self.num_layers}, {self.num_heads})"
            )

    def table(self, layer, batch: int, heads: int, keep: Tensor, device) -> Tensor | None:
        flags = self.selected(layer, heads, device)
        if flags is None or self.strength == 0.0:
            return None
        bins = key_bins(keep, self.bins, self.edges)  # (B, Nk)
        offset = -self.strength * torch.log(self.ratio[layer].to(device))  # (H, bins)
        values = offset[:, bins.clamp(min=0)].permute(1, 0, 2)  # (B, H, Nk)
        on = flags.view(1, heads, 1) & (bins >= 0).view(batch, 1, -1)
        return torch.where(on, values, torch.zeros((), dtype=values.dtype, device=device))

    def scores_for(self, layer, query, key, keep):
        B, H, Nk = query.shape[0], query.shape[1], key.shape[2]
        if keep is None:
            keep = torch.ones(B, Nk, dtype=torch.bool, device=query.device)
        table = self.table(layer, B, H, keep, query.device)
        return [] if table is None else [KeyBias(table)]

    def reference(self, logits, values, layer, keep: Tensor | None = None):
        # Weights divided by r^strength on the chosen heads, then renormalised.
        weights = softmax_rows(logits)
        B, H, _, Nk = weights.shape
        keep = torch.ones(B, Nk, dtype=torch.bool) if keep is None else keep
        bins = key_bins(keep, self.bins, self.edges)
        for h in self.bound_heads().get(layer, ()):
            r = self.ratio[layer, h][bins.clamp(min=0)]  # (B, Nk)
            w = weights[:, h] / r.unsqueeze(1) ** self.strength
            weights[:, h] = w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny)
        return weights @ values

    def __repr__(self):
        return f"calibrate_positions({self.kind}, bins={self.bins}, strength={self.strength:g})"


def _is_causal(model) -> bool:
    return bool(getattr(model, "can_generate", lambda: False)())


def special_edges(tokenizer) -> tuple[int, int]:
    """How many special tokens ``tokenizer`` adds before and after a text ([CLS] .. [SEP]: (1, 1))."""
    if tokenizer is None:
        return (0, 0)
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for lead in range(len(full) - len(plain) + 1):
        if full[lead : lead + len(plain)] == plain:
            return (lead, len(full) - len(plain) - lead)
    return (0, 0)


def measure_position_ratio(model, tokenizer, texts, bins: int, kind: str, edges: tuple[int, int] = (0, 0)) -> Tensor:
    """(L, Hq, bins): the share of the pooled rows' (encoder: every real token, 1/n each;
    causal: the last real token) content attention that each relative-position bin
    receives, over its share of the content tokens, averaged over ``texts``. Content:
    real keys but the ``edges`` (special tokens, which act as sinks and are left alone)."""
    from ..hf.switch import use
    from ..probes.pooled_mass import PooledSpanMass

    if isinstance(texts, str) or not isinstance(texts, (list, tuple)) or not texts:
        raise ValueError("texts: expected a non-empty list of reference texts (or of token-id lists)")
    mass: Tensor | None = None
    share = torch.zeros(bins, dtype=torch.float64)
    for i, text in enumerate(texts):
        if isinstance(text, str):
            if tokenizer is None:
                raise ValueError("tokenizer: text references need the tokenizer")
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
        else:
            ids = torch.as_tensor(text).long().view(1, -1)
        n = ids.shape[1]
        if n - sum(edges) < bins:
            raise ValueError(f"texts: reference {i} has {n - sum(edges)} content tokens, fewer than bins={bins}")
        keep = torch.ones(1, n, dtype=torch.bool)
        segs = key_bins(keep, bins, edges)
        rows = torch.full((1, n), 1.0 / n, dtype=torch.float64) if kind == "encoder" else torch.zeros(1, n, dtype=torch.float64)
        if kind == "causal":
            rows[0, -1] = 1.0
        meter = PooledSpanMass(rows, segs, bins)
        with torch.no_grad(), use(model, observers=[meter]):
            model(input_ids=ids)
        m = meter.per_example()[0]  # (L, H, bins)
        m = m / m.sum(-1, keepdim=True).clamp(min=1e-300)
        mass = m if mass is None else mass + m
        content = segs[0][segs[0] >= 0]
        share += torch.bincount(content, minlength=bins).double() / content.numel()
    assert mass is not None  # texts is non-empty (checked above)
    mass, share = mass / len(texts), share / len(texts)
    return (mass / share).clamp(min=1e-6)


def calibrate_positions(
    model, tokenizer=None, texts=None, *, bins: int = 8, strength: float = 1.0, heads="all", special: str = "include"
) -> PositionCalibration:
    """Measure the positional attention bias on ``texts`` and return the intervention that
    divides it out (see the module docstring). Causal LMs: ``texts`` are content-free
    prompts laid out like the real ones (Found in the Middle's dummy documents); encoders:
    any reference documents (the pooled rows' bias is measured on them). ``special``:
    "include" (every real token is a position, [CLS] too: the attention is spread evenly
    over all of them) or "exclude" (the tokenizer's special tokens are left alone and
    only the content's share is redistributed)."""
    from ..hf.switch import check_model

    check_model(model)
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins: expected an int >= 1, got {bins!r}")
    kind = "causal" if _is_causal(model) else "encoder"
    if special not in ("include", "exclude"):
        raise ValueError(f"special: expected 'include' or 'exclude', got {special!r}")
    edges = special_edges(tokenizer) if special == "exclude" else (0, 0)
    ratio = measure_position_ratio(model, tokenizer, texts, bins, kind, edges)
    return PositionCalibration(ratio, heads, strength, kind, edges)
