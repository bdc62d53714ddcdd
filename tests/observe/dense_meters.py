"""Every meter's quantity written literally on the dense float64 attention matrix.

These are the independent references the meters are tested against: they see the whole
(B, H, Nq, Nk) matrix at once, where the meters see tiles.
"""

from __future__ import annotations

import math

import torch

import attnkit as ak
from attnkit.kernels import make_request, reference_probabilities, reference_scores


def dense(q, k, v, **call):
    """(P, visible, S, positions of the queries) in float64."""
    req = make_request(q, k, v, **call)
    p = reference_probabilities(req, torch.float64)
    s, _ = reference_scores(req, torch.float64)
    vis = s != -math.inf
    pos = torch.arange(req.q_start, req.k_len)
    return p, vis, s, pos


def observe(q, k, v, meters, layer=0, **call):
    ak.attention(q, k, v, observers=meters, layer=layer, **call)
    return {(lay, h, m): val for meter in meters for lay, h, m, val in meter.rows()}


def rows_mean(x):
    """Mean over batch and query rows of a (B, H, R) tensor -> (H,)."""
    return x.mean(dim=(0, 2))


def first_k_mass(p, k):
    return rows_mean(p[..., :k].sum(-1))


def sink_score(p, vis):
    return p[..., 0].sum(dim=(0, 2)) / vis[..., 0].expand(p.shape[:3]).sum(dim=(0, 2))


def entropy_rows(w, vis):
    """(H_i, n_i, has-mass) per row, of w normalised over its keys."""
    w = w.abs()
    total = w.sum(-1, keepdim=True)
    p = torch.where(total > 0, w / total.clamp_min(1e-300), 0.0)
    h = -torch.special.xlogy(p, p).sum(-1)
    return h, vis.expand(w.shape).sum(-1).double(), total.squeeze(-1) > 0


def distance_matrix(pos, nk):
    return (pos.view(-1, 1) - torch.arange(nk).view(1, -1)).abs()


def distance_bin_mass(p, pos, lo, hi):
    d = distance_matrix(pos, p.shape[-1])
    inside = (d >= lo) & (d < (hi if hi is not None else 1 << 60))
    return rows_mean((p * inside).sum(-1))


def span_mass(p, vis, a, b):
    n_in = vis[..., a:b].expand(*p.shape[:3], b - a).sum(-1).double()
    n_all = vis.expand(p.shape).sum(-1).double()
    uniform = torch.where(n_all > 0, n_in / n_all.clamp_min(1), 0.0)  # a row that sees nothing: share 0
    return rows_mean(p[..., a:b].sum(-1)), rows_mean(uniform)


def logit_stats(s, vis, h):
    x = s[:, h][vis.expand(s.shape)[:, h]]
    return x.max().item(), x.min().item(), x.mean().item(), x.std(unbiased=False).item()


def doc_ids(batch, n):
    """Per-row document ids: different cut points in every batch row (plans per row)."""
    return torch.stack([torch.arange(n) * (b + 2) // n for b in range(batch)])


def qkv(B, Hq, Hkv, Nq, Nk, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64).to(dtype)
    # larger logits than unit-variance q.k/sqrt(D) so heads are not all near-uniform
    return q * 2, k, v


# (id, shapes (B, Hq, Hkv, Nq, Nk), call kwargs): full, causal with GQA, window,
# per-row documents, decoding (Nq < Nk, bottom-right), a score mod, a mask with
# rows that see nothing, and a length past one unmasked key segment (2048).
CASES = [
    ("full", (2, 4, 2, 200, 200), {}),
    ("causal-gqa", (1, 6, 2, 333, 333), {"mask": ak.causal()}),
    ("window", (1, 2, 2, 300, 300), {"mask": ak.window(37)}),
    ("documents", (2, 2, 1, 260, 260), {"mask": ak.document(doc_ids(2, 260))}),
    ("decode", (2, 4, 4, 5, 260), {"mask": ak.causal()}),
    # few-query calls (observed in one dense pass, kernels/dense_rows.py) with hidden keys,
    # a row that sees none, GQA and a score mod
    ("decode-hidden", (2, 4, 2, 3, 150), {"mask": lambda b, h, qi, ki: (ki <= qi) & (ki >= 7 * b) & (qi != 148)}),
    ("decode-alibi", (1, 4, 2, 1, 140), {"mask": ak.causal(), "score": ak.alibi(4)}),
    ("alibi", (1, 4, 4, 150, 150), {"mask": ak.causal(), "score": ak.alibi(4)}),
    ("dead-rows", (1, 2, 1, 140, 140), {"mask": lambda b, h, qi, ki: (ki <= qi) & (qi >= 3)}),
    ("long", (1, 2, 1, 2100, 2100), {"mask": ak.causal()}),
]
CASE_IDS = [c[0] for c in CASES]


_RECORDED: dict = {}
_RECORDER = "attnkit_test_dense_recorder"


def _recorder(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager formula in float64, keeping each layer's logits and weights."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    s = query.double() @ k.transpose(-1, -2) * scaling
    vis = torch.ones_like(s, dtype=torch.bool)
    if attention_mask is not None:
        vis = (attention_mask == 0).expand_as(s)
    s = s.masked_fill(~vis, -math.inf)
    p = torch.softmax(s, dim=-1)
    _RECORDED[module.layer_idx if hasattr(module, "layer_idx") else len(_RECORDED)] = (p, vis, s)
    return (p @ v).to(query.dtype).transpose(1, 2).contiguous(), None


def record_dense(model, **inputs) -> dict:
    """{layer: (P, visible, S)} of every attention call of ``model`` on ``inputs``, dense float64."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(_RECORDER, _recorder)
    AttentionMaskInterface.register(_RECORDER, eager_mask)
    previous = model.config._attn_implementation
    _RECORDED.clear()
    try:
        model.set_attn_implementation(_RECORDER)
        with torch.no_grad():
            model(**inputs)
    finally:
        model.set_attn_implementation(previous)
    return dict(_RECORDED)
