"""The reference: the recurrence token by token, exactly as the definition reads.

Kept deliberately plain (no augmented value column, no chunking, no log-space tricks)
so that it can serve as the oracle the parallel, chunked and recurrent forms are
tested against.
"""

from __future__ import annotations

import torch

from .call import LinearCall

Tensor = torch.Tensor


def reference_form(call: LinearCall) -> tuple[Tensor, Tensor]:
    """(outputs (B, H, Nq, Dv), final memory (B, H, D_f, Dv[+1])) in the compute dtype."""
    rec = call.rec
    cd = call.compute_dtype
    q, k, v = (t.to(cd) for t in (call.q, call.k, call.v))
    B, H, Nk, Dv = v.shape
    Nq = q.shape[2]
    phi_k = rec.keys(k, call.start)
    phi_q = rec.queries(q, call.start + Nk - Nq)  # queries sit at the last Nq key positions

    memory = call.initial_memory()
    S = memory[..., :Dv]  # (B, H, D_f, Dv)
    z = memory[..., Dv] if rec.normalize else None  # (B, H, D_f)

    def read(t_query: int) -> Tensor:
        o = torch.einsum("bhf,bhfv->bhv", phi_q[:, :, t_query], S)
        if rec.normalize:
            o = o / (torch.einsum("bhf,bhf->bh", phi_q[:, :, t_query], z).unsqueeze(-1) + rec.eps)
        return o

    gates, betas = call.gates()  # (the state update at a skipped key is undone below)
    outputs = []
    for t in range(Nk):
        S_before, z_before = S, z
        if gates is not None:
            G = torch.exp(gates[:, :, t].to(cd))  # (B, H, Dg): one decay per head, or one per feature row
            S = G.unsqueeze(-1) * S
            z = None if z is None else G * z
        phi = phi_k[:, :, t]  # (B, H, D_f)
        if rec.rule == "sum":
            S = S + torch.einsum("bhf,bhv->bhfv", phi, v[:, :, t])
            z = None if z is None else z + phi
        else:
            assert betas is not None  # the delta rule always has a β (1 when not given)
            beta = betas[:, :, t].to(cd).unsqueeze(-1)  # (B, H, 1)
            retrieved = torch.einsum("bhfv,bhf->bhv", S, phi)  # S̃ᵀ φ(k_t)
            S = S + torch.einsum("bhf,bhv->bhfv", phi, beta * (v[:, :, t] - retrieved))
            if z is not None:
                z = z + phi * (beta * (1 - torch.einsum("bhf,bhf->bh", z, phi).unsqueeze(-1)))
        if call.keep is not None:  # a key the mask hides: the state passes over it unchanged
            kept = call.keep[:, t].view(B, 1, 1, 1)
            S = torch.where(kept, S, S_before)
            if z is not None:
                assert z_before is not None  # z is None for every key or for none
                z = torch.where(kept[..., 0], z, z_before)
        if call.causal and t >= Nk - Nq:
            outputs.append(read(t - (Nk - Nq)))

    if call.causal:
        out = torch.stack(outputs, dim=2) if outputs else v.new_zeros(B, H, 0, Dv)
    else:
        out = torch.stack([read(i) for i in range(Nq)], dim=2) if Nq else v.new_zeros(B, H, 0, Dv)
    final = S if z is None else torch.cat([S, z.unsqueeze(-1)], dim=-1)  # z: None unless normalised
    return out, final
