"""Show observers the weights a linear-attention call puts on each value.

Every form is linear in the values: o_i = Σ_j W_ij v_j (+ the initial state's share),
with W the parallel form's masked, decayed φ(Q)φ(K)ᵀ for the sum rule and
φ(Q)φ(K)ᵀ·(I + diag(β)A_kk)^{-1}diag(β) (masked, decayed) for the delta rule, divided by
the row's denominator when normalised. Column block j of W is the output of the
recurrence run with one-hot values on the keys of block j (and zero state), so the
chunked form streams W to observers block by block in O(N · block) memory, for every
rule and gate alike.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...observe import AttentionTile, CallInfo, feed
from .call import LinearCall
from .chunked import chunked_form
from .gates import KeyGate

OBSERVE_Q_BLOCK = 128
OBSERVE_K_BLOCK = 128


def observe_linear(call: LinearCall, observers, layer: int | None, mechanism: str) -> None:
    B, H, Nq, _ = call.q.shape
    Nk = call.k.shape[2]
    info = CallInfo(B, H, Nq, Nk, Nk - Nq, layer, mechanism)
    feed(observers, info, weight_tiles(call, info))


def _keys_from(call: LinearCall, k0: int, values: torch.Tensor, memory) -> LinearCall:
    """The call restricted to keys k0: with other values and the normaliser left undivided."""
    q = call.q[:, :, max(0, k0 - call.q_offset) :] if call.causal else call.q

    def cut(t):  # a KeyGate computes from the cut keys itself
        return t if t is None or isinstance(t, KeyGate) else t[:, :, k0:]

    keep = None if call.keep is None else call.keep[:, k0:]
    return replace(
        call,
        rec=replace(call.rec, divide=False),
        q=q,
        k=call.k[:, :, k0:],
        v=values,
        g=cut(call.g),
        beta=cut(call.beta),
        memory=memory,
        start=call.start + k0,
        keep=keep,
    )


def weight_tiles(call: LinearCall, info: CallInfo):
    B, H, Nq, _ = call.q.shape
    Nk = call.k.shape[2]
    with torch.no_grad():
        denominator = None
        if call.rec.normalize:
            # No values: the output is the normaliser's column alone, initial z included.
            z0 = None if call.memory is None else call.memory[..., -1:]
            denominator = chunked_form(_keys_from(call, 0, call.v.new_zeros(B, H, Nk, 0), z0))[0] + call.rec.eps
        rows = torch.arange(B, device=call.q.device)
        for k0 in range(0, Nk, OBSERVE_K_BLOCK):
            k1 = min(k0 + OBSERVE_K_BLOCK, Nk)
            onehot = call.v.new_zeros(B, H, Nk - k0, k1 - k0)
            onehot[:, :, : k1 - k0] = torch.eye(k1 - k0, dtype=onehot.dtype, device=onehot.device)
            sub = _keys_from(call, k0, onehot, None)
            weights = chunked_form(sub)[0][..., : k1 - k0]  # (B, H, queries at positions >= k0, k1 - k0)
            first = Nq - weights.shape[2]  # queries before k0 see none of these keys (causal)
            if denominator is not None:
                weights = weights / denominator[:, :, first:]
            k_pos = torch.arange(k0, k1, device=call.q.device)
            for r0 in range(0, weights.shape[2], OBSERVE_Q_BLOCK):
                r1 = min(r0 + OBSERVE_Q_BLOCK, weights.shape[2])
                q_pos = torch.arange(first + r0, first + r1, device=call.q.device) + info.q_start
                yield AttentionTile(info, rows, q_pos, k_pos, weights[:, :, r0:r1])
