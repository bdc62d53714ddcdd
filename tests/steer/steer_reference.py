"""The dense float64 reference for steering tests, written here from the papers'
formulas (independent of attnkit.steer): an attention function registered in
transformers with transformers' eager mask, that computes

    s = scale * q k^T (+ the model's soft-cap),  changed by CHANGE's logit edits,
    A = softmax(s + mask),                        changed by CHANGE's weight edits,
    o = A v,                                      changed by CHANGE's output edits,

on the heads CHANGE names per layer. ``RECORD`` collects, when set, each layer's per-head
output sum and count over real query rows (for mean ablation)."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

DENSE = "attnkit_test_steer_dense"
CHANGE: dict = {}
RECORD: dict = {}


def _bins(keep, bins):
    """Relative-position bin of each real key: floor(rank * bins / n_real)."""
    out = torch.full(keep.shape, -1, dtype=torch.long)
    for b in range(keep.shape[0]):
        real = keep[b].nonzero().view(-1).tolist()
        for rank, j in enumerate(real):
            out[b, j] = min(rank * bins // len(real), bins - 1)
    return out


def dense(module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None, **kwargs):
    layer = module.layer_idx
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).double()
    v = value.repeat_interleave(groups, dim=1).double()
    s = query.double() @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    B, H, nq, nk = s.shape
    heads = CHANGE.get("heads", {}).get(layer, [])
    keep = CHANGE.get("keep")  # (B, Nk at the full length) real tokens
    keep = torch.ones(B, nk, dtype=torch.bool) if keep is None else keep[:, :nk]
    for h in heads:
        if "temperature" in CHANGE:
            s[:, h] = s[:, h] / CHANGE["temperature"]
        if "disperse" in CHANGE:
            s[:, h] = s[:, h] * (1.0 - CHANGE["disperse"])
    if attention_mask is not None:
        s = s + attention_mask.double()
    a = torch.softmax(s, dim=-1)
    for h in heads:
        if "emphasize" in CHANGE:  # PASTA: weights outside the spans times alpha, renormalised
            inside, alpha = CHANGE["emphasize"]
            w = a[:, h] * torch.where(
                inside[:, :nk], torch.tensor(1.0, dtype=torch.float64), torch.tensor(alpha, dtype=torch.float64)
            ).view(B, 1, nk)
            a[:, h] = w / w.sum(-1, keepdim=True)
        if "calibrate" in CHANGE:  # weights divided by ratio[bin]^strength, renormalised
            ratio, strength = CHANGE["calibrate"]
            bins = _bins(keep, ratio.shape[-1])
            r = ratio[layer, h][bins.clamp(min=0)]
            w = a[:, h] / r.view(B, 1, nk) ** strength
            a[:, h] = w / w.sum(-1, keepdim=True)
    o = a @ v
    for h in heads:
        if "scale" in CHANGE:
            o[:, h] = o[:, h] * CHANGE["scale"]
        if "ablate" in CHANGE:
            o[:, h] = 0.0 if CHANGE["ablate"] is None else CHANGE["ablate"][layer][h]
    if "record" in CHANGE:
        rows = keep[:, nk - nq :].double()
        total = torch.einsum("bhnd,bn->hd", o, rows)
        prev = RECORD.get(layer, (0.0, 0.0))
        RECORD[layer] = (prev[0] + total, prev[1] + float(rows.sum()))
    return o.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(DENSE, dense)
AttentionMaskInterface.register(DENSE, eager_mask)


def run_dense(model, change: dict, **inputs):
    CHANGE.clear()
    CHANGE.update(change)
    previous = model.config._attn_implementation
    model.set_attn_implementation(DENSE)
    try:
        with torch.no_grad():
            return model(**inputs)
    finally:
        model.set_attn_implementation(previous)
        CHANGE.clear()


def outputs(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state
