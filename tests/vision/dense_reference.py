"""Dense float64 attention written from the papers' formulas, independent of attnkit: an
attention function registered in transformers with transformers' eager mask.

    s = scale * q k^T (GQA heads repeated)        then CHANGE's logit edits on image keys,
    A = softmax over the visible keys             (a row with none is all zeros, not NaN),
                                                  then CHANGE's weight edits, renormalised,
    o = A v.

Eager attention in float64 turns a left-padded row into NaN (its padded query rows see
no key), which then reaches every real row through the padded values; this one leaves
those rows at zero, so the batches can be padded. ``PROBS[layer]`` keeps each decoder
layer's A (what ``output_attentions`` returns too). Vision-tower calls (no layer index)
run unchanged.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

DENSE = "attnkit_test_vision_dense"
CHANGE: dict = {}
PROBS: dict = {}


def _image(b_rows: int, nk: int) -> torch.Tensor:
    img = CHANGE["image"]
    out = torch.zeros(b_rows, nk, dtype=torch.bool)
    n = min(nk, img.shape[1])
    out[:, :n] = img[:, :n]
    return out


def dense(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    layer = getattr(module, "layer_idx", None)
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).double()
    v = value.repeat_interleave(groups, dim=1).double()
    s = query.double() @ k.transpose(-1, -2) * scaling
    B, H, nq, nk = s.shape
    if attention_mask is not None:
        visible = (attention_mask == 0).expand(B, H, nq, nk)
    elif getattr(module, "is_causal", False):
        visible = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq).expand(B, H, nq, nk)
    else:
        visible = torch.ones(B, H, nq, nk, dtype=torch.bool)
    decoder = isinstance(layer, int) and "image" in CHANGE
    heads = CHANGE.get("heads", {}).get(layer, []) if decoder else []
    img = _image(B, nk).view(B, 1, nk) if decoder else None
    for h in heads:
        if "pai" in CHANGE:  # PAI: image logits + alpha |logit|
            s[:, h] = torch.where(img, s[:, h] + CHANGE["pai"] * s[:, h].abs(), s[:, h])
        if "hold" in CHANGE:  # step t = query position - (N0 - 1); offset on image logits for t > 0
            offsets = CHANGE["hold"][layer][h]  # list, per step
            n0 = CHANGE["image"].shape[1]
            for i in range(nq):
                t = nk - nq + i - (n0 - 1)
                if t > 0:
                    s[:, h, i] = torch.where(img[:, 0], s[:, h, i] + offsets[min(t, len(offsets) - 1)], s[:, h, i])
    s = s.masked_fill(~visible, -math.inf)
    top = s.amax(-1, keepdim=True)
    e = torch.where(visible, torch.exp(s - torch.where(torch.isfinite(top), top, 0.0)), 0.0)
    a = e / e.sum(-1, keepdim=True).where(e.sum(-1, keepdim=True) > 0, torch.ones(()))
    f64 = lambda x: torch.tensor(float(x), dtype=torch.float64)  # noqa: E731  (a bare float in torch.where is float32)
    for h in heads:
        factor = None
        if "weights" in CHANGE:
            factor = torch.where(img, f64(CHANGE["weights"]), f64(1))
        if "calibrate" in CHANGE:
            blind, beta, boost = CHANGE["calibrate"]
            bl = torch.zeros(B, nk, dtype=torch.bool)
            bl[:, : blind.shape[1]] = blind[:, :nk]
            factor = torch.where(bl.view(B, 1, nk), f64(beta), torch.where(img, f64(boost), f64(1)))
        if "ablate" in CHANGE:
            factor = torch.where(img, f64(0), f64(1))
        if factor is not None:
            w = a[:, h] * factor
            total = w.sum(-1, keepdim=True)
            a[:, h] = torch.where(total > 0, w / torch.where(total > 0, total, 1.0), 0.0)
    if isinstance(layer, int):
        PROBS[layer] = a.clone()
    o = a @ v
    return o.to(query.dtype).transpose(1, 2).contiguous(), a


AttentionInterface.register(DENSE, dense)
AttentionMaskInterface.register(DENSE, eager_mask)


def run_dense(model, change: dict | None = None, **inputs):
    """The model's forward on the dense reference with ``change``; returns (output, PROBS)."""
    CHANGE.clear()
    CHANGE.update(change or {})
    PROBS.clear()
    previous = {id(c): (c, c._attn_implementation_internal) for c in _configs(model)}
    model.set_attn_implementation(DENSE)
    try:
        with torch.no_grad():
            return model(**inputs), dict(PROBS)
    finally:
        for c, impl in previous.values():
            c._attn_implementation_internal = impl
        CHANGE.clear()


def _configs(model):
    out = [model.config]
    for key in getattr(model.config, "sub_configs", {}):
        sub = getattr(model.config, key, None)
        if sub is not None:
            out.append(sub)
    return out
