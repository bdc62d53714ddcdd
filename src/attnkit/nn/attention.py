"""``Attention``: a multi-head attention layer that runs any attnkit mechanism.

MHA, GQA and MQA (``n_kv_heads``); MLA through ``latent=`` (mla.py); RoPE and its
scalings, ALiBi or no positions; QK-norm (RMS over each head's dims, as in Qwen3/OLMo 2;
Henry et al. 2020, arXiv 2010.04245); the output gate of gated attention ``Y * sigmoid(X
W)`` applied per head right after attention, headwise or elementwise (Qiu et al. 2025,
arXiv 2505.06708, their best variant); learned sinks, one logit per head (an extra key
of value zero, as in gpt-oss); a KV cache or recurrent state for decoding.

The mechanism is a submodule, so its parameters train and save with the layer. A
mechanism gets only q, k, v and the call's mask/score/scale/sinks; one that needs
data-dependent gates (GLA, DeltaNet...) computes them itself from k.
"""

from __future__ import annotations

import torch
from torch import nn

from ..api import attention
from ..mechanisms import Mechanism, build_mechanism
from ..mods import alibi, causal, window
from .cache import LayerCache
from .mla import LatentAttention, LatentConfig
from .positions import RotaryEmbedding

Tensor = torch.Tensor

GATES = (None, "headwise", "elementwise")


class Attention(nn.Module):
    """Multi-head attention over x of shape (B, N, d_model).

    Args:
        d_model: model width. n_heads: query heads. n_kv_heads: key/value heads (GQA;
            1 is MQA; default n_heads). head_dim: per-head size (default d_model // n_heads).
        mechanism: a registered mechanism name or a Mechanism instance;
            ``mechanism_params`` build a named one.
        rope: None (no rotary), True, a dict of RotaryEmbedding arguments (``rotary_dim``,
            ``base``, ``scaling``) or a RotaryEmbedding.
        qk_norm: RMS-normalise q and k per head (learned scale) before RoPE.
        gate: None, "headwise" or "elementwise" output gate (gated attention).
        sinks: learn one sink logit per query head (initialised to 0).
        bias: biases in the q/k/v/output projections.
        dropout: dropout on the layer's output (attnkit's kernels apply no dropout to the
            attention weights themselves).
        latent: a LatentConfig (or its dict) for multi-head latent attention.
        causal: causal masking (default True). window: sliding window (keys within
            ``window`` positions before the query). alibi: add ALiBi's distance bias.
        context: the context length the model is built for, given to mechanisms whose
            constructor takes ``context`` (sigmoid's n of b = -log n, cosFormer's horizon
            M) so that they do not depend on the length of each call.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        mechanism: str | Mechanism = "softmax",
        rope=None,
        qk_norm: bool = False,
        gate: str | None = None,
        sinks: bool = False,
        bias: bool = False,
        dropout: float = 0.0,
        latent: LatentConfig | dict | None = None,
        *,
        causal: bool = True,
        window: int | None = None,
        alibi: bool = False,
        mechanism_params: dict | None = None,
        norm_eps: float = 1e-6,
        context: int | None = None,
    ):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        head_dim = d_model // n_heads if head_dim is None else head_dim
        _check_int(d_model, "d_model")
        _check_int(n_heads, "n_heads")
        _check_int(n_kv_heads, "n_kv_heads")
        _check_int(head_dim, "head_dim")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads: must divide n_heads={n_heads} (GQA), got {n_kv_heads}")
        if gate not in GATES:
            raise ValueError(f"gate: expected None, 'headwise' or 'elementwise', got {gate!r}")
        if window is not None and not (isinstance(window, int) and window >= 0):
            raise ValueError(f"window: expected a non-negative int or None, got {window!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {dropout!r}")
        if isinstance(latent, dict):
            latent = LatentConfig(**latent)
        if latent is not None and (qk_norm or n_kv_heads != n_heads):
            raise ValueError("latent: MLA has its own key/value heads and latent norms; leave n_kv_heads and qk_norm unset")
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.causal, self.window, self.alibi, self.gate_kind = causal, window, alibi, gate

        if rope is True:
            rope = RotaryEmbedding(head_dim)
        elif isinstance(rope, dict):
            rope = RotaryEmbedding(head_dim, **rope)
        elif rope is not None and not isinstance(rope, RotaryEmbedding):
            raise ValueError(f"rope: expected None, True, a dict of RotaryEmbedding arguments or a RotaryEmbedding, got {rope!r}")

        if latent is None:
            self.rope = rope
            self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
            self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
            self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
            self.latent = None
            v_dim = head_dim
        else:
            self.rope = None
            self.latent = LatentAttention(d_model, n_heads, head_dim, latent, rope, eps=norm_eps)
            v_dim = self.latent.v_dim
        self.v_dim = v_dim
        self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.gate = None if gate is None else nn.Linear(d_model, n_heads * (v_dim if gate == "elementwise" else 1), bias=bias)
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None
        self.o_proj = nn.Linear(n_heads * v_dim, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.mechanism = build_mechanism(mechanism, mechanism_params or {}, n_heads, head_dim, n_kv_heads, v_dim, context)

    @property
    def recurrent(self) -> bool:
        return bool(getattr(self.mechanism, "recurrent", False))

    def mask(self, extra=None):
        """The layer's own mask (causal, window) and-ed with ``extra``."""
        m = None
        if self.window is not None:
            m = window(self.window) if self.causal else window(self.window, self.window)
        elif self.causal:
            m = causal()
        if extra is not None:
            m = extra if m is None else m & extra
        return m

    def forward(self, x: Tensor, cache: LayerCache | None = None, mask=None, positions: Tensor | None = None) -> Tensor:
        """x (B, N, d_model) -> (B, N, d_model).

        cache: this layer's LayerCache when decoding (keys and values, the latent, or the
        recurrent state grow in it). mask: an extra attnkit mask over (queries, all keys
        including cached ones), and-ed with the layer's own. positions: token positions
        (N,) or (B, N) for RoPE; default ``cache.length + arange(N)``."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x: expected (B, N, d_model={self.d_model}), got {tuple(x.shape)}")
        B, N, _ = x.shape
        start = 0 if cache is None else cache.length
        if positions is None:
            positions = torch.arange(start, start + N, device=x.device)
        score = alibi(self.n_heads) if self.alibi else None
        full_mask = self.mask(mask)
        if cache is not None:
            check_decodes(self.mechanism)
        if self.latent is not None:
            out = self.latent(x, positions, cache, self.mechanism, full_mask, score, self.sinks)
        else:
            out = self._attend(x, positions, cache, full_mask, score)
        if self.gate is not None:
            g = torch.sigmoid(self.gate(x)).view(B, N, self.n_heads, -1).transpose(1, 2)
            out = out * g
        out = out.transpose(1, 2).reshape(B, N, self.n_heads * self.v_dim)
        return self.dropout(self.o_proj(out))

    def _attend(self, x, positions, cache, mask, score) -> Tensor:
        B, N, _ = x.shape
        q = self.q_proj(x).view(B, N, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, N, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q, positions), self.rope(k, positions)
        call = dict(mask=mask, score=score, sinks=self.sinks)
        if cache is not None and self.recurrent:
            # The state replaces the KV cache: only the new tokens go in, with it.
            out, state = self.mechanism(q, k, v, initial_state=cache.state, return_state=True, **_present(call))
            cache.set_state(state, N)
            return out
        if cache is not None:
            held = cache.extend(k=k, v=v)
            k, v = held["k"], held["v"]
            if getattr(self.mechanism, "cache_state", False):
                # What earlier queries left (selective attention's F, multi-token's last
                # queries) goes in beside the keys.
                initial = self.mechanism.initial_state_for(cache.decode_state, N)
                out, cache.decode_state = self.mechanism(q, k, v, initial_state=initial, return_state=True, **_present(call))
                return out
        return attention(q, k, v, mechanism=self.mechanism, **call)

    def extra_repr(self) -> str:
        parts = [f"d_model={self.d_model}", f"n_heads={self.n_heads}"]
        if self.n_kv_heads != self.n_heads:
            parts.append(f"n_kv_heads={self.n_kv_heads}")
        parts.append(f"head_dim={self.head_dim}")
        for name, on in (("causal", self.causal), ("alibi", self.alibi)):
            if on:
                parts.append(name)
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.gate_kind:
            parts.append(f"gate={self.gate_kind}")
        return ", ".join(parts)


def check_decodes(mechanism) -> None:
    """Refuse a KV cache for a mechanism whose rows depend on the rest of the call."""
    if not getattr(mechanism, "decodes", True):
        raise ValueError(
            f"cache: mechanism {mechanism.name!r} cannot decode with a cache: {mechanism.decode_note} "
            "Run every step on the whole sequence (no cache) instead."
        )


def _present(call: dict) -> dict:
    """Only the options that are set: a recurrent mechanism refuses a score or sinks it cannot honour."""
    return {k: v for k, v in call.items() if v is not None}


def _check_int(value, name: str) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
