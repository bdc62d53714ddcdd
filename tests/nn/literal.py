"""Literal float64 formulas the attnkit.nn layers are checked against: dense attention
written out from the papers, reading the layer's own weights."""

import math

import torch


def rope_complex(x, positions, inv_freq, rotary_dim=None, factor=1.0):
    """RoPE as complex multiplication (Su et al. 2021): pair dim i with i + r/2 as the
    complex number x_i + j x_{i+r/2} and multiply it by exp(j * position * theta_i)."""
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    half = r // 2
    z = torch.complex(x[..., :half].double(), x[..., half:r].double())
    angle = positions.double()[:, None] * inv_freq.double()[None, :]
    z = z * torch.polar(torch.ones_like(angle), angle) * factor
    return torch.cat((z.real, z.imag, x[..., r:].double()), dim=-1)


def rms(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def linear(layer, x):
    out = x @ layer.weight.double().T
    return out if layer.bias is None else out + layer.bias.double()


def dense_attention(q, k, v, scale, causal=True, window=None, slopes=None, sinks=None):
    """softmax(scale q k^T + biases, masked) v with GQA repeat; one extra zero-valued key
    per head with logit sinks[h]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = scale * q @ k.transpose(-1, -2)
    nq, nk = s.shape[-2:]
    i = torch.arange(nk - nq, nk).view(-1, 1)
    j = torch.arange(nk).view(1, -1)
    if slopes is not None:
        s = s - slopes.double().view(1, -1, 1, 1) * (i - j).abs()
    keep = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= j >= i - window
        if not causal:
            keep &= j <= i + window
    s = s.masked_fill(~keep, -math.inf)
    if sinks is not None:
        s = torch.cat((s, sinks.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)), dim=-1)
    p = torch.softmax(s, dim=-1)[..., :nk]
    return p @ v


def attention_layer(layer, x, positions=None):
    """attnkit.nn.Attention (no latent) written out literally, float64."""
    x = x.double()
    B, N, _ = x.shape
    H, Hkv, D = layer.n_heads, layer.n_kv_heads, layer.head_dim
    positions = torch.arange(N) if positions is None else positions
    q = linear(layer.q_proj, x).view(B, N, H, D).transpose(1, 2)
    k = linear(layer.k_proj, x).view(B, N, Hkv, D).transpose(1, 2)
    v = linear(layer.v_proj, x).view(B, N, Hkv, D).transpose(1, 2)
    if layer.q_norm is not None:
        q = rms(q, layer.q_norm.weight.double(), layer.q_norm.eps)
        k = rms(k, layer.k_norm.weight.double(), layer.k_norm.eps)
    if layer.rope is not None:
        r = layer.rope
        q = rope_complex(q, positions, r.inv_freq, r.rotary_dim, r.attention_factor)
        k = rope_complex(k, positions, r.inv_freq, r.rotary_dim, r.attention_factor)
    slopes = alibi_slopes(H) if layer.alibi else None
    out = dense_attention(q, k, v, 1 / math.sqrt(D), layer.causal, layer.window, slopes, layer.sinks)
    if layer.gate is not None:
        out = out * torch.sigmoid(linear(layer.gate, x)).view(B, N, H, -1).transpose(1, 2)
    return linear(layer.o_proj, out.transpose(1, 2).reshape(B, N, H * D))


def alibi_slopes(n):
    """Press et al. 2021: geometric slopes 2^(-8i/n), i = 1..n, for n a power of two."""
    assert n & (n - 1) == 0
    return torch.tensor([2 ** (-8 * (i + 1) / n) for i in range(n)], dtype=torch.float64)


def latent_layer(layer, x, positions=None):
    """Multi-head latent attention (DeepSeek-V2 section 2.1) written out, float64:
    per-head keys and values expanded from the RMS-normalised latent, decoupled RoPE key
    shared by the heads, logits scaled by 1/sqrt(nope_dim + rope_dim)."""
    m = layer.latent
    x = x.double()
    B, N, _ = x.shape
    H, dn, dr, dv, r = layer.n_heads, m.nope_dim, m.rope_dim, m.v_dim, m.kv_rank
    positions = torch.arange(N) if positions is None else positions
    if m.config.q_rank:
        q = linear(m.q_up, rms(linear(m.q_down, x), m.q_norm.weight.double(), m.q_norm.eps))
    else:
        q = linear(m.q_proj, x)
    q = q.view(B, N, H, dn + dr).transpose(1, 2)
    q = torch.cat((q[..., :dn], rope_complex(q[..., dn:], positions, m.rope.inv_freq)), dim=-1)
    down = linear(m.kv_down, x)
    c = rms(down[..., :r], m.kv_norm.weight.double(), m.kv_norm.eps)
    k_rope = rope_complex(down[..., r:][:, None], positions, m.rope.inv_freq)  # (B, 1, N, dr)
    kv = linear(m.kv_up, c).view(B, N, H, dn + dv).transpose(1, 2)
    k = torch.cat((kv[..., :dn], k_rope.expand(B, H, N, dr)), dim=-1)
    slopes = alibi_slopes(H) if layer.alibi else None
    out = dense_attention(q, k, kv[..., dn:], 1 / math.sqrt(dn + dr), layer.causal, layer.window, slopes, layer.sinks)
    if layer.gate is not None:
        out = out * torch.sigmoid(linear(layer.gate, x)).view(B, N, H, -1).transpose(1, 2)
    return linear(layer.o_proj, out.transpose(1, 2).reshape(B, N, H * dv))
