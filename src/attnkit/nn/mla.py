"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1).

Keys and values of all heads come from one shared latent ``c_kv = W_DKV h`` (kv_rank
dims, RMS-normalised); only it and a small rotary key ``k_R = RoPE(W_KR h)`` (rope_dim
dims, shared by the heads: RoPE cannot pass through the up-projection, hence
"decoupled") are cached. Per head: ``k_C = W_UK c_kv``, ``v = W_UV c_kv``,
``q = [W_UQ c_q ; RoPE(W_QR c_q)]``, ``k = [k_C ; k_R]``, logits scaled by
``1/sqrt(nope_dim + rope_dim)``. Queries optionally go through their own low-rank
latent ``c_q`` (q_rank).

Two exact forms: ``expand`` materialises per-head k and v (the naive form, cheap at
prefill); ``absorb`` folds W_UK into the queries and W_UV after the attention, so
attention runs directly against the cached latent as a single shared key/value head
(the paper's decoding trick). Absorption relies on the weights being an affine average
of the values, so it is used for softmax only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..api import attention
from .cache import LayerCache
from .positions import RotaryEmbedding

Tensor = torch.Tensor


@dataclass(frozen=True)
class LatentConfig:
    """kv_rank: latent size d_c. q_rank: query latent size (None: full-rank queries).
    rope_dim: decoupled rotary dims per head. nope_dim / v_dim: per-head key (non-rotary
    part) and value sizes; default the layer's head_dim. absorb: True, False, or None
    (absorb when decoding a few tokens against a cache)."""

    kv_rank: int
    q_rank: int | None = None
    rope_dim: int = 16
    nope_dim: int | None = None
    v_dim: int | None = None
    absorb: bool | None = None

    def to_dict(self) -> dict:
        return asdict(self)


#: up to this many new tokens, ``absorb=None`` attends against the latent directly
ABSORB_MAX_TOKENS = 16


class LatentAttention(nn.Module):
    """The q/k/v side of MLA: projections, latent cache and the attention itself.

    ``forward`` returns the per-head outputs (B, H, N, v_dim); the layer applies its
    output gate and projection."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        config: LatentConfig,
        rope: RotaryEmbedding | None,
        rope_base: float = 10000.0,
        eps: float = 1e-6,
    ):
        super().__init__()
        c = config
        for name in ("kv_rank", "rope_dim"):
            if not (isinstance(getattr(c, name), int) and getattr(c, name) >= 1):
                raise ValueError(f"latent {name}: expected a positive int, got {getattr(c, name)!r}")
        if c.rope_dim % 2:
            raise ValueError(f"latent rope_dim: expected an even int, got {c.rope_dim}")
        self.config, self.n_heads = c, n_heads
        self.nope_dim = c.nope_dim or head_dim
        self.v_dim = c.v_dim or head_dim
        self.rope_dim, self.kv_rank = c.rope_dim, c.kv_rank
        self.scale = 1.0 / math.sqrt(self.nope_dim + self.rope_dim)
        q_out = n_heads * (self.nope_dim + self.rope_dim)
        if c.q_rank:
            self.q_down = nn.Linear(d_model, c.q_rank, bias=False)
            self.q_norm = nn.RMSNorm(c.q_rank, eps=eps)
            self.q_up = nn.Linear(c.q_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(d_model, q_out, bias=False)
        # W_DKV and W_KR in one matrix: the latent and the shared rotary key.
        self.kv_down = nn.Linear(d_model, c.kv_rank + c.rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(c.kv_rank, eps=eps)
        self.kv_up = nn.Linear(c.kv_rank, n_heads * (self.nope_dim + self.v_dim), bias=False)
        # The rotary part has its own size, so its own RoPE (same base and scaling as the layer's).
        if rope is not None:
            self.rope = RotaryEmbedding(c.rope_dim, base=rope.base, scaling=rope.scaling)
        else:
            self.rope = RotaryEmbedding(c.rope_dim, base=rope_base)

    def queries(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        B, N, _ = x.shape
        q = self.q_up(self.q_norm(self.q_down(x))) if self.config.q_rank else self.q_proj(x)
        q = q.view(B, N, self.n_heads, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        return q_nope, self.rope(q_rope, positions)

    def latent(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(normalised latent (B, 1, N, kv_rank), rotated shared key (B, 1, N, rope_dim)): what is cached."""
        c, k_rope = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)
        return self.kv_norm(c)[:, None], self.rope(k_rope[:, None], positions)

    def up_weights(self) -> tuple[Tensor, Tensor]:
        """W_UK (H, nope_dim, kv_rank) and W_UV (H, v_dim, kv_rank)."""
        w = self.kv_up.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def expand(self, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head keys (B, H, N, nope_dim + rope_dim) and values (B, H, N, v_dim)."""
        B, _, N, _ = latent.shape
        kv = self.kv_up(latent[:, 0]).view(B, N, self.n_heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, self.n_heads, N, self.rope_dim)), dim=-1)
        return k, v

    def forward(self, x: Tensor, positions: Tensor, cache: LayerCache | None, mechanism, mask, score, sinks) -> Tensor:
        q_nope, q_rope = self.queries(x, positions)
        latent, k_rope = self.latent(x, positions)
        if cache is not None:
            held = cache.extend(latent=latent, rope_key=k_rope)
            latent, k_rope = held["latent"], held["rope_key"]
        absorb = self.config.absorb
        softmax = getattr(mechanism, "name", "softmax") == "softmax"
        if absorb is None:
            absorb = softmax and cache is not None and x.shape[1] <= ABSORB_MAX_TOKENS
        if absorb and not softmax:
            raise ValueError(f"latent absorb: the absorbed form is exact for softmax only, not mechanism {mechanism.name!r}")
        call = dict(mask=mask, score=score, scale=self.scale, sinks=sinks)
        if absorb:
            return self.absorbed(q_nope, q_rope, latent, k_rope, call)
        k, v = self.expand(latent, k_rope)
        q = torch.cat((q_nope, q_rope), dim=-1)
        if cache is not None and getattr(mechanism, "cache_state", False):
            # What earlier queries left (selective attention's F...), as in Attention.
            initial = mechanism.initial_state_for(cache.decode_state, x.shape[1])
            present = {name: value for name, value in call.items() if value is not None}
            out, cache.decode_state = mechanism(q, k, v, initial_state=initial, return_state=True, **present)
            return out
        return attention(q, k, v, mechanism=mechanism, **call)

    def absorbed(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, call: dict) -> Tensor:
        """Attention against the latent: q_C . (W_UK c) = (W_UK^T q_C) . c, and
        sum_j p_j W_UV c_j = W_UV sum_j p_j c_j; one key/value head shared by all heads."""
        w_uk, w_uv = self.up_weights()
        q = torch.cat((torch.einsum("bhnd,hdr->bhnr", q_nope, w_uk), q_rope), dim=-1)
        k = torch.cat((latent, k_rope), dim=-1)
        out = attention(q, k, latent, **call)  # (B, H, N, kv_rank)
        return torch.einsum("bhnr,hvr->bhnv", out, w_uv)
