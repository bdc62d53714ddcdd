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

import weakref
from dataclasses import dataclass, field

import torch

from ..api import attention
from ..mods import Mask, ScoreMod, bias, causal, document, softcap, window
from ..mods.masks import And
from .heads import HeadMask, HeadScore, combine_sinks, merge_heads, split_heads
from .masks import KeyMask, MaskSpec, tensor_to_attnkit, to_attnkit
from .switch import active_switch

Tensor = torch.Tensor

#: module -> the edits ``attnkit.steer.apply`` puts on it: an object with
#: ``scores(layer, query, key, keep) -> [ScoreMod]`` (run after the model's own mods, on
#: every call whatever switch is in force, so a steered model can be switched and observed
#: inside ``hf.use``) and ``output(layer, out, keep) -> out`` on (B, Hq, Nq, Dv) before the
#: heads merge. ``keep`` is the padding mask's (B, Nk) kept keys, or None.
EDITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class ModelAttention:
    """The model's own attention for one call, in attnkit terms."""

    mask: Mask | None
    scores: list[ScoreMod]
    scale: float | None
    sinks: Tensor | None
    position_bias: Tensor | None  # kept apart: a per-head tensor to slice when heads split
    steer: list[ScoreMod] = field(default_factory=list)  # attnkit.steer's mods, after the model's

    def score(self, heads: Tensor | None = None) -> list[ScoreMod]:
        """The model's score mods, for all heads or ``heads``: soft-capping, then the
        position bias (transformers' order: its flex backend caps first, then adds)."""
        pb = self.position_bias
        if pb is not None and heads is not None and pb.shape[1] > 1:
            pb = pb[:, heads]
        if self.steer and heads is not None:
            raise ValueError(
                "heads: attnkit.steer's interventions name heads of the whole layer, so they cannot run inside a switch "
                "that gives some heads a mechanism of their own; switch all heads, or steer without heads="
            )
        return self.scores + ([bias(pb)] if pb is not None else []) + self.steer


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


def attnkit_attention_forward(
    module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None, dropout: float = 0.0, **kwargs
):
    """The function registered as ``attn_implementation="attnkit"``."""
    if dropout:
        raise ValueError(
            f"dropout: attnkit attention has no attention dropout, but {type(module).__name__} asked for p={dropout} "
            "(the model is in training mode); call model.eval() or set the config's attention dropout to 0"
        )
    switch, layer = active_switch(module)
    if switch is not None and switch.context_parallel is not None:
        from .context_parallel import sharded_attention

        out = sharded_attention(switch, layer, module, query, key, value, attention_mask, scaling, kwargs)
        return out.transpose(1, 2).contiguous(), None
    model = model_attention(module, query, key, attention_mask, scaling, kwargs)
    rows_interact = switch is not None and not switch.plain and switch.applies_to(layer)
    query, key, value = clean_padding(module, query, key, value, model.mask, rows_interact)
    edit = EDITS.get(module)
    keep = None
    if edit is not None:
        keep = _padding_keep(model.mask)
        model.steer = list(edit.scores(layer, query, key, keep))
    if switch is None or not switch.applies_to(layer):
        out = attention(query, key, value, mask=model.mask, score=model.score() or None, scale=model.scale, sinks=model.sinks)
    else:
        out = _switched(switch, layer, query, key, value, model)
    if edit is not None:
        out = edit.output(layer, out, keep)
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
        return _run(
            switch, layer, mech, query, key, value, mask=mask, score=scores or None, scale=model.scale, sinks=sinks, **observe
        )

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
    changed = _run(
        switch,
        layer,
        switch.mechanism_for(layer, q, k, v),
        q,
        k,
        v,
        mask=_and(model.mask, switch.mask),
        score=(model.score(idx) + ([switch.score] if switch.score is not None else [])) or None,
        scale=model.scale,
        sinks=None if sinks is None else sinks[idx],
    )
    parts = [(changed, idx)]
    if rest.numel():
        q, k, v = split_heads(query, key, value, rest)
        kept = attention(
            q,
            k,
            v,
            mask=model.mask,
            score=model.score(rest) or None,
            scale=model.scale,
            sinks=None if model.sinks is None else model.sinks[rest],
        )
        parts.append((kept, rest))
    return merge_heads(parts, num_heads)


def _run(switch, layer_index, mech, q: Tensor, k: Tensor, v: Tensor, **call) -> Tensor:
    """One call of the switch's mechanism (None: softmax). transformers hands over the
    cached keys and values with the new queries (Nq < Nk when decoding against a cache),
    which is all most mechanisms need; a mechanism whose rows depend on the rest of the
    call refuses it, and one with state left by earlier queries (selective attention,
    multi-token attention) gets what the switch kept from the calls that filled the cache."""
    if mech is None:
        return attention(q, k, v, **call)
    q_len, k_len = q.shape[2], k.shape[2]
    if q_len < k_len and not mech.decodes:
        raise ValueError(
            f"mechanism: {mech.name!r} cannot decode against a KV cache ({k_len - q_len} cached keys): {mech.decode_note} "
            "Run the model without a cache (use_cache=False) so that every step sees the whole sequence."
        )
    if not mech.cache_state:
        return attention(q, k, v, mechanism=mech, **call)
    before = switch.decode_state_before(layer_index, q.shape[0], k_len - q_len, mech.name)
    initial = mech.initial_state_for(None if before is None else before.to(q.device), q_len)
    present = {name: value for name, value in call.items() if value is not None}
    out, state = mech(q, k, v, initial_state=initial, return_state=True, **present)
    switch.decode_states[layer_index] = (state, k_len)
    return out


def clean_padding(
    module, query: Tensor, key: Tensor, value: Tensor, mask: Mask | None, rows_interact: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """Zero the padded slots of q, k and v before any mechanism sees them.

    A padded slot holds whatever the model computed from a pad token, possibly NaN or inf
    (an embedding never trained, a cache slot never written). The mask already hides
    padded keys, but NaN survives a product with a zero weight, and several mechanisms
    read keys or queries outside the weights (gates computed from k in linear attention,
    the selection of earlier queries in selective attention, convolutions over queries
    in multi-token attention). Padded query rows are the model's don't-care rows; in
    self-attention they are the last Nq key positions, so the same key mask names them.
    Where rows interact (a mechanism other than softmax: convolutions over queries,
    selections carried from query to query) they are zeroed, as the same rows run alone
    would see; for softmax, whose rows are independent, only their non-finite entries
    are, so a padded row's output stays the model's own (meters that read every row
    still match the model's eager attention)."""
    keep = _padding_keep(mask)
    if keep is None:
        return query, key, value
    zero = torch.zeros((), dtype=key.dtype, device=key.device)
    k_keep = keep.view(keep.shape[0], 1, keep.shape[1], 1)
    key, value = torch.where(k_keep, key, zero), torch.where(k_keep, value, zero)
    q_len, k_len = query.shape[2], key.shape[2]
    cross = getattr(module, "is_cross_attention", False) or "CrossAttention" in type(module).__name__
    if not cross and q_len <= k_len:
        q_keep = k_keep[:, :, k_len - q_len :]
        query = torch.where(q_keep if rows_interact else q_keep | torch.isfinite(query), query, zero)
    return query, key, value


def _padding_keep(mask: Mask | None) -> Tensor | None:
    """The (B, Nk) keys a transformers padding mask keeps, from the and-parts of ``mask``."""
    if isinstance(mask, KeyMask):
        return mask.keep
    if not isinstance(mask, And):
        return None
    keeps = [k for k in (_padding_keep(p) for p in mask.parts) if k is not None]
    if not keeps:
        return None
    out = keeps[0]
    for k in keeps[1:]:
        out = out & k
    return out


def _and(a: Mask | None, b: Mask | None) -> Mask | None:
    if a is None or b is None:
        return a if b is None else b
    return a & b
