"""Attention received per key from a few query rows, computed by the policy cache itself.

The weight-reading policies need, per layer and call, the softmax weights of some query
rows summed onto the keys: SnapKV's observation window, TOVA's current query, H2O's
every query. Running the whole forward through attnkit with an observer gives them, but
switches the model's attention for the call (and, while decoding, for every step). When
the layer's queries can be recomputed from its inputs (Llama-style ``q_proj`` [+
``q_norm``] and RoPE, as Quest does), the cache computes those rows' weights here
instead, from the keys it holds and the visibility it knows (causal order over
positions, the model's sliding window, each head's kept entries, padding), while the
forward itself stays on the model's own sdpa or eager attention:

    mass[b, h, s] = sum over requested rows i of softmax_s(scale * q_i . k_s  | visible)

Rows are taken in chunks so that a chunk's logits hold about ``CHUNK_LOGITS`` numbers
(O(N) memory per row however many rows are asked for), and a prefill chunk reads only
the keys at or before its last query (the layout of a prefill is the positions
themselves). A query always sees its own slot (as the cache's masks let a padded query
see itself), so no row is empty; mass that lands on an invalid slot is dropped.
"""

from __future__ import annotations

import torch

from .model_parts import can_recompute_queries

Tensor = torch.Tensor
# logits per chunk of query rows: a few MB in float32, so a chunk stays near the caches
CHUNK_LOGITS = 1 << 20


def direct_ok(modules) -> bool:
    """True when every attention module's weights can be computed here exactly: queries
    recomputable, a plain scaled softmax (no logit soft-capping, no learned sinks)."""
    for m in modules:
        config = getattr(m, "config", None)
        if not can_recompute_queries(m) or not isinstance(getattr(m, "scaling", None), float):
            return False
        if getattr(config, "attn_logit_softcapping", None) or getattr(m, "sinks", None) is not None:
            return False
        if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
            return False
    return True


def received_mass(
    q: Tensor,
    q_pos: Tensor,
    keys: Tensor,
    valid: Tensor,
    pos: Tensor,
    scale: float,
    window: int | None,
    prefill: bool,
    all_valid: bool | None = None,
    appended: bool = False,
) -> Tensor:
    """(B, Hq, L) float64: the softmax weights of the queries ``q`` (B, Hq, R, D) at
    padded positions ``q_pos`` (R,) over the layer's slots, summed over the R rows.

    ``keys`` (B, Hkv, L, D), ``valid`` (B, Hkv, L) and ``pos`` (B, Hkv, L) describe the
    layer after the call's tokens were appended. A slot is visible to a query at position
    p when it is valid, ``pos <= p`` and (sliding window) ``p - pos < window``, or when it
    is the query's own slot. ``prefill``: slot s holds position s (a fresh layer), so a
    chunk of rows reads only the keys up to its last query. ``all_valid``: every slot is
    valid, when the caller knows it (else it is checked). ``appended``: the queries are
    the tokens in the layer's last R slots (a decoding call after its append)."""
    B, Hq, R, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    g = Hq // Hkv
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    if R == 0 or L == 0:
        return torch.zeros(B, Hq, L, dtype=torch.float64, device=q.device)
    # the g query heads of a KV head share its keys: one (g * rows, D) x (D, span) product
    qs = (q.to(cd) * scale).view(B, Hkv, g, R, D)
    k = keys.to(cd)
    all_valid = bool(valid.all()) if all_valid is None else all_valid
    if appended and R == 1 and window is None:
        # one decoding query in the last slot: it sees every kept slot and itself (the step
        # a scored policy takes per token, kept to a handful of operations)
        s = torch.matmul(qs.view(B, Hkv, g, D), k.transpose(-1, -2))
        if all_valid:
            return torch.softmax(s, dim=-1).to(torch.float64).view(B, Hq, L)
        own = valid[..., -1:]
        see = torch.cat([valid[..., :-1], torch.ones_like(own)], -1)
        w = torch.softmax(s.masked_fill_(~see[:, :, None, :], float("-inf")), dim=-1).to(torch.float64)
        if not bool(own.all()):
            w = torch.where(valid[:, :, None, :], w, 0.0)  # a padded query's weight on itself is dropped
        return w.view(B, Hq, L)
    out = torch.zeros(B, Hkv, g, L, dtype=torch.float64, device=q.device)
    rows = max(1, CHUNK_LOGITS // max(B * Hq * L, 1))
    for r0 in range(0, R, rows):
        r1 = min(R, r0 + rows)
        n = r1 - r0
        p = q_pos[r0:r1]
        lo, hi = 0, L
        if prefill:
            hi = int(p[-1]) + 1
            if window is not None:
                lo = max(0, int(p[0]) - window + 1)
        s = torch.matmul(qs[:, :, :, r0:r1].reshape(B, Hkv, g * n, D), k[:, :, lo:hi].transpose(-1, -2))
        s = s.view(B, Hkv, g, n, hi - lo)
        if prefill and all_valid and window is None:
            # a fresh layer without padding: only the chunk's own keys are causally cut
            d0 = int(p[0])
            cut = torch.ones(n, hi - d0, dtype=torch.bool, device=s.device).triu_(1)
            s[..., d0:].masked_fill_(cut, float("-inf"))
        else:
            kp = pos[:, :, None, lo:hi]  # (B, Hkv, 1, span)
            pq = p.view(1, 1, -1, 1)
            see = kp <= pq
            if window is not None:
                see = see & (pq - kp < window)
            if not all_valid:
                see = see & valid[:, :, None, lo:hi]
            see = see | (kp == pq)
            s = s.masked_fill_(~see[:, :, None], float("-inf"))
        out[..., lo:hi] += torch.softmax(s, dim=-1).sum(-2).to(torch.float64)
    out = torch.where(valid[:, :, None, :], out, 0.0)
    return out.view(B, Hq, L)
