"""The attention function attnkit registers in transformers' ``AttentionInterface``.

transformers calls it as ``fn(module, query, key, value, attention_mask, scaling=...,
dropout=..., **kwargs)`` with q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) after RoPE and
the cache update, GQA heads not repeated, and expects (out (B, Nq, Hq, Dv), weights).
What the model itself does to attention — its mask (causal, sliding window, padding,
packed sequences), logit soft-capping, learned sinks, position biases, scaling — is read
from these arguments and reproduced exactly; what ``attnkit.hf.use`` asks for is then
applied on top, on the layers and heads it selects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api import attention
from ..mods import Mask, ScoreMod, bias, causal, document, softcap, window
from .heads import HeadMask, HeadScore, combine_sinks, merge_heads, split_heads
from .masks import MaskSpec, tensor_to_attnkit, to_attnkit

Tensor = torch.Tensor


@dataclass
class ModelAttention:
    """The model's own attention for one call, in attnkit terms."""

    mask: Mask | None
    scores: list[ScoreMod]
    scale: float | None
    sinks: Tensor | None
    position_bias: Tensor | None  # kept apart: a per-head tensor to slice when heads split

    def score(self, heads: Tensor | None = None) -> list[ScoreMod]:
        """The model's score mods, for all heads or ``heads``: soft-capping, then the
        position bias (transformers' order: its flex backend caps first, then adds)."""
        pb = self.position_bias
        if pb is not None and heads is not None and pb.shape[1] > 1:
            pb = pb[:, heads]
        return self.scores + ([bias(pb)] if pb is not None else [])


def model_attention(module, query: Tensor, key: Tensor, attention_mask, scaling, kwargs: dict) -> ModelAttention:
    q_len, k_len = query.shape[2], key.shape[2]
    mask, extra_bias = _model_mask(module, attention_mask, q_len, k_len, kwargs)
    position_bias = kwargs.get("position_bias")
    if extra_bias is not None:
        position_bias = extra_bias if position_bias is None else position_bias + extra_bias
    scores = []
    cap = kwargs.get("softcap")
    if cap is not None:
        scores.append(softcap(float(cap)))
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if sinks is not None:
        sinks = sinks.to(torch.float64 if query.dtype == torch.float64 else torch.float32)
    scale = None if scaling is None else float(scaling)
    return ModelAttention(mask, scores, scale, sinks, position_bias)


def _model_mask(module, attention_mask, q_len: int, k_len: int, kwargs: dict) -> tuple[Mask | None, Tensor | None]:
    if isinstance(attention_mask, MaskSpec):
        return to_attnkit(attention_mask, q_len, k_len), None
    if isinstance(attention_mask, Tensor):
        return tensor_to_attnkit(attention_mask)
    if attention_mask is not None:
        raise ValueError(
            f"attention_mask: {type(attention_mask).__name__} from {type(module).__name__} is not a mask attnkit reads; "
            "expected the mask transformers builds through AttentionMaskInterface, a 4-D tensor, or None"
        )
    # No mask was built (a model that passes none, or a call without the mask step): the
    # module's own flags say what the other backends would do.
    mask = None
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", False)
    if is_causal:
        mask = causal()  # bottom-right aligned, so also right for decoding against a cache
    sliding = kwargs.get("sliding_window")
    if sliding is not None and mask is not None:
        mask = window(int(sliding) - 1)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and torch.equal(cu_q, cu_k) and q_len == k_len:
        # Packed varlen batch (flash-attention style): one document per sequence.
        ids = torch.bucketize(torch.arange(k_len, device=cu_k.device), cu_k[1:], right=True)
        mask = document(ids) if mask is None else mask & document(ids)
    return mask, None


def attnkit_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """The function registered as ``attn_implementation="attnkit"``."""
    from .switch import active_switch

    if dropout:
        raise ValueError(
            f"dropout: attnkit attention has no attention dropout, but {type(module).__name__} asked for p={dropout} "
            "(the model is in training mode); call model.eval() or set the config's attention dropout to 0"
        )
    model = model_attention(module, query, key, attention_mask, scaling, kwargs)
    switch, layer = active_switch(module)
    if switch is None or not switch.applies_to(layer):
        out = attention(query, key, value, mask=model.mask, score=model.score() or None, scale=model.scale, sinks=model.sinks)
    else:
        out = _switched(switch, layer, query, key, value, model)
    return out.transpose(1, 2).contiguous(), None


def _switched(switch, layer, query, key, value, model: ModelAttention) -> Tensor:
    num_heads = query.shape[1]
    sink_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    extra_sinks = switch.sinks_for(layer, num_heads, query.device)
    observe = {"observers": switch.observers, "layer": layer} if switch.observers else {}
    if switch.heads is None:
        mask = _and(model.mask, switch.mask)
        scores = model.score() + ([switch.score] if switch.score is not None else [])
        sinks = combine_sinks(model.sinks, extra_sinks, None, sink_dtype)
        mech = switch.mechanism_for(layer, query, key, value)
        return attention(query, key, value, mask=mask, score=scores or None, scale=model.scale, sinks=sinks, mechanism=mech, **observe)

    selected = switch.head_flags(num_heads, query.device)
    if switch.plain:
        # Softmax: gate the change per head inside one call.
        mask = model.mask if switch.mask is None else _and(model.mask, HeadMask(switch.mask, selected))
        scores = model.score() + ([HeadScore(switch.score, selected)] if switch.score is not None else [])
        sinks = combine_sinks(model.sinks, extra_sinks, selected, sink_dtype)
        return attention(query, key, value, mask=mask, score=scores or None, scale=model.scale, sinks=sinks, **observe)

    # Another mechanism on some heads: its own call; the rest stay the model's softmax.
    idx = selected.nonzero().view(-1)
    rest = (~selected).nonzero().view(-1)
    sinks = combine_sinks(model.sinks, extra_sinks, None, sink_dtype)
    q, k, v = split_heads(query, key, value, idx)
    changed = attention(q, k, v, mask=_and(model.mask, switch.mask),
                        score=(model.score(idx) + ([switch.score] if switch.score is not None else [])) or None,
                        scale=model.scale, sinks=None if sinks is None else sinks[idx],
                        mechanism=switch.mechanism_for(layer, q, k, v))
    parts = [(changed, idx)]
    if rest.numel():
        q, k, v = split_heads(query, key, value, rest)
        kept = attention(q, k, v, mask=model.mask, score=model.score(rest) or None, scale=model.scale,
                         sinks=None if model.sinks is None else model.sinks[rest])
        parts.append((kept, rest))
    return merge_heads(parts, num_heads)


def _and(a: Mask | None, b: Mask | None) -> Mask | None:
    if a is None or b is None:
        return a if b is None else b
    return a & b
