"""Gate-Norm: skip the attention sublayers that mute themselves (the attention-suppression
paper of the reading lists: "some deep attention layers learn to mute their own
contribution"; Gate-Norm "ranks attention sublayers by query--key coupling and removes
the least coupled ones", from the weights alone).

Coupling of a layer, as computed here: the mean over query heads h of ``‖M_h‖_F`` with
``M_h = (W_Q,h diag(g))ᵀ (W_K,h diag(g))``, the bilinear form that turns a residual-stream
vector into the head's logits (``g``: the pre-attention norm's weight, folded in because
it scales both sides). ``‖AᵀB‖_F² = Σ (A Aᵀ) ⊙ (B Bᵀ)`` keeps it at O(d_head² d) per
head. A layer is skipped by making its attention sublayer add nothing to the residual
stream (pre-norm decoders: Llama-style and GPT-2). The abstract does not give the exact
norm; this is the team's reading of "query-key coupling".
"""

from __future__ import annotations

import torch
from torch import nn

from ..extras import require
from .base import Intervention

Tensor = torch.Tensor


def _attention_modules(model) -> list[tuple[nn.Module, Tensor, Tensor, Tensor | None, int, int]]:
    """Per layer: (module, W_Q (Hq*dh, d), W_K (Hkv*dh, d), norm weight or None, Hq, Hkv)."""
    require("transformers", "attnkit.steer's pruning")
    from transformers import PreTrainedModel

    out = []
    for parent in model.modules():
        for child in parent.children():
            if hasattr(child, "q_proj") and hasattr(child, "k_proj") and hasattr(parent, "input_layernorm"):
                norm = parent.input_layernorm.weight.detach()
                if "Gemma" in type(parent.input_layernorm).__name__:
                    norm = 1.0 + norm  # Gemma's RMSNorm multiplies by (1 + weight)
                cfg = child.config
                hq = cfg.num_attention_heads
                hkv = getattr(cfg, "num_key_value_heads", None) or hq
                out.append((child, child.q_proj.weight.detach(), child.k_proj.weight.detach(), norm, hq, hkv))
            elif (
                type(child).__name__ == "GPT2Attention"
                and not getattr(child, "is_cross_attention", False)
                and hasattr(parent, "ln_1")
            ):
                d = child.embed_dim
                w = child.c_attn.weight.detach()  # Conv1D: (d, 3d), x @ w
                out.append((child, w[:, :d].T, w[:, d : 2 * d].T, parent.ln_1.weight.detach(), child.num_heads, child.num_heads))
    if not out:
        name = type(model).__name__ if isinstance(model, PreTrainedModel) else type(model).__name__
        raise ValueError(
            f"model: prune_layers reads W_Q and W_K of pre-norm decoder attention (Llama-style q_proj/k_proj "
            f"after input_layernorm, or GPT-2); {name} has none (a post-norm encoder such as BERT has no "
            "sublayer that can be skipped without changing its norm)"
        )
    return out


def coupling_scores(model) -> list[float]:
    """Gate-Norm coupling per layer (see the module docstring), in layer order."""
    scores = []
    for _, wq, wk, norm, hq, hkv in _attention_modules(model):
        wq, wk = wq.double(), wk.double()
        if norm is not None:
            wq, wk = wq * norm.double(), wk * norm.double()
        dh = wq.shape[0] // hq
        per_head = []
        for h in range(hq):
            a = wq[h * dh : (h + 1) * dh]
            g = h // (hq // hkv)
            b = wk[g * dh : (g + 1) * dh]
            per_head.append(torch.sqrt(((a @ a.T) * (b @ b.T)).sum().clamp(min=0)))
        scores.append(float(torch.stack(per_head).mean()))
    return scores


class LayerPruning(Intervention):
    """Skips ``layers``' attention sublayers; ``ranking`` lists (layer, coupling) from the
    least coupled up."""

    name = "prune_layers"

    def __init__(self, layers: list[int], ranking: list[tuple[int, float]]):
        super().__init__({layer: [0] for layer in layers} if layers else {})
        self.layers, self.ranking = list(layers), ranking

    def bind(self, model):
        bound = super().bind(model) if self.layers else self
        return bound

    def hooks(self, model):
        modules = [m for m, *_ in _attention_modules(model)]
        handles = []
        for layer in self.layers:
            handles.append(modules[layer].register_forward_hook(_zero_output))
        return handles

    def reference(self, logits, values, layer):
        raise NotImplementedError("prune_layers removes whole sublayers; its reference is the model without them")

    def __repr__(self):
        return f"prune_layers({self.layers})"


def _zero_output(module, args, output):
    if isinstance(output, tuple):
        return (torch.zeros_like(output[0]),) + tuple(output[1:])
    return torch.zeros_like(output)


def prune_layers(model, k: int) -> LayerPruning:
    """Gate-Norm: rank attention sublayers by query-key coupling (weights only) and return
    the intervention that skips the ``k`` least coupled (``.layers``, ``.ranking``)."""
    scores = coupling_scores(model)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= len(scores):
        raise ValueError(f"k: expected an int in [0, {len(scores)}] (the model has {len(scores)} attention sublayers), got {k!r}")
    ranking = sorted(enumerate(scores), key=lambda item: (item[1], item[0]))
    return LayerPruning(sorted(layer for layer, _ in ranking[:k]), [(layer, score) for layer, score in ranking])
