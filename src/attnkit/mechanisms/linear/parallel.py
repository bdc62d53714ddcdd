"""The parallel form: the whole sequence as one masked quadratic product.

    sum:   O = (Φ_Q ⊙ e^b) S_0 + (Φ_Q Φ_Kᵀ ⊙ D ⊙ M) V,   D_ij = e^{b_i - b_j}
    delta: the same with V replaced by δ = (I + diag(β)A_kk)^{-1} diag(β) (V - (Φ_K ⊙ e^b) S_0)

O(N²) time and memory: for short sequences and tests (the chunked form is the same
algebra applied per chunk with the state passed between chunks).
"""

from __future__ import annotations

import torch

from .call import LinearCall
from .core import cumulative_gates, decayed_scores, delta_solve

Tensor = torch.Tensor


def parallel_form(call: LinearCall) -> tuple[Tensor, Tensor]:
    """(outputs (B, H, Nq, Dv), final memory (B, H, D_f, Dv')) in the compute dtype."""
    rec = call.rec
    phi_q, kf, v = call.features()
    memory = call.initial_memory()
    g, beta = call.gates()
    b = None if g is None else cumulative_gates(g, kf.dtype)
    if b is None:
        k_start, k_end, total = kf, kf, None
    else:
        k_start = kf * torch.exp(b.to(kf.dtype))
        k_end = kf * torch.exp((b[..., -1:, :] - b).to(kf.dtype))
        total = torch.exp(b[..., -1, :].to(kf.dtype)).unsqueeze(-1)  # decay over the whole call

    if rec.delta:
        assert beta is not None  # the delta rule always has a β (1 when not given)
        values = delta_solve(kf, b, beta.to(kf.dtype), v - k_start @ memory)
    else:
        values = v
    final = (memory if total is None else total * memory) + k_end.transpose(-1, -2) @ values

    if not call.causal:
        return rec.finish(phi_q @ final), final

    # Queries padded at the front to the key length so the causal mask is square; the
    # padded rows are dropped.
    Nk, Nq = kf.shape[2], call.q.shape[2]
    phi_q = torch.nn.functional.pad(phi_q, (0, 0, Nk - Nq, 0))
    q_start = phi_q if b is None else phi_q * torch.exp(b.to(kf.dtype))
    out = q_start @ memory + decayed_scores(phi_q, kf, b, strict=False) @ values
    return rec.finish(out[:, :, Nk - Nq :]), final
