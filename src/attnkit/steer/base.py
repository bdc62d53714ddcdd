"""What every intervention is: a small object bound to a model by ``steer.apply``.

An intervention contributes, for each attention call of a layer, score mods (run inside
the kernels after the model's own logits) and an output transform on the per-head
outputs (B, Hq, Nq, Dv) before the heads merge. Neither materialises attention weights,
so a steered model keeps attnkit's O(N) memory, every mask and the KV cache. Each also
has ``reference``: the paper's formula on dense float64 logits, which tests hold the
kernels to.
"""

from __future__ import annotations

import copy

import torch

from .targets import model_shape, resolve_heads

Tensor = torch.Tensor


class Intervention:
    """Base class. Subclasses set ``name`` and override ``scores_for``/``output_for``."""

    name = "intervention"

    def __init__(self, heads) -> None:
        self.heads_spec = heads
        self.heads: dict[int, tuple[int, ...]] | None = None  # resolved by ``bind``
        self.num_layers: int | None = None
        self.num_heads: int | None = None

    # -- binding ------------------------------------------------------------------------
    def bind(self, model) -> Intervention:
        """A copy resolved against ``model`` (heads checked); the original stays reusable."""
        bound = copy.copy(self)
        layers, heads = model_shape(model)
        bound.num_layers, bound.num_heads = layers, heads
        bound.heads = resolve_heads(self.heads_spec, layers, heads)
        bound.check(model)
        return bound

    def bound_heads(self) -> dict[int, tuple[int, ...]]:
        """``heads`` as ``bind`` resolved them (``steer.apply`` binds an intervention before it runs)."""
        if self.heads is None:
            raise RuntimeError(f"{self!r} is not bound to a model; steer.apply(model, ...) binds it")
        return self.heads

    def check(self, model) -> None:
        """Further checks against the model (raise ValueError naming the argument)."""

    def prepare(self, model) -> None:
        """Work done once before steering starts (e.g. mean ablation's reference run)."""

    def hooks(self, model) -> list:
        """torch hook handles to remove when steering ends."""
        return []

    # -- per call ----------------------------------------------------------------------
    def selected(self, layer, num_heads: int, device) -> Tensor | None:
        """(Hq,) bool flags of the chosen heads of ``layer``, or None when it has none."""
        heads = self.bound_heads().get(layer)
        if not heads:
            return None
        if num_heads != self.num_heads:
            raise ValueError(
                f"heads: checked against {self.num_heads} query heads per layer, but layer {layer}'s call has {num_heads}"
            )
        flags = torch.zeros(num_heads, dtype=torch.bool, device=device)
        flags[list(heads)] = True
        return flags

    def scores_for(self, layer, query: Tensor, key: Tensor, keep: Tensor | None) -> list:
        return []

    def output_for(self, layer, out: Tensor, keep: Tensor | None) -> Tensor:
        return out

    def reference(self, logits: Tensor, values: Tensor, layer: int) -> Tensor:
        """Dense float64 formula: ``logits`` (B, Hq, Nq, Nk) with -inf on hidden keys,
        ``values`` (B, Hq, Nk, Dv) -> out (B, Hq, Nq, Dv)."""
        raise NotImplementedError

    def __repr__(self):
        return f"{self.name}({self.heads_spec!r})"


def query_keep(keep: Tensor | None, out: Tensor) -> Tensor | None:
    """(B, Nq) real query rows of a self-attention call, from the (B, Nk) kept keys."""
    if keep is None:
        return None
    return keep[:, keep.shape[1] - out.shape[2] :]


def softmax_rows(logits: Tensor) -> Tensor:
    """softmax over keys, rows with no visible key all zero (attnkit's convention)."""
    top = logits.amax(-1, keepdim=True).clamp(min=torch.finfo(logits.dtype).min)
    w = torch.exp(logits - top)
    total = w.sum(-1, keepdim=True)
    return torch.where(total > 0, w / total.clamp(min=torch.finfo(logits.dtype).tiny), torch.zeros_like(w))
