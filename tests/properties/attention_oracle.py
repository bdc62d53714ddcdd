"""An independent float64 oracle for exact attention, and the specs the property tests draw.

Nothing here runs attnkit's kernels or evaluates attnkit's mask and score-mod objects:
masks and score mods are small specs (tuples) with two readings, ``to_attnkit_*`` builds
the library's objects, ``dense_mask`` / ``apply_atom`` evaluate the literal formulas
written below. Positions follow the documented convention: with Nq queries against Nk
keys, query row r sits at key position Nk - Nq + r (bottom-right alignment).

    scores = q k^T * scale;  score mods left to right (a -inf logit, a bias used as a
    mask, stays -inf under a row scale);  -inf where the mask hides a pair
    softmax over the keys and the sink logit (value 0);  out = P V;  lse = logsumexp
    a row with nothing visible: out = 0, lse = -inf
"""

from __future__ import annotations

import math

import torch

import attnkit as ak

Tensor = torch.Tensor
NEG_INF = -math.inf


def positions(q_len: int, k_len: int) -> tuple[Tensor, Tensor]:
    """(query positions (1, 1, Nq, 1), key positions (1, 1, 1, Nk))."""
    qpos = torch.arange(k_len - q_len, k_len).view(1, 1, -1, 1)
    kpos = torch.arange(k_len).view(1, 1, 1, -1)
    return qpos, kpos


# ----------------------------------------------------------------------------- masks


def _per_batch(x, batch: int) -> Tensor:
    """An int or a (B,) tensor as a (B, 1, 1, 1) tensor."""
    t = torch.as_tensor(x)
    return (t.expand(batch) if t.dim() == 0 else t).view(batch, 1, 1, 1)


def dense_mask(spec, batch: int, q_len: int, k_len: int) -> Tensor:
    """The visibility of a mask spec, bool (B, 1, Nq, Nk), from its literal definition."""
    qpos, kpos = positions(q_len, k_len)
    kind = spec[0]
    if kind == "causal":
        out = kpos <= qpos
    elif kind == "window":  # q - left <= kv <= q + right
        _, left, right = spec
        out = torch.ones(1, 1, q_len, k_len, dtype=torch.bool)
        if left is not None:
            out = out & (kpos >= qpos - left)
        if right is not None:
            out = out & (kpos <= qpos + right)
    elif kind == "document":  # same document id
        ids = spec[1]
        ids = ids.expand(batch, -1) if ids.dim() == 1 else ids
        rows = torch.stack([ids[b][qpos.view(-1)] for b in range(batch)]).view(batch, 1, q_len, 1)
        cols = ids.view(batch, 1, 1, k_len)
        out = rows == cols
    elif kind == "prefix_lm":  # bidirectional over the prefix, causal after it
        out = (kpos <= qpos) | (kpos < _per_batch(spec[1], batch))
    elif kind == "padding":  # key position < the row's length
        out = kpos < _per_batch(spec[1], batch)
    elif kind == "and":
        out = dense_mask(spec[1], batch, q_len, k_len) & dense_mask(spec[2], batch, q_len, k_len)
    elif kind == "or":
        out = dense_mask(spec[1], batch, q_len, k_len) | dense_mask(spec[2], batch, q_len, k_len)
    elif kind == "not":
        out = ~dense_mask(spec[1], batch, q_len, k_len)
    else:
        raise ValueError(kind)
    return torch.broadcast_to(out, (batch, 1, q_len, k_len))


def to_attnkit_mask(spec):
    kind = spec[0]
    if kind == "causal":
        return ak.causal()
    if kind == "window":
        return ak.window(spec[1], spec[2])
    if kind == "document":
        return ak.document(spec[1])
    if kind == "prefix_lm":
        return ak.prefix_lm(spec[1])
    if kind == "padding":
        return ak.padding(spec[1])
    if kind == "and":
        return to_attnkit_mask(spec[1]) & to_attnkit_mask(spec[2])
    if kind == "or":
        return to_attnkit_mask(spec[1]) | to_attnkit_mask(spec[2])
    if kind == "not":
        return ~to_attnkit_mask(spec[1])
    raise ValueError(kind)


def describe_mask(spec) -> str:
    kind = spec[0]
    if kind in ("and", "or"):
        return f"({describe_mask(spec[1])} {'&' if kind == 'and' else '|'} {describe_mask(spec[2])})"
    if kind == "not":
        return f"~{describe_mask(spec[1])}"
    if kind == "window":
        return f"window({spec[1]}, {spec[2]})"
    return kind


# ----------------------------------------------------------------------------- score mods


def t5_bucket(relative: Tensor, num_buckets: int, max_distance: int, bidirectional: bool) -> Tensor:
    """T5's relative-position bucket of ``relative = key - query`` (Raffel et al. 2019,
    arXiv 1910.10683): half the buckets exact distances, the rest log-spaced up to
    ``max_distance``; bidirectional tables give keys after the query the upper half."""
    n = num_buckets
    out = torch.zeros_like(relative)
    if bidirectional:
        n //= 2
        out = out + (relative > 0).long() * n
        dist = relative.abs()
    else:
        dist = torch.clamp(-relative, min=0)
    exact = n // 2
    ratio = torch.log(dist.clamp(min=1).double() / exact) / math.log(max_distance / exact)
    far = torch.clamp(exact + torch.floor(ratio * (n - exact)).long(), max=n - 1)
    return out + torch.where(dist < exact, dist, far)


def row_scale(s: Tensor, factor: Tensor) -> Tensor:
    """``s * factor``, except that -inf (a bias used as a mask) stays -inf: the documented
    reading of "-inf in a bias is a mask", where the bare product would give NaN for a
    factor of 0 (log 1) and a NaN gradient (-inf * 0) for a learnable factor."""
    hidden = torch.isneginf(s)
    return torch.where(hidden, s, s.masked_fill(hidden, 0.0) * factor)


def apply_atom(atom, s: Tensor, q_len: int, k_len: int) -> Tensor:
    """One score mod, literally, on float64 logits s (B, H, Nq, Nk)."""
    qpos, kpos = positions(q_len, k_len)
    heads = s.shape[1]
    kind = atom[0]
    if kind == "alibi":  # -slope_h |q - kv|  (Press et al., arXiv 2108.12409)
        slopes = atom[1].double().view(1, heads, 1, 1)
        return s - slopes * (qpos - kpos).abs().double()
    if kind == "softcap":
        cap = atom[1]
        return cap * torch.tanh(s / cap)
    if kind == "temperature":
        t = torch.as_tensor(atom[1], dtype=torch.float64) if not isinstance(atom[1], Tensor) else atom[1].double()
        return row_scale(s, 1.0 / (t.view(1, heads, 1, 1) if t.dim() else t))
    if kind == "log_length_scale":  # Scalable-Softmax (arXiv 2501.19399): s * scale * log n
        _, scale, causal = atom
        scale = torch.as_tensor(scale, dtype=torch.float64) if not isinstance(scale, Tensor) else scale.double()
        scale = scale.view(1, heads, 1, 1) if scale.dim() else scale
        n = torch.clamp(qpos + 1, min=1).double() if causal else torch.tensor(float(max(k_len, 1)), dtype=torch.float64)
        return row_scale(s, scale * torch.log(n))
    if kind == "bias":
        return s + atom[1].double()
    if kind == "relative_bias":
        _, table, max_distance, bidirectional = atom
        buckets = t5_bucket(kpos - qpos, table.shape[0], max_distance, bidirectional)  # (1, 1, Nq, Nk)
        per_head = table.double()[buckets.view(-1)].view(q_len, k_len, heads).permute(2, 0, 1)
        return s + per_head.unsqueeze(0)
    raise ValueError(kind)


def to_attnkit_atom(atom):
    kind = atom[0]
    if kind == "alibi":
        return ak.alibi(slopes=atom[1])
    if kind == "softcap":
        return ak.softcap(atom[1])
    if kind == "temperature":
        return ak.temperature(atom[1])
    if kind == "log_length_scale":
        return ak.log_length_scale(atom[1], causal=atom[2])
    if kind == "bias":
        return ak.bias(atom[1])
    if kind == "relative_bias":
        return ak.relative_bias(atom[1], max_distance=atom[2], bidirectional=atom[3])
    raise ValueError(kind)


def to_attnkit_score(atoms):
    if not atoms:
        return None
    mods = [to_attnkit_atom(a) for a in atoms]
    out = mods[0]
    for m in mods[1:]:
        out = out >> m
    return out


def atom_params(atom) -> list[Tensor]:
    return [x for x in atom[1:] if isinstance(x, Tensor) and x.is_floating_point()]


# ----------------------------------------------------------------------------- the oracle


def logits(q: Tensor, k: Tensor, scale: float, atoms, visible: Tensor | None) -> Tensor:
    """float64 modified logits (B, Hq, Nq, Nk), -inf where hidden."""
    groups = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(groups, dim=1)  # query head h reads key head h // groups
    s = torch.matmul(q.double(), k64.transpose(-1, -2)) * scale
    for atom in atoms:
        s = apply_atom(atom, s, q.shape[2], k.shape[2])
    if visible is not None:
        s = s.masked_fill(~visible, NEG_INF)
    return s


def oracle(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    visible: Tensor | None = None,
    atoms=(),
    scale: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out (B, Hq, Nq, Dv), lse (B, Hq, Nq)) in float64, differentiable in everything."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = logits(q, k, scale, atoms, visible)
    z = s
    if sinks is not None:
        B, H, Nq, _ = s.shape
        z = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(B, H, Nq, 1)], dim=-1)
    dead = torch.isneginf(z).all(dim=-1, keepdim=True)
    lse = torch.logsumexp(z.masked_fill(dead, 0.0), dim=-1, keepdim=True)
    p = torch.exp(s - lse).masked_fill(dead, 0.0)
    groups = q.shape[1] // k.shape[1]
    out = torch.matmul(p, v.double().repeat_interleave(groups, dim=1))
    return out, lse.masked_fill(dead, NEG_INF).squeeze(-1)


# ----------------------------------------------------------------------------- layouts


def with_layout(x: Tensor, layout: str) -> Tensor:
    """The same values as ``x`` (a differentiable view or copy) in another memory layout."""
    if layout == "contiguous":
        return x
    if layout == "last_dim_strided":  # x.mT.contiguous().mT: stride(-1) == rows
        return x.mT.contiguous().mT
    if layout == "every_other":  # x[..., ::2] of a buffer twice as wide: stride(-1) == 2
        return torch.stack([x, torch.zeros_like(x)], dim=-1).flatten(-2)[..., ::2]
    if layout == "transposed":  # (B, N, H, D) storage, as models produce it
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "offset":  # a view that starts 5 elements into its storage
        flat = torch.cat([torch.zeros(5, dtype=x.dtype), x.reshape(-1)])
        return flat[5:].view(x.shape)
    raise ValueError(layout)


LAYOUTS = ("contiguous", "last_dim_strided", "every_other", "transposed", "offset")


def expanded(x: Tensor, dim: int) -> Tensor:
    """A stride-0 view: index 0 of ``dim`` repeated along it (values change: use the view in
    the oracle too)."""
    return x.narrow(dim, 0, 1).expand(x.shape)
