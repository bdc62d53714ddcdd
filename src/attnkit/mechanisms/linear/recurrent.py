"""The recurrent form: one token at a time, O(1) work per token, for decoding.

Each step touches only the fixed-size state (D_f x Dv', the normaliser riding along as
the last value column), so the cost of a token does not grow with its position.
"""

from __future__ import annotations

import torch

from .call import LinearCall

Tensor = torch.Tensor


def recurrent_form(call: LinearCall) -> tuple[Tensor, Tensor]:
    """(outputs (B, H, Nq, Dv), final memory (B, H, D_f, Dv')) in the compute dtype."""
    rec = call.rec
    qf, kf, v = call.features()
    g, beta = call.gates()
    beta = None if beta is None else beta.to(kf.dtype)
    state = call.initial_memory()
    offset = call.q_offset
    outputs = []
    for t in range(kf.shape[2]):
        if g is not None:
            state = torch.exp(g[:, :, t].to(kf.dtype)).unsqueeze(-1) * state
        key = kf[:, :, t].unsqueeze(-1)  # (B, H, D_f, 1)
        value = v[:, :, t].unsqueeze(-2)  # (B, H, 1, Dv')
        if rec.delta:
            assert beta is not None  # the delta rule always has a β (1 when not given)
            value = beta[:, :, t, None, None] * (value - key.transpose(-1, -2) @ state)
        state = state + key @ value
        if call.causal and t >= offset:
            outputs.append(qf[:, :, t - offset].unsqueeze(-2) @ state)
    if call.causal:
        out = torch.cat(outputs, dim=2) if outputs else state.new_zeros(*call.q.shape[:3], state.shape[-1])
    else:
        out = qf @ state
    return rec.finish(out), state
