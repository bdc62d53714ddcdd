"""Checks and conversions of a linear-attention call's arguments: masks, per-token gates,
heads, and which input to blame for a non-finite output."""

from __future__ import annotations

import torch

from ...mods.masks import And, Causal, Padding, as_mask

Tensor = torch.Tensor


def read_mask(mask, B, H, Nq, Nk, device) -> tuple[bool, Tensor | None]:
    """(causal, keep (B, Nk) or None) from None, causal(), a key mask (padding(lengths),
    or any mask with ``key_only = True``), or these and-ed together. A key mask says which
    keys exist; the recurrence skips the others. Any other mask has no linear form."""
    causal, keep = False, None
    for part in _and_parts(mask):
        if isinstance(part, Causal):
            causal = True
        elif isinstance(part, Padding) or getattr(part, "key_only", False):
            part.check(B, H, Nq, Nk)
            b = torch.arange(B, device=device).view(-1, 1, 1, 1)
            kv = torch.arange(Nk, device=device).view(1, 1, 1, -1)
            zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
            kept = torch.broadcast_to(torch.as_tensor(part(b, zero, zero + Nk - 1, kv), dtype=torch.bool), (B, 1, 1, Nk)).reshape(
                B, Nk
            )
            keep = kept if keep is None else keep & kept
        else:
            raise ValueError(
                f"mask: linear attention supports None (every query reads the state after all keys), attnkit.causal(), "
                f"key masks such as attnkit.padding(lengths), and these and-ed together; got {mask!r}"
            )
    return causal, keep


def _and_parts(mask):
    if mask is None:
        return []
    if isinstance(mask, And):
        return [p for part in mask.parts for p in _and_parts(part)]
    return [as_mask(mask)]


def check_per_token(t, name: str, B, Hq, Hkv, Nk, Df) -> None:
    heads = f"{Hq}" if Hq == Hkv else f"{Hq} or {Hkv}"
    want = f"(B, H, Nk) = ({B}, {heads}, {Nk})" + ("" if Df is None else f" or (B, H, Nk, D_f) with D_f = {Df}")
    ok = isinstance(t, Tensor) and t.is_floating_point() and t.dim() in ((3,) if Df is None else (3, 4))
    ok = ok and t.shape[0] == B and t.shape[1] in (Hq, Hkv) and t.shape[2] == Nk and (t.dim() == 3 or t.shape[3] == Df)
    if not ok:
        raise ValueError(f"{name}: expected a float tensor of shape {want}, got {getattr(t, 'shape', t)!r}")


def expand_heads(t: Tensor, Hq: int) -> Tensor:
    """Per-kv-head gates are shared by the query heads that read that kv head (GQA)."""
    return t if t.shape[1] == Hq else t.repeat_interleave(Hq // t.shape[1], dim=1)


def nonfinite_error(q, k, v, g, beta, state) -> ValueError:
    named = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)]
    if state is not None:
        named += [("initial_state", t) for t in state.tensors()]
    for name, t in named:
        if t is not None and not bool(torch.isfinite(t.detach()).all()):
            return ValueError(
                f"{name}: contains NaN or inf; linear attention spreads it to the output. Clean the input, or pass check_finite=False"
            )
    return ValueError(
        "linear attention produced NaN or inf from finite inputs; the state overflowed (try a normalised or gated mechanism, or smaller inputs)"
    )
